"""What every attention layer does around its projections, written once.

A layer call, in the notation of :mod:`multihead.conventions` (``H`` the query heads)::

    check the call          check_backend, check_rope, check_cache, check_weights_selection
    positions (Lq,)|(B, Lq) resolve_positions: given (checked), else after the cached tokens,
                            else arange(Lq)
    mask over (Lq, Lk)      CallMasks.over_keys: the call's mask checked, & causal()
    q, k = rope(·, pos)     rotate: refuses a result of another shape
    cached?                 attend_cached: store k, v -> CacheRead, mask over its S slots
                            (CallMasks.over_slots), attend; a call that raises leaves the
                            cache as it was (rollback)

:class:`~multihead.layers.MultiHeadAttention` and
:class:`~multihead.layers.MultiHeadLatentAttention` differ only in what they project and how
they attend; both run these steps through this module, so a step's rules and its error messages
are the same on both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from multihead.backends.registry import check_backend_name
from multihead.blocks import Extent
from multihead.caches import CacheRead, KVCache
from multihead.caches.base import check_mask_parts
from multihead.call import Selection, mask_and_score_mod
from multihead.layers.checks import check_positions
from multihead.masks import Mask, holds_tree
from multihead.masks import causal as causal_mask
from multihead.memo import BoundedCache
from multihead.scores import ScoreMod
from multihead.scores.user import UserScoreMod

__all__ = [
    "CallMasks",
    "attend_cached",
    "check_backend",
    "check_cache",
    "check_rope",
    "check_weights_selection",
    "resolve_positions",
    "rotate",
]

_R = TypeVar("_R")


class CallMasks:
    """The masks of a layer's calls: the call's mask checked against ``(B, H, Lq, Lk)`` before
    any work, ``& causal()`` when the layer is causal (bottom-right; at absolute positions with a
    cache). A float mask is split into what it blocks and a bias, as :func:`multihead.attention`
    splits it.

    ``mask & causal()`` is built once per distinct mask value (masks hash by value) and reused,
    so backends' plan caches see the same mask object on every call.
    """

    __slots__ = ("causal", "heads", "layer", "_causal", "_combined")

    def __init__(self, layer: str, heads: int, causal: bool):
        self.layer, self.heads, self.causal = layer, heads, causal
        # Masks are immutable, so the causal mask is built once (no object creation per call,
        # nothing for torch.compile to trace).
        self._causal = causal_mask() if causal else None
        self._combined: BoundedCache[Mask, Mask] = BoundedCache(
            8
        )  # call mask -> & causal(), by value; a handful per layer

    def over_keys(
        self, mask: object, score_mod: object, B: int, Lq: int, Lk: int
    ) -> tuple[Mask | None, ScoreMod | None]:
        """The call's mask (and score modifier) over ``Lk`` keys, ``& causal()``."""
        mask, score_mod = mask_and_score_mod(mask, score_mod, q_len=Lq, kv_len=Lk)
        if mask is not None:
            if "custom" in mask.kinds():  # a block_select with one row per KV head: bound to Hq
                mask = mask.for_heads(self.heads)
            mask.check(Extent(B, self.heads, Lq, Lk))
        if score_mod is not None:
            score_mod.check(Extent(B, self.heads, Lq, Lk))
        causal = self._causal
        if causal is None:
            return mask, score_mod
        if mask is None:
            return causal, score_mod
        if torch.compiler.is_compiling():  # traced once; a Python dict lookup would break the graph
            return mask & causal, score_mod
        combined = self._combined.get(mask)
        if combined is None:
            combined = mask & causal
            self._combined.put(mask, combined)
        return combined, score_mod

    def over_slots(
        self, read: CacheRead, mask: object, score_mod: object, B: int, Lq: int
    ) -> tuple[Mask | Tensor | None, ScoreMod | None]:
        """The call's mask and modifiers over the ``S`` slots a cache returned
        (:meth:`CacheRead.mask`): mask objects at absolute positions, tensors over the
        ``(Lq, S)`` slots, ``causal`` as "keys at positions up to the query's"."""
        mask, score_mod = self._over(mask, score_mod, B, Lq, read.slots)
        if score_mod is not None:
            if not read.contiguous and any(
                m.relative or isinstance(m, UserScoreMod) for m in getattr(score_mod, "mods", [score_mod])
            ):
                raise ValueError(
                    f"{self.layer}: score_mod {score_mod._describe()} reads query and key "
                    f"indices, which this cache's slots (not in position order, or rows of different "
                    f"lengths) do not give as positions; hint: use DynamicKVCache with it"
                )
        return read.mask(mask, self.causal, self.heads), score_mod

    def over_slots_fit(self, mask: object, score_mod: object, B: int, Lq: int, S: int) -> None:
        """Refuse a mask or modifier that does not fit ``S`` slots (a tensor over other columns):
        :func:`attend_cached` asks with ``S = kv_cache.slots(Lq)`` before the update, since a
        rollback after it restores what reads see but not the slots written past the lengths."""
        if mask is not None or score_mod is not None:
            self._over(mask, score_mod, B, Lq, S)

    def _over(self, mask: object, score_mod: object, B: int, Lq: int, S: int) -> tuple[Mask | None, ScoreMod | None]:
        """The call's mask and modifiers read over ``S`` slots, checked part by part."""
        mask, score_mod = mask_and_score_mod(mask, score_mod, q_len=Lq, kv_len=S)
        if mask is not None:
            check_mask_parts(self.layer, mask, B, self.heads, Lq, S)  # tensors over the slots
        if score_mod is not None:
            score_mod.check(Extent(B, self.heads, Lq, S))
        return mask, score_mod


