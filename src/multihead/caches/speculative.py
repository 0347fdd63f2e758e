"""Speculative decoding over a KV cache: after a draft tree was verified, keep the accepted path.

A verification step appends the ``T`` draft tokens of a tree to a cache holding the prefix and
attends with :func:`multihead.masks.tree` (each draft sees the prefix, its ancestors and itself)::

    prefix (P tokens)  | tree nodes 0 .. T-1 at slots P .. P+T-1
    read = cache.update(k_tree, v_tree)                       # (B, Hkv, T, ·)
    out = attention(q_tree, read.keys, read.values, mask=read.mask(tree(parents), causal=True, heads=Hq))

The model's target tokens then accept a root-to-node path of the tree, say nodes ``[0, 2, 5]``.
:func:`commit_path` makes the cache hold exactly ``prefix + those tokens`` at positions
``P, P+1, P+2`` (the node at depth ``d`` moves from slot ``P + node`` to ``P + d``), as if they had
been decoded one by one; the other drafts are gone. Rotary keys need no change: a draft node is
rotated at ``P + depth`` (:meth:`multihead.masks.Tree.depths`), the position it keeps if accepted.

One owner of the commit, for the caches that keep every token where a step puts it:
:class:`~multihead.caches.DynamicKVCache` (and :class:`~multihead.caches.LatentKVCache`; every row
accepts as many tokens), :class:`~multihead.caches.StaticKVCache` and
:class:`~multihead.caches.PagedKVCache` (each row its own path; a paged row frees the pages it
no longer fills). Other caches are refused with the reason (``docs/inference.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.caches.base import KVCache, check_readable
from multihead.caches.dynamic import DynamicKVCache
from multihead.caches.paged import PagedKVCache
from multihead.caches.static import StaticKVCache
from multihead.masks.tree import Tree, tree

__all__ = ["commit_path"]

#: The caches a commit runs on, and why others are refused.
_REFUSED = {
    "SlidingWindowKVCache": "a ring keeps only the last window tokens, and crop cannot go back past what it holds",
    "QuantizedKVCache": "its slots are quantized: re-storing the accepted tokens would quantize them twice",
    "PolicyKVCache": "an eviction policy may already have dropped draft tokens, and it keeps its own per-head layout",
}


def commit_path(cache: KVCache, draft: Tree | Tensor, path: Sequence[int] | Sequence[Sequence[int]] | Tensor) -> None:
    """Keep the accepted ``path`` of the draft tree that the cache's last ``T`` tokens hold.

    Args:
        cache: holds ``prefix + T`` draft tokens in each row (the tree appended last).
        draft: the tree (:func:`multihead.masks.tree`) or its parents ``(T,)`` / ``(B, T)``.
        path: the accepted nodes, root first, each the child of the one before: a list of node
            indices (every row), a list of lists (one per row), or an integer tensor ``(A,)`` /
            ``(B, A)`` with ``-1`` after the end of a shorter row's path. An empty path rejects
            every draft (the cache keeps the prefix).

    Afterwards row ``b`` holds ``P_b + len(path_b)`` tokens: the prefix, then the accepted tokens
    at consecutive positions. Everything is checked before the cache changes: a refused commit
    leaves it as it was.
    """
    name = type(cache).__name__
    if not isinstance(cache, KVCache):
        raise TypeError(f"commit_path: cache must be a KVCache, got {name}")
    if name in _REFUSED or not isinstance(cache, (DynamicKVCache, StaticKVCache, PagedKVCache)):
        why = _REFUSED.get(name, "it is not one of the caches a commit knows how to read back")
        raise TypeError(
            f"commit_path: {name} cannot commit a tree path: {why}; expected a DynamicKVCache, StaticKVCache "
            f"or PagedKVCache"
        )
    if isinstance(draft, Tensor):
        check_readable("commit_path", "draft", draft, "the tree's parents (T,) or (B, T)")
    draft = draft if isinstance(draft, Tree) else tree(draft)
    lengths = cache.lengths.to("cpu")  # (B,): prefix + T
    B, T = lengths.shape[0], draft.size
    if B == 0 or int(lengths.min()) < T:
        raise ValueError(
            f"commit_path: the cache's rows hold {lengths.tolist()} tokens, fewer than the tree's T={T} "
            f"drafts; expected the draft tokens appended last (verify the tree first)"
        )
    if draft.parents.shape[0] not in (1, B):
        raise ValueError(f"commit_path: the tree has {draft.parents.shape[0]} rows, the cache {B}; expected 1 or {B}")
    rows = _paths(path, B)
    parents = draft.parents.expand(B, T).tolist()
    for b, row in enumerate(rows):
        _check_chain(row, parents[b], b, T)
    accepted = [len(row) for row in rows]
    per_row = isinstance(cache, (StaticKVCache, PagedKVCache))
    if not per_row and len(set(accepted)) > 1:
        raise ValueError(
            f"commit_path: {name} keeps one length for every row, but the paths accept {accepted} tokens; "
            f"expected as many in every row (StaticKVCache and PagedKVCache take one length per row)"
        )
    start = lengths - T  # (B,): the prefix of each row
    A = max(accepted)
    if A:  # the accepted tokens gathered into new tensors before anything is overwritten
        node = torch.tensor([row + [row[-1] if row else 0] * (A - len(row)) for row in rows])  # (B, A) padded
        k_acc, v_acc = _gather(cache, start.view(B, 1) + node)  # (B, Hkv, A, ·)
    uniform = int(start.min()) == int(start.max())
    cache.crop(int(start[0]) if uniform else start.to(cache.lengths.device))
    if A:
        cache.update(k_acc, v_acc)
    if len(set(accepted)) > 1:  # shorter paths: the padding written after them goes
        cache.crop((start + torch.tensor(accepted)).to(cache.lengths.device))


def _paths(path: object, B: int) -> list[list[int]]:
    """``path`` as one list of node indices per row."""
    if isinstance(path, Tensor):
        check_readable("commit_path", "path", path, "an integer tensor (A,) or (B, A) of accepted nodes")
        if path.is_floating_point() or path.dtype == torch.bool or path.dim() not in (1, 2):
            raise TypeError(
                f"commit_path: path must be an integer tensor (A,) or (B, A), got dtype {path.dtype}, "
                f"shape {tuple(path.shape)}"
            )
        table = path.view(-1, path.shape[-1]).tolist()
        rows = [[n for n in row if n != -1] for row in table]  # -1: after the end of the path
        for b, (row, full) in enumerate(zip(rows, table, strict=True)):
            if full[: len(row)] != row:
                raise ValueError(f"commit_path: path row {b} {full} has -1 before a node; -1 only pads the end")
    elif isinstance(path, (str, bytes)):
        raise TypeError(
            f"commit_path: path must be node indices (a list of ints, one list per row, or a tensor), got {path!r}"
        )
    elif isinstance(path, Sequence) and all(isinstance(n, int) and not isinstance(n, bool) for n in path):
        rows = [list(path)]  # ints, checked
    elif isinstance(path, Sequence) and all(isinstance(r, Sequence) for r in path):
        rows = [list(r) for r in path]
        for b, row in enumerate(rows):
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in row):
                raise TypeError(f"commit_path: path row {b} must be node indices (ints), got {row!r}")
    else:
        raise TypeError(
            f"commit_path: path must be node indices (a list of ints, one list per row, or an integer tensor), "
            f"got {path!r}"
        )
    if len(rows) == 1:
        rows = rows * B
    if len(rows) != B:
        raise ValueError(f"commit_path: path has {len(rows)} rows, the cache {B}; expected 1 or {B}")
    return rows


def _check_chain(row: list[int], parents: list[int], b: int, T: int) -> None:
    """``row`` must start at a root and go down one child at a time."""
    for i, node in enumerate(row):
        if not 0 <= node < T:
            raise ValueError(f"commit_path: path row {b} names node {node}; expected nodes in [0, {T})")
        want = -1 if i == 0 else row[i - 1]
        if parents[node] != want:
            what = "a root (parent -1)" if i == 0 else f"a child of node {want}, the node before it"
            raise ValueError(
                f"commit_path: path row {b} {row} is not a root-to-node chain: node {node} (parent "
                f"{parents[node]}) at depth {i} must be {what}"
            )


def _gather(cache: KVCache, want: Tensor) -> tuple[Tensor, Tensor]:
    """The keys and values ``(B, Hkv, A, ·)`` of the tokens at positions ``want (B, A)``."""
    B, A = want.shape
    if isinstance(cache, PagedKVCache):  # straight from the pages: no dense read of the whole cache
        ps = cache.page_size
        pages = torch.tensor([[cache.tables[b][p // ps] for p in row] for b, row in enumerate(want.tolist())])
        page, offset = pages.to(cache.key_pages.device), (want % ps).to(cache.key_pages.device)
        keys = cache.key_pages[:, page, offset].transpose(0, 1)  # (Hkv, B, A, D) -> (B, Hkv, A, D)
        return keys, cache.value_pages[:, page, offset].transpose(0, 1)
    # Every slot read back (an empty update returns them all, then undone), the wanted ones gathered.
    k0, v0 = _empty_kv(cache, B)
    read = cache.update(k0, v0)
    cache.rollback()
    slots = _slots_of(read.key_positions, want.to(read.query_positions.device), B)
    keys, values = read.keys, read.values
    index = slots.to(keys.device).view(B, 1, A, 1)
    k_acc = keys.gather(2, index.expand(B, keys.shape[1], A, keys.shape[3]))
    return k_acc, values.gather(2, index.expand(B, values.shape[1], A, values.shape[3]))


def _empty_kv(cache: KVCache, B: int) -> tuple[Tensor, Tensor]:
    """Keys and values of no token, shaped as the cache stores them (for an update that reads every slot)."""
    assert isinstance(cache, (DynamicKVCache, StaticKVCache))  # the kinds commit_path takes (checked first)
    keys, values = cache.keys, cache.values
    assert keys is not None and values is not None  # the cache holds the tree (checked above)
    k = keys[:, :, :0]
    return k, (k[..., : values.shape[3]] if values.data_ptr() == keys.data_ptr() else values[:, :, :0])


def _slots_of(key_positions: Tensor | None, want: Tensor, B: int) -> Tensor:
    """``(B, A)``: the slot holding each wanted position (slot ``j`` holds position ``j`` in a read
    with no table)."""
    if key_positions is None:
        return want
    table = key_positions.view(-1, key_positions.shape[-1]).expand(B, -1)  # (B, S)
    hit = table.unsqueeze(1) == want.unsqueeze(-1)  # (B, A, S)
    return hit.to(torch.int8).argmax(-1)
