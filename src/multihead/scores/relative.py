"""Relative biases: additive modifiers that depend only on the query head and on the distance
between a key's and a query's *aligned* positions (ALiBi, T5's bucketed bias, any Toeplitz bias).

``bias(h, d)`` with ``d = kv_pos - q_pos``: ``0`` on the diagonal, negative for past keys. The
positions are aligned as masks align them (:mod:`multihead.conventions`): ``bottom_right`` (the
default) puts the last query at the last key, so a decode step (``Lq = 1`` after ``T - 1``
cached keys) reads query position ``T - 1``; ``top_left`` puts query ``i`` at key ``i``. The
lengths are bound once per call (:meth:`ScoreMod.for_lengths`) before a backend sees the
modifier, so the FlexAttention signature ``score_mod(score, b, h, q_idx, kv_idx)`` still holds.

Why a class of its own: a bias that is a function of ``d`` is constant along each diagonal of a
block of scores. A block of ``R`` queries x ``K`` keys needs only the ``R + K - 1`` distinct
values, and a fused kernel can read them as an overlapping strided view (rows reversed)::

    vec = distance_bias(d0, d0 + R + K - 1)        (H, R + K - 1)
    vec.unfold(-1, K, 1)[h, r', c] = vec[h, r' + c] = bias(h, d0 + r' + c)   (H, R, K), no copy

so the ``blocksparse`` backend builds no ``rows x keys`` bias for the blocks it sees whole or up
to a causal diagonal (pieces that a mask cuts get a block-sized one; never ``Lq x Lk``), and
trains its parameters through the same view (:mod:`multihead.backends.blocksparse`).
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.scores.base import ADDITIVE, ScoreMod

__all__ = ["RelativeBias", "ALIGNMENTS"]

ALIGNMENTS = ("bottom_right", "top_left")


class RelativeBias(ScoreMod):
    """Base class of relative biases. Subclasses implement :meth:`bias` (and ``_describe``)."""

    kind = ADDITIVE
    num_heads: int | None
    align: str
    offset: int | None  # Lk - Lq bottom-right, bound by for_lengths; 0 top-left

    def __init__(self, num_heads: int | None, align: str = "bottom_right"):
        name = type(self).__name__
        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise ValueError(
                f"{name}: num_heads must be a positive int (the query heads Hq) or None, got {num_heads!r}"
            )
        if align not in ALIGNMENTS:
            raise ValueError(f"{name}: align must be one of {ALIGNMENTS}, got {align!r}")
        self._set(num_heads=num_heads, align=align, offset=0 if align == "top_left" else None)

    @abc.abstractmethod
    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
        """The bias for query heads ``h`` and aligned distances ``kv_pos - q_pos`` (broadcastable
        integer tensors): a tensor of their broadcast shape, computed in ``dtype`` (float64 for
        the per-block vectors, which are small; float32 or the scores' dtype per element)."""

    # --------------------------------------------------------------------------- alignment
    def for_lengths(self, q_len: int, kv_len: int) -> RelativeBias:
        offset = kv_len - q_len if self.align == "bottom_right" else 0
        if offset == self.offset:
            return self
        return self._replace(offset=offset)

    def _offset(self) -> int:
        if self.offset is None:
            raise ValueError(
                f"{self._describe()} is aligned bottom_right, which depends on the lengths of the "
                f"attention: call .for_lengths(Lq, Lk) first (multihead.attention does), or build it "
                f"with align='top_left'"
            )
        return self.offset

    # --------------------------------------------------------------------------- the modifier
    @property
    def relative(self) -> bool:
        return True

    def check(self, extent: Extent) -> None:
        heads = extent.heads
        if self.num_heads is not None and self.num_heads != heads:
            raise ValueError(
                f"{self._describe()} has num_heads={self.num_heads} but the attention has Hq={heads} "
                f"query heads; build it with num_heads={heads}"
            )

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if self.num_heads is None:
            h = torch.zeros_like(h)
        dtype = torch.float64 if score.dtype == torch.float64 else torch.float32
        return score + self.bias(h, kv_idx - q_idx - self._offset(), dtype).to(score.dtype)

    def distance_bias(
        self, d0: int, d1: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        n_heads = 1 if self.num_heads is None else self.num_heads
        h = torch.arange(n_heads, device=device).view(-1, 1)  # (H, 1)
        d = torch.arange(d0, d1, device=device).view(1, -1) - self._offset()  # (1, n): aligned distances
        return self.bias(h, d, torch.float64).to(dtype)  # (H|1, n)

    def bias_block(
        self,
        extent: Extent,
        block: Block,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        q0, q1, k0, k1 = block
        d0 = k0 - (q1 - 1)  # the smallest index distance of the block: last row, first key
        vec = self.distance_bias(d0, k1 - q0, device, dtype)  # (H|1, R + K - 1)
        rows = torch.arange(q0, q1, device=vec.device).view(-1, 1)
        cols = torch.arange(k0, k1, device=vec.device).view(1, -1)
        return vec[:, cols - rows - d0].unsqueeze(0)  # (1, H|1, R, K)

    def apply_block(self, extent: Extent, block: Block, scores: Tensor, heads: Tensor | None = None) -> Tensor:
        bias = self.bias_block(extent, block, scores.device, scores.dtype)
        if heads is not None and bias.shape[1] > 1:
            bias = bias[:, heads]
        return scores + bias


def toeplitz_view(vec: Tensor, rows: int, keys: int) -> Tensor:
    """``vec (H, rows + keys - 1)`` -> ``(H, rows, keys)`` with ``[h, r', c] = vec[h, r' + c]``:
    an overlapping view (no copy). Row ``r'`` is query row ``rows - 1 - r'`` of the block whose
    smallest distance is ``vec[:, 0]`` (rows reversed: strides cannot be negative)."""
    return vec.unfold(-1, keys, 1)