def resolve_positions(
    layer: str,
    positions: Tensor | None,
    kv_cache: KVCache | None,
    B: int,
    Lq: int,
    device: torch.device,
    default: Callable[[int, torch.device], Tensor | None] | None,
) -> Tensor | None:
    """The absolute positions of the ``Lq`` query tokens, ``(Lq,)`` or ``(B, Lq)`` int64: as given
    (checked), else ``kv_cache.next_positions`` (each row continues after its own cached tokens),
    else ``default(Lq, device)`` (``None``: the layer needs none)."""
    if positions is not None:
        return check_positions(layer, positions, B, Lq, device)
    if kv_cache is not None:
        following = kv_cache.next_positions(Lq, device)  # (Lq,) or (B, Lq): after the cached tokens
        if following.dim() == 2 and following.shape[0] != B:  # else the rotary embedding refuses them, unclearly
            raise ValueError(
                f"{layer}: the query has B={B} rows but kv_cache holds {following.shape[0]} "
                f"({type(kv_cache).__name__}, one row per sequence); hint: use one cache per batch of "
                f"sequences, reorder(indices) it to the new rows (beam search), or reset() it"
            )
        return following
    return None if default is None else default(Lq, device)


def arange_positions(L: int, device: torch.device) -> Tensor:
    """``(L,)``: the positions of a sequence that starts at 0."""
    return torch.arange(L, device=device)


def rotate(layer: str, rope: Callable[[Tensor, Tensor], Tensor], x: Tensor, positions: Tensor, what: str) -> Tensor:
    """``rope(x, positions)``, refusing a result of another shape than ``x``; ``what`` names ``x``
    in the message (``"query heads (B, H, L, D)"``)."""
    rotated = rope(x, positions)
    if not isinstance(rotated, Tensor) or rotated.shape != x.shape:
        got = tuple(rotated.shape) if isinstance(rotated, Tensor) else type(rotated).__name__
        raise ValueError(
            f"{layer}: rope must return a tensor of the shape it was given; for the "
            f"{what} = {tuple(x.shape)} it returned {got}"
        )
    return rotated


