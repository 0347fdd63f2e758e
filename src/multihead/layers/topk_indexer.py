"""``TopKIndexerAttention``: DeepSeek-V3.2's sparse attention (DSA), a lightning indexer choosing
the ``top_k`` keys of each query.

Per query token ``t`` (position ``p``) with the layer input ``x``, ``H_I`` indexer heads of
``d_I`` features::

    q_I[t, j] = x_t W_Q^j          (d_I,)  per indexer head j
    k_I[s]    = x_s W_K            (d_I,)  one key per token, shared by the indexer heads
    w[t, j]   = x_t W_w            (H_I,)
    I(t, s)   = Σ_j w[t, j] · ReLU(q_I[t, j] · k_I[s])          for s <= p (causal)
    S_t       = the top_k keys by I(t, s) (ties: the lower position), all of them while p < top_k
    o_t       = softmax(q_t Kᵀ / sqrt(D) over S_t) V              every head reads the same S_t

The selection is not differentiated: the main loss trains the attention (q, k, v, out) and not
the indexer, which the paper trains with a KL loss toward the main attention
(:meth:`TopKIndexerAttention.indexer_loss`): the target is the main attention's probabilities
summed over the heads and renormalised, over the selected keys; the indexer's input is detached
from the rest of the model (as the paper does), so the loss trains the indexer alone.

The choice is a token-level :func:`~multihead.masks.block_select` (blocks of one key, one row per
query token, one row for every head). A plain call (``backend="auto"``, no weights, no score
modifier) runs it a chunk of queries at a time against the keys they chose together
(:func:`~multihead.layers.token_selection.token_selected_attention`: no copy of each query's keys);
weights, a named backend or a score modifier run the mask on ``blocksparse``'s gathered path
(each query's ``top_k`` keys copied beside it). With a :class:`~multihead.caches.DynamicKVCache` the indexer keys of the
cached tokens are kept beside the cache (by the cache object, weakly) and extended by each call's
new tokens (the cache's last ``Lq`` slots), so prefill + decode steps equal the full forward. The
paper's indexer also rotates part of ``q_I``/``k_I`` and runs in FP8; here it is unrotated and in
the layer's dtype (docs/variants.md).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import attention
from multihead.blocks import Block, Extent
from multihead.caches import DynamicKVCache
from multihead.call import AttentionResult
from multihead.explain import Explanation, explain
from multihead.layers import token_selection
from multihead.layers.checks import check_causal_variant, check_counts, check_position_cache, check_self_attention
from multihead.layers.heads import Heads
from multihead.layers.multihead import MultiHeadAttention
from multihead.layers.ranking import best_first
from multihead.layers.token_selection import token_selected_attention
from multihead.masks import Mask, as_mask, block_select, causal

__all__ = ["TopKIndexerAttention", "IndexerCore"]


class TopKIndexerAttention(MultiHeadAttention):
    """Each query reads its ``top_k`` keys by a light indexer's score (DSA).

    Args:
        d_model, num_heads: as :class:`~multihead.layers.MultiHeadAttention`.
        num_kv_heads: ``Hkv``; default ``num_heads``.
        top_k: keys per query (the paper: 2048).
        index_heads: ``H_I``, the indexer's heads (the paper: 64).
        index_dim: ``d_I``, their features (the paper: 128).
        **options: every other argument of :class:`~multihead.layers.MultiHeadAttention`
            (``rope``, ``backend``, ...); ``causal`` is always ``True``; not ``attend`` or
            ``context_parallel``.

    ``forward(x, *, mask=None, positions=None, kv_cache=None, need_weights=False)``: self-attention,
    causal, ``kv_cache`` a :class:`~multihead.caches.DynamicKVCache`; ``need_weights`` gives the
    probabilities over every key (zero outside the selected ones). ``mask`` (padding, documents,
    windows: the same for every head) is joined to the causal one before the choice: the indexer
    never picks a key the mask blocks, so each query reads its ``top_k`` best visible keys.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        top_k: int = 2048,
        index_heads: int = 4,
        index_dim: int = 32,
        **options: Any,
    ):
        layer = type(self).__name__
        check_counts(layer, {"top_k": top_k, "index_heads": index_heads, "index_dim": index_dim})
        check_causal_variant(layer, options, "the indexer never reads a later key", "it attends in one call")
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, causal=True, **options)
        self.top_k, self.index_heads, self.index_dim = top_k, index_heads, index_dim
        weight = self.q_proj.weight
        device, dtype = weight.device, weight.dtype
        self.index_q = nn.Linear(d_model, index_heads * index_dim, bias=False, device=device, dtype=dtype)
        self.index_k = nn.Linear(d_model, index_dim, bias=False, device=device, dtype=dtype)
        self.index_w = nn.Linear(d_model, index_heads, bias=False, device=device, dtype=dtype)
        # per cache: the indexer keys of its tokens and the cache's revision and index_k's weight when
        # they were computed (a reorder moves rows under them; an optimizer step changes index_k)
        self._keys: weakref.WeakKeyDictionary[DynamicKVCache, tuple[Tensor, tuple[int, ...]]] = (
            weakref.WeakKeyDictionary()
        )
        self._cache: DynamicKVCache | None = None

    def forward(self, query: Tensor, *args: Any, kv_cache: Any = None, **kwargs: Any) -> Any:
        layer = type(self).__name__
        check_position_cache(layer, kv_cache, "its slots are positions")
        check_self_attention(layer, args, {**kwargs, "mask": None}, "the selection is causal by construction")
        self._cache = kv_cache
        try:
            return super().forward(query, kv_cache=kv_cache, **kwargs)
        finally:
            self._cache = None

    def _heads(self, query: Tensor) -> Heads:
        x = query if self.batch_first else query.transpose(0, 1)  # (B, Lq, E)
        return IndexerCore(self, x, self._cache), self.out_proj

    def index_scores(self, x: Tensor, keys: Tensor) -> Tensor:
        """``I (B, Lq, Lk)`` of the queries ``x (B, Lq, E)`` against indexer keys ``(B, Lk, d_I)``."""
        q = self.index_q(x).unflatten(-1, (self.index_heads, self.index_dim))  # (B, Lq, H_I, d_I)
        w = self.index_w(x)  # (B, Lq, H_I)
        dots = F.relu(torch.einsum("bqjd,bkd->bqjk", q, keys))  # (B, Lq, H_I, Lk)
        return torch.einsum("bqj,bqjk->bqk", w, dots)

    def indexer_loss(self, x: Tensor, *, positions: Tensor | None = None) -> Tensor:
        """The indexer's training loss on ``x (B, L, E)`` (batch first): the mean over tokens of
        ``KL(p_main ‖ softmax(I over S_t))``, ``p_main`` the main attention's probabilities
        summed over heads and renormalised on the selected keys ``S_t`` (no gradient), ``I`` on
        the detached input. Gradients reach ``index_q``, ``index_k``, ``index_w`` only."""
        x = x.detach()
        with torch.no_grad():
            inputs = x if self.batch_first else x.transpose(0, 1)
            _, weights = self(inputs, positions=positions, need_weights=True)  # (B, Hq, L, L)
            target = weights.sum(1)
            target = target / target.sum(-1, keepdim=True).clamp_min(torch.finfo(target.dtype).tiny)
        scores = self.index_scores(x, self.index_k(x))  # (B, L, L)
        chosen = target > 0  # the selected keys the main attention weighs
        logp = torch.log_softmax(scores.masked_fill(~chosen, float("-inf")), dim=-1)
        kl = torch.where(chosen, target * (torch.log(target.clamp_min(1e-30)) - logp), 0.0).sum(-1)
        return kl.mean()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, index_heads={self.index_heads}, index_dim={self.index_dim}"


