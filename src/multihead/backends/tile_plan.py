"""The tile plan of the ``triton_blocks`` kernels: for each tile of ``BM`` queries, the tiles of
``BN`` keys it reads, split into *full* tiles (every query sees every key: no mask evaluated) and
*partial* ones (the mask program evaluated element by element), read from the mask's structural
answers (``key_range``, ``block_state``), never from an ``Lq x Lk`` tensor::

    key tiles:   0    1    2    3    4    5          causal, Lq = Lk = 6 tiles
    query 0      P    .    .    .    .    .          P partial (the diagonal)
    query 1      F    P    .    .    .    .          F full
    query 2      F    F    P    .    .    .          . skipped (EMPTY)

The plan is two CSR tables on the kernel's device: per query tile ``ptr (Tq, 4)`` = [partial
start, partial end, full start, full end) into ``cols`` (key tiles); the backward's transposed
plan per key tile, into ``rows`` (query tiles). A key tile that runs past ``Lk`` is always partial
(its bounds are checked there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks import BlockState, Mask

__all__ = ["TilePlan", "tile_plan", "visible_tiles"]


@dataclass(frozen=True)
class TilePlan:
    """``ptr (T, 4)`` int32 and ``idx`` int32: the tiles each of ``T`` tiles reads (see above)."""

    ptr: Tensor
    idx: Tensor
    tiles: int  # visible tiles in all (partial and full): the kernel's work

    def to(self, device: torch.device) -> TilePlan:
        return TilePlan(self.ptr.to(device), self.idx.to(device), self.tiles)


# ------------------------------------------------------------------------------ the adapter
def visible_tiles(
    mask: Mask | None, batch: int, heads: int, q_len: int, kv_len: int, q0: int, q1: int, block_n: int
) -> list[tuple[int, bool]]:
    """The key tiles (index, partial?) that queries ``[q0, q1)`` see in any batch row and head.

    The one function of this backend that asks the mask protocol (``key_range``, ``block_state``
    on an ``Extent`` and a ``Block`` of whole-attention positions): a change of that protocol
    changes this function only. A range of tiles the mask calls FULL or EMPTY is answered in one
    question; only mixed ranges are split, so a causal row costs a few questions, not one per tile."""
    extent = Extent(batch, heads, q_len, kv_len)
    if mask is None:
        lo, hi = 0, kv_len
    else:
        lo, hi = mask.key_range(extent, Block(q0, q1, 0, kv_len))
    if lo >= hi:
        return []
    found: list[tuple[int, bool]] = []

    def classify(n0: int, n1: int) -> None:  # key tiles [n0, n1)
        k0, k1 = n0 * block_n, min(n1 * block_n, kv_len)
        state = BlockState.FULL if mask is None else mask.block_state(extent, Block(q0, q1, k0, k1))
        if state is BlockState.EMPTY:
            return
        if state is BlockState.FULL or n1 - n0 == 1:
            found.extend((n, state is not BlockState.FULL or (n + 1) * block_n > kv_len) for n in range(n0, n1))
            return
        mid = (n0 + n1) // 2
        classify(n0, mid)
        classify(mid, n1)

    classify(lo // block_n, -(-hi // block_n))
    return found


# ------------------------------------------------------------------------------ the plan
def tile_plan(
    mask: Mask | None, batch: int, heads: int, q_len: int, kv_len: int, block_m: int, block_n: int
) -> tuple[TilePlan, TilePlan]:
    """``(by query tile, by key tile)``: the forward's and dQ's plan, and dK/dV's (its transpose)."""
    rows, cols, partial = [], [], []
    for t in range(-(-q_len // block_m)):
        q0, q1 = t * block_m, min((t + 1) * block_m, q_len)
        for n, part in visible_tiles(mask, batch, heads, q_len, kv_len, q0, q1, block_n):
            rows.append(t)
            cols.append(n)
            partial.append(part)
    r, c, p = (torch.tensor(x, dtype=torch.int64) for x in (rows, cols, partial))
    return _csr(r, c, p, -(-q_len // block_m)), _csr(c, r, p, -(-kv_len // block_n))


def _csr(owner: Tensor, other: Tensor, partial: Tensor, count: int) -> TilePlan:
    """Entries grouped by ``owner`` tile, partial ones first: ``ptr (count, 4)``, ``idx``."""
    order = torch.argsort(owner * 2 + (1 - partial), stable=True)
    owner, other, partial = owner[order], other[order], partial[order]
    n_partial = torch.bincount(owner[partial == 1], minlength=count)
    n_all = torch.bincount(owner, minlength=count)
    start = torch.cumsum(n_all, 0) - n_all
    ptr = torch.stack([start, start + n_partial, start + n_partial, start + n_all], dim=1)
    return TilePlan(ptr.to(torch.int32).contiguous(), other.to(torch.int32).contiguous(), int(owner.numel()))
