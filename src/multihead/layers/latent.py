"""``MultiHeadLatentAttention``: DeepSeek-V2/V3's multi-head latent attention (MLA).

Notation of :mod:`multihead.conventions`, with ``E = d_model``, ``H = num_heads``,
``C = kv_lora_rank``, ``Cq = q_lora_rank``, ``N = qk_nope_head_dim``, ``R = qk_rope_head_dim``,
``V = v_head_dim``. Per token ``x (E)`` (DeepSeek-V2, section 2.1, in row-vector form)::

    queries   c_q = RMSNorm(x W_DQ)             (Cq)       q_a_proj, q_a_layernorm  (or q = x W_Q: q_proj)
              q   = c_q W_UQ -> H heads of N+R   (H, N+R)   q_b_proj;  q_h = [q_nope_h | q_rope_h]
    keys/vals [c_kv | k_rope] = x W_DKV          (C + R)    kv_a_proj_with_mqa
              c_kv = RMSNorm(c_kv)               (C)        kv_a_layernorm
              [k_nope_h | v_h] = c_kv W_UKV_h    (H, N+V)   kv_b_proj (no bias)
    RoPE      q_rope_h = rope(q_rope_h, p),  k_rope = rope(k_rope, p)   k_rope shared by every head
    attention o_h = softmax(q_h · [k_nope_h | k_rope]ᵀ / sqrt(N + R)) v_h
    output    y = [o_1 .. o_H] W_O                (E)        o_proj

The cache holds ``[c_kv | k_rope]``, ``C + R`` features per token (:class:`LatentKVCache`). Two
ways to run the same parameters (``mode``):

* ``"naive"``: up-project the (cached) latent to per-head ``K (B, H, S, N+R)`` and
  ``V (B, H, S, V)`` and run multi-head attention. With a cache, every step up-projects every
  cached token again (correct; the cost grows with the cache).
* ``"absorbed"``: ``q_nope_h · k_nope_h = (q_nope_h W_UK_hᵀ) · c_kv``, so the K up-projection is
  folded into the query, and ``Σ_t p_t (c_kv,t W_UV_hᵀ) = (Σ_t p_t c_kv,t) W_UV_hᵀ``, so the V
  up-projection is applied after attention, before ``o_proj``. Attention then runs against the
  cache rows themselves, as multi-query attention (one KV head)::

      q (B, H, Lq, C + R) = [q_nope_h W_UK_h | q_rope_h]      k = [c_kv | k_rope]  (B, 1, S, C + R)
      o (B, H, Lq, C)  -> o_h W_UV_hᵀ (B, H, Lq, V) -> o_proj   v = c_kv             (B, 1, S, C)

  ``D = C + R``, ``Dv = C``: more arithmetic per key than naive, but each cached token is read
  once as it is stored, never up-projected. For decoding; naive is cheaper for long prefills.

Parameter names are those of Hugging Face's DeepSeek-V2/V3 attention (``q_proj`` or ``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``;
``o_proj``), so their ``state_dict`` loads. The rotary embedding pairs features ``(2i, 2i+1)``
like DeepSeek's ``apply_rotary_emb`` (``interleaved=True``; HF permutes the features to its
half-split layout first, which gives the same scores).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

from multihead.backends import cpu_gemv
from multihead.caches import CacheRead, KVCache
from multihead.call import Selection
from multihead.explain import Explanation, explain
from multihead.hooks import HookPoints
from multihead.inputs import check_tensor
from multihead.layers.attend import (
    CallMasks,
    arange_positions,
    attend_cached,
    check_backend,
    check_cache,
    check_weights_selection,
    resolve_positions,
    rotate,
)
from multihead.layers.checks import check_flag, check_size
from multihead.layers.heads import attend_blocks, attend_heads, blocks_explanation, blocks_take, merge_heads
from multihead.layers.norm import RMSNorm
from multihead.layers.projection import project
from multihead.masks import Mask
from multihead.positions.rotary import RotaryEmbedding
from multihead.scores import ScoreMod

__all__ = ["MultiHeadLatentAttention", "MODES"]

_R = TypeVar("_R")  # what a _run's attend gives back: the output (and weights), or an Explanation

MODES = ("naive", "absorbed")


class MultiHeadLatentAttention(HookPoints, nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), self-attention, ``(B, L, E)`` in and out.

    Args:
        d_model: ``E``.
        num_heads: ``H``.
        kv_lora_rank: ``C``, the features of the key/value latent ``c_kv`` (512 in DeepSeek-V2/V3).
        q_lora_rank: ``Cq``, the features of the query latent, or ``None`` for a full-rank
            ``q_proj`` (DeepSeek-V2-Lite; V2 and V3 use 1536).
        qk_nope_head_dim: ``N``, the query/key features per head without position (128).
        qk_rope_head_dim: ``R``, the rotary features per head (64); even. The key's rotary part
            is one vector per token, shared by every head.
        v_head_dim: ``V``, the value features per head (128).
        mode: ``"naive"`` or ``"absorbed"`` (module docstring); the same parameters serve both,
            and ``layer.mode = ...`` switches at any time.
        rope: the rotary embedding of the ``R`` features, a callable ``rope(x (B, H, L, R),
            positions) -> x`` such as :class:`multihead.positions.RotaryEmbedding` (for example
            with ``scaling=YaRNScaling(...)``); default ``RotaryEmbedding(R, base=rope_base,
            interleaved=True)``.
        rope_base: ``θ`` of the default rotary embedding (``rope_theta``; default 10000). Give
            ``rope`` or ``rope_base``, not both.
        scale: the score scale, as :func:`multihead.attention`'s ``scale``; default
            ``1 / sqrt(N + R)``. DeepSeek's YaRN checkpoints multiply it by ``mscale²``
            (``0.1 · mscale_all_dim · ln(factor) + 1``, squared). (``softmax_scale``, DeepSeek's
            name, is the old spelling: it still works, with a ``DeprecationWarning``.)
        causal: as :class:`multihead.MultiHeadAttention`'s ``causal``: a bottom-right ``causal()``
            on top of any call mask, at absolute positions with a cache (keys at positions up to
            the query's). ``True`` by default here, unlike there: MLA is a decoder's attention,
            while ``MultiHeadAttention`` also serves encoders and cross-attention.
        bias: biases of ``q_proj``/``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``
            (``attention_bias`` in HF configs); ``q_b_proj`` and ``kv_b_proj`` never have one.
        norm_eps: ``ε`` of the two RMSNorms.
        backend: the :func:`multihead.attention` backend, ``"auto"`` or a registered name.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        mode: str = "naive",
        rope: Callable[[Tensor, Tensor], Tensor] | None = None,
        rope_base: float | None = None,
        scale: float | None = None,
        causal: bool = True,
        bias: bool = False,
        norm_eps: float = 1e-6,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        softmax_scale: float | None = None,
    ):
        super().__init__()
        layer = type(self).__name__
        scale_name = "scale"
        if softmax_scale is not None:
            if scale is not None:
                raise TypeError(f"{layer}: give scale, not softmax_scale (its old spelling) as well")
            warnings.warn(f"{layer}(softmax_scale=...) is now {layer}(scale=...)", DeprecationWarning, stacklevel=2)
            scale, scale_name = softmax_scale, "softmax_scale"
        self.d_model = check_size(layer, "d_model", d_model)
        self.num_heads = check_size(layer, "num_heads", num_heads)
        self.kv_lora_rank = check_size(layer, "kv_lora_rank", kv_lora_rank)
        self.q_lora_rank = None if q_lora_rank is None else check_size(layer, "q_lora_rank", q_lora_rank)
        self.qk_nope_head_dim = check_size(layer, "qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = check_size(layer, "qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = check_size(layer, "v_head_dim", v_head_dim)
        if qk_rope_head_dim % 2:
            raise ValueError(
                f"{layer}: qk_rope_head_dim must be even (rotary features turn in pairs), got "
                f"{qk_rope_head_dim}; DeepSeek-V2/V3 use 64"
            )
        self.mode = mode
        self.causal = check_flag(layer, "causal", causal)
        bias = check_flag(layer, "bias", bias)
        self.backend = check_backend(layer, backend)
        self.scale = None if scale is None else _positive(layer, scale_name, scale)
        norm_eps = _positive(layer, "norm_eps", norm_eps)
        self.rope = _make_rope(layer, rope, rope_base, qk_rope_head_dim, device)
        self._masks = CallMasks(layer, num_heads, self.causal)

        H, C, N, R, V = num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        factory = {"device": device, "dtype": dtype}
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, H * (N + R), bias=bias, **factory)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias, **factory)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps, device=device, dtype=dtype)
            self.q_b_proj = nn.Linear(q_lora_rank, H * (N + R), bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(d_model, C + R, bias=bias, **factory)
        self.kv_a_layernorm = RMSNorm(C, eps=norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = nn.Linear(C, H * (N + V), bias=False, **factory)  # head h: rows [h(N+V), h(N+V)+N) k, then v
        self.o_proj = nn.Linear(H * V, d_model, bias=bias, **factory)

    # ------------------------------------------------------------------------------ mode
    @property
    def mode(self) -> str:
        """``"naive"`` (latent up-projected to per-head K/V) or ``"absorbed"`` (attend to the latent as MQA)."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(
                f"{type(self).__name__}: mode must be one of {MODES} (up-project the latent to per-head "
                f"K/V, or attend to it directly as MQA), got {mode!r}"
            )
        self._mode = mode

    @property
    def softmax_scale(self) -> float | None:
        """The old spelling of :attr:`scale` (``DeprecationWarning``)."""
        warnings.warn(
            f"{type(self).__name__}.softmax_scale is now {type(self).__name__}.scale", DeprecationWarning, stacklevel=2
        )
        return self.scale

    @softmax_scale.setter
    def softmax_scale(self, value: float | None) -> None:
        warnings.warn(
            f"{type(self).__name__}.softmax_scale is now {type(self).__name__}.scale", DeprecationWarning, stacklevel=2
        )
        self.scale = None if value is None else _positive(type(self).__name__, "scale", value)

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one token takes in a :class:`~multihead.caches.LatentKVCache` of this layer (one
        batch row): ``(kv_lora_rank + qk_rope_head_dim) · element size`` (default: the parameters' dtype)."""
        dtype = self.kv_b_proj.weight.dtype if dtype is None else dtype
        return (self.kv_lora_rank + self.qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
        weights_heads: Selection = None,
        weights_rows: Selection = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from the tokens ``x`` to the cached tokens and themselves.

        Args:
            x: ``(B, L, E)``.
            mask: a mask object or a bool/float tensor broadcastable to ``(B, H, L, S)``, as for
                :class:`multihead.MultiHeadAttention` (with a cache: objects at absolute positions,
                tensors over the ``S`` slots returned); combined with ``causal()`` when ``causal``.
            positions: ``(L,)`` or ``(B, L)`` integer absolute positions for the rotary embedding;
                default ``kv_cache.next_positions(L)`` with a cache, ``arange(L)`` without. A cache
                whose slots follow positions refuses given positions that do not continue it; a
                call-order cache (``LatentKVCache``) stores in call order and they only rotate.
            kv_cache: a :class:`~multihead.caches.KVCache` of this layer's rows
                ``[c_kv | k_rope] (B, 1, ·, C + R)``, usually a :class:`~multihead.caches.LatentKVCache`
                (any cache works; others store the latent twice). The same cache serves both modes.
                A call that raises leaves it as it was.
            need_weights: also return the probabilities ``(B, H, L, S)`` (the same in both modes).
            weights_heads, weights_rows: with ``need_weights``, only these heads and query rows,
                ``(B, len(heads), len(rows), S)``, as for :meth:`multihead.MultiHeadAttention.forward`.

        Returns:
            ``(B, L, E)``, or ``(output, weights)`` when ``need_weights``.
        """
        check_flag(type(self).__name__, "need_weights", need_weights)
        check_weights_selection(type(self).__name__, need_weights, weights_heads, weights_rows)
        selection = (weights_heads, weights_rows)

        def attend(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            mask: Mask | Tensor | None,
            score_mod: ScoreMod | None,
            out_proj: Callable[[Tensor], Tensor],
        ) -> Tensor | tuple[Tensor, Tensor]:
            return self._attend(q, k, v, mask, score_mod, out_proj, need_weights, selection)

        def attend_over_blocks(
            q: Tensor, read: CacheRead, mask: Mask | Tensor | None, score_mod: ScoreMod | None
        ) -> Tensor | None:
            assert read.blocks is not None  # asked only of a read with blocks
            return attend_blocks(
                self,
                q,
                read.blocks,
                out_proj=self._absorbed_out,
                mask=mask,
                score_mod=score_mod,
                sinks=None,
                dropout_p=0.0,
                need_weights=need_weights,
                backend=self.backend,
            )

        return self._run(x, mask, positions, kv_cache, attend, attend_over_blocks)

    def explain(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
        weights_heads: Selection = None,
        weights_rows: Selection = None,
    ) -> Explanation:
        """:func:`multihead.explain` for the attention call ``forward`` would make in this mode:
        its shapes (absorbed: ``Hkv = 1, D = C + R, Dv = C``; naive: ``Hkv = H, D = N + R, Dv = V``),
        the backend and the kernel; ``need_weights``, ``weights_heads`` and ``weights_rows`` as
        for :meth:`forward`. A cache is updated and rolled back: it ends as it was."""
        check_flag(type(self).__name__, "need_weights", need_weights)
        check_weights_selection(type(self).__name__, need_weights, weights_heads, weights_rows)

        def report(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            mask: Mask | Tensor | None,
            score_mod: ScoreMod | None,
            out_proj: Callable[[Tensor], Tensor],
        ) -> Explanation:
            return explain(
                q,
                k,
                v,
                mask=mask,
                score_mod=score_mod,
                backend=self.backend,
                return_weights=need_weights,
                weights_heads=weights_heads,
                weights_rows=weights_rows,
            )

        def report_blocks(
            q: Tensor, read: CacheRead, mask: Mask | Tensor | None, score_mod: ScoreMod | None
        ) -> Explanation | None:
            assert read.blocks is not None  # asked only of a read with blocks
            if not blocks_take(self, q, read.blocks, score_mod, None, 0.0, need_weights, self.backend):
                return None
            return blocks_explanation(q, read, mask)

        return self._run(x, mask, positions, kv_cache, report, report_blocks, keep=False)

    def _run(
        self,
        x: Tensor,
        mask: Mask | Tensor | None,
        positions: Tensor | None,
        kv_cache: KVCache | None,
        attend: Callable[..., _R],
        attend_over_blocks: Callable[[Tensor, CacheRead, Mask | Tensor | None, ScoreMod | None], _R | None],
        keep: bool = True,
    ) -> _R:
        """Project, rotate, cache, then ``attend(q, k, v, mask, score_mod, out_proj)``; an absorbed
        step over a cache read held as blocks (a paged or quantized cache) first asks
        ``attend_over_blocks(q, read, mask, score_mod)`` (``q (B, H, L, C + R)``), which reads the
        blocks in place (:func:`~multihead.layers.heads.attend_blocks`) or returns ``None`` for a
        call that needs the dense read."""
        layer = type(self).__name__
        if kv_cache is not None:
            check_cache(layer, kv_cache, "LatentKVCache()")
        _check_x(layer, x, self.d_model, self.kv_b_proj.weight)
        B, L, _ = x.shape
        given = positions is not None  # a cache continues its rows itself unless told where
        positions = resolve_positions(layer, positions, kv_cache, B, L, x.device, arange_positions)
        assert positions is not None  # (L,) or (B, L): every call rotates
        if kv_cache is None:
            mask, score_mod = self._masks.over_keys(mask, None, B, L, L)

        q_nope, q_rope = self._queries(x, positions)  # (B, H, L, N), (B, H, L, R), scaled
        rows = self._latent_rows(x, positions)  # (B, 1, L, C + R): [c_kv | k_rope], what a cache stores
        C = self.kv_lora_rank
        if kv_cache is None:
            return self._attend_rows(attend, q_nope, q_rope, rows, mask, score_mod)

        def attend_slots(read: CacheRead) -> _R:  # every row and these: keys (B, 1, S, C + R), values (B, 1, S, C)
            slot_mask, score_mod = self._masks.over_slots(read, mask, None, B, L)
            if read.blocks is not None and self._mode == "absorbed":
                # pages through their block table, 8-bit slots with their scales: never a dense copy
                out = attend_over_blocks(self._absorbed_query(q_nope, q_rope), read, slot_mask, score_mod)
                if out is not None:
                    return out
            return self._attend_rows(attend, q_nope, q_rope, read.keys, slot_mask, score_mod, read.values)

        return attend_cached(
            kv_cache,
            rows,
            rows[..., :C],
            attend_slots,
            positions=positions,
            given=given,
            mask=mask,
            causal=self.causal,
            keep=keep,
            fits=lambda S: self._masks.over_slots_fit(mask, None, B, L, S),
            owner=self,
        )

    def _attend_rows(
        self,
        attend: Callable[..., _R],
        q_nope: Tensor,
        q_rope: Tensor,
        rows: Tensor,
        mask: Mask | Tensor | None,
        score_mod: ScoreMod | None,
        values: Tensor | None = None,
    ) -> _R:
        """Attention of the queries over the latent rows ``(B, 1, S, C + R)`` in this mode; absorbed,
        over ``values (B, 1, S, C)`` (default the rows' first ``C`` features: a cache that stores
        them apart, quantized, gives its own)."""
        H, C, N = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim
        if self._mode == "absorbed":
            # MQA over the rows: k (B, 1, S, C + R), v (B, 1, S, C), usually a view of k
            v = rows[..., :C] if values is None else values
            return attend(self._absorbed_query(q_nope, q_rope), rows, v, mask, score_mod, self._absorbed_out)
        latent, k_rope = rows[..., :C], rows[..., C:]  # (B, 1, S, C), (B, 1, S, R)
        kv = self.kv_b_proj(latent.squeeze(1))  # (B, S, H·(N+V)): every cached token up-projected
        B, S = kv.shape[:2]
        k_nope, v = kv.view(B, S, H, -1).transpose(1, 2).split([N, self.v_head_dim], -1)  # (B, H, S, N), (B, H, S, V)
        k = torch.cat([k_nope, k_rope.expand(B, H, S, -1)], dim=-1)  # (B, H, S, N + R)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, L, N + R)
        return attend(q, k, v, mask, score_mod, self.o_proj)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        score_mod: ScoreMod | None,
        out_proj: Callable[[Tensor], Tensor],
        need_weights: bool,
        selection: tuple[Selection, Selection] = (None, None),
    ) -> Tensor | tuple[Tensor, Tensor]:
        out, weights = attend_heads(
            self,
            q,
            k,
            v,
            out_proj=out_proj,
            mask=mask,
            score_mod=score_mod,
            need_weights=need_weights,
            backend=self.backend,
            weights_heads=selection[0],
            weights_rows=selection[1],
        )
        if need_weights:
            assert weights is not None  # attend_heads returns them when asked
            return out, weights
        return out

    # ------------------------------------------------------------------------------ pieces
    def _queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``q_nope (B, H, L, N)`` and the rotated ``q_rope (B, H, L, R)``, times the scale fold.

        :func:`~multihead.layers.heads.attend_heads` runs attention at the default scale
        ``1 / sqrt(q.shape[-1])``; the wanted scale differs from it in absorbed mode
        (``D = C + R``, scale ``1 / sqrt(N + R)``) or with ``scale``, so the queries are
        multiplied by ``scale · sqrt(D)`` here (rotation is linear: before or after is the same)."""
        B, L, _ = x.shape
        H, N, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = project(self.q_proj, x)  # (B, L, H·(N+R))
        else:
            q = project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, x)))  # (B, L, Cq) -> (B, L, H·(N+R))
        q = q.view(B, L, H, N + R).transpose(1, 2)  # (B, H, L, N + R)
        scale = 1 / math.sqrt(N + R) if self.scale is None else self.scale
        D = self.kv_lora_rank + R if self._mode == "absorbed" else N + R  # the head dim attention sees
        fold = scale * math.sqrt(D)
        if fold != 1.0:
            q = q * fold
        q_nope, q_rope = q.split([N, R], dim=-1)  # (B, H, L, N), (B, H, L, R)
        return q_nope, rotate(type(self).__name__, self.rope, q_rope, positions, "query (B, H, L, R)")

    def _latent_rows(self, x: Tensor, positions: Tensor) -> Tensor:
        """``[RMSNorm(c_kv) | rope(k_rope)] (B, 1, L, C + R)``, the rows a cache stores."""
        kv_a = project(self.kv_a_proj_with_mqa, x)  # (B, L, C + R)
        c_kv, k_rope = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # (B, L, C), (B, L, R)
        # (B, 1, L, R): one rotary key for every head
        k_rope = rotate(type(self).__name__, self.rope, k_rope.unsqueeze(1), positions, "key (B, H, L, R)")
        return torch.cat([self.kv_a_layernorm(c_kv).unsqueeze(1), k_rope], dim=-1)  # (B, 1, L, C + R)

    def _absorbed_query(self, q_nope: Tensor, q_rope: Tensor) -> Tensor:
        """``(B, H, L, C + R)``: ``q_nope_h W_UK_h``, then the rope part: the query over the latent rows."""
        w_uk = self._up_projections()[0]  # (H, N, C), a view of kv_b_proj.weight
        # a decode step's few bf16 rows: per head on the one-token kernel (layers/projection.py)
        return torch.cat([cpu_gemv.heads_matmul(q_nope, w_uk), q_rope], dim=-1)

    def _up_projections(self) -> tuple[Tensor, Tensor]:
        """``W_UK (H, N, C)`` and ``W_UV (H, V, C)``, views of ``kv_b_proj.weight (H·(N+V), C)``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _absorbed_out(self, y: Tensor) -> Tensor:
        """``(B, L, H·C)`` attention over the latent -> ``o_h W_UV_hᵀ`` per head -> ``o_proj``, ``(B, L, E)``."""
        o = y.unflatten(-1, (self.num_heads, self.kv_lora_rank)).transpose(1, 2)  # (B, H, L, C)
        w_uv = self._up_projections()[1]  # (H, V, C), rows of kv_b_proj.weight
        heads = cpu_gemv.heads_linear(o, w_uv)  # (B, H, L, V): a decode step's few bf16 rows on the kernel
        out: Tensor = project(self.o_proj, merge_heads(heads))  # (B, H, L, V) -> (B, L, E)
        return out

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"num_heads={self.num_heads}", f"kv_lora_rank={self.kv_lora_rank}"]
        if self.q_lora_rank is not None:
            parts.append(f"q_lora_rank={self.q_lora_rank}")
        parts += [
            f"qk_nope_head_dim={self.qk_nope_head_dim}",
            f"qk_rope_head_dim={self.qk_rope_head_dim}",
            f"v_head_dim={self.v_head_dim}",
            f"mode={self._mode!r}",
            f"causal={self.causal}",
        ]
        if self.scale is not None:
            parts.append(f"scale={self.scale}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)


# help(MultiHeadLatentAttention.__init__) shows the arguments, not nn.Module.__init__'s text.
MultiHeadLatentAttention.__init__.__doc__ = MultiHeadLatentAttention.__doc__


# ---------------------------------------------------------------------------------- helpers
def _check_x(layer: str, x: object, d_model: int, weight: Tensor) -> None:
    """``x``: a floating ``(B, L, E)`` tensor with ``E = d_model``, of the weights' dtype (outside
    autocast) and device."""
    x = check_tensor("x", x, "(B, L, E)", where=layer)
    if x.dim() != 3:
        raise ValueError(
            f"{layer}: x must have 3 dims (B, L, E), got shape {tuple(x.shape)}"
            f"{'; hint: add a batch dim with .unsqueeze(0)' if x.dim() == 2 else ''}"
        )
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{layer}: x has {x.shape[-1]} features (last dim of shape {tuple(x.shape)}) but the layer "
            f"expects d_model={d_model}"
        )
    if 0 in x.shape:
        raise ValueError(f"{layer}: x has a zero-size dimension, shape {tuple(x.shape)}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer}: x has dtype {x.dtype} but the layer's weights are {weight.dtype}; convert one of "
            f"them (x.to({weight.dtype}) or layer.to({x.dtype}))"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{layer}: x is on {x.device} but the layer's weights are on {weight.device}; move one of "
            f"them (x.to('{weight.device}') or layer.to('{x.device}'))"
        )


def _positive(layer: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{layer}: {name} must be a positive finite number, got {value!r}")
    return float(value)


def _make_rope(
    layer: str, rope: object, rope_base: object, dim: int, device: torch.device | str | None
) -> Callable[[Tensor, Tensor], Tensor]:
    if rope is None:
        base = 10000.0 if rope_base is None else _positive(layer, "rope_base", rope_base)
        return RotaryEmbedding(dim, base=base, interleaved=True, device=device)
    if rope_base is not None:
        raise ValueError(
            f"{layer}: give rope or rope_base, not both (rope_base={rope_base!r} would be ignored by "
            f"rope={rope!r}); hint: RotaryEmbedding({dim}, base={rope_base!r}, interleaved=True)"
        )
    if not callable(rope):
        raise TypeError(
            f"{layer}: rope must be None or a callable rope(x, positions) -> x (usually an nn.Module), "
            f"got {type(rope).__name__} {rope!r}"
        )
    rope_dim = getattr(rope, "dim", None)
    if isinstance(rope_dim, int) and rope_dim != dim:
        raise ValueError(
            f"{layer}: rope rotates heads of dim={rope_dim} but qk_rope_head_dim={dim}; expected "
            f"RotaryEmbedding({dim}, ...): only the rotary features of each head are rotated"
        )
    return rope
