"""``CachePolicy``: which of the tokens a cache holds it keeps after an update.

A policy is an object passed to a cache (``DynamicKVCache(policy=...)``); the cache
(:class:`~multihead.caches.policies.PolicyKVCache`) stores, attends and evicts, and asks the
policy one question after each update: of the candidates (the tokens held before it and the new
ones), which does each KV head keep? The answer is a bool ``(B, H, S)`` over the candidates, so a
policy is a rule over positions and scores, nothing more::

    candidates   sinks | older tokens ......... | window | new
    keep          1 1  |  0 0 1 0 0 1 0 ...    |  1 1 1 |  1      (H2O: heavy hitters + recent)

What a policy may read (:class:`Candidates`): each candidate's absolute position (``EMPTY`` for a
hole left by ``crop``), the tokens seen, whether this update is the prompt, the attention mass
each candidate has accumulated from every query since it arrived (when the policy asks for it:
``accumulates``), and the attention mass of a range of the update's query rows (``mass``), both
recomputed a block of rows at a time from the queries (:func:`attention_mass`), never as dense
``L x L`` weights.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from multihead.caches.base import EMPTY_POSITION
from multihead.masks import Mask

__all__ = ["REFUSED_BY", "refuse_policy", "CachePolicy", "Candidates", "group_pool"]


class Candidates(NamedTuple):
    """What a policy sees after an update.

    ``positions (B, H, S)``: each candidate's absolute position, ascending per head, with
    :data:`~multihead.caches.base.EMPTY_POSITION` for a hole. ``length``: the tokens seen, this
    update's included. ``new``: the tokens this update brought (the last ``new`` candidates).
    ``prompt``: whether this is the first update of the sequence (the prefill);
    ``prompt_length``: the tokens that update brought.
    ``scores (B, H, S)``: the attention mass each candidate has accumulated (``None`` unless the
    policy ``accumulates``). ``mass(r0, r1) -> (B, Hq, S)``: the attention mass each candidate
    receives from the update's query rows ``[r0, r1)``, per query head (``None`` unless the policy
    ``needs_queries``). ``query_heads``: ``Hq``.
    """

    positions: Tensor
    length: int
    new: int
    prompt: bool
    prompt_length: int
    scores: Tensor | None
    mass: Callable[[int, int], Tensor] | None
    query_heads: int

    @property
    def valid(self) -> Tensor:
        """``(B, H, S)``: the candidates that hold a token."""
        return self.positions != EMPTY_POSITION


class CachePolicy(abc.ABC):
    """Which tokens a cache keeps. Subclasses answer :meth:`keep`; the flags say what they read."""

    #: Ranks keys by the attention the queries give them: the cache needs the queries
    #: (:meth:`~multihead.caches.KVCache.observe`, which a layer calls before each update).
    needs_queries: bool = False
    #: Needs each candidate's attention mass accumulated over every query since it arrived (H2O).
    accumulates: bool = False
    #: Each query head keeps its own tokens: the cache stores ``Hq`` heads instead of ``Hkv``.
    per_query_head: bool = False

    def policy_mask(self) -> Mask | None:
        """A mask at positions the cache adds to every call (``None``: the kept tokens are the
        attention's keys, nothing more)."""
        return None

    def hides_nothing(self, queries: Tensor, key_positions: Tensor) -> bool:
        """Whether :meth:`policy_mask` lets every query at ``queries (Lq,)`` (ascending) see every
        key at ``key_positions`` that causality lets it see."""
        return True

    @property
    def reassigns_positions(self) -> bool:
        """Whether positions are slots of the cache rather than of the sequence (StreamingLLM's
        treatment for rotary models)."""
        return False

    def rotate(self, keys: Tensor, delta: Tensor) -> Tensor:
        """``keys (B, H, S, D)`` moved by ``delta (S,)`` positions (a policy that reassigns
        positions with a rotary embedding); others never move keys."""
        return keys

    @abc.abstractmethod
    def keep(self, candidates: Candidates) -> Tensor:
        """A bool ``(B, H, S)``: the candidates each head keeps (a hole is never kept)."""

    @abc.abstractmethod
    def _describe(self) -> str: ...

    def __repr__(self) -> str:
        return self._describe()


def group_pool(scores: Tensor, heads: int) -> Tensor:
    """``(B, Hq, S)`` scores of query heads -> ``(B, heads, S)``: the mean over the query heads of
    each KV head's group (``heads = Hkv``, contiguous groups as :func:`~multihead.conventions.kv_head_of`),
    or the scores as they are (``heads = Hq``)."""
    B, Hq, S = scores.shape
    if heads == Hq:
        return scores
    return scores.view(B, heads, Hq // heads, S).mean(dim=2)


def top_by_score(scores: Tensor, eligible: Tensor, count: int) -> Tensor:
    """A bool ``(B, H, S)``: the ``count`` eligible entries of highest score per ``(B, H)`` (every
    eligible one when there are fewer); ties go to the earlier position."""
    if count <= 0:
        return torch.zeros_like(eligible)
    ranked = torch.where(eligible, scores.to(torch.float64), float("-inf"))
    S = ranked.shape[-1]
    # stable: among equal scores the earlier candidate ranks first
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., : min(count, S)]
    chosen = torch.zeros_like(eligible).scatter(-1, order, True)
    return chosen & eligible


def most_recent(positions: Tensor, valid: Tensor, count: int) -> Tensor:
    """A bool ``(B, H, S)``: the ``count`` valid candidates of highest position per ``(B, H)``."""
    return top_by_score(positions.to(torch.float64), valid, count)


#: The cache kinds an eviction policy does not compose with, and why (``docs/inference.md`` says
#: the same); each takes ``policy=`` only to refuse it with this reason.
REFUSED_BY = {
    "StaticKVCache": (
        "a static cache keeps fixed shapes (compiled steps never recompile) and one length per row, while a "
        "policy gives each KV head its own kept tokens, gathered into new tensors whenever it evicts, and rows "
        "of different lengths would evict at different steps"
    ),
    "PagedKVCache": (
        "a row's block table maps its positions to pages in order, one table for every KV head, while SnapKV "
        "and H2O keep different tokens per head and sinks + window would leave a hole in the table that reads "
        "cannot skip (freeing the window's pages as they slide out is not built)"
    ),
}


def refuse_policy(cache: str, policy: object) -> None:
    """Raise, with the reason, when a ``policy`` is given to a cache kind in :data:`REFUSED_BY`."""
    if policy is None:
        return
    raise TypeError(
        f"{cache}: policy={type(policy).__name__} is not supported: {REFUSED_BY[cache]}; use "
        f"DynamicKVCache(policy=...) (rows share one length), or SlidingWindowKVCache for a window with fixed shapes"
    )
