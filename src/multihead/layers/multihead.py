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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import attention
from multihead.backends.registry import check_backend_name
from multihead.capture import is_capturing, record
from multihead.layers.convert import from_torch, to_torch
from multihead.layers.checks import check_dropout, check_flag, check_inputs, check_optional_size, check_size, dims
from multihead.layers.heads import merge_heads, split_heads
from multihead.masks import Mask, as_mask
from multihead.masks import causal as causal_mask

__all__ = ["MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention"]


class MultiHeadAttention(nn.Module):
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
        device, dtype: of the parameters.

    Parameters live in four ``nn.Linear`` submodules, ``q_proj`` (``E -> Hq·D``, head ``h`` at
    output rows ``[h·D, (h+1)·D)``), ``k_proj`` (``kdim -> Hkv·D``), ``v_proj``
    (``vdim -> Hkv·D``) and ``out_proj`` (``Hq·D -> E``): the names of Hugging Face and
    torchtune checkpoints.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, kdim: int | None = None, vdim: int | None = None,
                 qkv_bias: bool | tuple[bool, bool, bool] = True, out_bias: bool = True, dropout: float = 0.0,
                 causal: bool = False, batch_first: bool = True, backend: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        layer = type(self).__name__
        d_model = check_size(layer, "d_model", d_model)
        num_heads = check_size(layer, "num_heads", num_heads)
        num_kv_heads = check_optional_size(layer, "num_kv_heads", num_kv_heads, num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{layer}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}; "
                             f"num_kv_heads must divide num_heads (one of {_divisors(num_heads)})")
        if head_dim is None:
            if d_model % num_heads != 0:
                raise ValueError(f"{layer}: d_model={d_model} is not divisible by num_heads={num_heads}; "
                                 f"use num_heads in {_divisors(d_model)} or pass head_dim explicitly")
            head_dim = d_model // num_heads
        head_dim = check_size(layer, "head_dim", head_dim)
        kdim = check_optional_size(layer, "kdim", kdim, d_model)
        vdim = check_optional_size(layer, "vdim", vdim, d_model)
        q_bias, k_bias, v_bias = _qkv_biases(layer, qkv_bias)
        out_bias = check_flag(layer, "out_bias", out_bias)
        if not isinstance(backend, str):
            raise TypeError(f"{layer}: backend must be a str ('auto' or a registered name), got {type(backend).__name__}")
        check_backend_name(backend)

        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.kdim, self.vdim = kdim, vdim
        self.dropout = check_dropout(layer, dropout)
        self.causal = check_flag(layer, "causal", causal)
        self.batch_first = check_flag(layer, "batch_first", batch_first)
        self.backend = backend
        # Masks are immutable, so the causal mask is built once (no object creation per call,
        # nothing for torch.compile to trace).
        self._causal_mask = causal_mask() if causal else None

        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=q_bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=k_bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=v_bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=out_bias, **factory)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                mask: Mask | Tensor | None = None, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: ``(B, Lq, E)`` (``(Lq, B, E)`` when ``batch_first=False``).
            key: ``(B, Lk, kdim)``; default ``query`` (self-attention).
            value: ``(B, Lk, vdim)``; default ``key``.
            mask: a mask object (``multihead.causal()``, ``key_padding(lengths)``, ...) or a bool
                (``True`` = may attend) or float (additive) tensor broadcastable to
                ``(B, Hq, Lq, Lk)``. With ``causal=True`` it is combined as ``mask & causal()``.
            need_weights: also return the probabilities ``(B, Hq, Lq, Lk)`` used for the output
                (before dropout). Off by default: the fast path never computes them.

        Returns:
            ``(B, Lq, E)`` (``(Lq, B, E)``), or ``(output, weights)`` when ``need_weights``.
        """
        key = query if key is None else key
        value = key if value is None else value
        check_inputs(type(self).__name__, query, key, value, sizes=(self.d_model, self.kdim, self.vdim),
                     batch_first=self.batch_first)
        check_flag(type(self).__name__, "need_weights", need_weights)
        B, Lq = dims(query, self.batch_first)
        Lk = dims(key, self.batch_first)[1]
        mask = self._combined_mask(mask, B, Lq, Lk)

        q, k, v = self._project(query, key, value)  # (B, Lq, Hq·D), (B, Lk, Hkv·D), (B, Lk, Hkv·D); L first if not batch_first
        q = split_heads(q, self.num_heads, self.head_dim, self.batch_first)  # (B, Hq, Lq, D)
        k = split_heads(k, self.num_kv_heads, self.head_dim, self.batch_first)  # (B, Hkv, Lk, D)
        v = split_heads(v, self.num_kv_heads, self.head_dim, self.batch_first)  # (B, Hkv, Lk, D)

        capturing = is_capturing(self)
        want_weights = need_weights or capturing
        result = attention(q, k, v, mask=mask, dropout_p=self.dropout if self.training else 0.0,
                           return_weights=want_weights, backend=self.backend)
        y, weights = (result.output, result.weights) if want_weights else (result, None)  # (B, Hq, Lq, D)
        if capturing:
            record(self, weights)

        out = self.out_proj(merge_heads(y))  # (B, Lq, E)
        if not self.batch_first:
            out = out.transpose(0, 1)  # (Lq, B, E), a view
        return (out, weights) if need_weights else out

    # ------------------------------------------------------------------------------ helpers
    def _combined_mask(self, mask, B: int, Lq: int, Lk: int) -> Mask | None:
        """The call's mask, checked against ``(B, Hq, Lq, Lk)`` before any work, ``& causal()``."""
        mask = as_mask(mask)
        if mask is not None:
            mask.check(B, self.num_heads, Lq, Lk)
        if self._causal_mask is None:
            return mask
        return self._causal_mask if mask is None else mask & self._causal_mask

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The three input projections, as one matmul where the inputs allow it.

        Self-attention (``key is value is query``) multiplies by the concatenated q/k/v weights
        once, like a hand-fused ``qkv`` layer: one pass over ``query`` instead of three. The
        concatenation costs a copy of the weights (about 0.2 ms at E=768), cheap next to the matmul.
        """
        if key is query and value is query and _fusable(self.q_proj, self.k_proj, self.v_proj):
            q, k, v = _fused_linear(query, (self.q_proj, self.k_proj, self.v_proj))
            return q, k, v
        q = self.q_proj(query)
        if value is key and _fusable(self.k_proj, self.v_proj):
            k, v = _fused_linear(key, (self.k_proj, self.v_proj))
            return q, k, v
        return q, self.k_proj(key), self.v_proj(value)

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
        return ", ".join(parts)

    # ------------------------------------------------------------------------------ conversion
    @classmethod
    def from_torch(cls, module: nn.Module) -> "MultiHeadAttention":
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
        as zeros, which computes the same function.
        """
        return to_torch(self)


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` K/V heads, query
    head ``h`` reading K/V head ``h // (num_heads // num_kv_heads)``. For example
    ``num_heads=8, num_kv_heads=2``: query heads 0-3 read K/V head 0, heads 4-7 read head 1.

    Other keyword arguments as in :class:`MultiHeadAttention`.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, **options):
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, **options)


class MultiQueryAttention(MultiHeadAttention):
    """Multi-query attention: ``num_heads`` query heads share one K/V head of size ``head_dim``.

    Other keyword arguments as in :class:`MultiHeadAttention`.
    """

    def __init__(self, d_model: int, num_heads: int, **options):
        if "num_kv_heads" in options:
            raise TypeError("MultiQueryAttention has exactly one K/V head; use GroupedQueryAttention "
                            f"for num_kv_heads={options['num_kv_heads']!r}")
        super().__init__(d_model, num_heads, num_kv_heads=1, **options)


# ---------------------------------------------------------------------------------- helpers
def _qkv_biases(layer: str, qkv_bias) -> tuple[bool, bool, bool]:
    if isinstance(qkv_bias, bool):
        return qkv_bias, qkv_bias, qkv_bias
    if isinstance(qkv_bias, tuple) and len(qkv_bias) == 3 and all(isinstance(b, bool) for b in qkv_bias):
        return qkv_bias
    raise TypeError(f"{layer}: qkv_bias must be a bool or a tuple of three bools (q, k, v), got {qkv_bias!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fusable(*linears: nn.Module) -> bool:
    """Whether these projections may be run as one matmul: plain ``nn.Linear`` (not a LoRA or
    quantized replacement, whose forward must run), without hooks, biased alike."""
    first = linears[0]
    return all(
        type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks
        and (m.bias is None) == (first.bias is None) and m.weight.dtype == first.weight.dtype
        for m in linears
    )


def _fused_linear(x: Tensor, linears: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
    weight = torch.cat([m.weight for m in linears])  # (sum of out_features, in_features)
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1)
