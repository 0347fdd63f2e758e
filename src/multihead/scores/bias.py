"""``bias(tensor)``: a dense additive bias ``(B|1, H|1, Lq|1, Lk|1)`` added to the scores.

A bias that requires grad receives its gradient (``dS`` summed over its broadcast dimensions)
from every backend that runs it. Blocking is the mask's job: a ``-inf`` entry blocks that key
too, but a mask says so without a float tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.scores.base import ADDITIVE, ScoreMod

__all__ = ["bias", "Bias"]


def bias(tensor: Tensor, name: str = "bias") -> Bias:
    """An additive bias broadcastable to ``(B, Hq, Lq, Lk)`` (2 to 4 dims, right-aligned)."""
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        got = f"a tensor of dtype {tensor.dtype}" if isinstance(tensor, Tensor) else type(tensor).__name__
        raise TypeError(f"bias: expected a float tensor broadcastable to (B, Hq, Lq, Lk), got {got}")
    if tensor.dim() > 4 or tensor.dim() < 2:
        raise ValueError(
            f"{name} must have 2 to 4 dims broadcastable to (B, Hq, Lq, Lk), got shape {tuple(tensor.shape)}"
        )
    return Bias(tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape)), name)


class Bias(ScoreMod):
    """A dense bias ``(B|1, H|1, Lq|1, Lk|1)`` added to the scores; built by :func:`bias`."""

    kind = ADDITIVE
    tensor: Tensor  # (B|1, H|1, Lq|1, Lk|1)
    name: str

    def __init__(self, tensor: Tensor, name: str = "bias"):
        self._set(tensor=tensor, name=name)  # (B|1, H|1, Lq|1, Lk|1)

    def check(self, extent: Extent) -> None:
        expected = tuple(extent)
        # (not `s not in (1, e)`: dynamo, torch 2.13, answers it True for a symbolic size e)
        if any(s != 1 and s != e for s, e in zip(self.tensor.shape, expected)):
            raise ValueError(
                f"{self.name} of shape {tuple(self.tensor.shape)} is not broadcastable to "
                f"(B, Hq, Lq, Lk) = {expected}; each dim must be 1 or the matching size"
            )

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.tensor,)

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        t = self.tensor
        idx = [i * 0 if size == 1 else i for i, size in zip((b, h, q_idx, kv_idx), t.shape)]
        return score + t[idx[0], idx[1], idx[2], idx[3]]

    def bias_block(
        self,
        extent: Extent,
        block: Block,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        q0, q1, k0, k1 = block
        t = self.tensor
        rows = slice(q0, q1) if t.shape[2] > 1 else slice(0, 1)
        cols = slice(k0, k1) if t.shape[3] > 1 else slice(0, 1)
        part = t[:, :, rows, cols]
        return part.to(device=device if device is not None else part.device, dtype=dtype)

    def apply_block(self, extent: Extent, block: Block, scores: Tensor, heads: Tensor | None = None) -> Tensor:
        bias = self.bias_block(extent, block, scores.device, scores.dtype)
        if heads is not None and bias.shape[1] > 1:
            bias = bias[:, heads]
        return scores + bias

    def _describe(self) -> str:
        return f"{self.name}(<{str(self.tensor.dtype).replace('torch.', '')} tensor {tuple(self.tensor.shape)}>)"
