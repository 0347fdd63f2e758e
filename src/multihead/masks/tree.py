"""A token-tree mask: speculative decoding verifies a tree of draft tokens in one call.

The tree is given by parent indices: node ``i``'s parent is ``parents[i]`` (``-1``: a root, hung
under the cached prefix), parents before children (``parents[i] < i``, the order every drafter
emits). Node ``i`` sees its ancestors, itself, and every key before the tree; keys and queries
outside the tree are causal. With ``parents = [-1, 0, 0, 1, 2]`` after 3 cached keys (``p``)::

                 p p p 0 1 2 3 4            0
    node 0       █ █ █ █ · · · ·          ┌─┴─┐
    node 1       █ █ █ █ █ · · ·          1   2
    node 2       █ █ █ █ · █ · ·          │   │
    node 3       █ █ █ █ █ · █ ·          3   4
    node 4       █ █ █ █ · █ · █

So the mask is ``causal()`` with the tree x tree square replaced by the ancestor relation: it only
ever hides keys that causal shows. Where the tree sits:

* ``start=None`` (default): the last ``T`` keys and the last ``T`` queries of the call, aligned
  bottom-right like ``causal()`` (a verification call over a cache; a layer with any cache reads
  it at the call's new tokens: :meth:`multihead.caches.CacheRead.mask`);
* ``start=s`` (an int, or ``(B,)`` one per row): node ``i`` at position ``s + i`` of a square
  attention read top-left (queries and keys at the same positions), for rows whose prefixes differ.

Batched: ``parents (T,)`` is one tree for every row; ``(B, T)`` gives each row its own tree of
``T`` nodes (a row with fewer drafts pads with nodes nobody accepts: any valid parent).

Structure, for the backends that must not build ``Lq x Lk``: keys, key ranges and block states
are causal's except on blocks that meet the tree x tree square, which are read from the ``(B|1,
T, T)`` ancestor table built once on the host; so a block-sparse backend runs the prefix blocks
as full, the tree blocks as partial, and the decode path's row mask is ``T`` rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks.band import Band, causal
from multihead.masks.base import And, BlockState, Mask, Not, Or

__all__ = ["tree", "Tree", "at_new_tokens", "holds_tree"]

_SHOWN_NODES = 16  # a tree of at most this many nodes prints its parents


def tree(parents: Tensor, *, start: int | Tensor | None = None) -> Tree:
    """The mask of a token tree (see the module docstring for the picture).

    Args:
        parents: ``(T,)`` or ``(B, T)`` integer tensor: each node's parent, ``-1`` for a root; a
            parent comes before its child (``-1 <= parents[..., i] < i``).
        start: ``None``: the tree is the call's last ``T`` queries and keys (bottom-right). An int
            or a ``(B,)`` integer tensor: node ``i`` sits at position ``start + i`` of a square
            attention (top-left), per row when a tensor.
    """
    if (
        not isinstance(parents, Tensor)
        or parents.is_floating_point()
        or parents.is_complex()
        or parents.dtype == torch.bool
    ):
        got = f"dtype {parents.dtype}" if isinstance(parents, Tensor) else type(parents).__name__
        raise TypeError(f"tree: parents must be an integer tensor (T,) or (B, T) of parent indices, got {got}")
    if parents.dim() not in (1, 2) or parents.shape[-1] == 0 or parents.shape[0] == 0:
        raise ValueError(f"tree: parents must have shape (T,) or (B, T) with T >= 1 nodes, got {tuple(parents.shape)}")
    table = parents.detach().to("cpu", torch.int64, copy=True).view(-1, parents.shape[-1])  # (B|1, T)
    T = table.shape[1]
    bad = (table < -1) | (table >= torch.arange(T))  # -1 <= parent < i
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        where = f"parents[{b}, {i}]" if parents.dim() == 2 else f"parents[{i}]"
        raise ValueError(
            f"tree: {where} = {int(table[b, i])}; expected -1 (a root) or an earlier node in [0, {i}) "
            f"(parents come before their children, in the order a drafter emits them)"
        )
    return Tree(table, _start(start))


def _start(start: object) -> int | Tensor | None:
    if start is None:
        return None
    if isinstance(start, int) and not isinstance(start, bool):
        if start < 0:
            raise ValueError(f"tree: start must be >= 0 (the position of node 0), got {start}")
        return start
    if (
        not isinstance(start, Tensor)
        or start.is_floating_point()
        or start.is_complex()
        or start.dtype == torch.bool
        or start.dim() != 1
        or start.numel() == 0
    ):
        got = f"dtype {start.dtype}, shape {tuple(start.shape)}" if isinstance(start, Tensor) else repr(start)
        raise TypeError(f"tree: start must be None, an int or a (B,) integer tensor (one per row), got {got}")
    start = start.detach().to("cpu", torch.int64, copy=True)
    if bool((start < 0).any()):
        raise ValueError(f"tree: start must be >= 0 (the position of node 0 in each row), got {start.tolist()}")
    return start


class Tree(Mask):
    """Built by :func:`tree`: ``causal()`` with the tree x tree square replaced by the ancestor
    relation of ``parents`` ``(B|1, T)`` (host, int64)."""

    kind = "custom"  # read element by element through _mod where a backend needs elements
    parents: Tensor
    start: int | Tensor | None

    def __init__(self, parents: Tensor, start: int | Tensor | None):
        self._set(parents=parents, start=start)

    @property
    def size(self) -> int:
        """``T``: the nodes of the tree (of each row's tree)."""
        return self.parents.shape[1]

    def depths(self) -> Tensor:
        """``(B|1, T)`` int64: each node's depth (a root is 0). A node's rotary position is the
        prefix length plus its depth: the position it takes if its path is accepted."""
        return self._ancestors().sum(-1) - 1

    def is_chain(self) -> bool:
        """Whether every row's tree is one chain ``0 <- 1 <- 2 ...``: then the mask is ``causal()``."""
        chain = torch.arange(-1, self.size - 1)
        return bool((self.parents == chain).all())

    def placed_at(self, start: int | Tensor) -> Tree:
        """This tree at positions ``start + i`` (the ``start=`` of :func:`tree`)."""
        return Tree(self.parents, _start(start))

    # ----------------------------------------------------------------------------- meaning
    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        table = self._ancestors()
        if table.device != q.device:
            table = table.to(q.device)
        T = self.size
        shift, s = self._frame(b, q_len, kv_len)
        if isinstance(s, Tensor):
            s = s.to(q.device)
        qk = q + shift  # the query's own position among the keys
        n, m = qk - s, kv - s  # node numbers (outside [0, T): not a tree node)
        both = (n >= 0) & (n < T) & (m >= 0) & (m < T)
        row = torch.zeros_like(b) if table.shape[0] == 1 else b
        ancestor = table[row, n.clamp(0, T - 1), m.clamp(0, T - 1)]
        return (kv <= qk) & (~both | ancestor)

    def _describe(self) -> str:
        B, T = self.parents.shape
        shown = self.parents[0].tolist() if B == 1 and T <= _SHOWN_NODES else f"<parents ({B}, {T})>"
        start = "" if self.start is None else f", start={_shown(self.start)}"
        return f"tree({shown}{start})"

    def depends_on_lengths(self) -> bool:
        return self.start is None  # bottom-right: the tree is the last T of the call

    def check(self, extent: Extent) -> None:
        batch, _, q_len, kv_len = extent
        T = self.size
        for name, rows in (("parents", self.parents.shape[0]), ("start", _rows(self.start))):
            if rows != 1 and rows != batch:  # (not `in (1, B)`: dynamo)
                raise ValueError(f"tree: {name} has {rows} batch rows, the call {batch}; expected 1 or {batch}")
        if self.start is None:
            for what, length in (("Lq", q_len), ("Lk", kv_len)):
                if length is not None and length < T:
                    raise ValueError(
                        f"tree: a tree of T={T} nodes is the call's last {T} queries and keys, but {what}={length}; "
                        f"expected {what} >= {T} (pass the tree's tokens with the call)"
                    )
        elif kv_len is not None:
            last = int(self.start) if isinstance(self.start, int) else int(self.start.max())
            if last + T > kv_len:
                raise ValueError(
                    f"tree: nodes at positions [{last}, {last + T}) but Lk={kv_len}; expected start + T <= Lk"
                )

    def to_string(self, q_len: int | None = None, kv_len: int | None = None, b: int = 0, h: int = 0) -> str:
        """The picture (:meth:`Mask.to_string`), by default of the tree after one prefix key."""
        if q_len is None:
            s = 1 if self.start is None else int(self.start) if isinstance(self.start, int) else int(self.start[b])
            q_len = s + self.size
        return super().to_string(q_len, q_len if kv_len is None else kv_len, b, h)

    # ----------------------------------------------------------------------------- structure
    def causal_offset(self, q_len: int, kv_len: int) -> int | None:
        return self._band().causal_offset(q_len, kv_len) if self.is_chain() else None

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        return self._band()._key_range(extent, block)  # a node's last visible key is itself: causal's

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        state = self._band().block_state(extent, block)
        if state is BlockState.EMPTY or not self._meets_tree(extent, block):
            return state
        # The block cut at the tree's rows and keys: the pieces outside the tree x tree square are
        # causal's; only that square (at most T x T per row's start) is evaluated.
        shift, lo, hi = self._span(extent)
        q_cuts = sorted({block.q0, block.q1, *(min(max(x - shift, block.q0), block.q1) for x in (lo, hi))})
        k_cuts = sorted({block.k0, block.k1, *(min(max(x, block.k0), block.k1) for x in (lo, hi))})
        states = set()
        for q0, q1 in zip(q_cuts, q_cuts[1:]):
            for k0, k1 in zip(k_cuts, k_cuts[1:]):
                piece = Block(q0, q1, k0, k1)
                if self._meets_tree(extent, piece):
                    states.add(super().block_state(extent, piece))
                else:
                    states.add(self._band().block_state(extent, piece))
        if len(states) == 1:
            return states.pop()
        return BlockState.PARTIAL

    def materialize_block(self, extent: Extent, block: Block, device: torch.device | str | None = None) -> Tensor:
        band = self._band().materialize_block(extent, block, device)  # causal's comparison
        if not self._meets_tree(extent, block):
            return band
        if isinstance(self.start, Tensor):  # a tree per row at its own position: gathered (_mod)
            return super().materialize_block(extent, block, device)
        # causal, with the tree x tree square copied from the ancestor table (inside it, the
        # ancestors are all causal lets through: a parent comes before its child)
        shift, lo, hi = self._span(extent)
        r0, r1 = max(block.q0 + shift, lo), min(block.q1 + shift, hi)  # the square's rows, as key positions
        c0, c1 = max(block.k0, lo), min(block.k1, hi)
        table = self._ancestors()
        out = band.expand(table.shape[0], 1, block.rows, block.cols).clone()
        out[:, 0, r0 - shift - block.q0 : r1 - shift - block.q0, c0 - block.k0 : c1 - block.k0] = table[
            :, r0 - lo : r1 - lo, c0 - lo : c1 - lo
        ].to(out.device)
        return out

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        return self._band()._empty_rows(extent, device)  # a node sees itself: only causal empties a row

    # ----------------------------------------------------------------------------- helpers
    def _band(self) -> Band:
        return self._cached("_band_cache", lambda: causal() if self.start is None else causal("top_left"))

    def _frame(self, b: Tensor, q_len: int, kv_len: int) -> tuple[int, int | Tensor]:
        """``(shift, s)``: query ``i`` is key position ``i + shift``; node 0 is at key position ``s``
        (an int, or ``(B|1, 1, 1, 1)`` per row)."""
        start = self.start
        if start is None:
            return kv_len - q_len, kv_len - self.size
        if isinstance(start, int):
            return 0, start
        return 0, start[torch.zeros_like(b) if start.shape[0] == 1 else b]

    def _span(self, extent: Extent) -> tuple[int, int, int]:
        """``(shift, lo, hi)``: query ``i`` is key position ``i + shift``; every row's tree lies in
        key positions ``[lo, hi)``."""
        q_len, kv_len = extent.lengths
        T, start = self.size, self.start
        if start is None:
            return kv_len - q_len, kv_len - T, kv_len
        if isinstance(start, int):
            return 0, start, start + T
        return 0, int(start.min()), int(start.max()) + T

    def _meets_tree(self, extent: Extent, block: Block) -> bool:
        """Whether the block's rows and keys both reach the tree's positions (of some row)."""
        shift, lo, hi = self._span(extent)
        rows = block.q0 + shift < hi and block.q1 + shift > lo
        return rows and block.k0 < hi and block.k1 > lo

    def _ancestors(self) -> Tensor:
        """``(B|1, T, T)`` bool on the host: ``[b, i, j]`` = node ``j`` is ``i`` or an ancestor of it."""
        return self._cached("_ancestors_cache", self._build)

    def _build(self) -> Tensor:
        parents = self.parents
        B, T = parents.shape
        table = torch.zeros(B, T, T, dtype=torch.bool)
        rows = torch.arange(B)
        for i in range(T):  # parents come first: row i is its parent's row plus itself
            p = parents[:, i]
            has = p >= 0
            if bool(has.any()):
                table[rows[has], i] = table[rows[has], p[has]]
            table[:, i, i] = True
        return table


def at_new_tokens(mask: Mask, query_positions: Tensor) -> Mask:
    """``mask`` with every tree placed bottom-right (``start=None``) pinned to the call's new
    tokens: its nodes are the last ``T`` of ``query_positions`` ``(Lq,)`` or ``(B, Lq)``.

    A cache reads mask objects on the square of the whole sequence; a cache whose read is not the
    sequence itself (a static cache's ``max_len`` slots, rows of different lengths) would put a
    bottom-right tree at the end of its slots. Parts ``&``, ``|``, ``~`` are walked; other masks
    are left as they are."""
    if isinstance(mask, Tree):
        if mask.start is not None:
            return mask
        if query_positions.shape[-1] < mask.size:
            raise ValueError(
                f"tree: a tree of T={mask.size} nodes is the call's last {mask.size} tokens, but the call has "
                f"{query_positions.shape[-1]} new tokens; expected at least {mask.size}"
            )
        first = query_positions[..., query_positions.shape[-1] - mask.size]  # () or (B,)
        return mask.placed_at(int(first) if first.dim() == 0 else first)
    if isinstance(mask, (And, Or)):
        parts = [at_new_tokens(p, query_positions) for p in mask.parts]
        if all(a is b for a, b in zip(parts, mask.parts, strict=True)):
            return mask
        return type(mask)(*parts)
    if isinstance(mask, Not):
        inner = at_new_tokens(mask.inner, query_positions)
        return mask if inner is mask.inner else Not(inner)
    return mask


def holds_tree(mask: object) -> bool:
    """Whether ``mask`` is a tree or combines one (``&``, ``|``, ``~``): a call verifying drafts,
    whose tokens a cache stores after the ones it holds while their positions (``P + depth``) only
    rotate them."""
    if isinstance(mask, Tree):
        return True
    if isinstance(mask, (And, Or)):
        return any(holds_tree(p) for p in mask.parts)
    return isinstance(mask, Not) and holds_tree(mask.inner)


def _rows(start: int | Tensor | None) -> int:
    return start.shape[0] if isinstance(start, Tensor) else 1


def _shown(start: int | Tensor) -> str:
    if isinstance(start, int):
        return str(start)
    return str(start.tolist()) if start.numel() <= 8 else f"<({start.shape[0]},)>"
