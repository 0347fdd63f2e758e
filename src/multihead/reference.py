"""The reference implementation: the oracle every fast path is tested against. Never optimised.

Scaled dot-product attention, one step per line, with the math beside it (conventions in
:mod:`multihead.conventions`):

.. math::

    S_{bhij} = s \\sum_d Q_{bhid} K_{b,g(h),j,d} + M_{bhij}
    \\qquad P_{bhij} = \\frac{e^{S_{bhij} - m_{bhi}}}{\\sum_j e^{S_{bhij} - m_{bhi}}}
    \\qquad O_{bhie} = \\sum_j P_{bhij} V_{b,g(h),j,e}

with ``g(h) = h // (Hq // Hkv)``, scale ``s`` (default ``1/sqrt(D)``), ``M`` the additive form of
the mask (``-inf`` where blocked) and ``m`` the row maximum. A row whose every key is blocked
has no softmax at all: its probabilities, output and gradients are 0 and its log-sum-exp is
``-inf``. Blocked scores are *replaced* before the softmax (never ``-inf`` inside it), so no
NaN can enter the forward or the backward pass (``0 * NaN = NaN`` in autograd).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from multihead.conventions import default_scale, softmax_dtype
from multihead.masks import Mask, as_mask

__all__ = ["reference_attention", "AttentionResult"]


class AttentionResult(NamedTuple):
    """What :func:`multihead.attention` returns when weights or the LSE are asked for."""

    output: Tensor  # (B, Hq, Lq, Dv), dtype of q
    weights: Tensor | None  # (B, Hq, Lq, Lk), probabilities before dropout
    lse: Tensor | None  # (B, Hq, Lq), fp32 (fp64 for fp64 inputs); -inf on fully masked rows


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> AttentionResult:
    """Attention computed plainly, returning output, weights and log-sum-exp.

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``.
        mask: a :class:`~multihead.masks.Mask`, a bool tensor (True = may attend) or a float
            additive tensor, broadcastable to ``(B, Hq, Lq, Lk)``.
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        dropout_p: probability of zeroing a probability (on the output path only).
        dropout_mask: optional bool ``(B, Hq, Lq, Lk)``, ``True`` = kept; replaces the random draw
            so that other backends can be checked against this one with the same dropout.
        compute_dtype: dtype of the arithmetic; default fp32 for fp16/bf16 inputs, else the
            input dtype. Pass ``torch.float64`` for the oracle.

    Inputs are not validated here; :func:`multihead.attention` validates before dispatching.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dtype = compute_dtype or softmax_dtype(q.dtype)
    scale = default_scale(D) if scale is None else scale
    mask = as_mask(mask)

    # Grouped-query mapping: query head h reads KV head h // G  (G = Hq // Hkv).
    group = Hq // Hkv
    k = k.to(dtype).repeat_interleave(group, dim=1)  # (B, Hq, Lk, D)
    v = v.to(dtype).repeat_interleave(group, dim=1)  # (B, Hq, Lk, Dv)

    # S = s * Q K^T                                                       (B, Hq, Lq, Lk)
    scores = torch.matmul(q.to(dtype), k.transpose(-2, -1)) * scale

    # Which keys each query may see, and the additive part of the mask (M above).
    allowed = torch.ones((1, 1, Lq, Lk), dtype=torch.bool, device=q.device)
    if mask is not None:
        dense = mask.materialize(B, Hq, Lq, Lk, device=q.device, dtype=dtype)
        if mask.is_additive:
            allowed = ~torch.isneginf(dense)
            scores = scores + dense.masked_fill(~allowed, 0.0)  # finite bias only
        else:
            allowed = dense
    allowed = allowed.expand_as(scores)
    row_has_key = allowed.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)

    # A key no query may see can hold anything, even NaN: 0 * NaN = NaN, so its value is zeroed.
    key_seen = allowed.any(dim=-2).unsqueeze(-1)  # (B, Hq, Lk, 1)
    v = torch.where(key_seen, v, torch.zeros((), dtype=dtype, device=v.device))

    # Replace blocked scores by a finite value *before* the softmax: no -inf, no NaN.
    finite = scores.masked_fill(~allowed, 0.0)
    row_max = finite.masked_fill(~allowed, torch.finfo(dtype).min).amax(dim=-1, keepdim=True)
    row_max = torch.where(row_has_key, row_max, torch.zeros_like(row_max)).detach()  # m (no grad needed)

    # P = exp(S - m) / sum_j exp(S - m), with blocked keys contributing exactly 0.
    unnormalized = torch.exp(finite - row_max) * allowed
    denominator = unnormalized.sum(dim=-1, keepdim=True)
    denominator = torch.where(row_has_key, denominator, torch.ones_like(denominator))
    weights = unnormalized / denominator  # fully masked rows: 0 / 1 = 0

    # LSE = m + log sum_j exp(S - m); -inf where a row sees no key.
    lse = (row_max + torch.log(denominator)).squeeze(-1)
    lse = lse.masked_fill(~row_has_key.squeeze(-1), float("-inf"))

    # Dropout on the path to the output: keep with probability 1 - p, rescale by 1 / (1 - p).
    kept = weights
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = torch.rand(weights.shape, device=q.device) >= dropout_p
        kept = weights * dropout_mask.to(dtype) / (1.0 - dropout_p)

    # O = P V                                                             (B, Hq, Lq, Dv)
    output = torch.matmul(kept, v)
    return AttentionResult(output.to(q.dtype), weights, lse)
