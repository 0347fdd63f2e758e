"""KV-cache eviction policies: which tokens a cache keeps, as objects passed to it.

``DynamicKVCache(policy=...)`` gives a :class:`PolicyKVCache` that attends over what it holds
plus the new tokens, then keeps what the policy says::

    cache = mh.DynamicKVCache(policy=SinksAndWindow(sinks=4, window=1020))   # StreamingLLM
    cache = mh.DynamicKVCache(policy=SnapKV(compression_ratio=0.75))          # prompt at prefill
    cache = mh.DynamicKVCache(policy=H2O(heavy=64, recent=64))                # while decoding

* :class:`SinksAndWindow`: the first ``sinks`` tokens and the last ``window``, positions in the
  sequence or re-assigned in the cache;
* :class:`SnapKV`: at the prefill, each head (or KV group) keeps the prompt tokens its observation
  window attends to most, pooled over neighbours;
* :class:`H2O`: heavy hitters of accumulated attention plus recent tokens, while decoding;
* :class:`CachePolicy`: the interface (a bool of the candidates each head keeps).

``docs/inference.md`` ("Cache policies") has the design and the measured numbers.
"""

from multihead.caches.policies.base import CachePolicy, Candidates
from multihead.caches.policies.cache import PolicyKVCache
from multihead.caches.policies.h2o import H2O
from multihead.caches.policies.mass import attention_mass
from multihead.caches.policies.sinks_window import SinksAndWindow
from multihead.caches.policies.snapkv import SnapKV

__all__ = [
    "CachePolicy",
    "Candidates",
    "PolicyKVCache",
    "SinksAndWindow",
    "SnapKV",
    "H2O",
    "attention_mass",
]
