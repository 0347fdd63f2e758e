"""Key/value caches for step-by-step decoding, behind one interface.

A cache holds one attention layer's keys ``(B, Hkv, T, D)`` and values ``(B, Hkv, T, Dv)`` for
the ``T`` tokens seen so far (notation of :mod:`multihead.conventions`). A layer hands it the
keys and values of its new tokens and attends over everything it returns::

    k_all, v_all = cache.update(k_new, v_new)   # (B, Hkv, Lnew, ·) in, (B, Hkv, T + Lnew, ·) out

* :class:`KVCache`: the interface (``length``, ``update``, ``reset``) that
  :class:`multihead.MultiHeadAttention` uses through its ``kv_cache=`` argument;
* :class:`ConcatKVCache`: the simplest cache, grown by ``torch.cat``.

Static, sliding-window and paged caches implement the same interface.
"""

from multihead.caches.base import KVCache
from multihead.caches.concat import ConcatKVCache

__all__ = ["KVCache", "ConcatKVCache"]
