"""The `Mask` base class, its combinators (``&``, ``|``, ``~``) and evaluation at positions.

A mask is an immutable boolean predicate over ``(b, h, q_pos, kv_pos)``: ``True`` means the query
may attend to the key (see :mod:`multihead.conventions`). Masks only allow or block; what is
*added* to the scores (biases, softcap, ...) is a score modifier (:mod:`multihead.scores`).

Positions are absolute: a mask is evaluated at query and key positions *within the whole
attention* of ``Lq x Lk`` (the ``q_len``/``kv_len`` every method takes). A block of that attention
(a cache step, a ring step, a tile of a kernel) is the same mask read at shifted positions, with
the whole attention's lengths, never the block's: :meth:`Mask.shifted` and :meth:`Mask.at`.

Every mask answers three kinds of question:

* **meaning**: :meth:`Mask.mask_mod` on index tensors, the single source of truth;
* **dense form**: :meth:`Mask.materialize` / :meth:`Mask.materialize_block` and a text picture in
  ``repr``/:meth:`Mask.to_string`;
* **structure**, for backends that must not build an ``Lq x Lk`` tensor:
  :meth:`Mask.causal_offset`, :meth:`Mask.key_range`, :meth:`Mask.block_state`,
  :meth:`Mask.empty_rows`, :meth:`Mask.kinds`.

The block protocol: every method about part of the attention takes the whole attention's
:class:`~multihead.blocks.Extent` ``(B, H, Lq, Lk)`` first and the :class:`~multihead.blocks.Block`
``(q0, q1, k0, k1)`` second, then options (``device``)::

    mask.block_state(extent, block)            mask.materialize_block(extent, block, device)
    mask.key_range(extent, block)              mask.empty_rows(extent, device)
    mask.check(extent)                         (lengths may be None there: not known yet)

Masks compare and hash by value (tensors inside them by identity), so caches of plans key on
what a mask means, not on which Python object carries it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from multihead.blocks import Block, Extent, check_protocol
from multihead.values import Value, tensor_identity

__all__ = ["Mask", "BlockState", "And", "Or", "Not", "Positioned", "UNBOUNDED", "register_coercion", "tensor_identity"]

# Rows evaluated at a time when a generic question has to look at the mask element by element:
# bounds the memory of those fallbacks to about this many booleans.
_CHUNK_ELEMENTS = 1 << 22
_PICTURE_SIZE = 8
_PICTURE_ROWS, _PICTURE_COLUMNS = 32, 64  # the most to_string draws
#: "No limit" for an unbounded side of a key range, before clamping to ``[0, Lk)``.
UNBOUNDED = 1 << 62
#: The block protocol's methods and the parameters each takes first (:mod:`multihead.blocks`).
_PROTOCOL = {
    "check": ("extent",),
    "materialize_block": ("extent", "block"),
    "block_state": ("extent", "block"),
    "key_range": ("extent", "block"),
    "_key_range": ("extent", "block"),
    "empty_rows": ("extent",),
    "_empty_rows": ("extent",),
}

# How objects that are not masks (a bool tensor) become one on either side of ``& |``. Filled by
# the modules that define such masks (masks/tensor.py), so this module imports none of them.
_COERCIONS: list[tuple[type, Callable[..., Mask]]] = []


def register_coercion(kind: type, to_mask: Callable[..., Mask]) -> None:
    """Let objects of ``kind`` stand for a mask in ``&``/``|`` (``to_mask`` converts them)."""
    _COERCIONS.append((kind, to_mask))


class BlockState(enum.Enum):
    """What a mask looks like over a block of queries x keys, across every batch and head."""

    EMPTY = "empty"  # nothing visible: skip the block
    PARTIAL = "partial"  # needs an element-wise mask
    FULL = "full"  # everything visible: no mask needed


class Mask(Value, abc.ABC):
    """Base class of all masks, predicates over the ``(B, H, Lq, Lk)`` positions of an attention.

    Subclasses implement :meth:`_mod` and :meth:`_describe` and set
    ``kind`` (the name backends declare support for). A mask is a :class:`~multihead.values.Value`:
    fields set once in ``__init__`` (with :meth:`_set`) are the mask's value, compared and hashed
    by value; names starting with ``_`` are derived caches (:meth:`_cached`), not part of it.

    The structural answers a subclass may override to be fast (the defaults evaluate :meth:`_mod`
    on the block), all in the block protocol's one order, ``(extent, block, options)`` with an
    :class:`~multihead.blocks.Extent` ``(B, H, Lq, Lk)`` of the whole attention and a
    :class:`~multihead.blocks.Block` ``(q0, q1, k0, k1)`` of positions in it::

        check(self, extent)                                  ValueError if it cannot apply
        materialize_block(self, extent, block, device=None)  bool (B|1, H|1, rows, cols)
        block_state(self, extent, block)                     EMPTY / FULL / PARTIAL
        _key_range(self, extent, block)                      (lo, hi) of the block's rows, unclamped
        _empty_rows(self, extent, device=None)               bool (B|1, H|1, Lq)
        causal_offset(self, q_len, kv_len)                   the diagonal, if it is exactly causal

    A subclass written for the positional signatures of before (``block_state(q0, q1, k0, k1,
    q_len, kv_len, ...)``) is refused when its class is defined, with the new signature in the
    message."""

    kind: str = "mask"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_protocol(cls, _PROTOCOL)

    # ----------------------------------------------------------------------------- meaning
    @abc.abstractmethod
    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        """The predicate on broadcastable position tensors within an attention of ``q_len x kv_len``."""

    @abc.abstractmethod
    def _describe(self) -> str:
        """The mask as the expression that builds it, e.g. ``causal(align='top_left')``."""

    def depends_on_lengths(self) -> bool:
        """Whether the meaning depends on the whole attention's ``(Lq, Lk)`` (bottom-right
        alignment); such a mask needs them to be read at shifted positions."""
        return False

    def kinds(self) -> frozenset[str]:
        """The kinds of the leaf masks this mask is built from (backends declare which they run)."""
        return frozenset({self.kind})

    def extent(self) -> tuple[int | None, int | None]:
        """The ``(Lq, Lk)`` this mask is defined for by its own tensors (ids, tables), ``None``
        where it applies to any length. A block read past it is refused by :meth:`check`."""
        return None, None

    def mask_mod(
        self,
        b: int | Tensor,
        h: int | Tensor,
        q_idx: int | Tensor,
        kv_idx: int | Tensor,
        q_len: int | None = None,
        kv_len: int | None = None,
    ) -> Tensor:
        """``True`` where query ``q_idx`` of batch ``b``, head ``h`` may attend to ``kv_idx``.

        Arguments are integers or broadcastable integer tensors. ``q_len``/``kv_len`` resolve
        the causal alignment; without them the mask is read as square (``Lq == Lk``).
        """
        if (q_len is None) != (kv_len is None):
            raise ValueError("mask_mod: give both q_len and kv_len, or neither (square)")
        if q_len is None or kv_len is None:
            q_len = kv_len = 0
        idx = [x if isinstance(x, Tensor) else torch.tensor(x) for x in (b, h, q_idx, kv_idx)]
        return self._mod(idx[0], idx[1], idx[2], idx[3], q_len, kv_len)

    def as_mask_mod(self, q_len: int, kv_len: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """A FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` for these lengths."""

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self._mod(b, h, q_idx, kv_idx, q_len, kv_len)

        return mask_mod

    def for_heads(self, num_heads: int) -> Mask:
        """This mask for a call of ``num_heads`` query heads: ``self``, unless a part's meaning needs
        them (a :func:`~multihead.masks.block_select` table with one row per KV head maps query
        head ``h`` to row ``h // (Hq / Hkv)``). The call's entry points apply it before
        :meth:`check` (``validation.validate_call``, a layer's ``over_keys``)."""
        fields = self._fields()
        bound = {name: _for_heads(value, num_heads) for name, value in fields.items()}
        if all(bound[name] is fields[name] for name in fields):
            return self
        return self._replace(**bound)

    def check(self, extent: Extent) -> None:  # noqa: B027 (a default)
        """Raise ``ValueError`` if this mask cannot apply to ``extent`` ``(B, H, Lq, Lk)`` (a length
        ``None``: unknown, not checked)."""

    # ----------------------------------------------------------------------------- dense form
    def materialize(
        self, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device | str | None = None
    ) -> Tensor:
        """The mask as a bool tensor broadcastable to ``(B, H, Lq, Lk)``; dimensions the mask
        does not depend on have size 1. (The whole attention's block: :meth:`materialize_block`
        with ``Extent(batch, heads, q_len, kv_len)``.)"""
        extent = Extent(batch, heads, q_len, kv_len)
        return self.materialize_block(extent, extent.whole(), device)

    def materialize_block(self, extent: Extent, block: Block, device: torch.device | str | None = None) -> Tensor:
        """The block's queries ``[q0, q1)`` x keys ``[k0, k1)`` of :meth:`materialize`, as a bool
        tensor broadcastable to ``(B, H, rows, cols)``, built from the block's indices only
        (memory proportional to the block)."""
        q_len, kv_len = extent.lengths
        b, h, q, kv = _grid(extent, block, device)
        return _as_4d(self._mod(b, h, q, kv, q_len, kv_len), block.rows, block.cols)

    def to_string(self, q_len: int | None = None, kv_len: int | None = None, b: int = 0, h: int = 0) -> str:
        """A picture of the mask for batch ``b``, head ``h`` in a call of ``Lq = q_len`` queries
        and ``Lk = kv_len`` keys: rows are queries, columns keys, ``█`` may attend, ``·`` blocked.

        The lengths default to the mask's own (:meth:`extent`: its ids, tables or positions),
        else 8 (``Lk`` defaults to ``Lq``). At most the first 32 queries and 64 keys are drawn,
        evaluated at the full lengths (so a bottom-right alignment is the call's), with a last
        line saying so when the picture is cut.
        """
        own_q, own_kv = self.extent()
        if q_len is None:
            q_len = _PICTURE_SIZE if own_q is None else own_q
        if kv_len is None:
            kv_len = q_len if own_kv is None else own_kv
        n_rows, n_cols = min(q_len, _PICTURE_ROWS), min(kv_len, _PICTURE_COLUMNS)
        bb, hh = torch.tensor(b).view(1, 1, 1, 1), torch.tensor(h).view(1, 1, 1, 1)
        q = torch.arange(n_rows).view(1, 1, -1, 1)
        kv = torch.arange(n_cols).view(1, 1, 1, -1)
        allowed = _as_4d(self._mod(bb, hh, q, kv, q_len, kv_len), n_rows, n_cols)[0, 0]
        rows = ["".join("█" if x else "·" for x in row.tolist()) for row in allowed]
        if (n_rows, n_cols) != (q_len, kv_len):
            rows.append(f"(the first {n_rows} x {n_cols} of {q_len} x {kv_len})")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"{self._describe()}\n{self.to_string()}"

    # ----------------------------------------------------------------------------- composition
    def __and__(self, other: object) -> Mask:
        return And(self, _coerce(other, "&"))

    def __rand__(self, other: object) -> Mask:
        return And(_coerce(other, "&"), self)

    def __or__(self, other: object) -> Mask:
        return Or(self, _coerce(other, "|"))

    def __ror__(self, other: object) -> Mask:
        return Or(_coerce(other, "|"), self)

    def __invert__(self) -> Mask:
        return Not(self)

    def shifted(
        self, q_offset: int = 0, kv_offset: int = 0, *, q_len: int | None = None, kv_len: int | None = None
    ) -> Mask:
        """The block of this mask whose query ``i`` is position ``i + q_offset`` and key ``j``
        position ``j + kv_offset`` of the whole attention of ``q_len x kv_len``.

        The result, evaluated on the block's own lengths, equals the slice
        ``materialize(.., q_len, kv_len)[..., q_offset:q_offset + lq, kv_offset:kv_offset + lk]``.
        ``q_len``/``kv_len`` are required when the mask depends on them (bottom-right alignment;
        see :meth:`depends_on_lengths`). Cache steps and ring steps are such blocks.
        """
        for name, value in (("q_offset", q_offset), ("kv_offset", kv_offset)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"shifted: {name} must be an int, got {type(value).__name__}")
        q_len, kv_len = _check_whole_lengths(self, "shifted", q_len, kv_len)
        if q_offset == 0 and kv_offset == 0 and q_len is None:
            return self
        return Positioned(self, q_offset, kv_offset, q_len, kv_len)

    def at(
        self, q_positions: Tensor, kv_positions: Tensor, *, q_len: int | None = None, kv_len: int | None = None
    ) -> Mask:
        """This mask read at explicit positions: query ``i`` of a call is position
        ``q_positions[i]`` (or ``q_positions[b, i]``), key ``j`` is ``kv_positions[j]`` (or
        ``[b, j]``), within a whole attention of ``q_len x kv_len`` (required when the mask depends
        on them). Static caches, ring-buffer windows and zigzag shards are read this way."""
        for name, pos in (("q_positions", q_positions), ("kv_positions", kv_positions)):
            if (
                not isinstance(pos, Tensor)
                or pos.is_floating_point()
                or pos.dtype == torch.bool
                or pos.is_complex()
                or pos.dim() not in (1, 2)
            ):
                got = f"dtype {pos.dtype}, shape {tuple(pos.shape)}" if isinstance(pos, Tensor) else type(pos).__name__
                raise TypeError(f"at: {name} must be an integer tensor of shape (L,) or (B, L), got {got}")
        q_len, kv_len = _check_whole_lengths(self, "at", q_len, kv_len)
        # Copied: a mask is immutable, whatever the caller does to its tensors afterwards.
        return Positioned(self, q_positions.clone(), kv_positions.clone(), q_len, kv_len)

    # ----------------------------------------------------------------------------- structure
    def causal_offset(self, q_len: int, kv_len: int) -> int | None:
        """``d`` if this mask is exactly "key ``j`` visible iff ``j <= i + d``", else ``None``."""
        return None

    def key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        """A range ``[lo, hi)`` of keys, within the block's ``[k0, k1)``, covering every key visible
        to the block's queries ``[q0, q1)`` in any batch or head (conservative: it may include
        masked keys, never omits visible ones); ``(0, 0)`` when there is none. Usually asked of
        ``extent.rows(q0, q1)``: the block's queries against every key."""
        lo, hi = self._key_range(extent, block)
        lo, hi = max(lo, block.k0, 0), min(hi, block.k1)
        return (lo, hi) if lo < hi else (0, 0)

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        """Unclamped range in this mask's own key coordinates for the block's queries (only
        ``q0, q1`` are read; ``UNBOUNDED`` where unknown)."""
        return -UNBOUNDED, UNBOUNDED

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        """Whether the block's queries ``[q0, q1)`` x keys ``[k0, k1)`` are all visible, all
        blocked, or mixed, across every batch and head of ``extent``. Subclasses answer in O(1);
        this fallback evaluates the block."""
        allowed = self.materialize_block(extent, block)
        if bool(allowed.all()):
            return BlockState.FULL
        if not bool(allowed.any()):
            return BlockState.EMPTY
        return BlockState.PARTIAL

    def empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor | None:
        """Queries that see no key, as a bool tensor broadcastable to ``(B, H, Lq)``, or
        ``None`` when there are none."""
        empty = self._empty_rows(extent, device)
        return empty if bool(empty.any()) else None

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        """:meth:`empty_rows` as a tensor always (no data-dependent branch: compiles in one graph).
        The fallback evaluates the mask a chunk of rows at a time; traced (torch.compile,
        torch.export), all rows at once, since a loop over a symbolic ``Lq`` would fix its value."""
        if torch.compiler.is_compiling():
            return ~self.materialize_block(extent, extent.whole(), device).any(-1)
        batch, heads = extent.batch, extent.heads
        q_len, kv_len = extent.lengths
        step = max(1, _CHUNK_ELEMENTS // max(1, kv_len * batch * heads))
        parts = []
        for q0 in range(0, q_len, step):
            rows = self.materialize_block(extent, extent.rows(q0, min(q0 + step, q_len)), device)
            parts.append(~rows.any(-1))
        lead = torch.broadcast_shapes(*(p.shape[:2] for p in parts))  # (B|1, H|1): chunks differ in rows only
        return torch.cat([p.expand(*lead, p.shape[-1]) for p in parts], dim=-1)


def _for_heads(value: object, num_heads: int) -> object:
    """A field of a mask for a call of ``num_heads`` query heads (:meth:`Mask.for_heads`)."""
    if isinstance(value, Mask):
        return value.for_heads(num_heads)
    if isinstance(value, tuple) and any(isinstance(part, Mask) for part in value):
        bound = tuple(_for_heads(part, num_heads) for part in value)
        return value if all(b is v for b, v in zip(bound, value)) else bound
    return value


# --------------------------------------------------------------------------------- combinators
class _Combination(Mask):
    parts: tuple[Mask, ...]

    def __init__(self, *parts: Mask):
        flat: list[Mask] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, _Combination) and type(p) is type(self) else [p])
        self._set(parts=tuple(flat))

    def _reduce(
        self,
        b: Tensor,
        h: Tensor,
        q: Tensor,
        kv: Tensor,
        q_len: int,
        kv_len: int,
        op: Callable[[Tensor, Tensor], Tensor],
    ) -> Tensor:
        out = self.parts[0]._mod(b, h, q, kv, q_len, kv_len)
        for p in self.parts[1:]:
            out = op(out, p._mod(b, h, q, kv, q_len, kv_len))
        return out

    def check(self, extent: Extent) -> None:
        for p in self.parts:
            p.check(extent)

    def depends_on_lengths(self) -> bool:
        return any(p.depends_on_lengths() for p in self.parts)

    def kinds(self) -> frozenset[str]:
        # (frozenset(...) over a generator, not frozenset[str]().union(...): dynamo cannot call a
        # subscripted generic, and this runs in every refusal under torch.compile.)
        return self._cached("_kinds_cache", lambda: frozenset(k for p in self.parts for k in p.kinds()))

    def extent(self) -> tuple[int | None, int | None]:
        extents = [p.extent() for p in self.parts]
        return (
            next((e[0] for e in extents if e[0] is not None), None),
            next((e[1] for e in extents if e[1] is not None), None),
        )


class And(_Combination):
    """Visible where every part is visible."""

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self._reduce(b, h, q, kv, q_len, kv_len, torch.logical_and)

    def _describe(self) -> str:
        return " & ".join(_paren(p, Or) for p in self.parts)

    def causal_offset(self, q_len: int, kv_len: int) -> int | None:
        # causal & (something that blocks nothing structurally) is not provable here: only
        # a single causal part qualifies.
        return self.parts[0].causal_offset(q_len, kv_len) if len(self.parts) == 1 else None

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        ranges = [p._key_range(extent, block) for p in self.parts]
        return max(r[0] for r in ranges), min(r[1] for r in ranges)

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        states = [p.block_state(extent, block) for p in self.parts]
        if BlockState.EMPTY in states:
            return BlockState.EMPTY
        if all(s is BlockState.FULL for s in states):
            return BlockState.FULL
        return BlockState.PARTIAL


class Or(_Combination):
    """Visible where any part is visible."""

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self._reduce(b, h, q, kv, q_len, kv_len, torch.logical_or)

    def _describe(self) -> str:
        return " | ".join(_paren(p, And) for p in self.parts)

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        ranges = [r for r in (p._key_range(extent, block) for p in self.parts) if r[0] < r[1]]
        if not ranges:
            return 0, 0
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        states = [p.block_state(extent, block) for p in self.parts]
        if BlockState.FULL in states:
            return BlockState.FULL
        if all(s is BlockState.EMPTY for s in states):
            return BlockState.EMPTY
        return BlockState.PARTIAL


class Not(Mask):
    """Visible where the inner mask is blocked."""

    inner: Mask

    def __init__(self, inner: Mask):
        self._set(inner=inner)

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        return ~self.inner._mod(b, h, q, kv, q_len, kv_len)

    def _describe(self) -> str:
        return f"~{_paren(self.inner, (And, Or))}"

    def check(self, extent: Extent) -> None:
        self.inner.check(extent)

    def depends_on_lengths(self) -> bool:
        return self.inner.depends_on_lengths()

    def kinds(self) -> frozenset[str]:
        return self.inner.kinds()

    def extent(self) -> tuple[int | None, int | None]:
        return self.inner.extent()

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        state = self.inner.block_state(extent, block)
        swap = {BlockState.FULL: BlockState.EMPTY, BlockState.EMPTY: BlockState.FULL}
        return swap.get(state, BlockState.PARTIAL)


class Positioned(Mask):
    """``inner`` read at positions of a whole attention of ``q_len x kv_len``.

    A call's query ``i`` is position ``q_pos + i`` (``q_pos`` an int offset) or ``q_pos[i]`` /
    ``q_pos[b, i]`` (a tensor); keys likewise. ``q_len``/``kv_len`` are the whole attention's
    lengths (``None`` when ``inner`` does not depend on them). The lengths a caller passes when
    evaluating this mask are the block's and are not used: that is the point.
    """

    kind = "positions"
    inner: Mask
    q_pos: int | Tensor  # an offset, or positions (L,) / (B, L)
    kv_pos: int | Tensor
    q_len: int | None
    kv_len: int | None

    def __init__(self, inner: Mask, q_pos: int | Tensor, kv_pos: int | Tensor, q_len: int | None, kv_len: int | None):
        if (
            isinstance(inner, Positioned)
            and isinstance(q_pos, int)
            and isinstance(kv_pos, int)
            and isinstance(inner.q_pos, int)
            and isinstance(inner.kv_pos, int)
        ):
            # Offsets compose: the outer block is read in the inner block's coordinates.
            q_pos, kv_pos = q_pos + inner.q_pos, kv_pos + inner.kv_pos
            q_len, kv_len, inner = inner.q_len, inner.kv_len, inner.inner
        self._set(inner=inner, q_pos=q_pos, kv_pos=kv_pos, q_len=q_len, kv_len=kv_len)

    @property
    def _offsets(self) -> bool:
        return isinstance(self.q_pos, int) and isinstance(self.kv_pos, int)

    def _int_offsets(self) -> tuple[int, int] | None:
        """``(q_offset, kv_offset)`` when read at offsets, ``None`` when read at position tensors."""
        q_pos, kv_pos = self.q_pos, self.kv_pos
        return (q_pos, kv_pos) if isinstance(q_pos, int) and isinstance(kv_pos, int) else None

    def _whole(self) -> tuple[int, int]:
        # A mask that does not depend on the lengths ignores them; 0 keeps that explicit.
        return (self.q_len or 0, self.kv_len or 0)

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self.inner._mod(b, h, _read(self.q_pos, b, q), _read(self.kv_pos, b, kv), *self._whole())

    def _describe(self) -> str:
        inner = _paren(self.inner, (And, Or, Not))
        lengths = "" if self.q_len is None else f", q_len={self.q_len}, kv_len={self.kv_len}"
        q_pos, kv_pos = self.q_pos, self.kv_pos
        if isinstance(q_pos, Tensor) or isinstance(kv_pos, Tensor):
            q_shape, kv_shape = (tuple(p.shape) if isinstance(p, Tensor) else p for p in (q_pos, kv_pos))
            return f"{inner}.at(<q_positions {q_shape}>, <kv_positions {kv_shape}>{lengths})"
        return f"{inner}.shifted(q_offset={q_pos}, kv_offset={kv_pos}{lengths})"

    def check(self, extent: Extent) -> None:
        batch, _, q_len, kv_len = extent
        whole = [w if w is not None else e for w, e in zip((self.q_len, self.kv_len), self.inner.extent())]
        for name, pos, length, what, limit in (
            ("q", self.q_pos, q_len, "Lq", whole[0]),
            ("kv", self.kv_pos, kv_len, "Lk", whole[1]),
        ):
            if isinstance(pos, Tensor):
                if (length is not None and pos.shape[-1] != length) or (
                    pos.dim() == 2 and pos.shape[0] != 1 and pos.shape[0] != batch
                ):  # not `in (1, B)`: dynamo
                    raise ValueError(
                        f"at: {name}_positions has shape {tuple(pos.shape)} but the call has B={batch}, "
                        f"{what}={length}; expected ({length},) or ({batch}, {length})"
                    )
                # Positions on the host are checked against the whole attention (free there).
                # (Not while tracing: a data-dependent branch.)
                if (
                    limit is not None
                    and pos.device.type == "cpu"
                    and pos.numel()
                    and not torch.compiler.is_compiling()
                    and (int(pos.min()) < 0 or int(pos.max()) >= limit)
                ):
                    raise ValueError(
                        f"at: {name}_positions hold values in [{int(pos.min())}, {int(pos.max())}], "
                        f"outside the whole attention's {what}={limit}; expected 0 <= position < {limit}"
                    )
            elif limit is not None and length is not None and (pos < 0 or pos + length > limit):
                raise ValueError(
                    f"shifted: the block's {what}={length} at {name}_offset={pos} reads positions "
                    f"[{pos}, {pos + length}), outside the whole attention's {what}={limit}"
                )
        # The inner mask applies to the whole attention: its batch, heads and (when known) lengths.
        self.inner.check(extent.with_lengths(whole[0], whole[1]))

    def kinds(self) -> frozenset[str]:
        return self.inner.kinds() | ({"positions"} if not self._offsets else frozenset())

    def extent(self) -> tuple[int | None, int | None]:
        # Read at position tensors, a call has as many queries and keys as there are positions.
        q_pos, kv_pos = self.q_pos, self.kv_pos
        return (
            q_pos.shape[-1] if isinstance(q_pos, Tensor) else None,
            kv_pos.shape[-1] if isinstance(kv_pos, Tensor) else None,
        )

    def causal_offset(self, q_len: int, kv_len: int) -> int | None:
        offsets = self._int_offsets()
        if offsets is None:
            return None
        inner = self.inner.causal_offset(*self._whole())
        return None if inner is None else inner + offsets[0] - offsets[1]

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        offsets = self._int_offsets()
        if offsets is None:
            return -UNBOUNDED, UNBOUNDED
        lo, hi = self.inner._key_range(extent.with_lengths(*self._whole()), block.shifted(*offsets))
        return lo - offsets[1], hi - offsets[1]

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        offsets = self._int_offsets()
        if offsets is None:
            return super().block_state(extent, block)
        return self.inner.block_state(extent.with_lengths(*self._whole()), block.shifted(*offsets))


# --------------------------------------------------------------------------------- helpers
def _read(pos: int | Tensor, b: Tensor, idx: Tensor) -> Tensor:
    """Positions of call indices ``idx``: an offset added, or a tensor gathered (per batch row)."""
    if isinstance(pos, int):
        return idx + pos
    pos = pos.to(idx.device)
    if pos.dim() == 1:
        return pos[idx]
    return pos[b * 0 if pos.shape[0] == 1 else b, idx]


def _check_whole_lengths(mask: Mask, method: str, q_len: object, kv_len: object) -> tuple[int | None, int | None]:
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise TypeError(
                f"{method}: {name} must be a non-negative int (the whole attention's length), got {value!r}"
            )
    if (q_len is None) != (kv_len is None):
        raise ValueError(f"{method}: give both q_len and kv_len (the whole attention's lengths), or neither")
    if q_len is None and mask.depends_on_lengths():
        raise ValueError(
            f"{method}: {mask._describe()} depends on the whole attention's lengths (its bottom-right "
            f"diagonal sits at Lk - Lq); pass q_len= and kv_len= of the whole attention, e.g. "
            f"mask.{method}(..., q_len=Lq, kv_len=Lk)"
        )
    return cast("int | None", q_len), cast("int | None", kv_len)


def _grid(extent: Extent, block: Block, device: torch.device | str | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable index tensors ``b (B,1,1,1), h (1,H,1,1), q (1,1,rows,1), kv (1,1,1,cols)``."""
    b = torch.arange(extent.batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(extent.heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(block.q0, block.q1, device=device).view(1, 1, -1, 1)
    kv = torch.arange(block.k0, block.k1, device=device).view(1, 1, 1, -1)
    return b, h, q, kv


def _as_4d(allowed: Tensor, q_len: int, kv_len: int) -> Tensor:
    """Give a mask_mod result the query and key dimensions even if it ignored them."""
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed.expand(allowed.shape[0], allowed.shape[1], q_len, kv_len)


def _coerce(other: object, op: str) -> Mask:
    if isinstance(other, Mask):
        return other
    for kind, to_mask in _COERCIONS:
        if isinstance(other, kind):
            return to_mask(other, name=f"the right-hand side of '{op}'")
    raise TypeError(
        f"cannot combine a mask with {type(other).__name__} using '{op}'; expected a multihead mask or a bool tensor"
    )


def _paren(mask: Mask, kinds: type | tuple[type, ...]) -> str:
    text = mask._describe()
    return f"({text})" if isinstance(mask, kinds) else text
