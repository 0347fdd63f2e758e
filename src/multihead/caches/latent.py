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
compared with it and refused when it differs): only ``k`` is written. It is a
:class:`~multihead.caches.DynamicKVCache` whose values are a view of its keys: growth, crop,
rollback, reorder and the autograd-safe update are that class's; slot ``j`` holds position ``j``,
so ``positions`` given to an update must continue the cache (checked as for every cache).
"""

from __future__ import annotations

from torch import Tensor

from multihead.caches.base import CacheRead, check_prefix
from multihead.caches.dynamic import DynamicKVCache

__all__ = ["LatentKVCache"]


class LatentKVCache(DynamicKVCache):
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

    _separate_values = False  # the values are the first C features of the keys

    def __init__(self, capacity: int = 256):
        super().__init__(capacity)
        self._latent_dim: int | None = None  # C

    @property
    def latent_dim(self) -> int | None:
        """``C``, the features of the latent (``Dv``); ``None`` while empty."""
        return self._latent_dim

    @property
    def keys(self) -> Tensor | None:
        """``(B, Hkv, T, C + R)``: latent and rotary key of each stored token."""
        return super().keys

    @property
    def values(self) -> Tensor | None:
        """``(B, Hkv, T, C)``: the latent, a view of the first ``C`` features of :attr:`keys`."""
        return super().values

    latent = values

    @property
    def rope_keys(self) -> Tensor | None:
        """``(B, Hkv, T, R)``: the rotated rotary key shared by the heads, a view."""
        return None if self._k is None else self._k[:, :, : self._length, self._latent_dim :]

    def bytes_per_token(self) -> int:
        """Bytes one stored token takes (every row of the batch): ``B · Hkv · (C + R) · element size``."""
        if self._k is None:
            return 0
        B, Hkv, _, F = self._k.shape
        return B * Hkv * F * self._k.element_size()

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        """Store ``k (B, Hkv, Lnew, C + R)``, whose first ``C`` features ``v (B, Hkv, Lnew, C)`` are
        (``v`` is not stored: it is read back as a view of ``k``), and return every stored row."""
        return super().update(k, v, positions)

    def _values(self, end: int) -> Tensor:
        assert self._k is not None  # read once something is stored
        return self._k[:, :, :end, : self._latent_dim if self._latent_dim is not None else 0]

    def _check_update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        super()._check_update(k, v, positions)  # shapes and positions, as for every cache
        check_prefix(type(self).__name__, k, v)
        if self._latent_dim is None:  # every check passed: the first update fixes C; _values reads it
            self._latent_dim = v.shape[3]

    def reset(self) -> None:
        super().reset()
        self._latent_dim = None

    def __repr__(self) -> str:
        return (
            f"LatentKVCache(length={self._length}, capacity={self.capacity}, latent_dim={self._latent_dim}, "
            f"nbytes={self.nbytes})"
        )