TopKIndexerAttention.__init__.__doc__ = TopKIndexerAttention.__doc__


class IndexerCore:
    """:func:`multihead.attention` over each query's ``top_k`` keys by the indexer: ``q (B, Hq, Lq,
    D)``, ``k``, ``v (B, Hkv, Lk, D)``, query ``i`` at position ``Lk - Lq + i``; ``x (B, Lq, E)``
    the new tokens' layer input."""

    def __init__(self, layer: TopKIndexerAttention, x: Tensor, cache: DynamicKVCache | None):
        self.layer, self.x, self.cache = layer, x, cache

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, **options: Any
    ) -> Tensor | AttentionResult:
        Lq, Lk, mask = q.shape[2], k.shape[2], as_mask(mask)
        plain = options.get("backend", "auto") == "auto" and options.get("score_mod") is None
        # under torch.compile the mask (its one graph break is where block_select reads its table):
        # the chunks decide on the host per chunk
        if plain and not options.get("return_weights") and not torch.compiler.is_compiling():
            # the queries a chunk at a time against the keys they chose together (token_selection.py):
            # no copy of each query's top_k keys
            return token_selected_attention(q, k, v, self.choose(Lq, Lk, mask), **options)
        # weights, a named backend or a score modifier (positions are those of the whole call):
        # the block_select mask, every key copied beside its query
        result: Tensor | AttentionResult = attention(q, k, v, mask=self.mask(Lq, Lk, mask), **options)
        return result

    def explain(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, **options: Any
    ) -> Explanation:
        """:func:`multihead.explain` of the call over the selected keys as a ``block_select`` mask
        (backend, path, density): what a call with weights or a named backend runs; a plain call
        runs :func:`~multihead.layers.token_selection.token_selected_attention` instead (query
        chunks, each one :func:`multihead.attention` call with a boolean mask over its keys)."""
        return explain(q, k, v, mask=self.mask(q.shape[2], k.shape[2], as_mask(mask)), **options)

    def choose(self, Lq: int, Lk: int, mask: Mask | None = None) -> Tensor:
        """``(B, 1, Lq, top_k)`` int64: each query's keys, best first, ``-1`` for none. ``mask``
        (the call's, causal included): keys it blocks are never chosen."""
        layer = self.layer
        n = min(layer.top_k, Lk)
        with torch.no_grad():  # the choice is not differentiated
            keys = self._keys(Lq, Lk)  # (B, Lk, d_I)
            chosen = torch.full((keys.shape[0], 1, Lq, n), -1, dtype=torch.long, device=keys.device)
            # a chunk of queries at a time against the keys up to its last one: half the scores
            # of the whole table, and a table a chunk high (the whole one is L² · H_I floats)
            step = token_selection.QUERY_CHUNK
            for c0 in range(0, Lq, step):
                c1 = min(Lq, c0 + step)
                r = Lk - Lq + c1
                scores = layer.index_scores(self.x[:, c0:c1], keys[:, :r]).float()  # (B, C, r)
                pos = torch.arange(c0, c1, device=scores.device)[:, None] + (Lk - Lq)
                scores = scores.masked_fill(torch.arange(r, device=scores.device) > pos, float("-inf"))
                if mask is not None:
                    scores = scores.masked_fill(~self._visible(mask, keys.shape[0], Lq, Lk, c0, c1, r), float("-inf"))
                best = best_first(scores, n)  # (B, C, min(n, r)), ties to the lower position, -1 past the visible
                chosen[:, 0, c0:c1, : best.shape[-1]] = best
            return chosen

    def mask(self, Lq: int, Lk: int, mask: Mask | None = None) -> Mask:
        select = block_select(self.choose(Lq, Lk, mask), 1, query_block_size=1)
        return select & causal() if mask is None else select & mask

    def _visible(self, mask: Mask, B: int, Lq: int, Lk: int, c0: int, c1: int, r: int) -> Tensor:
        """``(B|1, C, r)`` bool: which of the first ``r`` keys the queries ``[c0, c1)`` may see; one
        choice serves every head, so a mask that differs between heads is refused."""
        Hq = self.layer.num_heads
        visible = mask.materialize_block(Extent(B, Hq, Lq, Lk), Block(c0, c1, 0, r), self.x.device)
        if visible.shape[1] > 1 and not bool((visible == visible[:, :1]).all()):
            raise ValueError(
                f"{type(self.layer).__name__}: the mask differs between heads, but the indexer chooses "
                f"one set of keys per query for every head; expected a mask the same for every head "
                f"(padding, documents, windows)"
            )
        return visible[:, 0]

    def _keys(self, Lq: int, Lk: int) -> Tensor:
        """Indexer keys ``(B, Lk, d_I)``: with a cache, those of the cached tokens from its record
        and the new tokens' (the cache's last ``Lq`` slots) computed now."""
        layer, cache = self.layer, self.cache
        new: Tensor = layer.index_k(self.x)  # (B, Lq, d_I)
        if cache is None:
            return new
        old = Lk - Lq
        weight = layer.index_k.weight
        stamp = (cache.revision, id(weight), weight.data_ptr(), weight._version)
        entry = layer._keys.get(cache)
        record = None if entry is None else entry[0]
        if old and entry is not None and entry[1] != stamp:
            # The indexer keys come from the layer's input, which the cache does not hold: they
            # cannot be computed again, and reusing them would select by other rows' (or other
            # weights') keys.
            changed = "was reordered or reset" if entry[1][0] != stamp[0] else "has new index_k weights"
            raise RuntimeError(
                f"{type(layer).__name__}: the cache {changed} since this layer indexed its {old} tokens "
                f"(revision {entry[1][0]} then, {stamp[0]} now), so their indexer keys no longer match; "
                f"hint: prefill a new cache (reorder and weight updates are not supported with a cache)"
            )
        if old and (record is None or record.shape[1] < old or record.shape[0] != new.shape[0]):
            raise RuntimeError(
                f"{type(layer).__name__}: the cache holds {old} tokens this layer did not index; hint: fill a "
                f"cache through this layer only"
            )
        if not old:
            keys = new
        else:
            assert record is not None  # refused above otherwise
            keys = torch.cat([record[:, :old], new], dim=1)
        layer._keys[cache] = (keys.detach(), stamp)
        return keys

    def __repr__(self) -> str:
        return f"{type(self).__name__}(top_k={self.layer.top_k})"
