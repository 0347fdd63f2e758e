"""``RMSNorm``: the root-mean-square normalisation of the layers' sub-steps (MLA's latents,
differential attention's per-head norm).

Computed in fp32 (fp64 for fp64 inputs) and rounded once to the input dtype, as DeepSeek's, the
DIFF Transformer's and Hugging Face's RMSNorm: the mean of squares of a bf16 row loses most of its
digits if it is summed in bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + ε) · weight`` over the last dim (module docstring for the dtype)."""

    def __init__(
        self, dim: int, *, eps: float = 1e-6, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(compute)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
