"""The call contract between :func:`multihead.attention` and its backends.

:class:`AttentionCall` is one validated call (what a backend is asked to serve);
:class:`AttentionResult` is what comes back. Backends import both from here and nothing from
the entry point. :func:`mask_and_score_mod` is the one place that turns what a user may pass as
``mask=``/``score_mod=`` into a boolean mask and a score modifier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import torch
from torch import Tensor

from multihead.blocks import Extent
from multihead.masks import Mask, TensorMask, additive_blocked, as_mask
from multihead.scores import Bias, ScoreMod, as_score_mod
from multihead.scores.base import Chain

__all__ = [
    "AttentionCall",
    "AttentionResult",
    "Returns",
    "mask_and_score_mod",
    "ScoreModArg",
    "Selection",
]

#: What ``score_mod=`` takes: a modifier, a function ``fn(score, b, h, q_idx, kv_idx) -> score``, or a list of them.
ScoreModArg: TypeAlias = "ScoreMod | Callable[..., Tensor] | Sequence[ScoreMod | Callable[..., Tensor]] | None"
#: What ``weights_heads=``/``weights_rows=`` take: an int, a sequence of ints, a slice or an integer tensor.
Selection: TypeAlias = "int | Sequence[int] | slice | Tensor | None"


class AttentionResult(NamedTuple):
    """What :func:`multihead.attention` returns when weights or the LSE are asked for; backends
    return it with ``weights=None`` and ``lse=None`` when their kernel gives no LSE."""

    output: Tensor  # (B, Hq, Lq, Dv), dtype of q
    weights: Tensor | None  # (B, Hq, Lq, Lk), probabilities before dropout
    lse: Tensor | None  # (B, Hq, Lq), lse_dtype(q.dtype); -inf on fully masked rows


@dataclass(frozen=True)
class Returns:
    """What a caller of :func:`multihead.attention` gets besides the output: the weights (of the
    query heads and rows selected, ``None`` = all) and the LSE."""

    weights: bool = False
    lse: bool = False
    heads: Tensor | None = None  # 1-D int64 indices of the query heads whose weights are returned
    rows: Tensor | None = None  # 1-D int64 indices of the query rows whose weights are returned


@dataclass(frozen=True)
class AttentionCall:
    """One validated call of :func:`multihead.attention`: what backends are asked to serve."""

    q: Tensor  # (B, Hq, Lq, D)
    k: Tensor  # (B, Hkv, Lk, D)
    v: Tensor  # (B, Hkv, Lk, Dv)
    mask: Mask | None  # boolean
    score_mod: ScoreMod | None
    scale: float
    dropout_p: float
    dropout_mask: Tensor | None
    return_lse: bool  # the LSE is wanted (for itself, the weights or the sinks); native if the kernel has one
    scale_folded: bool = False  # a scale <= 0 was folded into q (q * scale, scale 1): see validation
    # Read by attention()'s last step only (multihead.attention.finish); backends ignore them.
    sinks: Tensor | None = None  # (Hq,) per-head sink logits, joined through the LSE (multihead.sinks)
    returns: Returns | None = None  # what the caller gets besides the output (None: nothing)
    check_finite: bool = False  # the non-finite rules of docs/conventions.md

    @property
    def empty(self) -> bool:
        """``Lq == 0`` or ``Lk == 0``: the result is known without a kernel (fully masked rows)."""
        return self.q.shape[2] == 0 or self.k.shape[2] == 0

    def __post_init__(self) -> None:
        # Read by every backend's refusals: computed once. (Not functools.cached_property: its
        # lock, on Python 3.11, is a context manager torch.compile cannot trace.)
        B, Hq, Lq, D = self.q.shape
        object.__setattr__(self, "_shape", (B, Hq, self.k.shape[1], Lq, self.k.shape[2], D, self.v.shape[3]))

    @property
    def shape(self) -> tuple[int, int, int, int, int, int, int]:
        """``(B, Hq, Hkv, Lq, Lk, D, Dv)``."""
        shape: tuple[int, int, int, int, int, int, int] = self.__dict__["_shape"]  # set by __post_init__
        return shape

    @property
    def extent(self) -> Extent:
        """``Extent(B, Hq, Lq, Lk)``: the whole attention, as the mask and score-modifier block
        protocol takes it (:mod:`multihead.blocks`)."""
        extent: Extent | None = self.__dict__.get("_extent")  # made on first use: most calls never ask
        if extent is None:
            B, Hq, _, Lq, Lk, _, _ = self.shape
            extent = Extent(B, Hq, Lq, Lk)
            object.__setattr__(self, "_extent", extent)
        return extent

    @property
    def requires_grad(self) -> bool:
        """Whether a gradient will be asked of q, k, v or the modifier's tensors."""
        return torch.is_grad_enabled() and (
            any(t.requires_grad for t in (self.q, self.k, self.v))
            or (self.score_mod is not None and self.score_mod.requires_grad)
        )


def mask_and_score_mod(
    mask: object, score_mod: object, *, check_binary: bool = True, q_len: int | None = None, kv_len: int | None = None
) -> tuple[Mask | None, ScoreMod | None]:
    """``mask=``/``score_mod=`` as given by a user, as a boolean mask and one modifier, bound to
    the lengths ``Lq, Lk`` when given (:meth:`ScoreMod.for_lengths`: a relative bias aligns its
    positions as masks do).

    A float tensor passed as ``mask=`` (PyTorch's additive masks) becomes the bool mask of the
    entries it does not block (:func:`multihead.masks.additive_blocked`: ``-inf`` and values at or
    below ``finfo(dtype).min / 2``) and a :func:`multihead.scores.bias` applied before any other
    modifier. A float tensor of only 0s and 1s is refused (``check_binary``): adding 1 to some
    scores is never what ``torch.tril(torch.ones(L, L))`` meant.
    """
    score_mod = as_score_mod(score_mod)
    if score_mod is not None and q_len is not None and kv_len is not None:
        score_mod = score_mod.for_lengths(q_len, kv_len)
    if mask is not None and not isinstance(mask, (Mask, Tensor)):
        raise TypeError(f"mask must be a multihead mask, a bool or float tensor, or None; got {type(mask).__name__}")
    if isinstance(mask, Tensor) and mask.is_floating_point():
        if check_binary and not torch.compiler.is_compiling() and _is_zero_one(mask):
            raise ValueError(
                "mask is a float tensor of only 0s and 1s; float masks are additive, so this would add 1 to "
                "some scores instead of masking. Use `mask.bool()` if 1 means attend, `mask == 0` if 1 means "
                "blocked, or score_mod=multihead.scores.bias(tensor) if you really mean an additive bias"
            )
        if mask.dim() > 4 or mask.dim() < 2:
            raise ValueError(
                f"mask must have 2 to 4 dims broadcastable to (B, H, Lq, Lk), got shape {tuple(mask.shape)}"
            )
        additive = Bias(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)), name="mask")
        score_mod = additive if score_mod is None else Chain([additive, score_mod])
        return TensorMask(~additive_blocked(mask), name="mask"), score_mod
    return as_mask(mask), score_mod


def _is_zero_one(tensor: Tensor) -> bool:
    """Only 0s and 1s, with at least one of each (an all-0 or all-1 bias changes nothing)."""
    zeros, ones = tensor == 0, tensor == 1
    return bool((zeros | ones).all()) and bool(zeros.any()) and bool(ones.any())
