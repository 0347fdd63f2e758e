"""The ``blocksparse`` backend: structured masks run as a few fused-kernel calls per query block.

Cost follows the *visible* area of the mask instead of the ``Lq x Lk`` square, and no tensor of
``Lq x Lk`` elements is ever built. For each block of ``block_size`` queries::

    keys:   lo ................................................ hi      (mask.key_range)
            [ mask piece ][        full piece        ][ causal piece ]   (mask.block_state)
              small mask      no mask at all            is_causal=True, no mask

* keys outside ``mask.key_range`` and key blocks in state ``EMPTY`` are skipped;
* runs of ``FULL`` key blocks become one kernel call with no mask;
* the diagonal block of a causal edge (``causal()``, the right edge of ``sliding_window``) is
  passed as ``is_causal=True`` on a key range starting at the query block's aligned key;
* runs of ``PARTIAL`` key blocks become one call with a small additive mask of that run only
  (``mask.materialize_block``), e.g. the left edge of a sliding window or a document boundary;
* an additive score modifier (a bias) is added to every piece as a block-sized ``attn_mask``
  (:func:`multihead.scoring.additive_block`), never an ``Lq x Lk`` tensor; a bias that requires
  grad gets ``dS`` of each piece in the backward.

For a band (``causal() & sliding_window(w)``, any ``sliding_window``) the query blocks away from
the edges all see the same relative pattern; they run as ONE kernel call with the blocks folded
into the batch (:mod:`multihead.backends.band_runs`): one parallel region instead of three per
block, which keeps the speed when other processes share the cores (docs/performance.md).

Each piece returns its output and log-sum-exp (PyTorch's CPU flash kernel,
``aten._scaled_dot_product_flash_attention_for_cpu``); pieces of one query block are merged
with their LSE by :func:`multihead.merge_partials`::

    lse = log sum_i exp(lse_i)        out = sum_i exp(lse_i - lse) * out_i

The backward pass is the flash-attention one: for each piece, the kernel's backward is called
with the *merged* output and LSE, which gives exactly that piece's share of ``dq, dk, dv``;
nothing but ``q, k, v``, the output and the LSE is kept between forward and backward.
Fully masked rows give output 0, LSE ``-inf`` and zero gradients (see
:mod:`multihead.conventions`). Block size: ``docs/performance.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.backends.band_runs import BandRun, interior_run, run_backward, run_forward
from multihead.backends.base import MASK_KINDS, Backend, Capabilities
from multihead.backends.bias_backward import LOG_TINY, bias_backward, normalise_, row_delta, row_peak
from multihead.backends.document_runs import document_segments
from multihead.backends.torch_blocks import attention_by_blocks
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import lse_dtype, softmax_dtype
from multihead.masks import And, Band, BlockState, Mask
from multihead.merge import merge_partials
from multihead.scores import ADDITIVE, ELEMENTWISE, ScoreMod
from multihead.scores.relative import toeplitz_view
from multihead.scoring import additive_block, unseen_keys

__all__ = ["BlockSparseBackend", "block_plan", "Plan", "DEFAULT_BLOCK_SIZE"]

#: Queries per block and the key-block grid; chosen by measurement (docs/performance.md).
DEFAULT_BLOCK_SIZE = 256

_FULL, _CAUSAL, _MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class Piece:
    """One kernel call: keys ``[k0, k1)`` for the query block, with no mask, ``is_causal``, or a mask."""

    k0: int
    k1: int
    kind: str  # _FULL, _CAUSAL or _MASKED
    diagonal: int | None = None  # _CAUSAL: the key where row 0's diagonal is (default k0)


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


class BlockSparseBackend(Backend):
    """The ``blocksparse`` backend: structured masks as a few fused CPU flash-kernel calls per query block; cost
    ~ visible area. What it runs is declared in its ``capabilities``; why it refuses a call, in ``explain()``."""

    name = "blocksparse"
    summary = "structured masks as a few fused CPU flash-kernel calls per query block; cost ~ visible area"
    capabilities = Capabilities(
        device_types=frozenset({"cpu"}),
        native_lse=True,
        keys_in_pieces=True,  # bands and runs of heads merge per piece (merge_partials)
        # A plain tensor mask is already Lq x Lk: sdpa passes it to the kernel as it is.
        mask_kinds=MASK_KINDS - {"tensor"},
        score_mods=frozenset({ADDITIVE, ELEMENTWISE}),
        masks="structured masks (causal, sliding window, document, prefix-LM, key padding, custom, "
        "positions, and & | ~ of them); not plain tensor masks",
        compiles=False,
        compile_note="its per-block plan is Python control flow over the mask's values (key ranges, block states "
        "read on the host: lengths, document ids), which breaks the graph; sdpa traces into one",
    )

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self._plans: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------------------- dispatch
    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            reasons.append("this PyTorch has no CPU flash-attention kernel with a log-sum-exp")
        return reasons

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        """Why ``auto`` passes over this backend although it could serve the call (decision table
        in docs/performance.md)."""
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        mask = call.mask
        relative = call.score_mod is not None and call.score_mod.relative
        if mask is None and not relative and not _in_torch(call):
            return ["no mask: sdpa runs one fused call, as fast"]
        if call.dropout_p > 0 and B * Hq * Lq * Lk < DROPOUT_DENSE_ELEMENTS:
            if Lq * Lk < DROPOUT_MIN_SQUARE:
                return [
                    f"dropout: Lq*Lk = {Lq * Lk} < {DROPOUT_MIN_SQUARE}: the blockwise path's per-block ops cost "
                    "more than sdpa's math kernel on the dense mask (benchmarks/dropout.py)"
                ]
            share = _visited_share(mask, Lq, Lk, self.block_size)
            if share > DROPOUT_MAX_SHARE:
                return [
                    f"dropout: the blockwise path visits {share:.0%} of the scores (> {DROPOUT_MAX_SHARE:.0%}), "
                    "slower than sdpa's math kernel on the dense mask while the scores fit "
                    f"({B * Hq * Lq * Lk} < {DROPOUT_DENSE_ELEMENTS} elements; benchmarks/dropout.py)"
                ]
        offset = mask.causal_offset(Lq, Lk) if call.score_mod is None and mask is not None else None
        if call.dropout_p == 0 and (offset == 0 or (offset is not None and offset >= Lk - 1)):
            # (with dropout, sdpa runs its math kernel on the whole square: blocksparse skips the
            # blocked half; docs/performance.md)
            return ["causal diagonal that sdpa passes as is_causal: sdpa is as fast"]
        if Lq * Lk < SMALL_CALL_ELEMENTS and not _in_torch(call):
            return [
                f"Lq*Lk = {Lq * Lk} < {SMALL_CALL_ELEMENTS}: per-block overhead exceeds the saving; "
                "sdpa with the mask materialized is faster"
            ]
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        plan = self._plan(call)
        mods = call.score_mod
        relative = mods is not None and mods.relative
        counts = {_FULL: 0, _CAUSAL: 0, _MASKED: 0}
        computed = 0
        for blk in plan.blocks:
            for p in _pieces(blk, mods):
                counts[p.kind] += 1
                computed += (blk.q1 - blk.q0) * (p.k1 - p.k0)
        skipped = sum(1 for b in plan.blocks if not b.pieces)
        lines = []
        if _in_torch(call):
            why = (
                f"dropout p={call.dropout_p}: the CPU flash kernel has none"
                if call.dropout_p > 0
                else f"score modifier {call.score_mod._describe() if call.score_mod else None} is elementwise: "
                "the CPU flash kernel takes only an "
                "additive mask"
            )
            return [
                f"{why}, so each block of {self.block_size} queries attends to its visible key range in PyTorch "
                "(activation checkpointing: memory of one block, recomputed in the backward)"
            ]
        if plan.run is not None:
            run = plan.run
            computed += (run.q1 - run.q0) * run.span
            lines.append(
                f"band interior: {run.blocks} query blocks (rows {run.q0}-{run.q1 - 1}) as one batched kernel "
                f"call, each over a window of {run.span} keys"
            )
        if relative:
            calls = (
                f"kernel calls: {counts[_FULL] + counts[_CAUSAL]} with the relative bias as a strided view of "
                f"R + K - 1 values per head (rows reversed; a causal diagonal as -inf in those values), "
                f"{counts[_MASKED]} with a block-sized mask"
            )
        else:
            calls = (
                f"kernel calls: {counts[_FULL]} without mask, {counts[_CAUSAL]} is_causal, "
                f"{counts[_MASKED]} with a block-sized mask"
            )
        if plan.documents:
            lines.append(f"{len(plan.blocks)} documents, each one kernel call over its own keys; {skipped} see no key")
        else:
            lines.append(
                f"{len(plan.blocks)} other query blocks of {self.block_size} rows; {skipped} fully masked and skipped"
            )
        lines += [
            calls,
            f"scores computed: {computed} of {Lq * Lk} ({100.0 * computed / max(1, Lq * Lk):.1f}% of the square)",
            "PyTorch kernel: aten._scaled_dot_product_flash_attention_for_cpu, pieces merged by log-sum-exp",
        ]
        if relative and call.q.dtype != torch.float64:
            lines.append(
                f"relative bias: entries that no row can weigh above exp({LOG_TINY:g}) of its largest (by "
                "the bound scale·|q|·|k|) are -inf, so little denormal arithmetic; each group of heads reads "
                "keys from the first it may weigh; backward on the kernel for heads whose bias then spans "
                f"< 87.3, else in PyTorch with probabilities below exp({LOG_TINY:g}) set to 0"
            )
        elif mods is not None and mods.kind == ADDITIVE and not relative:
            lines.append(f"score modifier {mods._describe()}: added per piece as a block-sized attn_mask")
        if Hq != Hkv:
            lines.append(f"heads: GQA {Hq}/{Hkv} passed natively to the kernel")
        if D != Dv:
            lines.append(f"head dims D={D}, Dv={Dv} padded with zeros to {max(D, Dv)} (the kernel needs one size)")
        return lines

    # ------------------------------------------------------------------------------- running
    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        plan = self._plan(call)
        q, k, v = call.q, call.k, call.v
        if D < Dv:  # the kernel needs one head size: zero columns leave q.k unchanged
            q, k = F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D))
        elif Dv < D:  # zero value columns give zero output columns, dropped below
            v = F.pad(v, (0, D - Dv))
        mods = call.score_mod
        if _in_torch(call):  # no dropout, no elementwise modifier in the CPU flash kernel: a block at a time in PyTorch
            run = plan.run if mods is None else None  # a band's interior in batched chunks
            out, lse = attention_by_blocks(q, k, v, call.mask, mods, call.scale, call.dropout_p, self.block_size, run)
        else:
            out, lse = _BlockSparseAttention.apply(
                q, k, v, call.mask, mods, call.scale, plan, *(mods.tensors() if mods is not None else ())
            )
        if Dv < D:
            out = out[..., :Dv]
        return AttentionResult(out, None, lse if call.return_lse else None)

    def _plan(self, call: AttentionCall) -> Plan:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        # One shared window mask for the band's interior blocks; a relative bias is the same for
        # each of them too (a function of j - i), unless it needs its gradient (per piece, below).
        mods = call.score_mod
        batched = mods is None or (mods.relative and not mods.requires_grad)
        key = (call.mask, B, Hq, Lq, Lk, self.block_size, batched)  # by value; holds the mask's tensors alive
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        # Packed documents: one call per document, not a few per block (backends/document_runs.py).
        docs = document_segments(call.mask, Lq, Lk, -(-Lq // self.block_size)) if mods is None else None
        blocks = _document_blocks(docs) if docs is not None else block_plan(call.mask, B, Hq, Lq, Lk, self.block_size)
        run = _band_run(call.mask, Lq, Lk, self.block_size) if batched and docs is None else None
        if run is not None:
            inside = [b for b in blocks if run.q0 <= b.q0 and b.q1 <= run.q1]
            if sum(b.q1 - b.q0 for b in inside) == run.q1 - run.q0:  # the run replaces exactly these
                blocks = tuple(b for b in blocks if not (run.q0 <= b.q0 and b.q1 <= run.q1))
            else:
                run = None
        plan = Plan(run, blocks, documents=docs is not None)
        self._plans[key] = plan
        while len(self._plans) > 32:
            self._plans.popitem(last=False)
        return plan


#: With dropout, sdpa runs its math kernel on the dense scores, and the blockwise path
#: (:mod:`torch_blocks`) PyTorch ops on each query block's visible key range: per score it costs
#: 1.5-2x the math kernel (no mask, L=1024-4096), so it wins when it visits at most about half the
#: square. Measured forward+backward, B=1 H=8 D=64 fp32, sdpa / blocksparse time: causal 0.77,
#: 1.01, 1.21 at L=1024, 2048, 4096 (it visits 62%, 56%, 53%); sliding_window(512) 0.87, 1.78,
#: 3.08 (56%, 33%, 18%); no mask 0.66, 0.61, 0.49 (docs/performance.md, "Dropout"). Below
#: ``Lq·Lk = 1024²`` its per-block ops weigh more: ``sliding_window(16)`` at L=512 (52%) 0.68,
#: against ``sliding_window(64)`` at L=1024 (30%) 1.41 and ``sliding_window(256)`` (44%) 1.18.
DROPOUT_MAX_SHARE = 0.55
DROPOUT_MIN_SQUARE = 1 << 20
#: The math kernel holds B*Hq*Lq*Lk scores and probabilities: from this many (1 GiB of fp32
#: scores) on, auto takes the blockwise path whatever it visits, since its memory is one block.
DROPOUT_DENSE_ELEMENTS = 1 << 28


def _visited_share(mask: Mask | None, q_len: int, kv_len: int, block_size: int) -> float:
    """The share of the ``Lq x Lk`` scores that the blockwise path computes: each query block's key
    range (``mask.key_range``), as :func:`torch_blocks.attention_by_blocks` visits them."""
    if mask is None or q_len * kv_len == 0:
        return 1.0
    visited = 0
    for q0 in range(0, q_len, block_size):
        q1 = min(q0 + block_size, q_len)
        k0, k1 = mask.key_range(q0, q1, q_len, kv_len)
        visited += (q1 - q0) * max(0, k1 - k0)
    return visited / (q_len * kv_len)


#: Below this many scores a single SDPA call with a materialized mask beats the per-block loop
#: (measured, docs/performance.md).
SMALL_CALL_ELEMENTS = 256 * 256


# ----------------------------------------------------------------------------------- planning
def block_plan(
    mask: Mask | None, batch: int, heads: int, q_len: int, kv_len: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[QueryBlock, ...]:
    """The kernel calls for every query block, from the mask's structural answers only."""
    diagonal = _upper_diagonal(mask, q_len, kv_len)
    blocks = []
    for q0 in range(0, q_len, block_size):
        q1 = min(q0 + block_size, q_len)
        if mask is None:
            blocks.append(QueryBlock(q0, q1, (Piece(0, kv_len, _FULL),)))
            continue
        lo, hi = mask.key_range(q0, q1, q_len, kv_len)
        pieces: list[Piece] = []
        if lo < hi and diagonal is not None:
            d, rest = diagonal
            c0, c1 = q0 + d, min(q1 + d, kv_len)  # the block's diagonal, aligned for is_causal
            # Keys >= q1 + d are above every row's diagonal; keys < q0 + d are below it.
            hi = min(hi, c1)
            if lo <= c0 < c1 and (
                rest is None or rest.block_state(q0, q1, c0, c1, q_len, kv_len, batch, heads) is BlockState.FULL
            ):
                pieces = _classify(mask, q0, q1, lo, c0, q_len, kv_len, batch, heads, block_size)
                pieces.append(Piece(c0, c1, _CAUSAL))
                blocks.append(QueryBlock(q0, q1, tuple(_merge(pieces))))
                continue
        if lo < hi:
            pieces = _classify(mask, q0, q1, lo, hi, q_len, kv_len, batch, heads, block_size)
        blocks.append(QueryBlock(q0, q1, tuple(_merge(pieces))))
    return _merge_query_blocks(blocks)


