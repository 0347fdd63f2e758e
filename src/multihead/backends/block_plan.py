"""The plan of the ``blocksparse`` backend: which fused-kernel calls a structured mask needs, read
from the mask's structural answers only (``key_range``, ``block_state``, ``window``), never from
an ``Lq x Lk`` tensor. For each block of ``block_size`` queries::

    keys:   lo ................................................ hi      (mask.key_range)
            [ mask piece ][        full piece        ][ causal piece ]   (mask.block_state)
              small mask      no mask at all            is_causal=True, no mask

and, for a band, its interior query blocks as one batched run (:func:`band_run`,
:mod:`multihead.backends.band_runs`). How the pieces run: :mod:`multihead.backends.blocksparse`.
"""

from __future__ import annotations

from dataclasses import dataclass

from multihead.backends.band_runs import BandRun, interior_run
from multihead.blocks import Block, Extent
from multihead.masks import And, Band, BlockState, Mask
from multihead.scores import ScoreMod

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FULL",
    "CAUSAL",
    "MASKED",
    "Piece",
    "QueryBlock",
    "Plan",
    "block_plan",
    "kernel_pieces",
    "band_run",
]

#: Queries per block and the key-block grid; chosen by measurement (docs/performance.md).
DEFAULT_BLOCK_SIZE = 256

FULL, CAUSAL, MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class Piece:
    """One kernel call: keys ``[k0, k1)`` for the query block, with no mask, ``is_causal``, or a mask."""

    k0: int
    k1: int
    kind: str  # FULL, CAUSAL or MASKED
    diagonal: int | None = None  # CAUSAL: the key where row 0's diagonal is (default k0)


@dataclass(frozen=True)
class QueryBlock:
    q0: int
    q1: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Plan:
    """The kernel calls of one attention: the interior blocks of a band as one batched call
    (``run``, :mod:`multihead.backends.band_runs`), and the other query blocks one by one."""

    run: BandRun | None
    blocks: tuple[QueryBlock, ...]
    documents: bool = False  # the blocks are whole documents (backends/document_runs.py)


# ----------------------------------------------------------------------------------- planning
def block_plan(mask: Mask | None, extent: Extent, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[QueryBlock, ...]:
    """The kernel calls for every query block of ``extent`` ``(B, Hq, Lq, Lk)``, from the mask's
    structural answers only."""
    q_len, kv_len = extent.lengths
    diagonal = _upper_diagonal(mask, q_len, kv_len)
    blocks = []
    for q0 in range(0, q_len, block_size):
        q1 = min(q0 + block_size, q_len)
        if mask is None:
            blocks.append(QueryBlock(q0, q1, (Piece(0, kv_len, FULL),)))
            continue
        lo, hi = mask.key_range(extent, extent.rows(q0, q1))
        pieces: list[Piece] = []
        if lo < hi and diagonal is not None:
            d, rest = diagonal
            c0, c1 = q0 + d, min(q1 + d, kv_len)  # the block's diagonal, aligned for is_causal
            # Keys >= q1 + d are above every row's diagonal; keys < q0 + d are below it.
            hi = min(hi, c1)
            if lo <= c0 < c1 and (rest is None or rest.block_state(extent, Block(q0, q1, c0, c1)) is BlockState.FULL):
                pieces = _classify(mask, extent, Block(q0, q1, lo, c0), block_size)
                pieces.append(Piece(c0, c1, CAUSAL))
                blocks.append(QueryBlock(q0, q1, tuple(_merge(pieces))))
                continue
        if lo < hi:
            pieces = _classify(mask, extent, Block(q0, q1, lo, hi), block_size)
        blocks.append(QueryBlock(q0, q1, tuple(_merge(pieces))))
    return _merge_query_blocks(blocks)


def kernel_pieces(blk: QueryBlock, mods: ScoreMod | None) -> tuple[Piece, ...]:
    """The kernel calls of a query block. With a relative bias, adjacent FULL and CAUSAL pieces
    become one call: the bias is a strided view whatever its width, and the causal diagonal is
    ``-inf`` in its values (:func:`_relative_piece`); one call instead of two and no merge."""
    if mods is None or not mods.relative or len(blk.pieces) < 2:
        return blk.pieces
    out: list[Piece] = []
    for p in blk.pieces:
        prev = out[-1] if out else None
        if p.kind != MASKED and prev is not None and prev.kind == FULL and prev.k1 == p.k0:
            out[-1] = Piece(prev.k0, p.k1, p.kind, p.k0 if p.kind == CAUSAL else None)
        else:
            out.append(p)
    return tuple(out)


def band_run(mask: Mask | None, q_len: int, kv_len: int, block: int) -> BandRun | None:
    """The interior query blocks of a band (a ``Band`` or an ``&`` of them, bounded on both
    sides) as one batched run, when there are at least two of them; else ``None``."""
    if mask is None:
        return None
    parts = mask.parts if isinstance(mask, And) else (mask,)
    bands = [p for p in parts if isinstance(p, Band)]
    if len(bands) != len(parts):
        return None
    windows = [p.window(q_len, kv_len) for p in bands]
    if any(w is None for w in windows):  # aligned per sequence: no single relative pattern
        return None
    los = [w.lo for w in windows if w is not None and w.lo is not None]
    his = [w.hi for w in windows if w is not None and w.hi is not None]
    if not los or not his:
        return None
    run = interior_run(q_len, kv_len, block=block, lo=max(los), hi=min(his))
    return run if run is not None and run.blocks >= 2 else None


def _merge_query_blocks(blocks: list[QueryBlock]) -> tuple[QueryBlock, ...]:
    """Consecutive query blocks that read the same keys with no mask become one call (no mask,
    key padding): the kernel blocks large calls itself, and each call has a fixed overhead."""
    merged: list[QueryBlock] = []
    for blk in blocks:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and prev.pieces == blk.pieces
            and prev.q1 == blk.q0
            and all(p.kind == FULL for p in blk.pieces)
        ):
            merged[-1] = QueryBlock(prev.q0, blk.q1, prev.pieces)
        else:
            merged.append(blk)
    return tuple(merged)


