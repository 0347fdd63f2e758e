"""A score modifier of a whole attention read on a part of it: :class:`View`, the one base of
:class:`~multihead.scores.heads.HeadRange` (a range of query heads: Ulysses) and
:class:`~multihead.scores.shifted.Shifted` (a block of positions: a ring step).

Both wrap an ``inner`` modifier bound to the whole attention and differ only in how the call's
coordinates read in the whole one's, so the block methods are written here once, in those
terms::

    call's extent, block, heads, distances  ──_whole, _whole_block, _whole_heads,──>  inner's
                                               _whole_distances
    inner's values per head of the whole    ──_local_heads──>  per head of the call

Kind, tensors and relative form are the inner modifier's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.scores.base import ScoreMod

__all__ = ["View"]


class View(ScoreMod):
    """``inner`` read through a change of coordinates; a subclass overrides the maps it moves
    (each is the identity here) and implements ``__call__``, ``check``, ``for_lengths`` and
    ``_describe``."""

    inner: ScoreMod

    def _whole(self, extent: Extent) -> Extent:
        """The whole attention, from the call's ``extent``."""
        return extent

    def _whole_block(self, block: Block) -> Block:
        """The call's ``block`` as positions of the whole attention."""
        return block

    def _whole_heads(self, heads: Tensor | None, device: torch.device) -> Tensor | None:
        """The call's selected query heads (``None``: all of them) as heads of the whole attention."""
        return heads

    def _whole_distances(self, d0: int, d1: int) -> tuple[int, int]:
        """The call's distances ``[d0, d1)`` (``d = kv_idx - q_idx``) in the whole attention."""
        return d0, d1

    def _local_heads(self, values: Tensor, dim: int) -> Tensor:
        """``values`` with the whole attention's heads (or 1, broadcast) along ``dim``, at the call's heads."""
        return values

    @property
    def relative(self) -> bool:
        return self.inner.relative

    def distance_bias(
        self, d0: int, d1: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor | None:
        vec = self.inner.distance_bias(*self._whole_distances(d0, d1), device, dtype)  # (Hq|1, n)
        return None if vec is None else self._local_heads(vec, 0)

    def bias_block(
        self,
        extent: Extent,
        block: Block,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        bias = self.inner.bias_block(self._whole(extent), self._whole_block(block), device, dtype)  # (B|1, Hq|1, R, K)
        return self._local_heads(bias, 1)

    def apply_block(self, extent: Extent, block: Block, scores: Tensor, heads: Tensor | None = None) -> Tensor:
        whole_heads = self._whole_heads(heads, scores.device)
        return self.inner.apply_block(self._whole(extent), self._whole_block(block), scores, whole_heads)

    def tensors(self) -> tuple[Tensor, ...]:
        return self.inner.tensors()
