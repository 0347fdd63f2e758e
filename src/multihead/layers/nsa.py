"""``NativeSparseAttention``: NSA (Yuan et al., 2025, DeepSeek), three branches mixed by gates.

Per query token ``t`` (at position ``p``) and query head ``h`` of KV group ``g``, with ``l`` the
compression block, ``d`` its stride, ``l'`` the selection block, ``n`` the blocks selected and
``w`` the window::

    compressed  K̃_i = φ_K(K[i·d : i·d + l]),  Ṽ_i = φ_V(V[...])     block i, complete at i·d + l - 1
                p_cmp = softmax(q K̃ᵀ / sqrt(D) over blocks with i·d + l - 1 <= p)
                o_cmp = p_cmp Ṽ
    selected    s_j = Σ_{h in g} Σ_{i: block i overlaps block j of l'} p_cmp[h, i]     (pooled per group)
                chosen = block 0, the query's own block and the one before it, and the best others
                         by s_j among blocks starting at or before p: n in all (ties: lower j)
                o_slc = softmax(q Kᵀ / sqrt(D) over the keys of the chosen blocks, causal) V
    window      o_win = softmax(q Kᵀ / sqrt(D) over keys p - w < j <= p) V
    out         o = σ(x W_g)_cmp · o_cmp + σ(x W_g)_slc · o_slc + σ(x W_g)_win · o_win   per head

``φ`` (``compress_k``, ``compress_v``) is a linear map of the block's ``l`` keys flattened, after
adding a learned intra-block position encoding (``compress_pos_k``/``_v``, ``(l, D)``): the
paper's "MLP with intra-block position encoding" with one layer. The selection is not
differentiated (as in the paper); gradients reach the gates, ``φ``, and q, k, v through all three
branches. The three branches share the layer's keys and values (the paper gives each its own;
one set keeps a plain layer's projections and cache; documented in docs/variants.md).

The selected branch is a :func:`~multihead.masks.block_select` mask per query token, shared by
the query heads of a KV group, so it runs on ``blocksparse``'s gathered path (cost follows the
blocks); the window is a ``sliding_window`` (a band); the compressed branch is small
(``Lq x Lk / d`` scores) and runs in plain PyTorch (its probabilities are what selects).

With a :class:`~multihead.caches.DynamicKVCache` (slots are positions), the compressed blocks of
a cache are kept beside it (by the cache object, weakly) and extended as blocks fill: a call's
new tokens are the cache's last ``Lq`` slots, so blocks ending before them are reused and the
rest computed; prefill + decode steps equal the full forward.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from multihead.attention import attention
from multihead.backends.flash_pieces import available, flash
from multihead.blocks import Block, Extent
from multihead.caches import DynamicKVCache
from multihead.conventions import softmax_dtype
from multihead.explain import Explanation, explain
from multihead.layers.checks import check_causal_variant, check_counts, check_position_cache, check_self_attention
from multihead.layers.heads import Heads
from multihead.layers.multihead import MultiHeadAttention
from multihead.layers.ranking import best_first
from multihead.masks import Band, Mask, as_mask, block_select, causal, sliding_window

__all__ = ["NativeSparseAttention", "NsaCore"]

#: Query rows (query heads x tokens) per chunk of the compressed branch: its scores against every
#: compressed block (``Lk / d`` of them) stay a few MiB, in cache, where the whole table was
#: ``Hq · Lq · Lk / d`` (800 MB at 16k tokens).
CHUNK_ROWS = 2048


class NativeSparseAttention(MultiHeadAttention):
    """NSA: compressed, selected and sliding-window attention per head, mixed by sigmoid gates.

    Args:
        d_model, num_heads: as :class:`~multihead.layers.MultiHeadAttention`.
        num_kv_heads: ``Hkv``; default ``num_heads``. The selection is shared by a KV group.
        compress_block: ``l``, keys per compressed block (the paper: 32).
        compress_stride: ``d``, between compressed blocks (the paper: 16); divides ``l`` and ``l'``.
        select_block: ``l'``, keys per selected block (the paper: 64).
        select_count: ``n``, blocks each query reads, the forced ones included (the paper: 16).
        window: ``w``, the sliding window's keys (the paper: 512).
        **options: every other argument of :class:`~multihead.layers.MultiHeadAttention`
            (``rope``, ``backend``, ``head_dim``, ...); ``causal`` is always ``True``; not
            ``dropout``, ``attend`` or ``context_parallel``.

    ``forward(x, *, mask=None, positions=None, kv_cache=None)``: self-attention, causal; ``kv_cache``
    a :class:`~multihead.caches.DynamicKVCache`; ``mask`` (the same for every head) joins every
    branch: a compressed block counts only where the mask shows every key of it. No
    ``need_weights`` (three maps, no one probability table).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        select_count: int = 16,
        window: int = 512,
        **options: Any,
    ):
        layer = type(self).__name__
        sizes = {
            "compress_block": compress_block,
            "compress_stride": compress_stride,
            "select_block": select_block,
            "select_count": select_count,
            "window": window,
        }
        check_counts(layer, sizes)
        if compress_block % compress_stride or select_block % compress_stride:
            raise ValueError(
                f"{layer}: compress_stride must divide compress_block and select_block (blocks on one grid), got "
                f"compress_stride={compress_stride}, compress_block={compress_block}, select_block={select_block}"
            )
        check_causal_variant(layer, options, "NSA's branches never read a later key", "it attends in one call")
        if options.get("dropout", 0.0):
            raise ValueError(
                f"{layer}: dropout is not supported (the selection reads the probabilities), got {options['dropout']!r}"
            )
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, causal=True, **options)
        self.compress_block, self.compress_stride = compress_block, compress_stride
        self.select_block, self.select_count, self.window = select_block, select_count, window
        weight = self.q_proj.weight
        device, dtype = weight.device, weight.dtype
        D = self.head_dim
        self.compress_k = nn.Linear(compress_block * D, D, device=device, dtype=dtype)
        self.compress_v = nn.Linear(compress_block * D, D, device=device, dtype=dtype)
        self.compress_pos_k = nn.Parameter(torch.zeros(compress_block, D, device=device, dtype=dtype))
        self.compress_pos_v = nn.Parameter(torch.zeros(compress_block, D, device=device, dtype=dtype))
        self.gate_proj = nn.Linear(d_model, 3 * num_heads, device=device, dtype=dtype)  # (cmp, slc, win) per head
        # per cache: its compressed blocks and what they were derived from (_compress_stamp)
        self._compressed: weakref.WeakKeyDictionary[DynamicKVCache, tuple[Tensor, Tensor, tuple[Any, ...]]] = (
            weakref.WeakKeyDictionary()
        )
        self._cache: DynamicKVCache | None = None

    def forward(self, query: Tensor, *args: Any, kv_cache: Any = None, **kwargs: Any) -> Any:
        layer = type(self).__name__
        check_position_cache(
            layer, kv_cache, "its slots are positions, so blocks are cut where they were in the prefill"
        )
        check_self_attention(layer, args, {**kwargs, "mask": None}, "the branches are causal by construction")
        if kwargs.get("need_weights"):
            raise TypeError(f"{layer}: need_weights is not supported (three attention maps, no one table)")
        self._cache = kv_cache
        try:
            return super().forward(query, kv_cache=kv_cache, **kwargs)
        finally:
            self._cache = None

    def _heads(self, query: Tensor) -> Heads:
        g = torch.sigmoid(self.gate_proj(query))  # (B, Lq, 3·Hq); L first if not batch_first
        if not self.batch_first:
            g = g.transpose(0, 1)
        return NsaCore(self, g, self._cache), self.out_proj

    def compress(self, k: Tensor, v: Tensor, first: int = 0) -> tuple[Tensor, Tensor]:
        """``φ_K, φ_V`` of the compressed blocks ``first, first + 1, ...`` complete in ``k (B, Hkv,
        Lk, D)``, ``v``: ``(B, Hkv, nC - first, D)`` each."""
        l, d = self.compress_block, self.compress_stride
        Lk = k.shape[2]
        total = (Lk - l) // d + 1 if Lk >= l else 0
        if total <= first:
            empty = k.new_zeros(k.shape[0], k.shape[1], 0, self.head_dim)
            return empty, empty.clone()
        start = first * d
        kb = k[:, :, start:].unfold(2, l, d)  # (B, Hkv, n, D, l)
        vb = v[:, :, start:].unfold(2, l, d)
        kb = kb.transpose(-1, -2) + self.compress_pos_k  # (B, Hkv, n, l, D)
        vb = vb.transpose(-1, -2) + self.compress_pos_v
        return self.compress_k(kb.flatten(-2)), self.compress_v(vb.flatten(-2))

    def _compress_stamp(self, cache: DynamicKVCache) -> tuple[Any, ...]:
        """What a cache's compressed blocks derive from besides the slots they cover: the cache's
        :attr:`~multihead.caches.DynamicKVCache.revision` (a reorder moves rows under the blocks:
        beam search) and the compression's parameters (an optimizer step, ``.data =``, ``.to()``
        change them). Blocks recorded under another stamp are computed again."""
        params = [*self.compress_k.parameters(), *self.compress_v.parameters()]
        params += [self.compress_pos_k, self.compress_pos_v]
        return (cache.revision, *((id(p), p.data_ptr(), p._version) for p in params))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, compress_block={self.compress_block}, compress_stride={self.compress_stride}, "
            f"select_block={self.select_block}, select_count={self.select_count}, window={self.window}"
        )


