"""``MultiHeadAttention``: one layer for multi-head, grouped-query, multi-query and cross-attention.

Notation and every convention (mask polarity, causal alignment, GQA mapping, fully masked rows)
are those of :mod:`multihead.conventions`; ``E = d_model``::

    query (B, Lq, E)    -q_proj-> (B, Lq, Hq·D)  -split-> (B, Hq, Lq, D)  --.
    key   (B, Lk, kdim) -k_proj-> (B, Lk, Hkv·D) -split-> (B, Hkv, Lk, D) --+-> attention() -> (B, Hq, Lq, D)
    value (B, Lk, vdim) -v_proj-> (B, Lk, Hkv·D) -split-> (B, Hkv, Lk, D) --'         |
                                                       (B, Lq, E) <-out_proj- (B, Lq, Hq·D) <-merge-'

``Hkv = Hq`` is multi-head attention, ``1 < Hkv < Hq`` grouped-query (query head ``h`` reads
KV head ``h // (Hq // Hkv)``), ``Hkv = 1`` multi-query. With ``batch_first=False`` every
``(B, L, ·)`` above reads ``(L, B, ·)``; the heads are split and merged as views in both layouts.

Two seams sit between the split and :func:`multihead.attention`, for self-attention only::

    q (B, Hq, Lq, D), k (B, Hkv, Lq, D) -rope(·, positions)-> -kv_cache.update(k, v)-> k, v (B, Hkv, S, ·)

an injected rotary module (``rope=``) and a key/value cache (``kv_cache=``, a
:class:`multihead.caches.KVCache`). The common end, ``attention() -> merge -> out_proj``, is
:func:`multihead.layers.heads.attend_heads`, shared with the ``nn.MultiheadAttention`` drop-in
and the models.

A variant changes the common end's two steps, the attention function and the map of the merged
heads (``MultiHeadAttention._heads(query) -> (core, out_proj)``) and nothing else:
:class:`~multihead.layers.GatedAttention` (a gate on the merged heads),
:class:`~multihead.layers.DifferentialAttention` (two maps; a norm per head), ``docs/variants.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor, nn

from multihead.caches import CacheRead, KVCache
from multihead.call import ScoreModArg, Selection
from multihead.explain import Explanation, explain
from multihead.hooks import HookPoints
from multihead.layers.attend import (
    CallMasks,
    attend_cached,
    check_backend,
    check_cache,
    check_rope,
    check_weights_selection,
    resolve_positions,
    rotate,
)
from multihead.layers.checks import check_dropout, check_flag, check_inputs, check_optional_size, check_size, dims
from multihead.layers.convert import from_torch, to_torch
from multihead.layers.heads import Attend, Heads, attend_blocks, blocks_explanation, blocks_take, split_heads
from multihead.layers.projection import project_qkv
from multihead.masks import Mask
from multihead.scores import as_score_mod
from multihead.scores import softcap as softcap_mod

if TYPE_CHECKING:  # floor 3 beside the layers: imported only when a layer is given one
    from multihead.distributed import ContextParallel

__all__ = ["MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention"]


class MultiHeadAttention(HookPoints, nn.Module):
    """Multi-head attention with ``Hq`` query heads and ``Hkv`` key/value heads.

    Args:
        d_model: ``E``, the features of ``query`` and of the output.
        num_heads: ``Hq``, the number of query heads.
        num_kv_heads: ``Hkv``; ``None`` means ``Hq`` (MHA). Must divide ``Hq``.
        head_dim: ``D``; default ``d_model // num_heads`` (then ``num_heads`` must divide ``d_model``).
        kdim, vdim: features of ``key`` and ``value``; default ``d_model``.
        qkv_bias: bias of the q/k/v projections; a bool, or a tuple of three bools
            ``(q, k, v)`` (the labml MHA has ``(False, False, True)`` with ``bias=False``).
        out_bias: bias of the output projection.
        dropout: dropout on the attention probabilities, in training mode only.
        causal: apply a bottom-right ``causal()`` mask on top of any mask given at call time.
        batch_first: ``True`` for ``(B, L, E)`` inputs and outputs, ``False`` for ``(L, B, E)``.
        backend: the :func:`multihead.attention` backend, ``"auto"`` or a registered name.
        rope: a rotary position embedding applied to queries and keys, or ``None`` (no rotation).
            Any callable ``rope(x, positions) -> x`` (usually an ``nn.Module``, then registered
            as the submodule ``rope``) with

            * ``x``: ``(B, H, L, D)`` queries (``H = Hq``) or keys (``H = Hkv``) after the head split;
            * ``positions``: ``int64``, ``(L,)`` or ``(B, L)``, the absolute position of each token
              in its sequence (cached tokens count: the first new token after ``T`` cached ones
              is at position ``T``);
            * returns a tensor of the shape of ``x``, each token rotated by its position.

            The layer applies it to ``q`` at the query positions and to the *new* keys at the same
            positions before they enter a cache, so cached keys are rotated once, when stored.
            It needs self-attention (``key`` is ``None`` or ``query``).
        score_mod: a score modifier applied on every call before the call's own
            (:func:`multihead.attention`): a :mod:`multihead.scores` modifier such as
            ``positions.ALiBi(num_heads)``, a function ``fn(score, b, h, q_idx, kv_idx)``, or an
            ``nn.Module`` whose ``forward()`` returns one (``positions.RelativePositionBias``:
            registered as the submodule ``score_mod``, so its table trains with the layer).
        softcap: ``cap · tanh(s / cap)`` on the scores, after every modifier (Gemma 2).
        sinks: ``True`` creates one learnable sink logit per query head, ``self.sinks (Hq,)``
            (gpt-oss; :mod:`multihead.sinks`), initialised to 0.
        context_parallel: a :class:`multihead.distributed.ContextParallel`: the layer's input is
            this rank's shard of a sequence split over a process group (``cp.shard(x)``); the
            projections run on the shard, ``rope`` at the shard's global positions, and attention
            over the whole sequence through ring or all-to-all attention
            (``docs/distributed.md``). A mask is the whole sequence's. Self-attention only;
            without caches, weights, score modifiers, sinks or dropout. It builds the ``attend``
            seam :class:`multihead.distributed.ContextParallelAttend`.
        attend: how the layer attends once its heads are projected, a
            :class:`multihead.layers.heads.Attend` (default: ``Attend()``, :func:`attend_heads` on
            this process). An ``Attend`` subclass refuses in its own checks what it cannot do.
            Give ``attend`` or ``context_parallel``, not both.
        device, dtype: of the parameters.

    Parameters live in four ``nn.Linear`` submodules, ``q_proj`` (``E -> Hq·D``, head ``h`` at
    output rows ``[h·D, (h+1)·D)``), ``k_proj`` (``kdim -> Hkv·D``), ``v_proj``
    (``vdim -> Hkv·D``) and ``out_proj`` (``Hq·D -> E``): the names of Hugging Face and
    torchtune checkpoints.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        qkv_bias: bool | tuple[bool, bool, bool] = True,
        out_bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        batch_first: bool = True,
        backend: str = "auto",
        rope: Callable[[Tensor, Tensor], Tensor] | None = None,
        score_mod: ScoreModArg | nn.Module = None,
        softcap: float | None = None,
        sinks: bool = False,
        context_parallel: ContextParallel | None = None,
        attend: Attend | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        layer = type(self).__name__
        d_model = check_size(layer, "d_model", d_model)
        num_heads = check_size(layer, "num_heads", num_heads)
        num_kv_heads = check_optional_size(layer, "num_kv_heads", num_kv_heads, num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{layer}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}; "
                f"num_kv_heads must divide num_heads (one of {_divisors(num_heads)})"
            )
        if head_dim is None:
            if d_model % num_heads != 0:
                raise ValueError(
                    f"{layer}: d_model={d_model} is not divisible by num_heads={num_heads}; "
                    f"use num_heads in {_divisors(d_model)} or pass head_dim explicitly"
                )
            head_dim = d_model // num_heads
        head_dim = check_size(layer, "head_dim", head_dim)
        kdim = check_optional_size(layer, "kdim", kdim, d_model)
        vdim = check_optional_size(layer, "vdim", vdim, d_model)
        q_bias, k_bias, v_bias = _qkv_biases(layer, qkv_bias)
        out_bias = check_flag(layer, "out_bias", out_bias)
        backend = check_backend(layer, backend)
        check_rope(layer, rope)

        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.kdim, self.vdim = kdim, vdim
        self.dropout = check_dropout(layer, dropout)
        self.causal = check_flag(layer, "causal", causal)
        self.batch_first = check_flag(layer, "batch_first", batch_first)
        self.backend = backend
        self._masks = CallMasks(layer, num_heads, self.causal)

        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=q_bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=k_bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=v_bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=out_bias, device=device, dtype=dtype)
        self.rope = rope  # an nn.Module is registered as a submodule (its buffers follow .to())
        if score_mod is not None and not isinstance(score_mod, nn.Module):
            as_score_mod(score_mod, name=f"{layer}: score_mod")  # refused now, not at the first forward
        self.score_mod = score_mod  # an nn.Module (a RelativePositionBias) is registered as a submodule
        self.softcap = None if softcap is None else softcap_mod(softcap).cap
        self.sinks = (
            nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
            if check_flag(layer, "sinks", sinks)
            else None
        )
        self.attend = _attend_seam(layer, attend, context_parallel)
        self.attend.check_layer(
            layer, {"score_mod": score_mod, "softcap": self.softcap, "sinks": self.sinks, "dropout": self.dropout}
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
        score_mod: ScoreModArg = None,
        weights_heads: Selection = None,
        weights_rows: Selection = None,
        key_padding_mask: None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value``, or to the cached tokens and ``query`` itself.

        Args:
            query: ``(B, Lq, E)`` (``(Lq, B, E)`` when ``batch_first=False``).
            key: ``(B, Lk, kdim)``; default ``query`` (self-attention).
            value: ``(B, Lk, vdim)``; default ``key``.
            mask: a mask object (``multihead.causal()``, ``key_padding(lengths)``, ...) or a bool
                (``True`` = may attend) or float (additive) tensor broadcastable to
                ``(B, Hq, Lq, Lk)``. With ``causal=True`` it is combined as ``mask & causal()``.
                With ``kv_cache``, a mask object is read at the tokens' absolute positions in the
                whole sequence (so ``sliding_window(w)`` or ``document(ids)`` mean what they mean
                without a cache), and a tensor is over the ``S`` slots the cache returns
                (:meth:`~multihead.caches.KVCache.slots`; ``S = T`` for a ``DynamicKVCache``).
            positions: ``(Lq,)`` or ``(B, Lq)`` integer tensor, the absolute positions of the query
                tokens, handed to ``rope`` and to the cache; default
                ``kv_cache.next_positions(Lq)`` with a cache (each row continues after its own
                cached tokens), ``arange(Lq)`` without. A cache whose slots follow positions
                (static, sliding, paged) refuses given positions that do not continue each row,
                before storing anything; a call-order cache (dynamic, latent:
                ``places_by_position`` is ``False``) stores in call order and the positions only
                rotate (left-padded prompts, offsets). Without ``rope`` or cache it is checked and
                otherwise unused.
            kv_cache: a :class:`multihead.caches.KVCache` holding the keys and values of the tokens
                before ``query``; self-attention only. The layer projects only ``query``, rotates
                its keys, stores them with :meth:`~multihead.caches.KVCache.update` and attends over
                the slots it returns. ``causal=True`` then means "keys at positions up to the
                query's" (the bottom-right ``causal()`` of the whole sequence), per row for a
                ``StaticKVCache`` whose rows differ in length. A call that raises leaves the cache
                as it was (:meth:`~multihead.caches.KVCache.rollback`).
            need_weights: also return the probabilities ``(B, Hq, Lq, Lk)`` used for the output
                (before dropout). Off by default: the fast path never computes them.
            weights_heads, weights_rows: with ``need_weights``, return only these query heads and
                rows (an int, a sequence of ints, a slice or an integer tensor), weights
                ``(B, len(heads), len(rows), Lk)`` recomputed for the selection alone, as
                :func:`multihead.attention` does (``weights_heads=0, weights_rows=slice(-1, None)``:
                head 0's last row, never the whole square).
            score_mod: a :mod:`multihead.scores` modifier (or list) for this call, as in
                :func:`multihead.attention`.
            key_padding_mask: not taken (PyTorch's ``nn.MultiheadAttention`` argument, ``True`` =
                padding); anything but ``None`` raises a ``TypeError`` that says to pass
                ``mask=multihead.key_padding(lengths_or_table)`` (``True`` = a real key) or to use
                :class:`multihead.compat.MultiheadAttention`, which has PyTorch's signature.

        Returns:
            ``(B, Lq, E)`` (``(Lq, B, E)``), or ``(output, weights)`` when ``need_weights``.
        """
        if (
            key is None
            and value is None
            and positions is None
            and kv_cache is None
            and need_weights is False
            and score_mod is None
            and weights_heads is None
            and weights_rows is None
            and key_padding_mask is None
            and (mask is None or isinstance(mask, Mask))
            and self.rope is None
            and not self.attend.sharded
            and self.score_mod is None
            and self.softcap is None
        ):
            return self._self_attention(query, mask)
        if key_padding_mask is not None:
            _refuse_key_padding_mask(type(self).__name__, key_padding_mask)
        return self._call(
            self.attend,
            query,
            key,
            value,
            mask,
            positions,
            kv_cache,
            need_weights,
            score_mod,
            weights_heads,
            weights_rows,
        )

    def explain(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
        score_mod: ScoreModArg = None,
        weights_heads: Selection = None,
        weights_rows: Selection = None,
    ) -> Explanation:
        """:func:`multihead.explain` for the attention call :meth:`forward` would make with these
        arguments: its shapes ``(B, Hq, Hkv, Lq, Lk, D, Dv)`` after the projections (and the rotation
        and the cache), the layer's mask (``& causal()``) and modifiers, its dropout in training,
        the backend and the kernel. The projections run; attention and ``out_proj`` do not. A cache
        is updated and rolled back: it ends as it was. (The sinks of ``sinks=True`` are not part of
        :func:`multihead.explain`'s report.)"""
        layer = type(self).__name__
        if self.attend.sharded:
            raise ValueError(
                f"{layer}.explain: this layer attends through {self.attend!r}, over a sharded sequence; "
                f"explain reports one multihead.attention call on this process; hint: explain the same "
                f"layer without context_parallel on the whole sequence"
            )
        try:
            self._call(
                _Explaining(self.attend),
                query,
                key,
                value,
                mask,
                positions,
                kv_cache,
                need_weights,
                score_mod,
                weights_heads,
                weights_rows,
            )
        except _Explained as done:
            return done.explanation
        raise AssertionError("unreachable: _Explaining.attend_heads raises")  # pragma: no cover

    def _call(
        self,
        attend: Attend,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        mask: Mask | Tensor | None,
        positions: Tensor | None,
        kv_cache: KVCache | None,
        need_weights: bool,
        score_mod: ScoreModArg,
        weights_heads: Selection,
        weights_rows: Selection,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """:meth:`forward` of every call but the plain one, attending through ``attend``."""
        layer = type(self).__name__
        self_attention = key is None or key is query
        attend.check_call(
            layer,
            self_attention=self_attention,
            kv_cache=kv_cache,
            need_weights=need_weights,
            score_mod=score_mod,
            dropout=self.dropout if self.training else 0.0,
        )
        if kv_cache is not None:
            check_cache(layer, kv_cache, "DynamicKVCache()")
            _check_self_attention(layer, self_attention, key)
        if self.rope is not None and not self_attention:
            raise ValueError(
                f"{layer}: rope rotates the keys at the query positions, so it needs self-attention "
                f"(key=None or key=query), got a separate key of shape "
                f"{tuple(key.shape) if key is not None else None}; hint: use "
                f"a layer with rope=None for cross-attention"
            )
        key = query if key is None else key
        value = key if value is None else value
        check_inputs(
            layer,
            query,
            key,
            value,
            sizes=(self.d_model, self.kdim, self.vdim),
            batch_first=self.batch_first,
            weight=getattr(self.q_proj, "weight", None),
        )
        check_flag(layer, "need_weights", need_weights)
        check_weights_selection(layer, need_weights, weights_heads, weights_rows)
        selection = (weights_heads, weights_rows)
        B, Lq = dims(query, self.batch_first)
        if kv_cache is None:  # (with a cache: over the slots it returns, below)
            mask_q, mask_k = attend.mask_lengths(Lq, dims(key, self.batch_first)[1])  # a shard's: the whole's
            mask, score_mod = self._masks.over_keys(mask, self._score_mods(score_mod), B, mask_q, mask_k)
        given = positions is not None  # a cache continues its rows itself unless told where
        positions = resolve_positions(
            layer, positions, kv_cache, B, Lq, query.device, attend.positions if self.rope is not None else None
        )
        # The arguments are checked. What is left to refuse (a rope result of the wrong shape, keys
        # or positions the cache cannot store, a mask reaching further back than it keeps) is
        # refused before kv_cache.update changes anything; what fails after it (a score modifier
        # this cache's read cannot give indices to, a backend) rolls the cache back.

        # (B, Lq, Hq·D), (B, Lk, Hkv·D), (B, Lk, Hkv·D); L first if not batch_first
        q, k, v = project_qkv(self, query, key, value)
        heads = self._heads(query)
        q = split_heads(q, self.num_heads, self.head_dim, self.batch_first)  # (B, Hq, Lq, D)
        k = split_heads(k, self.num_kv_heads, self.head_dim, self.batch_first)  # (B, Hkv, Lk, D); Lk = Lq with a cache
        v = split_heads(v, self.num_kv_heads, self.head_dim, self.batch_first)  # (B, Hkv, Lk, D)
        if self.rope is not None:
            assert positions is not None  # set above whenever there is a rope
            q = rotate(layer, self.rope, q, positions, "query heads (B, H, L, D)")  # (B, Hq, Lq, D)
            # (B, Hkv, Lq, D), rotated once, before it is cached
            k = rotate(layer, self.rope, k, positions, "key heads (B, H, L, D)")
        if kv_cache is None:
            out, weights = self._attend(attend, q, k, v, mask, score_mod, need_weights, heads, selection)  # (B, Lq, E)
        else:
            call_mods = self._score_mods(score_mod)

            def attend_slots(read: CacheRead) -> tuple[Tensor, Tensor | None]:
                slot_mask, slot_mods = self._masks.over_slots(read, mask, call_mods, B, Lq)
                # pages, quantized slots: a piece at a time (a plain softmax through the default seam)
                if (
                    read.blocks is not None
                    and type(attend) is _Explaining
                    and type(attend.seam) is Attend
                    and heads[0] is None
                    and blocks_take(
                        self,
                        q,
                        read.blocks,
                        slot_mods,
                        self.sinks,
                        self.dropout if self.training else 0.0,
                        need_weights,
                        self.backend,
                    )
                ):
                    raise _Explained(blocks_explanation(q, read, slot_mask))
                if read.blocks is not None and type(attend) is Attend and heads[0] is None:
                    out = attend_blocks(
                        self,
                        q,
                        read.blocks,
                        out_proj=heads[1],
                        mask=slot_mask,
                        score_mod=slot_mods,
                        sinks=self.sinks,
                        dropout_p=self.dropout if self.training else 0.0,
                        need_weights=need_weights,
                        backend=self.backend,
                    )
                    if out is not None:
                        return out, None
                return self._attend(
                    attend, q, read.keys, read.values, slot_mask, slot_mods, need_weights, heads, selection
                )

            out, weights = attend_cached(
                kv_cache,
                k,
                v,
                attend_slots,
                positions=positions,
                given=given,
                mask=mask,
                causal=self.causal,
                queries=q,
                fits=lambda S: self._masks.over_slots_fit(mask, call_mods, B, Lq, S),
                owner=self,
            )
        if not self.batch_first:
            out = out.transpose(0, 1)  # (Lq, B, E), a view
        if need_weights:
            assert weights is not None  # attend returns them when asked (or refuses need_weights)
            return out, weights
        return out

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The :class:`~multihead.distributed.ContextParallel` this layer's input is a shard of
        (its ``attend`` seam's), or ``None``."""
        return getattr(self.attend, "context_parallel", None)

    # ------------------------------------------------------------------------------ helpers
    def _self_attention(self, query: Tensor, mask: Mask | None) -> Tensor:
        """:meth:`forward` of the commonest call, self-attention with at most a mask object on a
        layer without rope, score modifiers or context parallelism: the same checks and steps
        with none of the branches for what the call does not have (its Python cost is most of a
        small call's time, and of a launch-bound step's on a GPU)."""
        check_inputs(
            type(self).__name__,
            query,
            query,
            query,
            sizes=(self.d_model, self.kdim, self.vdim),
            batch_first=self.batch_first,
            weight=getattr(self.q_proj, "weight", None),
        )
        B, L = dims(query, self.batch_first)
        mask, _ = self._masks.over_keys(mask, None, B, L, L)
        q, k, v = project_qkv(self, query, query, query)  # (B, L, Hq·D), (B, L, Hkv·D) x 2; L first if not batch_first
        q = split_heads(q, self.num_heads, self.head_dim, self.batch_first)  # (B, Hq, L, D)
        k = split_heads(k, self.num_kv_heads, self.head_dim, self.batch_first)  # (B, Hkv, L, D)
        v = split_heads(v, self.num_kv_heads, self.head_dim, self.batch_first)  # (B, Hkv, L, D)
        out, _ = self._attend(self.attend, q, k, v, mask, None, False, self._heads(query))  # (B, L, E)
        return out if self.batch_first else out.transpose(0, 1)

    def _attend(
        self,
        attend: Attend,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        score_mod: ScoreModArg,
        need_weights: bool,
        heads: Heads,
        selection: tuple[Selection, Selection] = (None, None),
    ) -> tuple[Tensor, Tensor | None]:
        """The ``attend`` seam (:func:`attend_heads` by default) with this call's ``heads``
        (:meth:`_heads`), and this layer's sinks, dropout and backend."""
        return attend.attend_heads(
            self,
            q,
            k,
            v,
            out_proj=heads[1],
            core=heads[0],
            mask=mask,
            score_mod=score_mod,
            sinks=self.sinks,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            backend=self.backend,
            weights_heads=selection[0],
            weights_rows=selection[1],
        )

    def _heads(self, query: Tensor) -> Heads:
        """How this call's heads become the output: ``(core, out_proj)``
        (:data:`~multihead.layers.heads.Heads`), the attention function and
        ``(B, Lq, Hq·Dv) -> (B, Lq, E)`` applied to the merged heads. Here
        ``(None, self.out_proj)``: :func:`multihead.attention` and the projection; a variant built on this layer
        changes these two steps and nothing else (:class:`~multihead.layers.GatedAttention` gates
        the merged heads by ``query``, :class:`~multihead.layers.DifferentialAttention` attends
        with two maps and normalises each head)."""
        return None, self.out_proj

    def _score_mods(self, call_mod: ScoreModArg) -> list[Any] | None:
        """The layer's modifier (a module is called for it), then the call's, then the softcap."""
        mods: list[Any] = []
        for m in (self.score_mod() if isinstance(self.score_mod, nn.Module) else self.score_mod, call_mod):
            if m is not None:
                mods.extend(m if isinstance(m, (list, tuple)) else [m])
        if self.softcap is not None:
            mods.append(softcap_mod(self.softcap))
        return mods or None

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"head_dim={self.head_dim}")
        if (self.kdim, self.vdim) != (self.d_model, self.d_model):
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        parts += [f"causal={self.causal}", f"batch_first={self.batch_first}"]
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        if self.rope is not None and not isinstance(self.rope, nn.Module):  # a module prints as a child
            parts.append(f"rope={getattr(self.rope, '__name__', type(self.rope).__name__)}")
        if self.score_mod is not None and not isinstance(self.score_mod, nn.Module):
            # described, not repr'd: a bound method of this layer would print the layer again
            described = as_score_mod(self.score_mod)
            parts.append(f"score_mod={described._describe() if described is not None else None}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.sinks is not None:
            parts.append("sinks=True")
        if type(self.attend) is not Attend:
            parts.append(f"attend={self.attend!r}")
        return ", ".join(parts)

    # ------------------------------------------------------------------------------ conversion
    @classmethod
    def from_torch(cls, module: nn.Module) -> MultiHeadAttention:
        """A :class:`MultiHeadAttention` computing what ``module`` computes.

        ``module`` is a ``torch.nn.MultiheadAttention`` (or :class:`multihead.compat.MultiheadAttention`);
        its weights are copied (not shared), its layout, dropout, device, dtype and train/eval
        mode kept. ``add_bias_kv``/``add_zero_attn`` have no native equivalent: keep those modules
        as :class:`multihead.compat.MultiheadAttention`. Always returns a ``MultiHeadAttention``.
        """
        return from_torch(module, cls)

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention`` computing what this layer computes (weights copied).

        Needs ``num_kv_heads == num_heads``, ``head_dim == d_model // num_heads`` and
        ``causal=False`` (PyTorch's class has no causal flag: pass ``is_causal``/``attn_mask`` at
        call time). A bias this layer lacks but PyTorch's single ``bias`` flag requires is created
        as zeros, which computes the same function. A layer with ``rope`` has no equivalent.
        """
        if self.rope is not None:
            raise ValueError(
                f"{type(self).__name__}.to_torch: this layer rotates queries and keys with "
                f"rope={self.rope!r}, which torch.nn.MultiheadAttention cannot; needs rope=None"
            )
        for name in ("score_mod", "softcap", "sinks"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{type(self).__name__}.to_torch: this layer has {name}={getattr(self, name)!r}, "
                    f"which torch.nn.MultiheadAttention cannot express; needs {name}=None"
                )
        return to_torch(self)


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` K/V heads, query
    head ``h`` reading K/V head ``h // (num_heads // num_kv_heads)``. For example
    ``num_heads=8, num_kv_heads=2``: query heads 0-3 read K/V head 0, heads 4-7 read head 1.

    Other keyword arguments as in :class:`MultiHeadAttention`.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, **options: Any):
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, **options)


class MultiQueryAttention(MultiHeadAttention):
    """Multi-query attention: ``num_heads`` query heads share one K/V head of size ``head_dim``.

    Other keyword arguments as in :class:`MultiHeadAttention`.
    """

    def __init__(self, d_model: int, num_heads: int, **options: Any):
        if "num_kv_heads" in options:
            raise TypeError(
                "MultiQueryAttention has exactly one K/V head; use GroupedQueryAttention "
                f"for num_kv_heads={options['num_kv_heads']!r}"
            )
        super().__init__(d_model, num_heads, num_kv_heads=1, **options)


# help(MultiHeadAttention.__init__) shows the arguments, not the text of nn.Module.__init__
# (a method without a docstring inherits its parent's in help() and inspect.getdoc).
for _layer in (MultiHeadAttention, GroupedQueryAttention, MultiQueryAttention):
    _layer.__init__.__doc__ = _layer.__doc__


# ---------------------------------------------------------------------------------- helpers
def _refuse_key_padding_mask(layer: str, key_padding_mask: object) -> NoReturn:
    """PyTorch's ``key_padding_mask=`` (``True`` = padding) given to this layer: say what to write."""
    shape = tuple(key_padding_mask.shape) if isinstance(key_padding_mask, Tensor) else None
    raise TypeError(
        f"{layer}.forward() takes no key_padding_mask (got {type(key_padding_mask).__name__}"
        f"{f' of shape {shape}' if shape is not None else ''}): that is nn.MultiheadAttention's argument. "
        "Pass mask=multihead.key_padding(lengths_or_table) instead, with lengths (B,) or a bool (B, Lk) "
        "table in which True = a real key, the opposite of PyTorch's key_padding_mask (True = padding): "
        "mask=multihead.key_padding(~key_padding_mask). Or use multihead.compat.MultiheadAttention, "
        "which takes PyTorch's signature"
    )


def _qkv_biases(layer: str, qkv_bias: object) -> tuple[bool, bool, bool]:
    if isinstance(qkv_bias, bool):
        return qkv_bias, qkv_bias, qkv_bias
    if isinstance(qkv_bias, tuple) and len(qkv_bias) == 3 and all(isinstance(b, bool) for b in qkv_bias):
        return qkv_bias
    raise TypeError(f"{layer}: qkv_bias must be a bool or a tuple of three bools (q, k, v), got {qkv_bias!r}")


def _check_self_attention(layer: str, self_attention: bool, key: Tensor | None) -> None:
    """A cache stores the keys of the query tokens: self-attention only."""
    if not self_attention:
        raise ValueError(
            f"{layer}: kv_cache is only valid for self-attention (key=None or key=query): the cache "
            f"stores the keys of the query tokens; got a separate key of shape "
            f"{tuple(key.shape) if key is not None else None}; "
            f"hint: for cross-attention project the memory once and call without kv_cache"
        )


class _Explained(Exception):  # noqa: N818 (not an error: how explain() leaves the call, rolling a cache back)
    def __init__(self, explanation: Explanation):
        super().__init__()
        self.explanation = explanation


class _Explaining(Attend):
    """A layer's own seam for every step, except that the attention is explained, not run."""

    def __init__(self, seam: Attend):
        self.seam = seam
        self.check_call = seam.check_call  # type: ignore[method-assign]
        self.mask_lengths = seam.mask_lengths  # type: ignore[method-assign]
        self.positions = seam.positions  # type: ignore[method-assign]

    def attend_heads(
        self,
        layer: nn.Module,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        score_mod: ScoreModArg = None,
        dropout_p: float = 0.0,
        need_weights: bool = False,
        backend: str = "auto",
        weights_heads: Selection = None,
        weights_rows: Selection = None,
        core: Callable[..., Any] | None = None,
        **unexplained: object,  # out_proj, sinks
    ) -> NoReturn:
        # A variant's core attends its own way (two maps, a selection) and explains that way.
        explain_call = explain if core is None else core.explain  # type: ignore[attr-defined]
        raise _Explained(
            explain_call(
                q,
                k,
                v,
                mask=mask,
                score_mod=score_mod,
                dropout_p=dropout_p,
                return_weights=need_weights,
                backend=backend,
                weights_heads=weights_heads,
                weights_rows=weights_rows,
            )
        )


def _attend_seam(layer: str, attend: object, cp: object) -> Attend:
    """The layer's ``attend`` seam: given, built from ``context_parallel``, or the default."""
    if attend is not None:
        if cp is not None:
            raise TypeError(
                f"{layer}: give attend or context_parallel, not both (context_parallel={cp!r} builds "
                f"its own attend seam); got attend={attend!r}"
            )
        if not isinstance(attend, Attend):
            raise TypeError(
                f"{layer}: attend must be None or a multihead.layers.heads.Attend (subclass it to attend "
                f"another way), got {type(attend).__name__}"
            )
        return attend
    if cp is None:
        return _LOCAL
    from multihead.distributed import ContextParallel, ContextParallelAttend  # floor 3: imported only when used

    if not isinstance(cp, ContextParallel):
        raise TypeError(
            f"{layer}: context_parallel must be None or a multihead.distributed.ContextParallel, "
            f"got {type(cp).__name__}"
        )
    return ContextParallelAttend(cp)


_LOCAL = Attend()  # the default seam holds nothing: one for every layer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
