"""``ConcatKVCache``: a cache that grows by concatenation.

The simplest :class:`~multihead.caches.KVCache`: every update concatenates the new keys and
values after the stored ones, ``O(T)`` copying per step and no preallocation, no length limit.
Good for short sequences, tests and eager decoding; a preallocated cache keeps shapes fixed
for ``torch.compile`` instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.caches.base import KVCache, check_truncate, check_update

__all__ = ["ConcatKVCache"]


class ConcatKVCache(KVCache):
    """One layer's keys ``(B, Hkv, T, D)`` and values ``(B, Hkv, T, Dv)``, grown by ``torch.cat``.

    Empty when created; the first :meth:`update` fixes ``B, Hkv, D, Dv``, dtype and device until
    :meth:`reset`. The stored tensors are ``keys`` and ``values`` (``None`` while empty).

        cache = ConcatKVCache()
        k_all, v_all = cache.update(k, v)      # prefill: (B, Hkv, 5, D) -> (B, Hkv, 5, D)
        k_all, v_all = cache.update(k1, v1)    # one step: (B, Hkv, 1, D) -> (B, Hkv, 6, D)
        cache.length                           # 6
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # (B, Hkv, T, D)
        self.values: Tensor | None = None  # (B, Hkv, T, Dv)

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        check_update(type(self).__name__, k, v, self.keys, self.values)
        if self.keys is not None:
            k = torch.cat([self.keys, k], dim=2)  # (B, Hkv, T + Lnew, D)
            v = torch.cat([self.values, v], dim=2)  # (B, Hkv, T + Lnew, Dv)
        self.keys, self.values = k, v
        return k, v

    def truncate(self, length: int) -> None:
        length = check_truncate(type(self).__name__, length, self.length)
        if length == 0:
            self.reset()
        elif length < self.length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def reset(self) -> None:
        self.keys = self.values = None