NativeSparseAttention.__init__.__doc__ = NativeSparseAttention.__doc__


class NsaCore:
    """The three branches with :func:`multihead.attention`'s signature: ``q (B, Hq, Lq, D)``,
    ``k``, ``v (B, Hkv, Lk, D)``, query ``i`` at position ``Lk - Lq + i``; gates ``(B, Lq, 3·Hq)``."""

    def __init__(self, layer: NativeSparseAttention, gates: Tensor, cache: DynamicKVCache | None):
        self.layer, self.gates, self.cache = layer, gates, cache

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, **options: Any) -> Tensor:
        for name in ("score_mod", "sinks"):
            if options.get(name) is not None:
                raise TypeError(f"NativeSparseAttention: {name} is not supported")
        if options.get("return_weights"):
            raise TypeError("NativeSparseAttention: weights are not supported (three attention maps, no one table)")
        backend = options.get("backend", "auto")
        B, Hq, Lq, D = q.shape
        extra = _beyond_causal(mask)
        o_cmp, idx = self.compressed_and_chosen(q, k, v, extra)
        window: Mask = sliding_window(self.layer.window - 1)
        if extra is None:
            o_slc = self._selected_attention(q, k, v, idx, backend)
        else:  # the call's mask joins each branch's: the selected blocks' keys it allows
            o_slc = attention(q, k, v, mask=self._selected(idx, Hq) & extra, backend=backend)
            window = window & extra
        o_win = attention(q, k, v, mask=window, backend=backend)
        g = self.gates.view(B, Lq, 3, Hq).permute(2, 0, 3, 1).unsqueeze(-1)  # (3, B, Hq, Lq, 1)
        return g[0] * o_cmp + g[1] * o_slc + g[2] * o_win  # (B, Hq, Lq, D)

    def explain(self, q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Explanation:
        """:func:`multihead.explain` of the selected branch's call (its backend, path and density);
        the window is a band, the compressed branch plain PyTorch."""
        with torch.no_grad():
            _, idx = self.compressed_and_chosen(q, k, v)
        return explain(q, k, v, mask=self._selected(idx, q.shape[1]), backend=options.get("backend", "auto"))

    def _selected_attention(self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, backend: Any) -> Tensor:
        """The selected branch. A few new tokens against a long cache (decode steps: fewer keys
        chosen than cached) read only their chosen blocks: the keys at ``j·l' + t`` gathered per
        token and KV group, ``(B·Lq, Hkv, n·l', D)``, attended with a mask of the slots that are
        chosen and causal; the ``block_select`` mask would have the call read every cached key.
        Otherwise (prefill, training) the mask, run key-major by ``blocksparse``."""
        B, Hq, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        ls, n = self.layer.select_block, idx.shape[-1]
        if Lq * n * ls >= Lk:
            return attention(q, k, v, mask=self._selected(idx, Hq), backend=backend)
        pos = torch.arange(Lk - Lq, Lk, device=q.device).view(1, 1, Lq, 1)  # the queries' positions
        keys = (idx.unsqueeze(-1) * ls + torch.arange(ls, device=q.device)).flatten(-2)  # (B, Hkv, Lq, n·l')
        visible = (idx >= 0).repeat_interleave(ls, dim=-1) & (keys <= pos)  # chosen, causal (own block: up to p)
        where = keys.clamp(0, Lk - 1).flatten(2).unsqueeze(-1)  # (B, Hkv, Lq·n·l', 1)
        kg = k.gather(2, where.expand(-1, -1, -1, D)).view(B, Hkv, Lq, n * ls, D).transpose(1, 2)
        vg = v.gather(2, where.expand(-1, -1, -1, v.shape[-1])).view(B, Hkv, Lq, n * ls, -1).transpose(1, 2)
        G = Hq // Hkv
        if available(q):  # the fused kernel on the folded heads: (B·Lq, Hkv, G, D) rows, the mask per KV group
            additive = torch.zeros(visible.shape, dtype=softmax_dtype(q.dtype), device=q.device)
            additive.masked_fill_(~visible, float("-inf"))  # every row sees its own key: none is empty
            qf = q.view(B, Hkv, G, Lq, D).permute(0, 3, 1, 2, 4).reshape(B * Lq, Hkv, G, D)
            o, _ = flash(
                qf,
                kg.reshape(B * Lq, Hkv, n * ls, D),
                vg.reshape(B * Lq, Hkv, n * ls, -1),
                0.0,
                False,
                attn_mask=additive.transpose(1, 2).reshape(B * Lq, Hkv, 1, n * ls),
                scale=1 / math.sqrt(D),
            )  # (B·Lq, Hkv, G, Dv)
            heads: Tensor = o.view(B, Lq, Hq, -1).transpose(1, 2)  # (B, Hq, Lq, Dv)
            return heads
        mask = visible.transpose(1, 2).repeat_interleave(G, dim=1).reshape(B * Lq, Hq, 1, n * ls)
        out = attention(
            q.transpose(1, 2).reshape(B * Lq, Hq, 1, D),  # each token its own batch row: its own keys
            kg.reshape(B * Lq, Hkv, n * ls, D),
            vg.reshape(B * Lq, Hkv, n * ls, -1),
            mask=mask,
            backend=backend,
        )
        return out.view(B, Lq, Hq, -1).transpose(1, 2)  # (B, Hq, Lq, Dv)

    def _selected(self, idx: Tensor, Hq: int) -> Mask:
        return block_select(idx, self.layer.select_block, num_heads=Hq, query_block_size=1) & causal()

    def compressed_and_chosen(
        self, q: Tensor, k: Tensor, v: Tensor, extra: Mask | None = None
    ) -> tuple[Tensor, Tensor]:
        """``o_cmp (B, Hq, Lq, D)`` as :meth:`compressed` and the chosen blocks ``(B, Hkv, Lq,
        n)`` as :meth:`choose`, without the ``(B, Hq, Lq, nC)`` table of probabilities: a query
        chunk at a time, the compressed branch runs on the fused kernel (its output and LSE,
        differentiable) over the blocks complete by the chunk's last query, and the chunk's
        probabilities ``exp(s − lse)`` are recomputed, pooled and ranked before the next chunk.
        Cost ``∝ Lq · Lk / d`` multiply-adds, memory ``∝ chunk · Lk / d``. ``extra`` (the call's mask
        beyond causal, the same for every head): a compressed block is seen by a query only if the
        mask lets it see every key of the block (no information from a key it may not read), and
        a query that sees no block gets 0."""
        layer = self.layer
        B, Hq, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        G = Hq // Hkv
        kc, vc = self._blocks(k, v, Lq)  # (B, Hkv, nC, D)
        nC = kc.shape[2]
        l, d = layer.compress_block, layer.compress_stride
        scale = 1 / math.sqrt(D)
        first = min(Lq, max(0, l - 1 - (Lk - Lq)))  # queries before it see no complete block
        outs = [q.new_zeros(B, Hq, first, vc.shape[-1])]
        chosen = []
        if first:
            none = q.new_zeros(B, Hkv, first, 0, dtype=torch.float32)
            chosen.append(self._rank(none, Lk - Lq, Lk))
        ends = torch.arange(nC, device=q.device) * d + l - 1  # the last key of each compressed block
        step = max(d, CHUNK_ROWS // G // d * d)
        for a in range(first, Lq, step):
            b = min(Lq, a + step)
            pos = torch.arange(a, b, device=q.device) + (Lk - Lq)
            n = min(nC, (b + Lk - Lq - l) // d + 1)  # blocks complete by the chunk's last query (at b - 1)
            additive = torch.zeros(b - a, n, dtype=softmax_dtype(q.dtype), device=q.device)
            additive.masked_fill_(ends[:n] > pos[:, None], float("-inf"))  # (C, n); every row sees block 0
            unseen: Tensor | None = None
            if extra is not None:  # (B|1, C, n): blocks whose every key the mask shows the query
                keys = (n - 1) * d + l
                shown = self._visible(extra, B, Lq, Lk, a, b, keys).unfold(-1, l, d).all(-1)
                additive = additive.masked_fill(~shown, float("-inf"))  # (B|1, C, n)
                unseen = torch.isneginf(additive).all(-1, keepdim=True)  # rows that see no block: 0 below
                additive = additive.masked_fill(unseen, 0.0).unsqueeze(1)  # (B|1, 1, C, n)
            additive = additive.repeat(*([1] * (additive.dim() - 2)), G, 1)  # rows of the folded heads: (·, G·C, n)
            qf = q[:, :, a:b].reshape(B, Hkv, G * (b - a), D)  # a group's heads folded into rows
            o, p = _attend(qf, kc[:, :, :n], vc[:, :, :n], additive, scale)  # p: (B, Hkv, G·C, n), no grad
            if unseen is not None:
                rows = unseen.unsqueeze(1).repeat(1, 1, G, 1)  # (B|1, 1, G·C, 1)
                o, p = o.masked_fill(rows, 0.0), p.masked_fill(rows, 0.0)
            outs.append(o.view(B, Hq, b - a, -1))
            pooled = p.view(B, Hkv, G, b - a, n).sum(2)  # (B, Hkv, C, n): summed over the group's heads
            chosen.append(self._rank(pooled, a + Lk - Lq, Lk))
        return torch.cat(outs, dim=2), torch.cat(chosen, dim=2)

    def _visible(self, mask: Mask, B: int, Lq: int, Lk: int, a: int, b: int, keys: int) -> Tensor:
        """``(B|1, b - a, keys)`` bool: which of the first ``keys`` keys the queries ``[a, b)`` may
        see; the compressed branch and the choice serve every head of a group, so a mask that
        differs between heads is refused."""
        extent = Extent(B, self.layer.num_heads, Lq, Lk)
        visible = mask.materialize_block(extent, Block(a, b, 0, keys), self.gates.device)
        if visible.shape[1] > 1 and not bool((visible == visible[:, :1]).all()):
            raise ValueError(
                "NativeSparseAttention: the mask differs between heads, but the compressed branch and the "
                "choice serve every head of a group; expected a mask the same for every head (padding, "
                "documents, windows)"
            )
        return visible[:, 0].expand(-1, b - a, keys)

    def compressed(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``o_cmp (B, Hq, Lq, D)`` and ``p_cmp (B, Hq, Lq, nC)``: attention over the compressed
        blocks complete at each query's position (rows with none: 0)."""
        layer = self.layer
        B, Hq, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        kc, vc = self._blocks(k, v, Lq)  # (B, Hkv, nC, D)
        nC = kc.shape[2]
        G = Hq // Hkv
        scores = q.view(B, Hkv, G, Lq, D) @ kc.unsqueeze(2).transpose(-1, -2) / math.sqrt(D)  # (B, Hkv, G, Lq, nC)
        ends = torch.arange(nC, device=q.device) * layer.compress_stride + layer.compress_block - 1
        pos = torch.arange(Lq, device=q.device) + (Lk - Lq)
        allowed = ends <= pos[:, None]  # (Lq, nC)
        has = allowed.any(-1, keepdim=True)
        scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has, 0.0)
        p = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)
        p = p.masked_fill(~has, 0.0).to(q.dtype)
        o = p @ vc.unsqueeze(2)  # (B, Hkv, G, Lq, D)
        return o.view(B, Hq, Lq, D), p.view(B, Hq, Lq, nC)

    def choose(self, p_cmp: Tensor, Lq: int, Lk: int) -> Tensor:
        """``(B, Hkv, Lq, n)`` int64: the selected blocks of each query token and KV group, best
        first, ``-1`` for none (fewer blocks exist yet), from ``p_cmp (B, Hq, Lq, nC)``."""
        B, Hq, _, nC = p_cmp.shape
        Hkv = self.layer.num_kv_heads
        with torch.no_grad():
            pooled = p_cmp.detach().view(B, Hkv, Hq // Hkv, Lq, nC).sum(2).float()  # (B, Hkv, Lq, nC)
            return self._rank(pooled, Lk - Lq, Lk)

    def _rank(self, pooled: Tensor, p0: int, Lk: int) -> Tensor:
        """The chosen blocks ``(B, Hkv, C, n)`` of the queries at positions ``p0, ..., p0 + C - 1``
        from their pooled probabilities ``(B, Hkv, C, nC')`` of the first ``nC'`` compressed blocks."""
        layer = self.layer
        l, d, ls = layer.compress_block, layer.compress_stride, layer.select_block
        n = min(layer.select_count, math.ceil(Lk / ls))
        C = pooled.shape[2]
        pos = torch.arange(p0, p0 + C, device=pooled.device)
        nS = (p0 + C - 1) // ls + 1  # up to the last query's own block: no later one is read
        # compressed block i, keys [i·d, i·d + l), overlaps selection block j, keys [j·l', (j+1)·l'),
        # for i in [j·r − c + 1, (j+1)·r) with r = l'/d, c = l/d (both whole: the blocks share a
        # grid): a window of r + c − 1 blocks every r, one unfold of the zero-padded row
        r, c = ls // d, l // d
        padded = torch.nn.functional.pad(pooled[..., : nS * r], (c - 1, nS * r - min(nS * r, pooled.shape[-1])))
        scores = padded.unfold(-1, r + c - 1, r).sum(-1)  # (B, Hkv, C, nS)
        own = (pos // ls)[:, None]
        block = torch.arange(nS, device=pooled.device)
        forced = (block == 0) | (block == own) | (block == own - 1)
        scores = scores.masked_fill(forced, float("inf")).masked_fill(block > own, float("-inf"))
        top = best_first(scores, n)  # ties to the lower block number
        return torch.nn.functional.pad(top, (0, n - top.shape[-1]), value=-1)

    def _blocks(self, k: Tensor, v: Tensor, Lq: int) -> tuple[Tensor, Tensor]:
        """The compressed blocks of ``k, v``; with a cache, those ending before this call's new
        tokens (its last ``Lq`` slots) are read from the cache's record and the rest computed."""
        layer, cache = self.layer, self.cache
        if cache is None:
            return layer.compress(k, v)
        Lk = k.shape[2]
        l, d = layer.compress_block, layer.compress_stride
        old = Lk - Lq  # slots written before this call
        keep = (old - l) // d + 1 if old >= l else 0
        record = layer._compressed.get(cache)
        stamp = layer._compress_stamp(cache)
        if record is None or record[2] != stamp or record[0].shape[:2] != k.shape[:2]:
            keep = 0
        else:
            keep = min(keep, record[0].shape[2])
        kn, vn = layer.compress(k, v, first=keep)
        if keep:
            assert record is not None  # keep > 0 only with a record
            kn = torch.cat([record[0][:, :, :keep], kn], dim=2)
            vn = torch.cat([record[1][:, :, :keep], vn], dim=2)
        layer._compressed[cache] = (kn, vn, stamp)
        return kn, vn

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer.extra_repr()})"


def _beyond_causal(mask: Mask | Tensor | None) -> Mask | None:
    """The call's mask when it is more than the layer's ``causal()`` (which every branch applies by
    construction): ``None`` for no mask or ``causal()`` alone."""
    if mask is None:
        return None
    mask = as_mask(mask)
    # by its fields, not `== causal()`: a mask's hash is a graph break under torch.compile
    plain = isinstance(mask, Band) and mask.left is None and mask.right == 0 and mask.align == "bottom_right"
    return None if mask is None or plain else mask


def _attend(q: Tensor, k: Tensor, v: Tensor, additive: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q (B, H, R, D)`` over ``k, v (B, H, n, D)`` with ``additive (R, n)`` (every
    row sees a key): the output, differentiable, and the probabilities in fp32, not. On the CPU
    the fused kernel gives the output and its LSE, and the probabilities are ``exp(s − lse)``
    (one matmul and one pass; no softmax graph is kept for the backward); elsewhere a softmax."""
    if available(q):
        o, lse = flash(q, k, v, 0.0, False, attn_mask=additive, scale=scale)
        with torch.no_grad():
            acc = additive.dtype  # the softmax dtype
            bias = additive - lse.to(acc).unsqueeze(-1)  # (B, H, R, n): the GEMM adds it as it writes
            qs, kt = (q.detach().to(acc) * scale).flatten(0, 1), k.detach().to(acc).transpose(-1, -2).flatten(0, 1)
            return o, torch.exp_(torch.baddbmm(bias.flatten(0, 1), qs, kt)).view(bias.shape)
    p = torch.softmax((q.to(additive.dtype) @ k.to(additive.dtype).transpose(-1, -2)) * scale + additive, dim=-1)
    return (p.to(v.dtype) @ v), p.detach()
