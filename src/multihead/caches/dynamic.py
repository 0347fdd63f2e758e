"""``DynamicKVCache``: a cache that grows as tokens arrive, for eager decoding.

Keys and values live in buffers ``(B, Hkv, capacity, D)`` whose first ``length`` slots are filled,
slot ``j`` holding the token at call order ``j``. An update writes the new tokens after them and
returns views of the filled slots; when the buffers are full they are reallocated at twice the
size (amortised ``O(1)`` copying per token, not a ``torch.cat`` of everything per step). Every
row has the same length; :class:`~multihead.caches.StaticKVCache` holds rows of different lengths.
Slot ``j`` holds position ``j``: ``positions`` given to an update must continue the cache
(:func:`~multihead.caches.base.check_continuation`, as for every cache).
Under autograd (keys that require grad: backpropagating through cached steps) an update
concatenates instead, so that no step's saved keys are overwritten in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from multihead.caches.base import (
    CacheRead,
    KVCache,
    check_continuation,
    check_crop,
    check_indices,
    check_kv,
    check_kv_held,
    under_autograd,
)
from multihead.caches.policies.cache import PolicyKVCache

__all__ = ["DynamicKVCache"]

if TYPE_CHECKING:
    from multihead.caches.policies.base import CachePolicy


class DynamicKVCache(KVCache):
    """One layer's keys ``(B, Hkv, T, D)`` and values ``(B, Hkv, T, Dv)``, grown by doubling.

    Args:
        capacity: slots allocated at the first update (at least the tokens it brings); later
            growth doubles it. Shapes, dtype and device come from the first update and hold until
            :meth:`reset`.
        policy: an eviction policy (:mod:`multihead.caches.policies`: ``SinksAndWindow``,
            ``SnapKV``, ``H2O``); the cache built is then a
            :class:`~multihead.caches.policies.PolicyKVCache`, which keeps what the policy says.

    ``keys``/``values`` are views of the filled slots (``None`` while empty)::

        cache = DynamicKVCache()
        read = cache.update(k, v)     # prefill (B, Hkv, 5, D): read.keys (B, Hkv, 5, D)
        read = cache.update(k1, v1)   # one step (B, Hkv, 1, D): read.keys (B, Hkv, 6, D)
        cache.length                  # 6

    It keeps call order (:attr:`~multihead.caches.KVCache.places_by_position` is ``False``): a
    layer given ``positions=`` rotates by them (left-padded prompts, offsets) and stores in order.
    """

    places_by_position = False

    def __new__(cls, capacity: int = 256, *, policy: CachePolicy | None = None) -> DynamicKVCache:
        # With an eviction policy the cache keeps its own layout (per-head kept tokens): the
        # policy's cache is built instead (multihead.caches.policies.PolicyKVCache).
        if policy is not None and cls is DynamicKVCache:
            return PolicyKVCache(policy)  # type: ignore[return-value]  # the same KVCache interface
        return super().__new__(cls)

    def __init__(self, capacity: int = 256, *, policy: CachePolicy | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"DynamicKVCache: capacity must be a positive int, got {capacity!r}")
        self.initial_capacity = capacity
        self._k: Tensor | None = None  # (B, Hkv, capacity, D)
        self._v: Tensor | None = None  # (B, Hkv, capacity, Dv)
        self._length = 0
        self._undo: int | None = None  # the length before the last update
        self._revision = 0  # bumped when held slots may hold other tokens (reorder, reset)

    # ------------------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Tokens seen, the same in every row (a host int: no synchronisation)."""
        return self._length

    @property
    def lengths(self) -> Tensor:
        """``(B,)``: :attr:`length` in every row, on the keys' device (a fill: no synchronisation);
        ``(0,)`` on the CPU while empty (the batch comes with the first update)."""
        if self._k is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.full((self._k.shape[0],), self._length, dtype=torch.int64, device=self._k.device)

    @property
    def revision(self) -> int:
        """A count that changes whenever the slots below :attr:`length` may hold other tokens than
        before: :meth:`reorder` (rows moved) and :meth:`reset`. An update, :meth:`crop` and
        :meth:`rollback` only append or shorten, so what is derived from the first ``n`` slots
        (NSA's compressed blocks) stays valid for those slots while this is unchanged."""
        return self._revision

    @property
    def capacity(self) -> int:
        """Slots allocated (grows by doubling); 0 before the first update."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def keys(self) -> Tensor | None:
        """The cached keys ``(B, Hkv, length, D)``, or ``None`` before the first update."""
        return None if self._k is None else self._k[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        """The cached values ``(B, Hkv, length, Dv)``, or ``None`` before the first update."""
        return None if self._k is None else self._values(self._length)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._k, self._v) if t is not None)

    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        return torch.arange(self._length, self._length + new, device=device)

    def slots(self, new: int) -> int:
        return self._length + new

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        self._check_update(k, v, positions)
        new = k.shape[2]
        query_positions = self.next_positions(new, k.device)  # what positions, when given, equal
        end = self._length + new
        if under_autograd(k, v, *(t for t in (self._k, self._v) if t is not None)):
            # Under autograd an earlier step's keys are saved for backward: never write into them in
            # place (not even under no_grad, while they belong to a graph); concatenate (the graph
            # keeps what each step read).
            old_k = self._k[:, :, : self._length] if self._k is not None else k[:, :, :0]
            self._k = torch.cat([old_k, k], dim=2)
            if self._separate_values:
                old_v = self._v[:, :, : self._length] if self._v is not None else v[:, :, :0]
                self._v = torch.cat([old_v, v], dim=2)
        else:
            if self._k is None or end > self.capacity:
                self._grow(k, v, max(end, 2 * self.capacity, self.initial_capacity))
            assert self._k is not None  # grown above
            self._k[:, :, self._length : end] = k
            if self._separate_values:
                assert self._v is not None
                self._v[:, :, self._length : end] = v
        self._undo, self._length = self._length, end
        return CacheRead(self._k[:, :, :end], self._values(end), query_positions)

    # Values are stored in their own buffer here; a subclass whose values are the first ``Dv``
    # features of the keys (:class:`~multihead.caches.LatentKVCache`) sets this to False and reads
    # them back through :meth:`_values`.
    _separate_values = True

    def _values(self, end: int) -> Tensor:
        """``(B, Hkv, end, Dv)``: the values of the first ``end`` slots."""
        assert self._v is not None  # read once something is stored
        return self._v[:, :, :end]

    def _check_update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        """Refuse keys/values the cache could not store and positions that do not continue it
        (slot ``j`` holds position ``j``), before anything changes."""
        name = type(self).__name__
        if self._k is None:
            check_kv(name, k, v, sized_by_updates=True)
        else:
            B, Hkv, _, D = self._k.shape
            held = f"{self._length} tokens, k {(B, Hkv, self._length, D)}"
            check_kv_held(name, k, v, self._k, self._values(0), held=held, sized_by_updates=True)
        if positions is not None:
            check_continuation(name, positions, self.next_positions(k.shape[2], k.device), k.shape[0])

    def _grow(self, k: Tensor, v: Tensor, capacity: int) -> None:
        B, Hkv, _, D = k.shape
        new_k = k.new_empty(B, Hkv, capacity, D)
        if self._k is not None and self._length:
            new_k[:, :, : self._length] = self._k[:, :, : self._length]
        if self._separate_values:
            new_v = v.new_empty(B, Hkv, capacity, v.shape[3])
            if self._v is not None and self._length:
                new_v[:, :, : self._length] = self._v[:, :, : self._length]
            self._v = new_v
        self._k = new_k

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        self._length, self._undo = self._undo, None

    def crop(self, length: int | Tensor) -> None:
        length = check_crop(type(self).__name__, length, None, per_row=False)
        assert isinstance(length, int)  # per_row=False refuses tensors
        self._length, self._undo = min(length, self._length), None  # row[:length]: fewer tokens stay

    def reorder(self, indices: Tensor) -> None:
        """Row ``i`` becomes the old row ``indices[i]``; the batch becomes ``len(indices)``."""
        if self._k is None:
            raise ValueError(f"{type(self).__name__}.reorder: the cache is empty; nothing to reorder")
        indices = check_indices(type(self).__name__, indices, self._k.shape[0], self._k.device)
        self._k = self._k.index_select(0, indices)
        if self._separate_values and self._v is not None:
            self._v = self._v.index_select(0, indices)
        self._undo, self._revision = None, self._revision + 1

    def reset(self) -> None:
        self._k = self._v = None
        self._length, self._undo, self._revision = 0, None, self._revision + 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self._length}, capacity={self.capacity}, nbytes={self.nbytes})"
