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
  (``mask.materialize_block``), e.g. the left edge of a sliding window or a document boundary.

Each piece returns its output and log-sum-exp (PyTorch's CPU flash kernel,
``aten._scaled_dot_product_flash_attention_for_cpu``); pieces of one query block are merged
with their LSE::

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

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.backends.base import Backend, Capabilities
from multihead.masks import And, Band, BlockState, Mask, TensorMask
from multihead.masks.base import Not, Or, Shifted
from multihead.reference import AttentionResult
from multihead.validation import AttentionCall

__all__ = ["BlockSparseBackend", "block_plan", "DEFAULT_BLOCK_SIZE"]

#: Queries per block and the key-block grid; chosen by measurement (docs/performance.md).
DEFAULT_BLOCK_SIZE = 256

_FULL, _CAUSAL, _MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class Piece:
    """One kernel call: keys ``[k0, k1)`` for the query block, with no mask, ``is_causal``, or a mask."""

    k0: int
    k1: int
    kind: str  # _FULL, _CAUSAL or _MASKED


@dataclass(frozen=True)
class QueryBlock:
    q0: int
    q1: int
    pieces: tuple[Piece, ...]


class BlockSparseBackend(Backend):
    name = "blocksparse"
    summary = "structured masks as a few fused CPU flash-kernel calls per query block; cost ~ visible area"
    capabilities = Capabilities(
        device_types=frozenset({"cpu"}),
        dropout=False,
        masks="structured masks (causal, sliding window, document, prefix-LM, key padding, custom, "
              "and & | ~ of them); not plain tensor masks",
    )

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self._plans: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------------------- dispatch
    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            reasons.append("this PyTorch has no CPU flash-attention kernel with a log-sum-exp")
        if call.mask is not None and _has_tensor_mask(call.mask):
            reasons.append("plain tensor masks are already Lq x Lk; sdpa passes them to the kernel as they are")
        return reasons

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        """Why ``auto`` passes over this backend although it could serve the call (decision table
        in docs/performance.md)."""
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        mask = call.mask
        if torch.compiler.is_compiling():
            return ["under torch.compile: the per-block plan is Python control flow that would break "
                    "the graph; sdpa traces into one"]
        if mask is None:
            return ["no mask: sdpa runs one fused call, as fast"]
        offset = mask.causal_offset(Lq, Lk)
        if offset == 0 or (offset is not None and offset >= Lk - 1):
            return ["causal diagonal that sdpa passes as is_causal: sdpa is as fast"]
        if Lq * Lk < SMALL_CALL_ELEMENTS:
            return [f"Lq*Lk = {Lq * Lk} < {SMALL_CALL_ELEMENTS}: per-block overhead exceeds the saving; "
                    "sdpa with the mask materialized is faster"]
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        blocks = self._plan(call)
        counts = {_FULL: 0, _CAUSAL: 0, _MASKED: 0}
        computed = 0
        for blk in blocks:
            for p in blk.pieces:
                counts[p.kind] += 1
                computed += (blk.q1 - blk.q0) * (p.k1 - p.k0)
        skipped = sum(1 for b in blocks if not b.pieces)
        lines = [f"{len(blocks)} query blocks of {self.block_size} rows; {skipped} fully masked and skipped",
                 f"kernel calls: {counts[_FULL]} without mask, {counts[_CAUSAL]} is_causal, "
                 f"{counts[_MASKED]} with a block-sized mask",
                 f"scores computed: {computed} of {Lq * Lk} ({100.0 * computed / max(1, Lq * Lk):.1f}% of the square)",
                 "PyTorch kernel: aten._scaled_dot_product_flash_attention_for_cpu, pieces merged by log-sum-exp"]
        if Hq != Hkv:
            lines.append(f"heads: GQA {Hq}/{Hkv} passed natively to the kernel")
        if D != Dv:
            lines.append(f"head dims D={D}, Dv={Dv} padded with zeros to {max(D, Dv)} (the kernel needs one size)")
        return lines

    # ------------------------------------------------------------------------------- running
    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        blocks = self._plan(call)
        q, k, v = call.q, call.k, call.v
        if D < Dv:  # the kernel needs one head size: zero columns leave q.k unchanged
            q, k = F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D))
        elif Dv < D:  # zero value columns give zero output columns, dropped below
            v = F.pad(v, (0, D - Dv))
        out, lse = _BlockSparseAttention.apply(q, k, v, call.mask, call.scale, blocks)
        if Dv < D:
            out = out[..., :Dv]
        return AttentionResult(out, None, lse if call.return_lse else None)

    def _plan(self, call: AttentionCall) -> tuple[QueryBlock, ...]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        key = (id(call.mask), B, Hq, Lq, Lk, self.block_size)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is call.mask:
            self._plans.move_to_end(key)
            return cached[1]
        blocks = block_plan(call.mask, B, Hq, Lq, Lk, self.block_size)
        self._plans[key] = (call.mask, blocks)  # the mask is kept so that its id is not reused
        while len(self._plans) > 32:
            self._plans.popitem(last=False)
        return blocks