def _document_blocks(segments) -> tuple[QueryBlock, ...]:
    """Each document (:class:`document_runs.Segment`) as a query block of one piece."""
    return tuple(
        QueryBlock(s.q0, s.q1, (Piece(s.k0, s.k1, _CAUSAL if s.causal else _FULL),) if s.k0 < s.k1 else ())
        for s in segments
    )


def _in_torch(call: AttentionCall) -> bool:
    """Dropout or an elementwise modifier: the fused kernel can do neither (torch_blocks runs it)."""
    return call.dropout_p > 0 or (call.score_mod is not None and call.score_mod.kind == ELEMENTWISE)


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
            and all(p.kind == _FULL for p in blk.pieces)
        ):
            merged[-1] = QueryBlock(prev.q0, blk.q1, prev.pieces)
        else:
            merged.append(blk)
    return tuple(merged)


def _classify(mask, q0, q1, k0, k1, q_len, kv_len, batch, heads, block_size) -> list[Piece]:
    """Split keys ``[k0, k1)`` on the block grid until each part is EMPTY, FULL or one block."""
    if k0 >= k1:
        return []
    state = mask.block_state(q0, q1, k0, k1, q_len, kv_len, batch, heads)
    if state is BlockState.EMPTY:
        return []
    if state is BlockState.FULL:
        return [Piece(k0, k1, _FULL)]
    if k1 - k0 <= block_size:
        return [Piece(k0, k1, _MASKED)]
    mid = (k0 + k1) // 2 // block_size * block_size
    if mid <= k0:
        mid = (k0 // block_size + 1) * block_size
    return _classify(mask, q0, q1, k0, mid, q_len, kv_len, batch, heads, block_size) + _classify(
        mask, q0, q1, mid, k1, q_len, kv_len, batch, heads, block_size
    )


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of the same kind become one call (causal pieces stay alone)."""
    merged: list[Piece] = []
    for p in pieces:
        if merged and merged[-1].kind == p.kind != _CAUSAL and merged[-1].k1 == p.k0:
            merged[-1] = Piece(merged[-1].k0, p.k1, p.kind)
        else:
            merged.append(p)
    return merged


def _band_run(mask: Mask | None, q_len: int, kv_len: int, block: int) -> BandRun | None:
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


def _upper_diagonal(mask: Mask | None, q_len: int, kv_len: int):
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


# ----------------------------------------------------------------------------------- kernels
# torch.ops entries have no annotations (Any); None on a build without them (refusals say so).
# Their attn_mask may be fp32 whatever q's dtype: the kernel computes its softmax in fp32 and
# reads an fp16/bf16 mask as fp32 anyway. Every bias reaches it unrounded, in the softmax dtype
# (fp32; fp64 for fp64): rounded to bf16, a relative bias whose rows peak at different values
# (ALiBi with keys after the query) or a bias under large ``q·k`` scores loses the differences
# that decide the softmax, and the kernel's LSE would be that of another bias than the one the
# weights are recomputed with (multihead.blockwise).
_flash: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _piece_mask(
    mask: Mask | None,
    mods: ScoreMod | None,
    q: Tensor,
    blk: QueryBlock,
    piece: Piece,
    q_len: int,
    kv_len: int,
    k_heads: int,
):
    """The additive ``attn_mask`` of one piece ``(B|1, Hq|1, rows, keys)`` in the softmax dtype
    (unrounded, see ``_flash``; ``None`` when the kernel needs none), the rows (``(B|1, Hq|1,
    rows)`` bool) that see no key of the piece, the keys (``(B|1, 1, keys, 1)``) that no row of
    the piece sees, and what the kernel's LSE lacks per row (``None``, or the shift of
    :func:`multihead.scoring.additive_block`)."""
    if mods is None and piece.kind != _MASKED:
        return None, None, None, None
    # A FULL piece sees every key; a CAUSAL one with a modifier needs its diagonal as -inf.
    piece_mask = None if piece.kind == _FULL else mask
    bias, visible, shift = additive_block(
        piece_mask,
        mods,
        q.shape[0],
        q.shape[1],
        blk.q0,
        blk.q1,
        piece.k0,
        piece.k1,
        q_len,
        kv_len,
        q.device,
        q.dtype,
        mask_dtype=softmax_dtype(q.dtype),
    )
    return bias, ~visible.any(-1), unseen_keys(visible, k_heads), shift


#: log of fp32's smallest normal number (1.18e-38).
_LOG_NORMAL = -87.3
#: Keys whose weight is provably below ``e^-50`` of the row's largest are left out (``-inf``), as
#: :mod:`bias_backward` sets such probabilities to 0: even ``2^31`` of them add less than
#: ``2^-41`` to a row's sum, which fp32 cannot hold (see _underflow_cut).
_NEGLIGIBLE = -LOG_TINY


@dataclass(frozen=True)
class Bounds:
    """``|scale · q_i · k_j| <= scale · |q_i| · |k_j|``: the norms of the query rows ``(B, Hq, Lq)``
    and of the keys ``(B, Hkv, Lk)``, for :func:`_underflow_cut`."""

    q: Tensor
    k: Tensor
    scale: float

    @staticmethod
    def of(q: Tensor, k: Tensor, scale: float, mods: ScoreMod | None) -> Bounds | None:
        if mods is None or not mods.relative or q.dtype == torch.float64:
            return None  # fp64 kernels accumulate in fp64: nothing to cut
        acc = softmax_dtype(q.dtype)
        return Bounds(
            torch.linalg.vector_norm(q, dim=-1, dtype=acc), torch.linalg.vector_norm(k, dim=-1, dtype=acc), abs(scale)
        )

    def score(self, q0: int, q1: int, k0: int, k1: int) -> Tensor:
        """An upper bound of ``|scale · q·k|`` over rows ``[q0, q1)`` x keys ``[k0, k1)`` (a 0-dim tensor)."""
        return self.scale * self.q[:, :, q0:q1].amax() * self.k[:, :, k0:k1].amax()


def _underflow_cut(vec: Tensor, common: tuple[int, int], bound: Tensor) -> Tensor:
    """``vec (H|1, n)`` of a relative bias with ``-inf`` where no row can give the entry a weight
    above ``e^-50`` of its largest (:data:`_NEGLIGIBLE`). Every row sees the entries
    ``vec[:, common[0]:common[1]]``, so its maximum score is at least ``max(those) - bound``; an
    entry below that by more than ``bound + 50`` scores below ``max - 50`` for every row that
    reads it. ALiBi at long context has many such entries, and they cost more than nothing: their
    ``exp`` is mostly an fp32 denormal, on which x86 arithmetic is about 100x slower. The
    forward+backward of a causal ALiBi attention at L=4096 ran 2-4x slower before entries below
    fp32's underflow were cut (benchmarks/positions.py); cutting at ``e^-50`` instead leaves the
    kernel of a sliding window's band almost no denormal (:func:`_run_bias`)."""
    lo, hi = common
    if lo >= hi:
        return vec
    floor = vec[:, lo:hi].amax(dim=-1, keepdim=True) - 2 * bound - _NEGLIGIBLE  # (H|1, 1)
    return vec.masked_fill(vec < floor, float("-inf"))  # NaN bounds compare False: nothing cut


def _relative_piece(mods: ScoreMod | None, q: Tensor, blk: QueryBlock, piece: Piece, bounds: Bounds | None = None):
    """A relative bias (:mod:`multihead.scores.relative`) on a FULL or CAUSAL piece, as the
    kernel's ``attn_mask``: ``(1, H|1, R, K)``, a strided view of ``R + K - 1`` values for the
    piece's rows in *reverse* order (strides cannot be negative; the caller flips q and the
    results), with the causal diagonal as ``-inf``; and the per-head shift ``(1, H|1, 1)`` taken off
    for fp16/bf16 (``None`` otherwise), which the kernel's LSE lacks. ``None`` for other pieces,
    other modifiers, or a bias that blocks (a ``-inf`` of its own: the general path handles it).
    With ``bounds`` (fp32/fp16/bf16 kernels), entries that can only underflow are ``-inf`` too, and
    the third value is, per row of the bias (``H|1``), the first key of the piece that some row may
    weigh: the keys before it are ``-inf`` for every row; and the fourth, per row of the bias,
    whether its finite values span less than 87.3 (so that its probabilities are fp32 denormals
    only for extreme scores, and the kernel's backward serves it: see :func:`_run_bias`). Both
    ``None`` without ``bounds``."""
    if mods is None or piece.kind == _MASKED or not mods.relative:
        return None
    rows, keys = blk.q1 - blk.q0, piece.k1 - piece.k0
    d0 = piece.k0 - (blk.q1 - 1)  # the smallest distance j - i: last row, first key
    vec = mods.distance_bias(d0, d0 + rows + keys - 1, q.device, softmax_dtype(q.dtype))  # (H|1, R + K - 1)
    assert vec is not None  # a relative modifier: its bias is a function of the distance
    if not bool(torch.isfinite(vec).all()):
        return None
    if piece.kind == _CAUSAL:  # row r sees keys up to diagonal + r: distances up to diagonal - q0
        diagonal = piece.k0 if piece.diagonal is None else piece.diagonal
        d = torch.arange(d0, d0 + rows + keys - 1, device=q.device)
        vec = vec.masked_fill(d > diagonal - blk.q0, float("-inf"))
        # Row r sees keys k0 .. min(diagonal + r, k1 - 1): every row sees distances k0 - q0 ..
        # min(diagonal - q0, k1 - q0 - R) (the keys may end before a late row's diagonal).
        common = (piece.k0 - blk.q0 - d0, min(diagonal - blk.q0, piece.k1 - blk.q0 - rows) - d0 + 1)
    else:  # every row sees distances k0 - q0 .. k1 - q0 - R
        common = (piece.k0 - blk.q0 - d0, piece.k1 - blk.q0 - rows - d0 + 1)
    starts = calm = None
    if bounds is not None:
        vec = _underflow_cut(vec, common, bounds.score(blk.q0, blk.q1, piece.k0, piece.k1))
        # Key c reads vec[c : c + R] (one entry per row): all -inf below the first finite entry.
        finite = torch.isfinite(vec)
        first = finite.to(torch.int8).argmax(dim=-1)  # (H|1,)
        spread = torch.where(finite, vec, -torch.inf).amax(-1) - torch.where(finite, vec, torch.inf).amin(-1)
        starts = (first - (rows - 1)).clamp(min=0).tolist()
        calm = (spread < -_LOG_NORMAL).tolist()
    shift = None
    if q.dtype in (torch.float16, torch.bfloat16):  # as additive_block: keep the values near 0
        peak = vec.amax(dim=-1, keepdim=True)
        vec, shift = vec - peak, peak.view(1, -1, 1)
    view = toeplitz_view(vec, rows, keys).unsqueeze(0)  # in the softmax dtype: unrounded (see _flash)
    return view, shift, starts, calm


