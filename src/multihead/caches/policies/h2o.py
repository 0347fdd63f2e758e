"""``H2O``: heavy hitters plus recent tokens, by attention accumulated while decoding.

Zhang et al. (2023): a few tokens collect most of the attention over a whole generation. Each
cached key accumulates the attention weight every query gives it (with GQA, the mean over the
query heads of its KV group); after each update a head keeps its ``recent`` most recent tokens and, of the rest,
the ``heavy`` of largest accumulated attention. With one new token per step this evicts exactly
one token, the paper's greedy rule::

    accumulated   .9  .1  .4  .05 .3 | .2  .1      heavy=2, recent=2
    keep           1   .   1   .   . |  1   1

The prompt is attended in full first; its weights (every prompt query's, causal, recomputed a
block of rows at a time) start the accumulation, and the cache is brought to the budget then.
"""

from __future__ import annotations

from torch import Tensor

from multihead.caches.policies.base import CachePolicy, Candidates, most_recent, top_by_score
from multihead.caches.policies.budget import check_budget, kept_of

__all__ = ["H2O"]


class H2O(CachePolicy):
    """Keep ``heavy`` heavy hitters and ``recent`` recent tokens per head (``budget = heavy + recent``).

    Args:
        heavy, recent: tokens kept by accumulated attention and by recency; or
        compression_ratio: the share of the prompt removed (kvpress's knob); the budget is then
            fixed at the prefill, ``int(prompt · (1 - ratio))``, split half heavy, half recent
            (the paper's equal shares), the recent half taking an odd token.
        selection: ``"kv_group"`` (default: one set per KV head, scores averaged over its group) or
            ``"head"`` (each query head its own set; the cache stores ``Hq`` heads).
    """

    needs_queries = True
    accumulates = True

    def __init__(
        self,
        heavy: int | None = None,
        recent: int | None = None,
        *,
        compression_ratio: float | None = None,
        selection: str = "kv_group",
    ):
        if compression_ratio is None:
            for name, value in (("heavy", heavy), ("recent", recent)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"H2O: {name} must be an int >= 0 (or pass compression_ratio= instead), got {value!r}"
                    )
            assert heavy is not None and recent is not None  # checked above
            if heavy + recent < 1:
                raise ValueError(f"H2O: heavy + recent must keep at least one token, got {heavy} + {recent}")
        else:
            if heavy is not None or recent is not None:
                raise ValueError("H2O: pass heavy and recent, or compression_ratio, not both")
            check_budget("H2O", None, compression_ratio)
        if selection not in ("kv_group", "head"):
            raise ValueError(f"H2O: selection must be 'kv_group' or 'head', got {selection!r}")
        self.heavy, self.recent, self.compression_ratio, self.selection = heavy, recent, compression_ratio, selection

    @property
    def per_query_head(self) -> bool:  # type: ignore[override]  # a property over the class flag
        return self.selection == "head"

    def shares(self, prompt: int) -> tuple[int, int]:
        """``(heavy, recent)`` for a sequence whose prompt has ``prompt`` tokens."""
        if self.heavy is not None and self.recent is not None:
            return self.heavy, self.recent
        kept = kept_of(prompt, None, self.compression_ratio)
        return kept // 2, kept - kept // 2

    def keep(self, candidates: Candidates) -> Tensor:
        heavy, recent = self.shares(candidates.prompt_length)
        valid = candidates.valid
        if int(valid.sum(-1).max()) <= heavy + recent:
            return valid
        assert candidates.scores is not None  # accumulates: the cache passes them
        recent_kept = most_recent(candidates.positions, valid, recent)
        return recent_kept | top_by_score(candidates.scores, valid & ~recent_kept, heavy)

    def _describe(self) -> str:
        knob = (
            f"heavy={self.heavy}, recent={self.recent}"
            if self.compression_ratio is None
            else f"compression_ratio={self.compression_ratio}"
        )
        return f"H2O({knob}, selection={self.selection!r})"
