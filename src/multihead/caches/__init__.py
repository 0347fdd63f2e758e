"""Key/value caches for step-by-step decoding, behind one interface.

A cache holds one attention layer's keys ``(B, Hkv, ·, D)`` and values ``(B, Hkv, ·, Dv)`` for
the tokens seen so far (notation of :mod:`multihead.conventions`), ``Hkv`` heads only: GQA and MQA
layers store ``Hq / Hkv`` times less. A layer hands it the new tokens' keys and values and attends
over what it returns::

    read = cache.update(k_new, v_new)      # (B, Hkv, Lnew, ·) in; read.keys (B, Hkv, S, ·) out
    mask = read.mask(call_mask, causal=True, heads=Hq)   # at absolute positions

* :class:`KVCache`: the interface :class:`multihead.MultiHeadAttention` uses through ``kv_cache=``;
  :class:`CacheRead`, what an update returns;
* :class:`DynamicKVCache`: grows as needed (eager decoding);
* :class:`StaticKVCache`: preallocated, one length per row, compiles without recompiling;
* :class:`SlidingWindowKVCache`: a ring buffer for ``sliding_window(window)`` attention;
* :class:`PagedKVCache`: pages from one pool addressed by block tables (serving);
* :class:`LatentKVCache`: one latent row per token for multi-head latent attention (MLA);
* :class:`QuantizedKVCache`: int8 or fp8 slots with scales, full-precision sinks and residual window.
* :class:`PrefixCache`: pages shared between requests (reference counts, copy-on-write, an index
  from token ids to pages, LRU eviction); :func:`prefix_attention` (cascade over the shared
  pages) and :func:`ragged_attention` (requests with their own query lengths, one call);
* :func:`commit_path`: speculative decoding, the accepted path of a verified draft tree kept;
* :mod:`~multihead.caches.policies`: eviction policies (``SinksAndWindow``, ``SnapKV``, ``H2O``),
  passed as ``DynamicKVCache(policy=...)``.

``docs/inference.md`` shows each in use.
"""

from multihead.caches import policies
from multihead.caches.base import CacheRead, KVCache
from multihead.caches.dynamic import DynamicKVCache
from multihead.caches.latent import LatentKVCache
from multihead.caches.paged import PagedKVCache
from multihead.caches.prefix import PrefixCache
from multihead.caches.quantized import QuantizedKVCache
from multihead.caches.ragged import prefix_attention, ragged_attention
from multihead.caches.sliding import SlidingWindowKVCache
from multihead.caches.speculative import commit_path
from multihead.caches.static import StaticKVCache

__all__ = [
    "KVCache",
    "CacheRead",
    "DynamicKVCache",
    "StaticKVCache",
    "SlidingWindowKVCache",
    "PagedKVCache",
    "LatentKVCache",
    "QuantizedKVCache",
    "policies",
    "PrefixCache",
    "ragged_attention",
    "prefix_attention",
    "commit_path",
]
