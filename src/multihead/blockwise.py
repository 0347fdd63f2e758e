"""Log-sum-exp and attention weights recomputed from ``q``, ``k`` and the mask, block by block.

Fast kernels return only the output. When a caller also wants the log-sum-exp or the weights,
these helpers recompute them a block of query rows at a time, so memory stays at one
``rows x Lk`` block per head instead of the full ``Lq x Lk`` square:

.. math::  \\mathrm{lse}_i = \\log \\sum_{j \\text{ visible}} e^{s\\, q_i \\cdot k_j + M_{ij}}
           \\qquad P_{ij} = e^{s\\, q_i \\cdot k_j + M_{ij} - \\mathrm{lse}_i}

Fully masked rows give ``lse = -inf`` and a weights row of 0 (never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.conventions import softmax_dtype
from multihead.masks import Mask

__all__ = ["lse_by_blocks", "weights_by_blocks", "scores_block"]

# Elements of one score block (rows x Lk x heads x batch) computed at a time.
_BLOCK_ELEMENTS = 1 << 23


def scores_block(q: Tensor, k: Tensor, mask: Mask | None, scale: float, q0: int, q1: int,
                 q_len: int, heads: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Scaled, masked scores of query rows ``[q0, q1)``: ``(B, h, rows, Lk)`` in the softmax
    dtype, and the bool ``allowed`` block (``None`` when nothing is masked).

    ``heads`` selects query heads (default all). For all heads K is not copied per group: the
    ``G`` query heads of a group are folded into the rows of one matmul per KV head. A selection
    gathers just the KV heads it reads.
    """
    B, Hq, _, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dtype = softmax_dtype(q.dtype)
    rows = q1 - q0
    if heads is None:
        # Query head h = kv * G + g reads KV head kv: (B, Hq, rows, D) -> (B, Hkv, G*rows, D).
        qb = q[:, :, q0:q1].to(dtype).reshape(B, Hkv, (Hq // Hkv) * rows, D)
        scores = torch.matmul(qb, k.to(dtype).transpose(-2, -1)).view(B, Hq, rows, Lk) * scale
    else:
        kv_ids = heads // (Hq // Hkv)  # grouped mapping
        qb = q[:, heads, q0:q1].to(dtype)  # (B, h, rows, D)
        kb = k[:, kv_ids].to(dtype)  # (B, h, Lk, D): only the KV heads the selection reads
        scores = torch.matmul(qb, kb.transpose(-2, -1)) * scale  # (B, h, rows, Lk)
    if mask is None:
        return scores, None
    dense = mask.materialize_block(B, Hq, q0, q1, q_len, Lk, device=q.device, dtype=dtype)
    if dense.shape[1] != 1 and heads is not None:
        dense = dense[:, heads]
    if mask.is_additive:
        allowed = ~torch.isneginf(dense)
        scores = scores + dense.masked_fill(~allowed, 0.0)
    else:
        allowed = dense
    return scores.masked_fill(~allowed, float("-inf")), allowed


def _row_step(q: Tensor, k: Tensor, heads: int) -> int:
    return max(1, _BLOCK_ELEMENTS // max(1, q.shape[0] * heads * k.shape[2]))


def lse_by_blocks(q: Tensor, k: Tensor, mask: Mask | None, scale: float) -> Tensor:
    """Log-sum-exp of the scaled, masked scores: ``(B, Hq, Lq)``, ``-inf`` on fully masked rows."""
    Lq = q.shape[2]
    step = _row_step(q, k, q.shape[1])
    parts = []
    for q0 in range(0, Lq, step):
        scores, _ = scores_block(q, k, mask, scale, q0, min(q0 + step, Lq), Lq)
        # logsumexp of an all -inf row is -inf, and its gradient is 0 (not NaN) in PyTorch.
        parts.append(_safe_logsumexp(scores))
    return torch.cat(parts, dim=-1)


def weights_by_blocks(q: Tensor, k: Tensor, mask: Mask | None, scale: float, lse: Tensor,
                      heads: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
    """Attention probabilities ``exp(S - lse)`` for the requested query heads and rows.

    Returns ``(B, len(heads), len(rows), Lk)`` (all heads / rows by default), holding no more
    than that slice plus one block of scores.
    """
    Lq = q.shape[2]
    n_heads = q.shape[1] if heads is None else len(heads)
    row_ids = torch.arange(Lq, device=q.device) if rows is None else rows
    step = _row_step(q, k, n_heads)
    # Written into one preallocated result: a list plus torch.cat would hold the slice twice.
    weights = None
    done = 0
    chunks = [row_ids[start:start + step] for start in range(0, len(row_ids), step)]
    # Scattered rows (e.g. [0, 8000]) would make a chunk's row span, and its scores, large:
    # such chunks are taken one row at a time, so memory stays at the slice plus one block.
    chunks = [c for chunk in chunks
              for c in ((chunk,) if int(chunk.max()) - int(chunk.min()) < 2 * len(chunk) + 64 else chunk.split(1))]
    for chunk in chunks:
        q0, q1 = int(chunk.min()), int(chunk.max()) + 1
        scores, _ = scores_block(q, k, mask, scale, q0, q1, Lq, heads)
        scores = scores[:, :, chunk - q0]
        block_lse = (lse if heads is None else lse[:, heads])[:, :, chunk].unsqueeze(-1).to(scores.dtype)
        # exp(-inf - (-inf)) would be NaN: fully masked rows are set to 0 explicitly.
        safe_lse = torch.where(torch.isneginf(block_lse), torch.zeros_like(block_lse), block_lse)
        probs = torch.exp(scores - safe_lse)
        probs = torch.where(torch.isneginf(block_lse), torch.zeros_like(probs), probs)
        if weights is None:
            weights = probs.new_empty(probs.shape[0], probs.shape[1], len(row_ids), probs.shape[3])
        weights[:, :, done:done + len(chunk)] = probs
        done += len(chunk)
    return weights


def _safe_logsumexp(scores: Tensor) -> Tensor:
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    finite_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    total = torch.exp(scores - finite_max).sum(dim=-1)
    # A fully masked row sums to 0; log(0)'s gradient (inf * 0) would be NaN, so it is taken of 1
    # and the row set to -inf afterwards (masked_fill passes no gradient to it).
    empty = torch.isneginf(row_max).squeeze(-1)
    total = torch.where(empty, torch.ones_like(total), total)
    return (torch.log(total) + finite_max.squeeze(-1)).masked_fill(empty, float("-inf"))