#: Heads whose cut keys begin within this many keys of each other share one kernel call.
_HEAD_RUN_SLACK = 128


def _head_runs(starts: list[int] | None, Hq: int, Hkv: int) -> list[tuple[int, int, int]]:
    """``(h0, h1, start)``: query heads ``[h0, h1)`` (whole KV groups) and the first key of the
    piece their kernel call reads. A relative bias cut at ``e^-50`` (:func:`_underflow_cut`) leaves
    a steep head (ALiBi's first slopes) only the near past: its call starts where its first
    weighable key is, and heads whose starts are close share a call. Exact: the keys a call
    leaves out are ``-inf`` for every row of its heads."""
    if starts is None or len(starts) == 1:
        return [(0, Hq, 0 if starts is None else starts[0])]
    G = Hq // Hkv
    runs: list[tuple[int, int, int]] = []
    for g in range(Hkv):
        start = min(starts[g * G : (g + 1) * G])
        if runs and abs(start - runs[-1][2]) <= _HEAD_RUN_SLACK:
            h0, _, s0 = runs[-1]
            runs[-1] = (h0, (g + 1) * G, min(s0, start))
        else:
            runs.append((g * G, (g + 1) * G, start))
    return runs


def _reversed(x: Tensor) -> Tensor:
    """``x (B, H, rows, ...)`` with its rows in reverse order (``index_select``: ``flip`` measured
    about 10x slower on these sizes)."""
    rows = x.shape[2]
    return x.index_select(2, torch.arange(rows - 1, -1, -1, device=x.device))


