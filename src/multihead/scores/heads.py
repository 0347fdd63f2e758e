"""A score modifier restricted to a range of query heads: :func:`head_range`.

Head-parallel attention (:func:`multihead.distributed.ulysses_attention`) gives each rank a
contiguous range of query heads and calls attention on those alone, so the local call's head
``h`` is head ``first + h`` of the whole attention. A modifier with one value per head (ALiBi's
slopes, a relative bias's heads, a bias tensor ``(B|1, Hq, Lq|1, Lk|1)``, a user's function of
``h``) is read at the heads of the call, as :func:`multihead.masks.head_range` reads a mask::

    whole (Hq = 4)      ALiBi slopes  s0 s1 s2 s3
    head_range(alibi, first=2, count=2, num_heads=4)   local heads 0 1 read slopes s2 s3

Attention sinks are a plain ``(Hq,)`` tensor, sliced the same way by :func:`sinks_range`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Extent, check_head_range
from multihead.scores.base import Chain, ScoreMod
from multihead.scores.bias import Bias
from multihead.scores.relative import RelativeBias
from multihead.scores.softcap import Softcap
from multihead.scores.view import View

__all__ = ["head_range", "sinks_range", "HeadRange"]


def head_range(score_mod: ScoreMod | None, first: int, count: int, num_heads: int) -> ScoreMod | None:
    """``score_mod`` of an attention of ``num_heads`` query heads, read for heads ``[first, first +
    count)`` as the heads ``0 .. count - 1`` of a call of ``count`` heads.

    A modifier that reads no head (``softcap``, a relative bias shared by every head, a bias tensor
    broadcast over heads) comes back as it is; a bias tensor with one slice per head is sliced; a
    chain is restricted element by element; any other becomes a :class:`HeadRange`."""
    check_head_range("head_range", first, count, num_heads)
    if score_mod is None:
        return None
    if isinstance(score_mod, Chain):
        parts = (head_range(m, first, count, num_heads) for m in score_mod.mods)
        return Chain([m for m in parts if m is not None])  # (none is: each part is a modifier)
    if isinstance(score_mod, Softcap) or (isinstance(score_mod, RelativeBias) and score_mod.num_heads is None):
        return score_mod
    if isinstance(score_mod, Bias):
        if score_mod.tensor.shape[1] == 1:
            return score_mod
        return Bias(score_mod.tensor[:, first : first + count], score_mod.name)  # (B|1, count, Lq|1, Lk|1)
    return HeadRange(score_mod, first, count, num_heads)


def sinks_range(sinks: Tensor | None, first: int, count: int, num_heads: int) -> Tensor | None:
    """The sink logits ``(num_heads,)`` of heads ``[first, first + count)``: ``(count,)``, a view
    (its gradient reaches the whole tensor's slice)."""
    check_head_range("sinks_range", first, count, num_heads)
    return None if sinks is None else sinks[first : first + count]


class HeadRange(View):
    """``inner`` (a modifier of ``num_heads`` heads) with head ``h`` read as head ``first + h``,
    for a call of ``count`` heads. Built by :func:`head_range`."""

    inner: ScoreMod
    first: int
    count: int
    num_heads: int

    def __init__(self, inner: ScoreMod, first: int, count: int, num_heads: int):
        self._set(inner=inner, first=first, count=count, num_heads=num_heads, kind=inner.kind)

    def _whole(self, extent: Extent) -> Extent:
        return extent.with_heads(self.num_heads)

    def _whole_heads(self, heads: Tensor | None, device: torch.device) -> Tensor:
        local = torch.arange(self.count, device=device) if heads is None else heads
        return local + self.first

    def _local_heads(self, values: Tensor, dim: int) -> Tensor:
        return values if values.shape[dim] == 1 else values.narrow(dim, self.first, self.count)

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner(score, b, h + self.first, q_idx, kv_idx)

    def check(self, extent: Extent) -> None:
        if extent.heads != self.count:
            raise ValueError(
                f"head_range: a modifier of heads [{self.first}, {self.first + self.count}) is read by a "
                f"call of {extent.heads} heads; expected {self.count}"
            )
        self.inner.check(self._whole(extent))

    def for_lengths(self, q_len: int, kv_len: int) -> ScoreMod:
        inner = self.inner.for_lengths(q_len, kv_len)
        return self if inner is self.inner else HeadRange(inner, self.first, self.count, self.num_heads)

    def _describe(self) -> str:
        heads = f"first={self.first}, count={self.count}, num_heads={self.num_heads}"
        return f"head_range({self.inner._describe()}, {heads})"
