"""A block-selection mask: per batch, head (group) and query block, the key blocks to read.

The mask of trainable sparse attention (MoBA, NSA's selected branch): a selection computed per
call, here a table of key-block numbers. With ``bs = block_size``, query ``i`` of batch ``b`` and
head ``h`` may attend key ``j`` iff ``j // bs`` is one of ``indices[b, h', i // bs, :]``
(``h'`` = ``h``, or ``0`` for one row of heads, or the KV head of ``h``; ``i // query_block_size``
when the queries are grouped otherwise, e.g. per token). Positions are those of
the whole attention, as for every mask; causality is not included, compose it::

    indices[0, 0] = [[0, -1], [0, 1], [2, 0]]   (3 query blocks, k = 2, block_size = 2)
    block_select(indices, 2) & causal()

    key    0 1 2 3 4 5
    q 0    █ · · · · ·      query block 0 reads key block 0
    q 1    █ █ · · · ·
    q 2    █ █ █ · · ·      query block 1 reads key blocks 0 and 1
    q 3    █ █ █ █ · ·
    q 4    █ █ · · █ ·      query block 2 reads key blocks 2 and 0
    q 5    █ █ · · █ █

The meaning is :meth:`BlockSelect._mod` (a gather from the dense ``(B, H, nQ, nK)`` table of
selected blocks); the structural questions (:meth:`~BlockSelect.block_state`,
:meth:`~BlockSelect.key_range`) are thin reads of that table on the host, answered for every
batch row and head at once, so a block-sparse backend skips the blocks no row and no head selects.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks.base import BlockState, Mask

__all__ = ["block_select", "BlockSelect"]


def block_select(
    indices: Tensor, block_size: int, *, num_heads: int | None = None, query_block_size: int | None = None
) -> BlockSelect:
    """The mask reading, for each query block, the key blocks ``indices`` names.

    Args:
        indices: ``(B, H, nQ, k)`` integer tensor, ``nQ = ceil(Lq / query_block_size)``: the key-block
            numbers query block ``n`` of batch ``b`` and head ``h`` reads, ``-1`` for none (a row
            may name fewer than ``k`` blocks; a block named twice counts once). ``B`` may be 1
            (every batch row), ``H`` 1 (every head), the query heads ``Hq``, or the KV heads
            ``Hkv`` of a GQA call (query head ``h`` reads row ``h // (Hq / Hkv)``: the call's
            ``Hq`` binds it, :meth:`Mask.for_heads`; ``num_heads`` says it ahead).
        block_size: the keys of a block (and the queries of one, unless ``query_block_size``).
        num_heads: ``Hq``, when ``1 < H < Hq``: query head ``h`` reads row ``h // (Hq / H)`` (the GQA
            mapping of :mod:`multihead.conventions`); optional, the call's ``Hq`` is used otherwise
            (needed only where the mask is evaluated outside a call, ``materialize``).
        query_block_size: the queries sharing one row of ``indices`` (default ``block_size``;
            then ``nQ = ceil(Lq / query_block_size)``). ``1`` selects per query token, as MoBA's
            gate does.
    """
    if (
        not isinstance(indices, Tensor)
        or indices.is_floating_point()
        or indices.is_complex()
        or indices.dtype == torch.bool
    ):
        got = f"dtype {indices.dtype}" if isinstance(indices, Tensor) else type(indices).__name__
        raise TypeError(
            f"block_select: indices must be an integer tensor (B, H, nQ, k) of key-block numbers, got {got}"
        )
    if indices.dim() != 4 or 0 in indices.shape:
        raise ValueError(
            f"block_select: indices must have shape (B, H, ceil(Lq / block_size), k) with no zero dim, "
            f"got {tuple(indices.shape)}"
        )
    for name, size in (("block_size", block_size), ("query_block_size", query_block_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"block_select: {name} must be a positive int, got {size!r}")
    H = indices.shape[1]
    if num_heads is not None:
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or num_heads % H:
            raise ValueError(
                f"block_select: num_heads must be the query heads Hq, a multiple of the {H} rows of heads "
                f"in indices, got {num_heads!r}"
            )
    # Copied, as every mask copies its tensors: an int64 table was shared with the caller, so one
    # changed in place afterwards (a buffer reused per step) left the mask reading its old table if
    # it had been used, the new one if not, while ``indices`` showed the new values.
    indices = indices.detach().to(torch.int64, copy=True)
    return BlockSelect(indices, block_size, num_heads, query_block_size or block_size)


class BlockSelect(Mask):
    """Built by :func:`block_select`."""

    kind = "custom"  # read element by element through _mod, as a custom mask_mod is
    indices: Tensor
    block_size: int
    num_heads: int | None
    query_block_size: int

    def __init__(self, indices: Tensor, block_size: int, num_heads: int | None, query_block_size: int):
        self._set(indices=indices, block_size=block_size, num_heads=num_heads, query_block_size=query_block_size)

    # ----------------------------------------------------------------------------- meaning
    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        table = self._table()
        if table.device != q.device:
            table = table.to(q.device)
        B, H, nQ, nK = table.shape
        qb, kb = q // self.query_block_size, kv // self.block_size
        row = torch.zeros_like(h) if H == 1 else h // (self.num_heads // H) if self.num_heads else h
        batch = torch.zeros_like(b) if B == 1 else b
        picked = table[batch, row, qb.clamp(0, nQ - 1), kb.clamp(0, nK - 1)]  # (B, H, Lq, Lk) by broadcasting
        return picked & (qb < nQ) & (kb < nK)

    def _describe(self) -> str:
        B, H, nQ, k = self.indices.shape
        heads = "" if self.num_heads is None else f", num_heads={self.num_heads}"
        if self.query_block_size != self.block_size:
            heads += f", query_block_size={self.query_block_size}"
        per_row = float(self._host_table().sum()) / (B * H * nQ)
        return (
            f"block_select(indices ({B}, {H}, {nQ}, {k}), block_size={self.block_size}{heads}: "
            f"{per_row:.1f} key blocks per query block)"
        )

    def for_heads(self, num_heads: int) -> Mask:
        """One row per KV head (``1 < H < Hq``, ``Hq`` a multiple): bound to the call's ``Hq``, so
        that query head ``h`` reads row ``h // (Hq / H)``, as ``num_heads=Hq`` asks."""
        H = self.indices.shape[1]
        if self.num_heads is None and 1 < H < num_heads and num_heads % H == 0:
            return self._replace(num_heads=num_heads)
        return self

    def check(self, extent: Extent) -> None:
        batch, heads, q_len, kv_len = extent.batch, extent.heads, extent.q_len, extent.kv_len
        B, H, nQ, _ = self.indices.shape
        if B not in (1, batch):
            raise ValueError(f"block_select: indices have {B} batch rows, the call {batch}; expected 1 or {batch}")
        if self.num_heads is not None and self.num_heads != heads:
            # with H = Hq rows it passed, and query head h read row h // (num_heads / H): another head's
            raise ValueError(
                f"block_select: num_heads={self.num_heads} but the call has {heads} query heads; expected "
                f"num_heads={heads} (or none when indices have a row per query head or one for all)"
            )
        if H not in (1, heads) and self.num_heads != heads:
            hint = f"; for {H} KV heads give num_heads={heads}" if heads % H == 0 else ""
            raise ValueError(
                f"block_select: indices have {H} rows of heads, the call {heads} query heads; expected 1, "
                f"{heads}, or the KV heads with num_heads={heads}{hint}"
            )
        if q_len is not None and math.ceil(q_len / self.query_block_size) > nQ:
            raise ValueError(
                f"block_select: {q_len} queries make {math.ceil(q_len / self.query_block_size)} blocks of "
                f"{self.query_block_size}, but indices name key blocks for {nQ}"
            )
        largest = self._largest()  # before any table: one as wide as a garbage index would not fit
        if kv_len is not None:
            blocks = math.ceil(kv_len / self.block_size)
            if largest >= blocks:
                raise ValueError(
                    f"block_select: indices name key block {largest}, but {kv_len} keys make {blocks} blocks "
                    f"of {self.block_size}; expected key-block numbers in [0, {blocks}) or -1 for none"
                )

    def extent(self) -> tuple[int | None, int | None]:
        return self.indices.shape[2] * self.query_block_size, None  # the queries the table has rows for

    # ----------------------------------------------------------------------------- structure
    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        rows = self._rows(block.q0, block.q1)
        if rows is None:
            return 0, 0
        picked = rows.flatten(0, 2).any(0).nonzero()  # the key blocks any of these rows reads
        if picked.numel() == 0:
            return 0, 0
        return int(picked[0]) * self.block_size, (int(picked[-1]) + 1) * self.block_size

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        q0, q1, k0, k1 = block.q0, block.q1, block.k0, block.k1
        rows = self._rows(q0, q1)
        if rows is None or k0 >= k1:
            return BlockState.EMPTY
        nQ, nK = self.indices.shape[2], rows.shape[-1]
        first, last = k0 // self.block_size, (k1 - 1) // self.block_size
        picked = rows[..., first : min(last, nK - 1) + 1]  # key blocks past the table: never read
        if picked.numel() == 0 or not bool(picked.any()):
            return BlockState.EMPTY
        # FULL: every query has a row (none past the table) and every row reads every key block here
        covered = (q1 - 1) // self.query_block_size < nQ and last < nK
        return BlockState.FULL if covered and bool(picked.all()) else BlockState.PARTIAL

    # ----------------------------------------------------------------------------- the table
    def _rows(self, q0: int, q1: int) -> Tensor | None:
        """The host table's rows of query blocks covering queries ``[q0, q1)``, or ``None``."""
        table = self._host_table()
        first, last = q0 // self.query_block_size, (q1 - 1) // self.query_block_size
        if q0 >= q1 or first >= table.shape[2]:
            return None
        return table[:, :, first : last + 1]

    def _table(self) -> Tensor:
        """``(B, H, nQ, nK)`` bool on the indices' device, ``nK = 1 + the largest block named``."""
        return self._cached("_table_cache", self._build)

    def _host_table(self) -> Tensor:
        return self._cached("_host_cache", lambda: self._table().cpu())

    def _largest(self) -> int:
        """The largest key block named (``-1`` when none is), after refusing a number below ``-1``:
        one host read of the indices, no table."""
        return self._cached("_largest_cache", self._read_bounds)

    def _read_bounds(self) -> int:
        low, high = torch.aminmax(self.indices)
        if int(low) < -1:
            raise ValueError(
                f"block_select: indices are key-block numbers or -1 for none, got {int(low)}; expected values >= -1"
            )
        return int(high)

    def _build(self) -> Tensor:
        idx = self.indices
        nK = max(self._largest() + 1, 1)
        table = torch.zeros(*idx.shape[:3], nK + 1, dtype=torch.bool, device=idx.device)
        table.scatter_(-1, torch.where(idx < 0, nK, idx), True)  # -1 lands in the spare last column
        return table[..., :nK]