def _pieces(blk: QueryBlock, mods: ScoreMod | None) -> tuple[Piece, ...]:
    """The kernel calls of a query block. With a relative bias, adjacent FULL and CAUSAL pieces
    become one call: the bias is a strided view whatever its width, and the causal diagonal is
    ``-inf`` in its values (:func:`_relative_piece`); one call instead of two and no merge."""
    if mods is None or not mods.relative or len(blk.pieces) < 2:
        return blk.pieces
    out: list[Piece] = []
    for p in blk.pieces:
        prev = out[-1] if out else None
        if p.kind != _MASKED and prev is not None and prev.kind == _FULL and prev.k1 == p.k0:
            out[-1] = Piece(prev.k0, p.k1, p.kind, p.k0 if p.kind == _CAUSAL else None)
        else:
            out.append(p)
    return tuple(out)


def _run_bias(mods: ScoreMod | None, run: BandRun, q: Tensor, bounds: Bounds | None = None):
    """A relative bias on a band run: ``(1, H|1, block, span)`` for row ``s`` and window column
    ``c`` of every interior block (distance ``lo + c - s``: the same for each block), the
    fp16/bf16 per-head shift ``(1, H|1, 1)`` as for :func:`_relative_piece`, and the query heads
    whose backward may use the kernel (see below); ``(None, None, None)`` without a modifier.

    Every row of the band sees every distance ``lo .. hi``. The kernel's backward is faster than
    ``bias_backward`` unless it meets many fp32 denormals, which a probability ``exp(s + b - lse)``
    becomes below ``e^-87.3``. After :func:`_underflow_cut` a head's bias spans at most
    ``50 + 2·bound`` over the band; a head whose bias spans less than ``87.3`` reaches a denormal
    only where a key's score falls more than the rest of that margin below the row's typical
    scores, which is rare: its backward takes the kernel (a choice of speed only: the kernel is
    exact on denormals, just slower). Measured, ALiBi on ``sliding_window(512)`` at L=16384
    (``B=1, H=8, D=64``, fp32): forward+backward 1.07x the window alone, against 1.78x with the
    steep heads in ``bias_backward`` (docs/positions.md). Only with ``bounds`` (fp32/fp16/bf16
    kernels); ``None`` means every head takes ``bias_backward``."""
    if mods is None:
        return None, None, None
    block, span = run.block, run.span
    d0 = run.lo - (block - 1)
    vec = mods.distance_bias(d0, d0 + block + span - 1, q.device, softmax_dtype(q.dtype))  # (H|1, block + span - 1)
    assert vec is not None  # a relative modifier: its bias is a function of the distance
    kernel_heads = None
    if bounds is not None:  # every row sees the whole band, distances lo .. hi
        bound = bounds.score(run.q0, run.q1, run.k0, run.k1)
        vec = _underflow_cut(vec, (run.lo - d0, run.hi - d0 + 1), bound)
        band = vec[:, run.lo - d0 : run.hi - d0 + 1]
        finite = torch.isfinite(band)
        spread = torch.where(finite, band, -torch.inf).amax(-1) - torch.where(finite, band, torch.inf).amin(-1)
        kernel_heads = (spread < -_LOG_NORMAL).expand(q.shape[1]).tolist()  # (Hq,) bools
    s = torch.arange(block, device=q.device).view(-1, 1)
    c = torch.arange(span, device=q.device).view(1, -1)
    bias = vec[:, c - s + block - 1]  # (H|1, block, span)
    shift = None
    if q.dtype in (torch.float16, torch.bfloat16):
        peak = vec.amax(dim=-1, keepdim=True).unsqueeze(-1)
        bias, shift = bias - peak, peak.view(1, -1, 1)
    return bias.unsqueeze(0), shift, kernel_heads  # in the softmax dtype: unrounded (see _flash)


