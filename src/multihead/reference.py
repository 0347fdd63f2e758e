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

import torch
from torch import Tensor

from multihead.blocks import Block
from multihead.call import AttentionResult, ScoreModArg, mask_and_score_mod
from multihead.conventions import default_scale, repeat_kv, softmax_dtype
from multihead.masks import Mask
from multihead.scoring import score_block

__all__ = ["reference_attention", "AttentionResult"]


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> AttentionResult:
    """Attention computed plainly, returning output, weights and log-sum-exp.

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``.
        mask: a :class:`~multihead.masks.Mask` or a bool tensor (True = may attend) broadcastable
            to ``(B, Hq, Lq, Lk)``; a float tensor is read as PyTorch's additive masks are.
        score_mod: a :mod:`multihead.scores` modifier (or a list, applied in order).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        dropout_p: probability of zeroing a probability (on the output path only).
        dropout_mask: optional bool ``(B, Hq, Lq, Lk)``, ``True`` = kept; replaces the random draw
            so that other backends can be checked against this one with the same dropout.
        compute_dtype: dtype of the arithmetic; default fp32 for fp16/bf16 inputs, else the
            input dtype. Pass ``torch.float64`` for the oracle.

    Inputs are not validated here; :func:`multihead.attention` validates before dispatching.
    """
    B, Hq, Lq, D = q.shape
    dtype = compute_dtype or softmax_dtype(q.dtype)
    scale = default_scale(D) if scale is None else scale
    mask, score_mod = mask_and_score_mod(mask, score_mod, check_binary=False, q_len=Lq, kv_len=k.shape[2])

    # S = s * Q K^T, modified, -inf where blocked (multihead.scoring, shared with the blockwise
    # code). Query head h reads KV head h // G (G = Hq // Hkv).                 (B, Hq, Lq, Lk)
    scores, visible = score_block(q, k, mask, score_mod, scale, Block(0, Lq, 0, k.shape[2]), dtype=dtype)
    if visible is None:
        visible = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=q.device)
    visible = visible.expand_as(scores)
    row_has_key = visible.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)

    # m = the row maximum over visible keys (0 for a row that sees none; no gradient needed).
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_has_key, row_max, torch.zeros_like(row_max)).detach()

    # Blocked scores are replaced by m *before* the softmax: exp(m - m) = 1 is finite whatever
    # the visible scores are (0 - m could overflow when every visible score is below -88 in fp32),
    # then multiplied by 0. No -inf and no NaN enters the forward or the backward pass.
    finite = torch.where(visible, scores, row_max)

    # P = exp(S - m) / sum_j exp(S - m), with blocked keys contributing exactly 0.
    unnormalized = torch.exp(finite - row_max) * visible
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

    # Non-finite inputs (multihead.nonfinite): a row whose query holds NaN/inf, or that may see a
    # key or value holding one, is NaN; other rows are untouched. The product P V would compute
    # 0 * NaN = NaN for rows that may not see a bad value, so bad values are zeroed for it.
    bad_key = repeat_kv((~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))).unsqueeze(-1), Hq).squeeze(
        -1
    )  # (B, Hq, Lk)
    v = repeat_kv(v.to(dtype), Hq)  # (B, Hq, Lk, Dv)
    v = torch.where(bad_key.unsqueeze(-1), torch.zeros((), dtype=dtype, device=v.device), v)
    poisoned = (visible & bad_key.unsqueeze(-2)).any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    poisoned = poisoned | (~torch.isfinite(q).all(dim=-1, keepdim=True) & row_has_key)

    # O = P V                                                             (B, Hq, Lq, Dv)
    output = torch.matmul(kept, v).masked_fill(poisoned, float("nan"))
    lse = lse.masked_fill(poisoned.squeeze(-1), float("nan"))
    weights = weights.masked_fill(poisoned, float("nan"))
    return AttentionResult(output.to(q.dtype), weights, lse)
