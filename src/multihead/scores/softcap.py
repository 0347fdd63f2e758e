"""``softcap(cap)``: ``cap · tanh(s / cap)``, the logit soft-capping of Gemma 2 and Grok.

Scores keep their order but never exceed ``±cap``. Not additive: it runs on backends that apply a
function inside the softmax (the reference, flex); fused kernels with an additive mask cannot.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.scores.base import ELEMENTWISE, ScoreMod

__all__ = ["softcap", "Softcap"]


def softcap(cap: float) -> Softcap:
    """Soft-capping of the (scaled) scores at ``cap > 0``."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(
            f"softcap: cap must be a Python number (int or float), got {type(cap).__name__}"
            + ("; use float(cap)" if hasattr(cap, "item") else "")
        )
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    return Softcap(float(cap))


class Softcap(ScoreMod):
    """``cap · tanh(s / cap)`` on the scaled scores; built by :func:`softcap`."""

    kind = ELEMENTWISE
    cap: float

    def __init__(self, cap: float):
        self._set(cap=cap)

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.cap * torch.tanh(score / self.cap)

    def apply_block(self, extent: Extent, block: Block, scores: Tensor, heads: Tensor | None = None) -> Tensor:
        return self.cap * torch.tanh(scores / self.cap)

    def _describe(self) -> str:
        return f"softcap({self.cap})"
