"""A learned relative position bias (T5, Raffel et al. 2020): one trainable scalar per head and
*bucket* of the distance between a key and a query.

The distance ``d = j - i`` (key minus query, aligned positions) is put in one of
``num_buckets`` buckets: small distances each get their own bucket, larger ones share buckets
whose width grows logarithmically up to ``max_distance``, beyond which all share the last::

    bidirectional (encoders): half the buckets for keys before the query, half for keys after
    n = |d| (bidirectional) or max(-d, 0) (causal: keys after the query share bucket 0)
    exact = buckets // 2                  (buckets = num_buckets, halved if bidirectional)
    bucket(n) = n                                                   if n < exact
              = min(exact + floor(log(n / exact) / log(max_distance / exact) · (buckets - exact)),
                    buckets - 1)                                    otherwise
    (+ buckets when bidirectional and d > 0)

The table ``weight (num_buckets, Hq)`` is a parameter of :class:`RelativePositionBias`, an
``nn.Module`` whose ``forward()`` returns the score modifier reading it. Through the
``blocksparse`` backend it is added one block at a time as a strided view of ``R + K - 1``
values (:mod:`multihead.scores.relative`) and its gradient is gathered the same way: no
``Lq x Lk`` bias is built, in the forward or the backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from multihead.scores.relative import RelativeBias

__all__ = ["RelativePositionBias", "BucketedBias", "relative_position_bucket"]


def relative_position_bucket(
    distance: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket (``int64``, same shape) of each distance ``d = key position - query position``."""
    buckets = num_buckets // 2 if bidirectional else num_buckets
    d = distance.long()
    offset = (d > 0).long() * buckets if bidirectional else torch.zeros_like(d)
    n = d.abs() if bidirectional else (-d).clamp(min=0)
    exact = buckets // 2
    # log(n / exact) is only read where n >= exact; clamp keeps log finite elsewhere.
    # In float32, as T5 computed it: at distances where the real value is a whole number, float64
    # could round to the other side and give a checkpoint a different bucket than it was trained with.
    scaled = torch.log(n.clamp(min=1).float() / exact) / math.log(max_distance / exact) * (buckets - exact)
    large = (exact + scaled.long()).clamp(max=buckets - 1)
    return offset + torch.where(n < exact, n, large)


class BucketedBias(RelativeBias):
    """The score modifier of a :class:`RelativePositionBias`: ``weight[bucket(j - i), h]``."""

    weight: Tensor  # (num_buckets, Hq)
    bidirectional: bool
    num_buckets: int
    max_distance: int

    def __init__(
        self, weight: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int, align: str = "bottom_right"
    ):
        super().__init__(weight.shape[1], align)
        self._set(weight=weight, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)

    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
        bucket = relative_position_bucket(
            distance, bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        return self.weight[bucket, h].to(dtype)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.weight,)

    def _describe(self) -> str:
        return (
            f"relative_position_bias(num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}, bidirectional={self.bidirectional})"
        )


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias. ``forward()`` returns the score modifier::

        rel = RelativePositionBias(num_heads=8)                  # weight (32, 8), trainable
        out = attention(q, k, v, mask=causal(), score_mod=rel())
        layer = MultiHeadAttention(512, 8, score_mod=rel)        # registered, called per forward

    Args:
        num_heads: ``Hq``.
        num_buckets: buckets of the distance (T5: 32).
        max_distance: distances from here on share the last bucket (T5: 128).
        bidirectional: buckets for keys after the query too (encoders); ``False`` for decoders,
            where keys after the query share one bucket (a causal mask hides them anyway).
        align: ``"bottom_right"`` or ``"top_left"``, as for masks.
        device, dtype: of ``weight``.
    """

    def __init__(
        self,
        num_heads: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        align: str = "bottom_right",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, value, low in (
            ("num_heads", num_heads, 1),
            ("num_buckets", num_buckets, 2 if not bidirectional else 4),
            ("max_distance", max_distance, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RelativePositionBias: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(bidirectional, bool):
            raise TypeError(f"RelativePositionBias: bidirectional must be a bool, got {type(bidirectional).__name__}")
        exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if max_distance <= exact:
            raise ValueError(
                f"RelativePositionBias: max_distance={max_distance} must exceed the {exact} exact buckets "
                f"(num_buckets={num_buckets}, bidirectional={bidirectional})"
            )
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional, self.align = bidirectional, align
        # T5's layout: relative_attention_bias.weight is (num_buckets, num_heads).
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        BucketedBias(
            self.weight.detach(),
            bidirectional=bidirectional,
            num_buckets=num_buckets,
            max_distance=max_distance,
            align=align,
        )  # checks align now, not at the first forward

    def forward(self) -> BucketedBias:
        return BucketedBias(
            self.weight,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
            align=self.align,
        )

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )
