"""Attention with dropout, a block of queries at a time, for the ``blocksparse`` backend.

PyTorch's CPU flash kernel has no dropout, and SDPA with dropout falls back to its math kernel
with a dense ``Lq x Lk`` mask. Here each query block attends to the key range its mask lets it
see (``mask.key_range``: the window of a band, the prefix of a causal row, the document of a
packed sequence), in plain PyTorch::

    S = scale · Q_b K_rᵀ + bias      (block x range: the mask's -inf and the additive modifiers)
    lse = logsumexp(S)               P = softmax(S)          (the probabilities, before dropout)
    O_b = dropout(P) V_r             keep ~ Bernoulli(1 - p) (torch's dropout, the global generator)

Each block runs under activation checkpointing: nothing of the block is kept for the backward,
which recomputes it with the same random draw (the generator state is saved and restored), so
memory stays at one block whatever ``L`` is and a fixed seed gives the same result twice. Cost
follows the visible area of the mask, like the fused path. Fully masked rows give output 0 and
LSE ``-inf`` (their probabilities are 0, never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from multihead.conventions import lse_dtype
from multihead.scoring import additive_block

__all__ = ["dropout_attention"]


def dropout_attention(q: Tensor, k: Tensor, v: Tensor, mask, mods, scale: float, dropout_p: float,
                      block: int) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hq, Lq, Dv)`` and LSE ``(B, Hq, Lq)`` of attention with dropout on the
    probabilities, one query block of ``block`` rows at a time; differentiable."""
    B, Hq, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    outs, lses = [], []
    for q0 in range(0, Lq, block):
        q1 = min(q0 + block, Lq)
        k0, k1 = (0, Lk) if mask is None else mask.key_range(q0, q1, Lq, Lk)
        if k0 >= k1:  # the block sees no key: output 0, LSE -inf
            outs.append(q.new_zeros((B, Hq, q1 - q0, Dv)) + 0 * q[:, :, q0:q1, :1].sum())
            lses.append(torch.full((B, Hq, q1 - q0), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device))
            continue
        bias, _, _ = additive_block(mask, mods, B, Hq, q0, q1, k0, k1, Lq, Lk, q.device, lse_dtype(q.dtype))
        out, lse = checkpoint(_block, q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], bias, scale, dropout_p,
                              use_reentrant=False, preserve_rng_state=True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block(qb: Tensor, kb: Tensor, vb: Tensor, bias: Tensor, scale: float, dropout_p: float) -> tuple[Tensor, Tensor]:
    """One query block against its key range: ``(B, Hq, rows, Dv)`` and its LSE ``(B, Hq, rows)``."""
    B, Hq, rows, D = qb.shape
    Hkv, keys = kb.shape[1], kb.shape[2]
    acc = lse_dtype(qb.dtype)
    # Query head h = kv * G + g reads KV head kv: the G heads of a group fold into one matmul.
    s = torch.matmul(qb.to(acc).reshape(B, Hkv, (Hq // Hkv) * rows, D), kb.to(acc).transpose(-2, -1))
    s = s.view(B, Hq, rows, keys) * scale + bias  # (B, Hq, rows, keys); -inf where blocked
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, rows); -inf for a row that sees no key of the range
    # A row of only -inf (fully masked) would give NaN in softmax and its backward: it is given
    # finite scores, then probabilities 0.
    empty = torch.isneginf(lse).unsqueeze(-1)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    dropped = torch.nn.functional.dropout(p, dropout_p)  # keep ~ Bernoulli(1 - p), kept ones scaled by 1 / (1 - p)
    out = torch.matmul(dropped.view(B, Hkv, (Hq // Hkv) * rows, keys), vb.to(acc)).view(B, Hq, rows, -1)
    return out.to(qb.dtype), lse