def _zero_unseen(kb: Tensor, vb: Tensor, unseen: Tensor | None) -> tuple[Tensor, Tensor]:
    """Keys no query of a piece may see can hold anything (NaN beyond a length); the kernel
    computes ``0 * value`` for them and ``0 * NaN = NaN``, so they are zeroed."""
    if unseen is None or not bool(unseen.any()):
        return kb, vb
    zero = torch.zeros((), dtype=kb.dtype, device=kb.device)
    return torch.where(unseen, zero, kb), torch.where(unseen, zero, vb)


def _run_piece(q, k, v, mask, mods, scale, blk, piece, q_len, kv_len, bounds=None):
    """Output, LSE as the kernel computed it, and the shift taken off the bias (``None``, or
    broadcastable to ``(B, Hq, rows)``: the piece's LSE is the kernel's plus the shift); rows
    that see none of its keys get LSE ``-inf``."""
    qb = q[:, :, blk.q0 : blk.q1]
    kb, vb = k[:, :, piece.k0 : piece.k1], v[:, :, piece.k0 : piece.k1]
    relative = _relative_piece(mods, q, blk, piece, bounds)
    if relative is not None:  # rows reversed: the bias is a strided view (_relative_piece)
        win, shift, starts, _ = relative
        qr, Hq, Hkv = _reversed(qb), q.shape[1], k.shape[1]
        runs = _head_runs(starts, Hq, Hkv)
        parts = []
        for h0, h1, t in runs:  # each group of heads from its first weighable key
            g0, g1 = h0 * Hkv // Hq, h1 * Hkv // Hq
            w = win[:, h0:h1, :, t:] if win.shape[1] > 1 else win[:, :, :, t:]
            parts.append(_flash(qr[:, h0:h1], kb[:, g0:g1, t:], vb[:, g0:g1, t:], 0.0, False, attn_mask=w, scale=scale))
        out, lse = (
            parts[0] if len(parts) == 1 else (torch.cat([o for o, _ in parts], 1), torch.cat([l for _, l in parts], 1))
        )
        return _reversed(out), _reversed(lse), shift
    bias, empty, unseen, shift = _piece_mask(mask, mods, q, blk, piece, q_len, kv_len, k.shape[1])
    if bias is None:
        return *_flash(qb, kb, vb, 0.0, piece.kind == _CAUSAL, scale=scale), None
    kb, vb = _zero_unseen(kb, vb, unseen)
    out, lse = _flash(qb, kb, vb, 0.0, False, attn_mask=bias, scale=scale)
    if bool(empty.any()):  # the kernel gives such rows LSE 0; they must weigh nothing in the merge
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse, shift


def _frame(lses: list[Tensor], shifts: list[Tensor | None]) -> Tensor | None:
    """The row LSEs of a query block's pieces, ``(B, Hq, rows)`` as the kernels computed them
    with the pieces' shifts taken off their biases, are merged relative to one shift per row,
    the ``base`` returned here (``None`` when no piece shifts): the largest shift among the
    pieces the row sees keys of (0 where it sees none). See :class:`_BlockSparseAttention`."""
    if all(s is None for s in shifts):
        return None
    found = [
        torch.where(torch.isfinite(l), torch.zeros((), dtype=l.dtype, device=l.device) if s is None else s, -torch.inf)
        for l, s in zip(lses, shifts)
    ]
    base = found[0] if len(found) == 1 else torch.stack(torch.broadcast_tensors(*found)).amax(0)
    return torch.where(torch.isfinite(base), base, torch.zeros_like(base))


