"""``DifferentialAttention``: the difference of two softmax maps (Ye et al., DIFF Transformer).

Notation of :mod:`multihead.conventions`; each head's query and key of ``D`` features are two
halves of ``d = D / 2``, its value is ``D`` wide. Per head ``h`` (reading KV head ``g(h)``)::

    [q1 | q2] = q_h,   [k1 | k2] = k_g(h)                                     (·, d) each
    A1 = softmax(q1 k1ᵀ / sqrt(d)),   A2 = softmax(q2 k2ᵀ / sqrt(d))          (Lq, Lk)
    λ  = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init                             one scalar per layer
    o_h = (1 - λ_init) · RMSNorm((A1 - λ A2) V_g(h))                          (Lq, D), the norm per head
    y   = [o_1 | ... | o_Hq] W_O + b_O
    λ_init = 0.8 − 0.6 · exp(−0.3 · (depth − 1)),  depth = the layer's index from 1

``A1 V`` and ``A2 V`` are two calls of :func:`multihead.attention` (with the other half of the
query zeroed: :class:`DifferentialCore`), so every mask, score modifier, backend and cache of
:class:`~multihead.layers.MultiHeadAttention` applies to both maps; the layer *is* one, with its
projections (``q_proj: E -> Hq·D`` holds head ``h``'s ``[q1 | q2]`` at rows ``[h·D, (h+1)·D)``,
as the paper's code lays them out), whose attention function and last step
(:meth:`~multihead.layers.MultiHeadAttention._heads`) are these. A cache stores the keys and values
once, ``D`` wide, as the plain layer's.

GQA maps both halves of query head ``h`` to the same halves of KV head ``h // (Hq / Hkv)``, as the
paper's FlashAttention version does (its ``repeat_kv`` version, with ``Hkv < Hq``, pairs the
halves differently).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import attention
from multihead.call import AttentionResult
from multihead.explain import Explanation, explain
from multihead.layers.attend import check_rope
from multihead.layers.heads import Heads
from multihead.layers.multihead import MultiHeadAttention
from multihead.layers.norm import RMSNorm

__all__ = ["DifferentialAttention", "DifferentialCore", "lambda_init"]


def lambda_init(depth: int) -> float:
    """``λ_init = 0.8 − 0.6 · exp(−0.3 · (depth − 1))`` for the layer at ``depth`` (from 1): 0.2
    for the first layer, towards 0.8 for deep ones."""
    return 0.8 - 0.6 * math.exp(-0.3 * (depth - 1))


class DifferentialAttention(MultiHeadAttention):
    """Differential attention with ``Hq`` heads of ``D`` features (two maps of ``D / 2`` each).

    Args:
        d_model, num_heads: as :class:`~multihead.layers.MultiHeadAttention`; ``head_dim`` ``D``
            (default ``d_model // num_heads``) must be even. The paper halves the head count of
            the Transformer it replaces, so that ``D`` doubles and the parameters stay the same.
        num_kv_heads: ``Hkv``; default ``num_heads``.
        depth: the layer's index in its model, from 1; sets ``λ_init`` (:func:`lambda_init`).
        lambda_init: ``λ_init`` itself, instead of the one ``depth`` gives (the paper's ablation
            uses a constant 0.8 or 0.5).
        norm_eps: ``ε`` of the per-head RMSNorm (the paper's code uses 1e-5).
        rope: as :class:`~multihead.layers.MultiHeadAttention`'s, but rotating ``D / 2`` features
            (``RotaryEmbedding(D // 2)``): it is applied to each half alone, as the paper's code does.
        **options: every other argument of :class:`~multihead.layers.MultiHeadAttention` (``causal``,
            ``dropout`` (each map its own), ``score_mod`` and ``sinks`` (each map),
            ``batch_first``, ``backend``, ...); not ``attend`` or ``context_parallel``.

    Parameters beyond the plain layer's: ``lambda_q1``, ``lambda_k1``, ``lambda_q2``,
    ``lambda_k2`` ``(D / 2,)`` (initialised from ``N(0, 0.1²)``, as the paper's code) and ``subln``,
    the per-head :class:`~multihead.layers.norm.RMSNorm` of ``D`` features. ``need_weights``
    returns the combined map ``A1 - λ A2`` (rows sum to ``1 - λ``, entries may be negative).
    Hooks: ``q``/``k`` see both halves, ``output`` sees ``(A1 - λ A2) V`` before the norm;
    ``scores``/``pattern`` are refused (there are two).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        depth: int = 1,
        lambda_init: float | None = None,
        norm_eps: float = 1e-5,
        rope: Callable[[Tensor, Tensor], Tensor] | None = None,
        **options: Any,
    ):
        layer = type(self).__name__
        for name in ("attend", "context_parallel"):
            if options.get(name) is not None:
                raise TypeError(
                    f"{layer}: {name} is not supported (it attends in one call; this layer attends "
                    f"with two maps), got {name}={options[name]!r}"
                )
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"{layer}: depth must be the layer's index from 1 (an int >= 1), got {depth!r}")
        init = _lambda_init(layer, depth, lambda_init)
        # finite too: ε = inf passed `> 0` and the norm made every output exactly 0, silently
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not 0 < norm_eps < math.inf:
            raise ValueError(f"{layer}: norm_eps must be a positive finite number, got {norm_eps!r}")
        check_rope(layer, rope)  # before it is wrapped
        super().__init__(
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            rope=None if rope is None else _Halves(rope),
            **options,
        )
        if self.head_dim % 2:
            raise ValueError(
                f"{layer}: head_dim must be even (each head's query and key split into two halves), "
                f"got head_dim={self.head_dim}; hint: pass head_dim= explicitly or change num_heads"
            )
        half = self.head_dim // 2
        rope_dim = getattr(rope, "dim", None)
        if isinstance(rope_dim, int) and rope_dim != half:
            raise ValueError(
                f"{layer}: rope rotates {rope_dim} features but each half of a head has "
                f"head_dim // 2 = {half}; expected RotaryEmbedding({half}, ...)"
            )
        self.depth, self.lambda_init = depth, init
        weight = self.q_proj.weight
        factory: dict[str, Any] = {"device": weight.device, "dtype": weight.dtype}
        self.lambda_q1 = nn.Parameter(torch.zeros(half, **factory).normal_(0, 0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(half, **factory).normal_(0, 0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(half, **factory).normal_(0, 0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(half, **factory).normal_(0, 0.1))
        self.subln = RMSNorm(self.head_dim, eps=float(norm_eps), **factory)

    def lambda_full(self) -> Tensor:
        """``λ = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init``, a 0-dim tensor of the parameters' dtype
        (computed in fp32 at least, as the paper's code)."""
        compute = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        dot1 = (self.lambda_q1.to(compute) * self.lambda_k1.to(compute)).sum()
        dot2 = (self.lambda_q2.to(compute) * self.lambda_k2.to(compute)).sum()
        return (torch.exp(dot1) - torch.exp(dot2) + self.lambda_init).to(self.lambda_q1.dtype)

    def _heads(self, query: Tensor) -> Heads:
        """Two maps combined by ``λ`` (:class:`DifferentialCore`); each head normalised, scaled by
        ``1 - λ_init``, then ``out_proj``."""
        return DifferentialCore(self.lambda_full(), self.head_dim // 2), self._normed_out

    def _normed_out(self, merged: Tensor) -> Tensor:
        """``(B, Lq, Hq·D) -> out_proj((1 - λ_init) · RMSNorm(each head)) (B, Lq, E)``."""
        heads = self.subln(merged.unflatten(-1, (self.num_heads, self.head_dim)))  # (B, Lq, Hq, D)
        out: Tensor = self.out_proj((heads * (1 - self.lambda_init)).flatten(-2))  # (B, Lq, E)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, depth={self.depth}, lambda_init={self.lambda_init:g}"

    @classmethod
    def from_torch(cls, module: nn.Module) -> MultiHeadAttention:
        raise TypeError(
            f"{cls.__name__}.from_torch: torch.nn.MultiheadAttention has one softmax map per head, "
            f"not two; hint: MultiHeadAttention.from_torch(module)"
        )

    def to_torch(self) -> nn.MultiheadAttention:
        raise TypeError(
            f"{type(self).__name__}.to_torch: torch.nn.MultiheadAttention cannot compute the difference of two maps"
        )


DifferentialAttention.__init__.__doc__ = DifferentialAttention.__doc__


class DifferentialCore:
    """``(A1 - λ A2) V`` with :func:`multihead.attention`'s signature: the attention function of a
    :class:`DifferentialAttention` call (``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
    ``v (B, Hkv, Lk, Dv)``, ``D = 2·half``). Every option is passed to both calls; with
    ``return_weights`` the result's ``weights`` are ``A1 - λ A2`` and its ``lse`` is ``None`` (a
    difference of two maps has no log-sum-exp).

    Each map is one call with the other half of the *query* zeroed, ``[q1 | 0] · [k1 | k2] = q1 · k1``,
    at the scale ``1 / sqrt(half)``: the keys and values are read as they are (from a cache, no
    copy), and ``D = Dv`` as the fused kernels want (keys of ``D / 2`` against values of ``D``
    would be padded to ``D`` by the backend, and both halves of ``q`` and ``k`` copied)."""

    def __init__(self, lam: Tensor, half: int):
        self.lam, self.half = lam, half

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor | AttentionResult:
        scale = 1 / math.sqrt(self.half)
        first = attention(self._map(q, 0), k, v, scale=scale, **options)  # A1 V (B, Hq, Lq, Dv)
        second = attention(self._map(q, 1), k, v, scale=scale, **options)  # A2 V
        if isinstance(first, Tensor):
            assert isinstance(second, Tensor)  # the same options ask for the same result
            return torch.addcmul(first, self.lam, second, value=-1)  # A1 V - λ A2 V, one pass
        assert isinstance(second, AttentionResult)
        weights = None
        if first.weights is not None and second.weights is not None:
            weights = first.weights - self.lam.to(first.weights.dtype) * second.weights
        return AttentionResult(first.output - self.lam * second.output, weights, None)

    def explain(self, q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Explanation:
        """:func:`multihead.explain` of the first map's call (the second's is the same call on the
        other half of ``q``)."""
        return explain(self._map(q, 0), k, v, scale=1 / math.sqrt(self.half), **options)

    def _map(self, q: Tensor, which: int) -> Tensor:
        """``[q1 | 0]`` (``which=0``) or ``[0 | q2]``, ``(B, Hq, Lq, D)``."""
        d = self.half
        return F.pad(q[..., :d], (0, d)) if which == 0 else F.pad(q[..., d:], (d, 0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(half={self.half})"


class _Halves(nn.Module):
    """``rope`` applied to each half of a head's ``D`` features alone: ``(B, H, L, D) -> (B, H, L, D)``."""

    def __init__(self, rope: Callable[[Tensor, Tensor], Tensor]):
        super().__init__()
        self.rope = rope  # an nn.Module is registered (its buffers follow .to())

    @property
    def dim(self) -> int | None:
        rope_dim = getattr(self.rope, "dim", None)
        return 2 * rope_dim if isinstance(rope_dim, int) else None

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        first, second = x.chunk(2, dim=-1)  # (B, H, L, D/2) each
        return torch.cat([self.rope(first, positions), self.rope(second, positions)], dim=-1)


def _lambda_init(layer: str, depth: int, value: object) -> float:
    if value is None:
        return lambda_init(depth)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{layer}: lambda_init must be a finite number (or None: from depth), got {value!r}")
    if not 0 <= value < 1:  # the heads are scaled by 1 - λ_init: 0 erases the output, below 0 flips it
        raise ValueError(
            f"{layer}: lambda_init must be in [0, 1) (the heads are scaled by 1 - lambda_init), got {value!r}"
        )
    return float(value)