#: Below this many scores a single SDPA call with a materialized mask beats the per-block loop
#: (measured, docs/performance.md).
SMALL_CALL_ELEMENTS = 256 * 256


# ----------------------------------------------------------------------------------- planning
def block_plan(mask: Mask | None, batch: int, heads: int, q_len: int, kv_len: int,
               block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[QueryBlock, ...]:
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
            if lo <= c0 < c1 and (rest is None or rest.block_state(q0, q1, c0, c1, q_len, kv_len, batch, heads)
                                  is BlockState.FULL):
                pieces = _classify(mask, q0, q1, lo, c0, q_len, kv_len, batch, heads, block_size)
                pieces.append(Piece(c0, c1, _CAUSAL))
                blocks.append(QueryBlock(q0, q1, tuple(_merge(pieces))))
                continue
        if lo < hi:
            pieces = _classify(mask, q0, q1, lo, hi, q_len, kv_len, batch, heads, block_size)
        blocks.append(QueryBlock(q0, q1, tuple(_merge(pieces))))
    return _merge_query_blocks(blocks)


def _merge_query_blocks(blocks: list[QueryBlock]) -> tuple[QueryBlock, ...]:
    """Consecutive query blocks that read the same keys with no mask become one call (no mask,
    key padding): the kernel blocks large calls itself, and each call has a fixed overhead."""
    merged: list[QueryBlock] = []
    for blk in blocks:
        prev = merged[-1] if merged else None
        if (prev is not None and prev.pieces == blk.pieces and prev.q1 == blk.q0
                and all(p.kind == _FULL for p in blk.pieces)):
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
    return (_classify(mask, q0, q1, k0, mid, q_len, kv_len, batch, heads, block_size)
            + _classify(mask, q0, q1, mid, k1, q_len, kv_len, batch, heads, block_size))


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of the same kind become one call (causal pieces stay alone)."""
    merged: list[Piece] = []
    for p in pieces:
        if merged and merged[-1].kind == p.kind != _CAUSAL and merged[-1].k1 == p.k0:
            merged[-1] = Piece(merged[-1].k0, p.k1, p.kind)
        else:
            merged.append(p)
    return merged


def _upper_diagonal(mask: Mask | None, q_len: int, kv_len: int):
    """``(d, rest)`` when ``mask`` is "key ``j <= i + d``" ``&`` ``rest`` (``rest`` may be
    ``None``): causal masks and the right edge of sliding windows, alone or in an ``&``.
    ``None`` when the mask has no such edge."""
    if mask is None:
        return None
    parts = mask.parts if isinstance(mask, And) else (mask,)
    uppers, rest = [], []
    for p in parts:
        if isinstance(p, Band) and p.right is not None:
            uppers.append(p._offset(q_len, kv_len) + p.right)
            if p.left is not None:
                rest.append(Band(p.left, None, p.align, name="sliding_window"))
        else:
            rest.append(p)
    if not uppers:
        return None
    rest_mask = None if not rest else (rest[0] if len(rest) == 1 else And(*rest))
    return min(uppers), rest_mask


def _has_tensor_mask(mask: Mask) -> bool:
    if isinstance(mask, TensorMask):
        return True
    if isinstance(mask, (And, Or)):
        return any(_has_tensor_mask(p) for p in mask.parts)
    if isinstance(mask, (Not, Shifted)):
        return _has_tensor_mask(mask.inner)
    return False


# ----------------------------------------------------------------------------------- kernels
_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _piece_mask(mask: Mask, q: Tensor, blk: QueryBlock, piece: Piece, q_len: int, kv_len: int):
    """The additive mask of one piece ``(B|1, Hq|1, rows, keys)`` in q's dtype, the rows
    (``(B|1, Hq|1, rows)`` bool) that see no key of the piece, and the keys (``(B|1, 1, keys, 1)``)
    that no row of the piece sees."""
    B, Hq = q.shape[0], q.shape[1]
    block = mask.materialize_block(B, Hq, blk.q0, blk.q1, q_len, kv_len, q.device, q.dtype, piece.k0, piece.k1)
    if mask.is_additive:
        visible = ~torch.isneginf(block)
        bias = block
    else:
        visible = block
        bias = torch.zeros(block.shape, dtype=q.dtype, device=q.device).masked_fill_(~block, float("-inf"))
    return bias, ~visible.any(-1), ~visible.any(-2).any(1, keepdim=True).unsqueeze(-1)


def _zero_unseen(kb: Tensor, vb: Tensor, unseen: Tensor) -> tuple[Tensor, Tensor]:
    """Keys no query of a piece may see can hold anything (NaN beyond a length); the kernel
    computes ``0 * value`` for them and ``0 * NaN = NaN``, so they are zeroed."""
    if not bool(unseen.any()):
        return kb, vb
    zero = torch.zeros((), dtype=kb.dtype, device=kb.device)
    return torch.where(unseen, zero, kb), torch.where(unseen, zero, vb)


def _run_piece(q, k, v, mask, scale, blk, piece, q_len, kv_len):
    """Output and LSE of one piece; rows that see none of its keys get LSE ``-inf``."""
    qb = q[:, :, blk.q0:blk.q1]
    kb, vb = k[:, :, piece.k0:piece.k1], v[:, :, piece.k0:piece.k1]
    if piece.kind == _FULL:
        return _flash(qb, kb, vb, 0.0, False, scale=scale)
    if piece.kind == _CAUSAL:
        return _flash(qb, kb, vb, 0.0, True, scale=scale)
    bias, empty, unseen = _piece_mask(mask, q, blk, piece, q_len, kv_len)
    kb, vb = _zero_unseen(kb, vb, unseen)
    out, lse = _flash(qb, kb, vb, 0.0, False, attn_mask=bias, scale=scale)
    if bool(empty.any()):  # the kernel gives such rows LSE 0; they must weigh nothing in the merge
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, blocks):
        B, Hq, Lq, _ = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        out = torch.zeros((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=_lse_dtype(q), device=q.device)
        for blk in blocks:
            parts = [_run_piece(q, k, v, mask, scale, blk, p, Lq, Lk) for p in blk.pieces]
            if not parts:
                continue  # fully masked block: output 0, LSE -inf
            if len(parts) == 1:
                out[:, :, blk.q0:blk.q1], lse[:, :, blk.q0:blk.q1] = parts[0]
                continue
            lses = torch.stack([p[1].expand(B, Hq, -1) for p in parts])  # (pieces, B, Hq, rows)
            total = torch.logsumexp(lses, dim=0)
            safe = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
            acc = None
            for (o, _), piece_lse in zip(parts, lses):
                w = torch.exp(piece_lse - safe).unsqueeze(-1)  # 0 for rows the piece does not see
                acc = o.to(w.dtype) * w if acc is None else acc.addcmul_(o.to(w.dtype), w)
            out[:, :, blk.q0:blk.q1] = acc
            lse[:, :, blk.q0:blk.q1] = total
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.blocks = mask, scale, blocks
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
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
        acc_dtype = _lse_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
        # Fully masked rows: LSE +inf makes every probability exp(s - inf) = 0, so no NaN.
        lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
        for blk in ctx.blocks:
            if not blk.pieces:
                continue
            rows = slice(blk.q0, blk.q1)
            go, qb, ob = grad_out[:, :, rows], q[:, :, rows], out[:, :, rows]
            lb = lse_b[:, :, rows].to(torch.float64 if q.dtype == torch.float64 else torch.float32)
            for p in blk.pieces:
                keys = slice(p.k0, p.k1)
                kb, vb = k[:, :, keys], v[:, :, keys]
                bias = None
                if p.kind == _MASKED:
                    bias, _, unseen = _piece_mask(ctx.mask, q, blk, p, Lq, Lk)
                    kb, vb = _zero_unseen(kb, vb, unseen)
                g_q, g_k, g_v = _flash_backward(go, qb, kb, vb, ob, lb, 0.0, p.kind == _CAUSAL,
                                                attn_mask=bias, scale=ctx.scale)
                dq[:, :, rows] += g_q
                dk[:, :, keys] += g_k
                dv[:, :, keys] += g_v
        if grad_lse is not None:
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32
