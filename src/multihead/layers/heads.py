"""Splitting projections into heads and merging them back, in either layout, as views.

A projection ``(B, L, H·D)`` (or ``(L, B, H·D)``) holds head ``h`` at features
``[h·D, (h+1)·D)``. The core wants ``(B, H, L, D)``; both directions are views (no copy), and
SDPA's CPU and CUDA kernels take the resulting strides as they are::

    batch_first=True   (B, L, H·D) -view-> (B, L, H, D) -transpose(1, 2)-> (B, H, L, D)
    batch_first=False  (L, B, H·D) -view-> (L, B, H, D) -permute(1,2,0,3)-> (B, H, L, D)

The fused kernels write their output ``(B, H, L, D)`` with ``(B, L, H, D)`` strides, so
:func:`merge_heads` is free for them as well.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["split_heads", "merge_heads"]


def split_heads(x: Tensor, heads: int, head_dim: int, batch_first: bool) -> Tensor:
    """``(B, L, H·D)`` or ``(L, B, H·D)`` -> ``(B, H, L, D)``, a view."""
    if batch_first:
        B, L, _ = x.shape
        return x.view(B, L, heads, head_dim).transpose(1, 2)  # (B, H, L, D)
    L, B, _ = x.shape
    return x.view(L, B, heads, head_dim).permute(1, 2, 0, 3)  # (B, H, L, D)


def merge_heads(y: Tensor) -> Tensor:
    """``(B, H, L, D)`` -> ``(B, L, H·D)``; a view when ``y`` has ``(B, L, H, D)`` strides."""
    B, H, L, D = y.shape
    return y.transpose(1, 2).reshape(B, L, H * D)  # (B, L, H·D)
