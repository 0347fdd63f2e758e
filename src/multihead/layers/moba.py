"""``MixtureOfBlockAttention``: MoBA (Lu et al., 2025, Moonshot), attention over gated key blocks.

Keys are cut into blocks of ``bs`` tokens. Each query token ``q`` (of head ``h``, reading KV head
``g(h)``) scores every block by the mean of its keys and reads its own block and the best others,
``top_k`` blocks in all, causally::

    s_j = q · mean(K_g(h)[j·bs : (j+1)·bs])        j a block that starts at or before q's position
    own block: always chosen (s = +inf);  later blocks: never (s = -inf)
    chosen = the top_k blocks by s_j (ties: the lower block number), fewer while fewer exist
    o = softmax(q Kᵀ / sqrt(D) over the keys of the chosen blocks, causal) V

The gate has no parameters and its choice is not differentiated (as in the paper): gradients flow
through the attention over the chosen keys. The choice is a mask,
:func:`multihead.masks.block_select` with one row per query token (``query_block_size=1``), joined
to the call's mask (``& causal()`` and whatever the call gives), so every backend and every mask
applies; the layer is a :class:`~multihead.layers.MultiHeadAttention` whose attention function
(:class:`MobaCore`) makes the choice first.

With a cache, a decode step scores the blocks of every cached token again (complete blocks score
as they did in the prefill; the query's own block is always chosen), so prefill + decode steps
equal the full forward. The key blocks are cut at the cache's slots, which are positions in a
``DynamicKVCache`` (the one cache the layer takes).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.attention import attention
from multihead.call import AttentionResult
from multihead.explain import Explanation, explain
from multihead.layers.checks import check_causal_variant, check_counts, check_position_cache
from multihead.layers.heads import Heads
from multihead.layers.multihead import MultiHeadAttention
from multihead.layers.ranking import best_first
from multihead.masks import Mask, block_select

__all__ = ["MixtureOfBlockAttention", "MobaCore"]

#: Most gate scores (query heads x queries x key blocks) ranked at once: a chunk of queries whose
#: scores and ranking keys stay a few MiB (the whole table is 50M scores at 16k tokens, blocks of 64).
CHUNK_SCORES = 1 << 20


class MixtureOfBlockAttention(MultiHeadAttention):
    """MoBA: each query reads its own key block and the ``top_k - 1`` best earlier ones.

    Args:
        d_model, num_heads: as :class:`~multihead.layers.MultiHeadAttention`.
        num_kv_heads: ``Hkv``; default ``num_heads``. The blocks of KV head ``g`` are scored by
            each of its query heads for itself.
        block_size: ``bs``, the keys of a block (the paper: 512 to 4096 for long contexts).
        top_k: the blocks each query reads, its own included (the paper: 3).
        **options: every other argument of :class:`~multihead.layers.MultiHeadAttention`
            (``rope``, ``backend``, ``dropout``, ...); ``causal`` is always ``True`` (the gate
            is causal), not ``attend`` or ``context_parallel``.

    ``need_weights`` returns the probabilities over every key (zero outside the chosen blocks).
    ``forward`` takes a :class:`~multihead.caches.DynamicKVCache` only.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        block_size: int = 64,
        top_k: int = 3,
        **options: Any,
    ):
        layer = type(self).__name__
        check_counts(layer, {"block_size": block_size, "top_k": top_k})
        check_causal_variant(layer, options, "MoBA's gate never reads a later block", "it attends without the gate")
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, causal=True, **options)
        self.block_size, self.top_k = block_size, top_k

    def forward(self, query: Tensor, *args: Any, kv_cache: Any = None, **kwargs: Any) -> Any:
        why = "its slots are positions, so key blocks are cut where they were in the prefill"
        check_position_cache(type(self).__name__, kv_cache, why)
        return super().forward(query, *args, kv_cache=kv_cache, **kwargs)

    def _heads(self, query: Tensor) -> Heads:
        return MobaCore(self.block_size, self.top_k), self.out_proj

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, top_k={self.top_k}"


MixtureOfBlockAttention.__init__.__doc__ = MixtureOfBlockAttention.__doc__


class MobaCore:
    """:func:`multihead.attention` behind MoBA's gate: ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
    ``v (B, Hkv, Lk, Dv)``; query ``i`` is at position ``Lk - Lq + i`` (bottom-right, as the
    layer's causal mask). The chosen blocks (:meth:`choose`) become a ``block_select`` mask
    joined to ``mask``; every other option is :func:`multihead.attention`'s."""

    def __init__(self, block_size: int, top_k: int):
        self.block_size, self.top_k = block_size, top_k

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, **options: Any
    ) -> Tensor | AttentionResult:
        result: Tensor | AttentionResult = attention(q, k, v, mask=self._mask(q, k, mask), **options)
        return result

    def explain(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, **options: Any
    ) -> Explanation:
        return explain(q, k, v, mask=self._mask(q, k, mask), **options)

    def choose(self, q: Tensor, k: Tensor) -> Tensor:
        """``(B, Hq, Lq, top_k)`` int64: the key blocks each query reads, best first, ``-1`` for
        none (a query with fewer earlier blocks)."""
        B, Hq, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        bs, nK = self.block_size, math.ceil(Lk / self.block_size)
        with torch.no_grad():  # the choice is not differentiated
            sums = F.pad(k, (0, 0, 0, nK * bs - Lk)).view(B, Hkv, nK, bs, D).sum(3)  # (B, Hkv, nK, D)
            counts = torch.full((nK,), bs, dtype=k.dtype, device=k.device)
            counts[-1] = Lk - (nK - 1) * bs  # the last block may be short
            means = sums / counts[:, None]
            G = Hq // Hkv
            block = torch.arange(nK, device=q.device)
            chosen = []
            step = max(1, CHUNK_SCORES // (Hq * nK))
            for a in range(0, Lq, step):  # a chunk of queries at a time: their scores stay in cache
                b = min(Lq, a + step)
                # (B, Hkv, G, C, D) @ (B, Hkv, 1, D, nK) -> (B, Hq, C, nK): each query head scores its KV head's blocks
                m = (b - 1 + Lk - Lq) // bs + 1  # blocks up to the chunk's last query's own: no later one is read
                qc = q[:, :, a:b].reshape(B, Hkv, G, b - a, D)
                scores = (qc @ means[:, :, None, :m].transpose(-1, -2)).view(B, Hq, b - a, m)
                own = (torch.arange(a, b, device=q.device) + (Lk - Lq)) // bs  # (C,) the block of each query
                scores = scores.masked_fill_(block[:m] > own[:, None], float("-inf"))
                scores = scores.masked_fill_(block[:m] == own[:, None], float("inf"))
                top = best_first(scores, self.top_k)  # ties to the lower block number
                chosen.append(F.pad(top, (0, min(self.top_k, nK) - top.shape[-1]), value=-1))
            return torch.cat(chosen, dim=2)

    def _mask(self, q: Tensor, k: Tensor, mask: Mask | Tensor | None) -> Mask:
        select = block_select(self.choose(q, k), self.block_size, query_block_size=1)
        return select if mask is None else select & mask

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, top_k={self.top_k})"