def attend_cached(
    kv_cache: KVCache,
    k: Tensor,
    v: Tensor,
    attend: Callable[[CacheRead], _R],
    *,
    positions: Tensor | None,
    given: bool,
    mask: object,
    causal: bool,
    keep: bool = True,
    queries: Tensor | None = None,
    fits: Callable[[int], None] | None = None,
    owner: object = None,
) -> _R:
    """``attend(kv_cache.update(k, v))``: the new keys ``k (B, Hkv, Lq, D)`` and values stored,
    then attention over every slot the cache returns.

    Refused before anything is stored: a ``mask`` reaching keys the cache no longer holds
    (:meth:`~multihead.caches.KVCache.check_mask`), and positions the cache cannot store. A cache
    that places tokens by position stores them at ``positions`` when they were ``given``; a
    call-order cache (and any cache, for positions it chose itself) stores them in call order, and
    the positions only rotate; so does a call whose mask holds a draft tree
    (:func:`~multihead.masks.tree`). A call that raises after the update leaves the cache as it was
    (:meth:`~multihead.caches.KVCache.rollback`, then the record of the update before is handed
    back: :meth:`~multihead.caches.KVCache.undo_record`); so does one with ``keep=False`` (``explain``).
    ``queries`` (rotated, ``(B, Hq, Lq, D)``) go to :meth:`~multihead.caches.KVCache.observe` first.
    ``owner`` (the layer) is refused while the cache holds another layer's tokens
    (:meth:`~multihead.caches.KVCache.check_owner`) and claims it after an update it keeps.
    ``fits(S)`` refuses the call's mask if it cannot fit the ``S = kv_cache.slots(Lq)`` slots the
    update will return (:meth:`CallMasks.over_slots_fit`)."""
    if owner is not None:
        kv_cache.check_owner(owner, type(owner).__name__)
    kv_cache.check_mask(mask, causal, k.shape[2])
    if fits is not None:
        fits(kv_cache.slots(k.shape[2]))
    if queries is not None:  # an eviction policy ranks keys by the attention they receive
        kv_cache.observe(queries)
    # A draft tree's tokens go to the slots after the cached ones, whatever their positions: those
    # (P + depth, the positions they keep if accepted) only rotate them (masks.tree).
    placed = given and kv_cache.places_by_position and not holds_tree(mask)
    record = kv_cache.undo_record()  # the last update's, restored after a rollback of this one

    def withdraw() -> None:  # the queries observed were for this update only (a rollback brings them back)
        if queries is not None:
            kv_cache.observe(None)

    try:
        read = kv_cache.update(k, v, positions if placed else None)  # the cached keys and these, (B, Hkv, S, ·)
    except BaseException:  # refused before any change
        withdraw()
        raise
    try:
        result = attend(read)
    except BaseException:  # e.g. a forced backend that refuses: the cache is as it was
        kv_cache.rollback()
        kv_cache.restore_undo_record(record)
        withdraw()
        raise
    if not keep:
        kv_cache.rollback()
        kv_cache.restore_undo_record(record)
        withdraw()
    elif owner is not None:
        kv_cache.claim(owner)
    return result


# ---------------------------------------------------------------------------------- checks
def check_backend(layer: str, backend: object) -> str:
    """``"auto"`` or a registered backend name."""
    if not isinstance(backend, str):
        raise TypeError(f"{layer}: backend must be a str ('auto' or a registered name), got {type(backend).__name__}")
    check_backend_name(backend)
    return backend


def check_rope(layer: str, rope: object) -> None:
    """``None`` or a callable ``rope(x, positions) -> x``."""
    if rope is not None and not callable(rope):
        raise TypeError(
            f"{layer}: rope must be None or a callable rope(x, positions) -> x (usually an "
            f"nn.Module), got {type(rope).__name__} {rope!r}"
        )


def check_cache(layer: str, kv_cache: object, example: str) -> KVCache:
    """A :class:`~multihead.caches.KVCache`; ``example`` names the usual one (``"DynamicKVCache()"``)."""
    if not isinstance(kv_cache, KVCache):
        raise TypeError(
            f"{layer}: kv_cache must be None or a multihead.caches.KVCache (for example "
            f"{example}), got {type(kv_cache).__name__}"
        )
    return kv_cache


def check_weights_selection(layer: str, need_weights: bool, weights_heads: Selection, weights_rows: Selection) -> None:
    """``weights_heads``/``weights_rows`` only with ``need_weights=True``."""
    if (weights_heads is not None or weights_rows is not None) and not need_weights:
        raise ValueError(
            f"{layer}: weights_heads/weights_rows select which weights to return; they need "
            f"need_weights=True, got need_weights=False"
        )
