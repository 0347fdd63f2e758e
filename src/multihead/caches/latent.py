"""``LatentKVCache``: the cache of multi-head latent attention (MLA), one row per token.

An MLA layer (:class:`multihead.layers.latent.MultiHeadLatentAttention`) does not cache keys and
values per head. Per token it caches the normalised latent ``c_kv`` (``C = kv_lora_rank``
features) and the rotated rotary key ``k_rope`` (``R = qk_rope_head_dim`` features) that every
head shares, side by side in one row::

    one token:   | c_kv (C)                              | k_rope (R) |
    keys   (B, 1, T, C + R)  = the whole rows              (absorbed MLA: the MQA keys)
    values (B, 1, T, C)      = a view of the first C features (the MQA values: the latent itself)

so the latent is stored once and read as both. That is ``(C + R) · bytes`` per token and layer:
``576 · 2`` bytes in bf16 for DeepSeek-V2/V3 (``C = 512, R = 64``), against
``2 · Hkv · D · 2`` for a GQA layer (``4096`` bytes with ``Hkv = 8, D = 128``).

The interface is :class:`~multihead.caches.KVCache`'s, so the layer's masks and positions go
through :meth:`CacheRead.mask` as for every cache. ``update(k, v)`` takes the rows ``k`` and the
latent ``v``, which must be ``k[..., :Dv]`` (the layer passes that view; any other tensor is
compared with it and refused when it differs): only ``k`` is written. Storage grows like
:class:`~multihead.caches.DynamicKVCache`'s: slot ``j`` holds position ``j``, one length for every
row, buffers reallocated at twice the size when full.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.caches.base import CacheRead, KVCache, check_crop, check_indices, check_kv

__all__ = ["LatentKVCache"]


class LatentKVCache(KVCache):
    """One MLA layer's latent rows ``(B, Hkv, T, C + R)`` (``Hkv = 1`` for MLA), grown by doubling.

    Args:
        capacity: tokens allocated at the first update (at least the tokens it brings); later
            growth doubles it. Shapes, dtype and device come from the first update and hold until
            :meth:`reset`.

    ``keys`` are views of the filled rows, ``values`` (``latent``) of their first ``C``
    features, ``rope_keys`` of their last ``R`` (``None`` while empty)::

        cache = LatentKVCache()
        rows = torch.cat([c_kv, k_rope], -1)        # (B, 1, 5, C + R)
        read = cache.update(rows, rows[..., :C])    # read.keys (B, 1, 5, C + R), read.values (B, 1, 5, C)
        cache.nbytes                                # capacity · B · (C + R) · element size
    """

    def __init__(self, capacity: int = 256):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"LatentKVCache: capacity must be a positive int, got {capacity!r}")
        self.initial_capacity = capacity
        self._rows: Tensor | None = None  # (B, Hkv, capacity, C + R)
        self._latent_dim: int | None = None  # C
        self._length = 0
        self._undo: int | None = None  # the length before the last update

    # ------------------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return 0 if self._rows is None else self._rows.shape[2]

    @property
    def latent_dim(self) -> int | None:
        """``C``, the features of the latent (``Dv``); ``None`` while empty."""
        return self._latent_dim

    @property
    def keys(self) -> Tensor | None:
        """``(B, Hkv, T, C + R)``: latent and rotary key of each stored token."""
        return None if self._rows is None else self._rows[:, :, :self._length]

    @property
    def values(self) -> Tensor | None:
        """``(B, Hkv, T, C)``: the latent, a view of the first ``C`` features of :attr:`keys`."""
        return None if self._rows is None else self._rows[:, :, :self._length, :self._latent_dim]

    latent = values

    @property
    def rope_keys(self) -> Tensor | None:
        """``(B, Hkv, T, R)``: the rotated rotary key shared by the heads, a view."""
        return None if self._rows is None else self._rows[:, :, :self._length, self._latent_dim:]

    @property
    def nbytes(self) -> int:
        return 0 if self._rows is None else self._rows.numel() * self._rows.element_size()

    def bytes_per_token(self) -> int:
        """Bytes one stored token takes (every row of the batch): ``B · Hkv · (C + R) · element size``."""
        if self._rows is None:
            return 0
        B, Hkv, _, F = self._rows.shape
        return B * Hkv * F * self._rows.element_size()

    def next_positions(self, new: int, device=None) -> Tensor:
        return torch.arange(self._length, self._length + new, device=device)

    def slots(self, new: int) -> int:
        return self._length + new

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        """Store ``k (B, Hkv, Lnew, C + R)``, whose first ``C`` features ``v (B, Hkv, Lnew, C)`` are
        (``v`` is not stored: it is read back as a view of ``k``), and return every stored row."""
        name = type(self).__name__
        if self._rows is None:
            check_kv(name, k, v)
        else:
            B, Hkv, _, F = self._rows.shape
            check_kv(name, k, v, batch=B, heads=Hkv, head_dim=F, value_dim=self._latent_dim, dtype=self._rows.dtype,
                     device=self._rows.device, held=f"{self._length} tokens, rows {(B, Hkv, self._length, F)} with "
                                                   f"a latent of C={self._latent_dim}")
        _check_prefix(name, k, v)
        new = k.shape[2]
        query_positions = self.next_positions(new, k.device) if positions is None else positions
        end = self._length + new
        if self._rows is None or end > self.capacity:
            self._grow(k, max(end, 2 * self.capacity, self.initial_capacity))
        self._latent_dim = v.shape[3]
        self._rows[:, :, self._length:end] = k
        self._undo, self._length = self._length, end
        rows = self._rows[:, :, :end]  # (B, Hkv, S, C + R)
        return CacheRead(rows, rows[..., :self._latent_dim], query_positions)

    def _grow(self, k: Tensor, capacity: int) -> None:
        B, Hkv, _, F = k.shape
        rows = k.new_empty(B, Hkv, capacity, F)
        if self._rows is not None and self._length:
            rows[:, :, :self._length] = self._rows[:, :, :self._length]
        self._rows = rows

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        self._length, self._undo = self._undo, None

    def crop(self, length: int | Tensor) -> None:
        length = check_crop(type(self).__name__, length, None)
        if isinstance(length, Tensor):
            raise TypeError(f"{type(self).__name__}.crop: every row has the same length here, so length must be an "
                            f"int, got a tensor {tuple(length.shape)}")
        if length > self._length:
            raise ValueError(f"{type(self).__name__}.crop: length must be in [0, {self._length}] (the tokens "
                             f"stored), got {length}")
        self._length, self._undo = length, None

    def reorder(self, indices: Tensor) -> None:
        if self._rows is None:
            raise ValueError(f"{type(self).__name__}.reorder: the cache is empty; nothing to reorder")
        indices = check_indices(type(self).__name__, indices, self._rows.shape[0], self._rows.device)
        self._rows = self._rows.index_select(0, indices)
        self._undo = None

    def reset(self) -> None:
        self._rows, self._latent_dim = None, None
        self._length, self._undo = 0, None

    def __repr__(self) -> str:
        return (f"LatentKVCache(length={self._length}, capacity={self.capacity}, latent_dim={self._latent_dim}, "
                f"nbytes={self.nbytes})")


def _check_prefix(name: str, k: Tensor, v: Tensor) -> None:
    """``v`` must be ``k[..., :Dv]``: a view of it (free to check), or equal to it."""
    Dv = v.shape[3]
    if Dv > k.shape[3]:
        raise ValueError(f"{name}.update: v must be the first Dv features of k (the latent, stored once), so "
                         f"Dv <= D; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if v.data_ptr() == k.data_ptr() and v.stride() == k.stride():
        return
    if not torch.equal(v, k[..., :Dv]):
        raise ValueError(f"{name}.update: v must equal k[..., :{Dv}] (the latent, stored once and read back as a "
                         f"view of k), got a different tensor; hint: pass rows = cat([latent, k_rope], -1) and "
                         f"rows[..., :{Dv}]")
