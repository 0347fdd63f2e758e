"""Attention a block of queries at a time in plain PyTorch, for what the fused CPU kernel cannot
do: dropout, and elementwise score modifiers (softcap, a user's ``score_mod``). Used by the
``blocksparse`` backend.

PyTorch's CPU flash kernel takes only an additive mask and has no dropout; SDPA with dropout
falls back to its math kernel with a dense ``Lq x Lk`` mask. Here each query block attends to
the key range its mask lets it see (``mask.key_range``: the window of a band, the prefix of a
causal row, the document of a packed sequence)::

    S = score_mod(scale · Q_b K_rᵀ) , -inf where blocked     (multihead.scoring.score_block)
    lse = logsumexp(S)               P = exp(S - lse)        (the probabilities, before dropout)
    O_b = dropout(P) V_r             keep ~ Bernoulli(1 - p) (torch's dropout, the global generator)

Each block runs under activation checkpointing: nothing of the block is kept for the backward,
which recomputes it (with the same random draw: the generator state is saved and restored), so
memory stays at one block whatever ``L`` is and a fixed seed gives the same result twice. The
backward is autograd's, so tensors a modifier reads, even through a closure, get their gradient.
Cost follows the visible area of the mask. Fully masked rows give output 0 and LSE ``-inf``
(their probabilities are 0, never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from multihead.blockwise import safe_logsumexp, zero_anchor
from multihead.conventions import lse_dtype
from multihead.scoring import score_block

__all__ = ["attention_by_blocks"]


def attention_by_blocks(
    q: Tensor, k: Tensor, v: Tensor, mask, mods, scale: float, dropout_p: float, block: int
) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hq, Lq, Dv)`` and LSE ``(B, Hq, Lq)``, one query block of ``block`` rows at a
    time, with any score modifier and dropout ``dropout_p`` on the probabilities; differentiable."""
    B, Hq, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (mods is not None and mods.requires_grad)
    )
    # A block that sees no key is 0 (LSE -inf) plus a zero carrying the graph of q, k, v and the
    # modifier's tensors, as the fused path's blocks are: with only k, v requiring grad, a call
    # where no block sees a key must still backpropagate (exact zeros), not be a constant.
    anchor: Tensor | None = None
    outs, lses = [], []
    for q0 in range(0, Lq, block):
        q1 = min(q0 + block, Lq)
        k0, k1 = (0, Lk) if mask is None else mask.key_range(q0, q1, Lq, Lk)
        if k0 >= k1:  # the block sees no key: output 0, LSE -inf
            out = q.new_zeros((B, Hq, q1 - q0, Dv))
            lse = torch.full((B, Hq, q1 - q0), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
            if grad:
                if anchor is None:
                    anchor = zero_anchor(q, k, v, *(mods.tensors() if mods is not None else ()))
                out, lse = out + anchor.to(out.dtype), lse + anchor.to(lse.dtype)
            outs.append(out)
            lses.append(lse)
            continue
        args = (q, k, v, mask, mods, scale, dropout_p, q0, q1, k0, k1)
        out, lse = checkpoint(_block, *args, use_reentrant=False, preserve_rng_state=True) if grad else _block(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block(
    q: Tensor, k: Tensor, v: Tensor, mask, mods, scale: float, dropout_p: float, q0: int, q1: int, k0: int, k1: int
) -> tuple[Tensor, Tensor]:
    """Queries ``[q0, q1)`` against keys ``[k0, k1)``: ``(B, Hq, rows, Dv)`` and the LSE ``(B, Hq, rows)``."""
    B, Hq, Lq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    rows, keys = q1 - q0, k1 - k0
    s, _ = score_block(q, k, mask, mods, scale, q0, q1, Lq, k0=k0, k1=k1)  # (B, Hq, rows, keys), softmax dtype
    lse = safe_logsumexp(s)  # (B, Hq, rows); -inf for a row that sees no key of the range
    # exp(-inf - (-inf)) would be NaN: rows that see no key get a finite LSE here, then probability 0.
    empty = torch.isneginf(lse).unsqueeze(-1)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse.unsqueeze(-1)), lse.unsqueeze(-1)))
    p = p.masked_fill(empty, 0.0)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)  # keep ~ Bernoulli(1 - p), kept ones scaled by 1 / (1 - p)
    vb = v[:, :, k0:k1].to(p.dtype)
    # Query head h = kv * G + g reads KV head kv: the G heads of a group fold into one matmul.
    out = torch.matmul(p.reshape(B, Hkv, (Hq // Hkv) * rows, keys), vb).view(B, Hq, rows, Dv)
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))
