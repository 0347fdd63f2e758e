"""The plain pieces of the variants' fp64 equations (``tests/layers/test_variants_*.py``), written
from the papers and the conventions, not from the package: a masked softmax that gives 0 on a row
with no key, RoPE as rotated pairs, an RMSNorm, and the masks as dense tables.

Each function works in the dtype it is given, so the same equations run in fp64 (the oracle) and
in fp32/bf16 (the naive baseline of the relative rule, shared/TESTING.md).
"""

from __future__ import annotations

import torch
from torch import Tensor


def linear(x: Tensor, params: dict, name: str) -> Tensor:
    """``x Wᵀ + b`` of the state-dict entries ``name.weight`` (and ``name.bias`` when present)."""
    y = x @ params[f"{name}.weight"].to(x.dtype).T
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias.to(x.dtype)


def softmax_rows(scores: Tensor, allowed: Tensor) -> Tensor:
    """``softmax`` over the keys where ``allowed``; a row with no allowed key is all zeros (and its
    gradient zero: the masked scores are replaced before the softmax, never after)."""
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    return torch.softmax(scores, dim=-1).masked_fill(~has_key, 0.0)


def rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Half-split RoPE of ``x (..., L, D)`` at ``positions (L,)``: pair ``(i, i + D/2)`` turned by
    ``p · base^(-2i/D)``, as GPT-NeoX writes it."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    angle = positions.to(torch.float64)[:, None] * theta  # (L, D/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x²) + ε) · weight`` over the last dim."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def allowed_table(B: int, Lq: int, Lk: int, *, causal: bool = False, lengths: Tensor | None = None) -> Tensor:
    """``(B, Lq, Lk)`` bool, ``True`` = may attend: bottom-right causal (query ``i`` sees keys
    ``j <= i + Lk - Lq``) and/or keys ``j < lengths[b]``."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    table = torch.ones(B, Lq, Lk, dtype=torch.bool)
    if causal:
        table &= j <= i + (Lk - Lq)
    if lengths is not None:
        table &= j[None] < lengths[:, None, None]
    return table