def _classify(mask: Mask, extent: Extent, block: Block, block_size: int) -> list[Piece]:
    """Split the block's keys ``[k0, k1)`` on the block grid until each part is EMPTY, FULL or one block."""
    k0, k1 = block.k0, block.k1
    if k0 >= k1:
        return []
    state = mask.block_state(extent, block)
    if state is BlockState.EMPTY:
        return []
    if state is BlockState.FULL:
        return [Piece(k0, k1, FULL)]
    if k1 - k0 <= block_size:
        return [Piece(k0, k1, MASKED)]
    mid = (k0 + k1) // 2 // block_size * block_size
    if mid <= k0:
        mid = (k0 // block_size + 1) * block_size
    return _classify(mask, extent, block.with_keys(k0, mid), block_size) + _classify(
        mask, extent, block.with_keys(mid, k1), block_size
    )


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of the same kind become one call (causal pieces stay alone)."""
    merged: list[Piece] = []
    for p in pieces:
        if merged and merged[-1].kind == p.kind != CAUSAL and merged[-1].k1 == p.k0:
            merged[-1] = Piece(merged[-1].k0, p.k1, p.kind)
        else:
            merged.append(p)
    return merged


def _upper_diagonal(mask: Mask | None, q_len: int, kv_len: int) -> tuple[int, Mask | None] | None:
    """``(d, rest)`` when ``mask`` is "key ``j <= i + d``" ``&`` ``rest`` (``rest`` may be
    ``None``): causal masks and the right edge of sliding windows, alone or in an ``&``.
    ``None`` when the mask has no such edge."""
    if mask is None:
        return None
    parts = mask.parts if isinstance(mask, And) else (mask,)
    uppers: list[int] = []
    rest: list[Mask] = []
    for p in parts:
        window = p.window(q_len, kv_len) if isinstance(p, Band) else None
        if isinstance(p, Band) and window is not None and window.hi is not None:
            uppers.append(window.hi)
            if p.left is not None:
                rest.append(Band(p.left, None, p.align, name="sliding_window"))
        else:
            rest.append(p)
    if not uppers:
        return None
    rest_mask = None if not rest else (rest[0] if len(rest) == 1 else And(*rest))
    return min(uppers), rest_mask
