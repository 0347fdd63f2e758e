"""``SnapKV``: at the prefill, each head keeps the prompt tokens its last queries attend to most.

Li et al. (2024): the attention of the prompt's last ``window`` queries (the observation window)
predicts which keys generation will read. After the prompt is attended in full, each head

1. sums the softmax weights of the observation window's rows over the keys before the window
   (:func:`~multihead.caches.policies.mass.attention_mass`, a block of rows at a time);
2. pools them over neighbouring keys (``pooling`` ``"avg"`` or ``"max"``, odd ``kernel``, stride 1,
   zero (avg) or ``-inf`` (max) padding of ``kernel // 2``; an average counts the padding, as
   ``avg_pool1d`` does), so a selected token brings its neighbours;
3. keeps the ``budget - window`` keys of highest pooled score, plus the whole window.

GQA (``selection="kv_group"``): a KV head keeps one set for its group, ranked by the mean of the
group's pooled scores (each query head's weights are normalised over its own row first, so every
head counts alike). ``selection="head"``: each query head keeps its own set, and the cache stores
``Hq`` heads from then on (the GQA saving is given up for the finer selection). Generated tokens
are all kept; only the prompt is compressed, once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.caches.policies.base import CachePolicy, Candidates, group_pool, top_by_score
from multihead.caches.policies.budget import check_budget, kept_of

__all__ = ["SnapKV"]

_SELECTIONS = ("kv_group", "head")


class SnapKV(CachePolicy):
    """Compress the prompt at prefill: each head keeps what the observation window reads most.

    Args:
        budget: prompt tokens kept per head, the window included; or
        compression_ratio: the share of the prompt removed (kvpress's knob: 0.75 keeps a quarter).
        window: observation window, the prompt's last queries (SnapKV's default 32).
        kernel: pooling width, odd (default 5); ``pooling``: ``"avg"`` (default) or ``"max"``.
        selection: ``"kv_group"`` (default) or ``"head"`` (module docstring).
    """

    needs_queries = True

    def __init__(
        self,
        budget: int | None = None,
        *,
        compression_ratio: float | None = None,
        window: int = 32,
        kernel: int = 5,
        pooling: str = "avg",
        selection: str = "kv_group",
    ):
        check_budget("SnapKV", budget, compression_ratio)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SnapKV: window must be an int >= 1 (the prompt's last queries), got {window!r}")
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"SnapKV: kernel must be an odd int >= 1 (pooling over both neighbours), got {kernel!r}")
        if pooling not in ("avg", "max"):
            raise ValueError(f"SnapKV: pooling must be 'avg' or 'max', got {pooling!r}")
        if selection not in _SELECTIONS:
            raise ValueError(f"SnapKV: selection must be one of {_SELECTIONS}, got {selection!r}")
        self.budget, self.compression_ratio = budget, compression_ratio
        self.window, self.kernel, self.pooling, self.selection = window, kernel, pooling, selection

    @property
    def per_query_head(self) -> bool:  # type: ignore[override]  # a property over the class flag
        return self.selection == "head"

    def keep(self, candidates: Candidates) -> Tensor:
        valid = candidates.valid
        L = candidates.prompt_length
        kept = kept_of(L, self.budget, self.compression_ratio)
        if not candidates.prompt or int(valid.sum(-1).max()) <= kept:
            return valid  # generated tokens, or a prompt within the budget: everything stays
        assert candidates.mass is not None  # needs_queries: the cache passes the mass
        window = min(self.window, L, kept)
        S = candidates.positions.shape[-1]
        prefix = S - window  # candidates before the window: the prompt is the whole cache here
        mass = candidates.mass(L - window, L)[..., :prefix]  # (B, Hq, prefix): the window's votes
        pooled = _pool(mass, self.kernel, self.pooling)
        heads = candidates.positions.shape[1]
        scores = group_pool(pooled, heads)  # (B, H, prefix)
        keep = torch.zeros_like(valid)
        keep[..., prefix:] = True
        keep[..., :prefix] = top_by_score(scores, valid[..., :prefix], kept - window)
        return keep & valid

    def _describe(self) -> str:
        knob = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
        return (
            f"SnapKV({knob}, window={self.window}, kernel={self.kernel}, pooling={self.pooling!r}, "
            f"selection={self.selection!r})"
        )


def _pool(scores: Tensor, kernel: int, pooling: str) -> Tensor:
    """``(B, H, S)`` pooled over ``kernel`` neighbours, stride 1, same length."""
    if kernel == 1:
        return scores
    B, H, S = scores.shape
    flat = scores.reshape(B * H, 1, S)
    if pooling == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    else:
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out.view(B, H, S)