def _offset(base: Tensor, shift: Tensor | None) -> Tensor:
    """``base - shift``: what a row LSE kept relative to ``base`` (:func:`_frame`) lacks to be the
    LSE of a kernel that saw its bias with ``shift`` taken off. Exactly 0 where they are equal (a
    query block of one piece); large only for a piece the row gives no weight."""
    return base if shift is None else base - shift.to(base.dtype)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, mods, scale, plan, *mod_tensors):
        B, Hq, Lq, _ = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        out = torch.zeros((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
        # The LSE is kept relative to a per-row base (the shift of the bias the kernels saw, see
        # _frame) and returned as lse + base: the backward needs each piece's LSE as its kernel
        # saw it, and lse + shift - shift in fp32 would be exact only to ulp(|lse + shift|)
        # (0.008 at a bias of -1e5), which exp makes a relative error of every probability.
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        base = torch.zeros((B, Hq, Lq), dtype=lse.dtype, device=q.device)
        bounds = Bounds.of(q, k, scale, mods)
        if plan.run is not None:
            rows = slice(plan.run.q0, plan.run.q1)
            bias, shift, _ = _run_bias(mods, plan.run, q, bounds)
            out[:, :, rows], lse[:, :, rows] = run_forward(q, k, v, plan.run, scale, bias=bias)
            if shift is not None:
                base[:, :, rows] = shift
        for blk in plan.blocks:
            parts = [_run_piece(q, k, v, mask, mods, scale, blk, p, Lq, Lk, bounds) for p in _pieces(blk, mods)]
            if not parts:
                continue  # fully masked block: output 0, LSE -inf
            rows = slice(blk.q0, blk.q1)
            outs, lses, shifts = zip(*parts)
            frame = _frame(list(lses), list(shifts))
            if frame is not None:
                base[:, :, rows] = frame
                lses = tuple(l - _offset(frame, s) for l, s in zip(lses, shifts))
            if len(parts) == 1:
                out[:, :, rows], lse[:, :, rows] = outs[0], lses[0]
                continue
            out[:, :, rows], lse[:, :, rows] = merge_partials(list(outs), [l.expand(B, Hq, -1) for l in lses])
        ctx.save_for_backward(q, k, v, out, lse, base)
        ctx.mask, ctx.mods, ctx.scale, ctx.plan = mask, mods, scale, plan
        ctx.set_materialize_grads(False)
        return out, lse + base

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, base = ctx.saved_tensors  # lse relative to base (forward)
        mods = ctx.mods
        bounds = Bounds.of(q, k, ctx.scale, mods)  # as in the forward: the same entries cut
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is not None:
            # d lse_i / d s_ij = P_ij: the kernel's dS = P * (dP - rowsum(dO * O)) gets the LSE's
            # gradient through one extra column: O' = [O, 1], dO' = [dO, -g], V' = [V, 0] (and
            # zero columns on q, k so the head sizes match) give rowsum(dO' * O') = rowsum(dO * O) - g.
            grad_lse = grad_lse.masked_fill(torch.isneginf(lse), 0.0)
            q, k, v = F.pad(q, (0, 1)), F.pad(k, (0, 1)), F.pad(v, (0, 1))
            out = torch.cat([out, torch.ones_like(out[..., :1])], dim=-1)
            grad_out = torch.cat([grad_out, -grad_lse.unsqueeze(-1).to(grad_out.dtype)], dim=-1)
        Lq, Lk = q.shape[2], k.shape[2]
        acc_dtype = lse_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
        mod_tensors = mods.tensors() if mods is not None else ()
        wants_mod_grad = [t.requires_grad for t in mod_tensors]
        d_mods = [torch.zeros_like(t) if w else None for t, w in zip(mod_tensors, wants_mod_grad)]
        run = ctx.plan.run
        if run is not None:  # interior band rows are never fully masked: the LSE is finite there
            rows = slice(run.q0, run.q1)
            bias, shift, kernel_heads = _run_bias(mods, run, q, bounds)
            run_lse = lse[:, :, rows].to(acc_dtype) + _offset(base[:, :, rows], shift)  # what the kernel saw
            g_q, _, _ = run_backward(
                grad_out[:, :, rows],
                q,
                k,
                v,
                out[:, :, rows],
                run_lse,
                run,
                ctx.scale,
                dk=dk,
                dv=dv,
                bias=bias,
                kernel_heads=kernel_heads,
            )
            dq[:, :, rows] += g_q
        # Fully masked rows: LSE +inf makes every probability exp(s - inf) = 0, so no NaN.
        lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
        for blk in ctx.plan.blocks:
            if not blk.pieces:
                continue
            rows = slice(blk.q0, blk.q1)
            go, qb, ob = grad_out[:, :, rows], q[:, :, rows], out[:, :, rows]
            lb, lb_base = lse_b[:, :, rows].to(acc_dtype), base[:, :, rows]
            pieces = _pieces(blk, mods)
            whole = len(pieces) == 1  # the piece holds every key its rows see
            for p in pieces:
                keys = slice(p.k0, p.k1)
                kb, vb = k[:, :, keys], v[:, :, keys]
                relative = _relative_piece(mods, q, blk, p, bounds)
                if relative is not None:  # rows reversed: the bias is a strided view (_relative_piece)
                    win, shift, starts, calm = relative
                    lp = _reversed(lb + _offset(lb_base, shift))
                    gor, qr, orr = _reversed(go), _reversed(qb), _reversed(ob)
                    if any(wants_mod_grad):  # dS summed along the view's diagonals: the bias values' gradient
                        d_vec, on_ds = _diagonal_sums(win, rows=blk.q1 - blk.q0, keys=p.k1 - p.k0)
                        g_q, g_k, g_v = bias_backward(
                            gor, qr, kb, vb, orr, lp, win, ctx.scale, on_ds=on_ds, whole_rows=whole
                        )
                        dq[:, :, rows] += _reversed(g_q)
                        dk[:, :, keys] += g_k
                        dv[:, :, keys] += g_v
                        _accumulate_relative_grads(mods, mod_tensors, d_mods, d_vec, blk, p)
                        continue
                    Hq_, Hkv_ = q.shape[1], k.shape[1]
                    for h0, h1, t in _head_runs(starts, Hq_, Hkv_):  # as the forward: keys before t are -inf
                        g0, g1 = h0 * Hkv_ // Hq_, h1 * Hkv_ // Hq_
                        w = win[:, h0:h1, :, t:] if win.shape[1] > 1 else win[:, :, :, t:]
                        args = (gor[:, h0:h1], qr[:, h0:h1], kb[:, g0:g1, t:], vb[:, g0:g1, t:], orr[:, h0:h1])
                        if calm is not None and all(calm[h0:h1] if len(calm) > 1 else calm):
                            g_q, g_k, g_v = _flash_backward(
                                *args, lp[:, h0:h1], 0.0, False, attn_mask=w, scale=ctx.scale,
                            )  # fmt: skip
                        else:  # a steep bias: denormals would slow the kernel's backward (bias_backward)
                            g_q, g_k, g_v = bias_backward(*args, lp[:, h0:h1], w, ctx.scale, whole_rows=whole)
                        dq[:, h0:h1, rows] += _reversed(g_q)
                        dk[:, g0:g1, p.k0 + t : p.k1] += g_k
                        dv[:, g0:g1, p.k0 + t : p.k1] += g_v
                    continue
                bias, _, unseen, shift = _piece_mask(ctx.mask, mods, q, blk, p, Lq, Lk, k.shape[1])
                kb, vb = _zero_unseen(kb, vb, unseen)
                causal = bias is None and p.kind == _CAUSAL
                lp = lb + _offset(lb_base, shift)  # the kernel saw the bias shifted down
                g_q, g_k, g_v = _flash_backward(go, qb, kb, vb, ob, lp, 0.0, causal, attn_mask=bias, scale=ctx.scale)
                dq[:, :, rows] += g_q
                dk[:, :, keys] += g_k
                dv[:, :, keys] += g_v
                if any(wants_mod_grad):
                    _accumulate_mod_grads(
                        mods, mod_tensors, d_mods, _piece_ds(go, qb, kb, vb, ob, lp, bias, ctx.scale, whole), blk, p
                    )
        if grad_lse is not None:
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, *d_mods)


def _piece_ds(go, qb, kb, vb, ob, lb, bias, scale, whole_rows=False) -> Tensor:
    """``dS = P (dP - rowsum(dO O))`` of one piece ``(B, Hq, rows, keys)``: the gradient of the
    scores, which an additive bias receives as it is. Memory: one piece. ``whole_rows``: the
    piece holds every key its rows weigh, so ``P`` is normalised by its own row sums and
    ``rowsum(dO O)`` comes from it (:func:`multihead.backends.bias_backward.row_delta`)."""
    B, Hq, rows, _ = qb.shape
    Hkv, keys = kb.shape[1], kb.shape[2]
    acc = lb.dtype
    fold = lambda x: x.to(acc).reshape(B, Hkv, (Hq // Hkv) * rows, x.shape[-1])  # query head h -> KV head h // G
    s = torch.matmul(fold(qb), kb.to(acc).transpose(-2, -1)).view(B, Hq, rows, keys) * scale
    if bias is not None:
        s = s + bias.to(acc)
    lb = lb.unsqueeze(-1)
    # 0 where blocked (-inf) and on fully masked rows (lse +inf)
    p = torch.exp(s - (row_peak(s, lb) if whole_rows else lb))
    if whole_rows:
        normalise_(p)
    dp = torch.matmul(fold(go), vb.to(acc).transpose(-2, -1)).view(B, Hq, rows, keys)
    delta = row_delta(p, dp, go, ob, vb) if whole_rows else (go.to(acc) * ob.to(acc)).sum(-1, keepdim=True)
    return p * (dp - delta)


def _diagonal_sums(win: Tensor, rows: int, keys: int):
    """A zero ``d_vec (H|1, R + K - 1)`` and the ``on_ds(ds, c0, c1)`` of :func:`bias_backward`
    that adds the chunk's ``dS``, summed over the batch (and the heads for a head-less bias),
    along the diagonals of the strided view: ``d_vec[n] += sum of dS over r' + c = n``."""
    acc = torch.float64 if win.dtype == torch.float64 else torch.float32
    d_vec = torch.zeros(win.shape[1], rows + keys - 1, dtype=acc, device=win.device)

    def on_ds(ds: Tensor, c0: int, c1: int) -> None:
        g = ds.sum(dim=0) if win.shape[1] > 1 else ds.sum(dim=(0, 1)).unsqueeze(0)  # (H|1, R, n)
        # Keys [c0, c1) read the values [c0, c1 + R - 1): the unfold's backward over those only
        # (one over the whole piece per chunk would cost O(K^2)).
        part = torch.zeros(win.shape[1], c1 - c0 + rows - 1, dtype=acc, device=win.device, requires_grad=True)
        with torch.enable_grad():
            d_vec[:, c0 : c1 + rows - 1] += torch.autograd.grad(toeplitz_view(part, rows, c1 - c0), part, g.to(acc))[0]

    return d_vec, on_ds


def _accumulate_relative_grads(mods, tensors, grads, d_vec, blk, piece) -> None:
    """Add ``d_vec``, the gradient of one relative piece's bias values, to the gradients of the
    tensors the bias reads (through :meth:`ScoreMod.distance_bias`; memory of one vector)."""
    rows, keys = blk.q1 - blk.q0, piece.k1 - piece.k0
    d0 = piece.k0 - (blk.q1 - 1)
    with torch.enable_grad():
        vec = mods.distance_bias(d0, d0 + rows + keys - 1, d_vec.device, d_vec.dtype)  # (H|1, R + K - 1)
        _add_grads(vec, d_vec, tensors, grads)


def _accumulate_mod_grads(mods, tensors, grads, ds, blk, piece) -> None:
    """Add ``dS`` of one piece to the gradients of the tensors an additive modifier reads, through
    the same ``bias_block`` the forward used (autograd of a slice: memory of one piece)."""
    with torch.enable_grad():
        block = mods.bias_block(ds.shape[0], ds.shape[1], blk.q0, blk.q1, piece.k0, piece.k1, ds.device, ds.dtype)
        reduce = [d for d in range(4) if block.shape[d] == 1 and ds.shape[d] != 1]
        _add_grads(block, ds.sum(dim=reduce, keepdim=True) if reduce else ds, tensors, grads)


def _add_grads(output: Tensor, grad: Tensor, tensors, grads) -> None:
    """``grads[i] += d(output)/d(tensors[i]) · grad`` for the tensors that require grad."""
    needed = [t for t in tensors if t.requires_grad]
    found = iter(torch.autograd.grad(output, needed, grad, allow_unused=True))
    for i, t in enumerate(tensors):
        if t.requires_grad:
            g = next(found)
            if g is not None:
                grads[i] += g.to(grads[i].dtype)
