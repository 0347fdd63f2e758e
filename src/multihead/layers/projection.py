"""A layer's three input projections, ``q_proj``, ``k_proj`` and ``v_proj``, as one matmul where
the inputs allow it::

    self-attention     x (B, L, E) @ [W_q; W_k; W_v]ᵀ -> (B, L, Hq·D + 2·Hkv·D) -split-> q, k, v
    key is value       q_proj(query);  memory @ [W_k; W_v]ᵀ -split-> k, v
    otherwise          q_proj(query), k_proj(key), v_proj(value)

The joined weights are derived from the parameters on every call and never kept: a copy kept
between calls goes stale when the weights change through ``.data`` (EMA updates, hand-written
init), which moves no version counter. So the join happens only where it is cheap next to what it
saves:

* with gradients (training): the concatenation is part of the graph, one pass over ``x`` and one
  matmul in the backward, like a hand-fused ``qkv`` layer;
* without gradients on CPU the projections run apart: per decode step the copy of the weights
  would cost as much as the matmul it saves;
* without gradients on CUDA, self-attention joins them on every call: a launch-bound step pays
  for each launch on the host, and the copy costs the GPU next to nothing
  (docs/performance.md#on-the-gpu-h100, "The layer");
* under ``torch.compile`` they run apart (the compiler fuses what it can).

A projection that is not a plain ``nn.Linear`` (LoRA, quantized) or has hooks is always called
itself, never bypassed.

Every projection of a decode step goes through :func:`project`: a plain ``nn.Linear`` applied to
a few bf16 rows on the CPU without gradients runs the one-token kernel
(:mod:`multihead.backends.cpu_gemv`), which reads the weights once at the memory's speed where
PyTorch's bf16 GEMM reads them at about half of it (docs/inference.md#one-token-projections).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from multihead.backends import cpu_gemv

__all__ = ["project", "project_qkv", "unhooked"]

#: ``nn.Linear`` and the subclass ``nn.MultiheadAttention`` names its ``out_proj`` (the same forward)
_LINEARS = (nn.Linear, NonDynamicallyQuantizableLinear)


def project(linear: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``linear(x)``, on the one-token kernel where it takes the call (the module docstring):
    ``linear`` a plain ``nn.Linear`` without hooks (anything else is called), ``x`` 1 to 4 rows of
    bf16 on the CPU, no gradient wanted, outside ``torch.compile``
    (:func:`multihead.backends.cpu_gemv.supports`; where it does not, ``F.linear``: what a plain
    ``nn.Linear`` runs)."""
    if x.dtype == torch.bfloat16 and x.is_cpu and isinstance(linear, nn.Module) and _plain(linear):
        params = linear._parameters  # (a plain nn.Linear's parameters, read without __getattr__)
        weight = params["weight"]
        assert weight is not None
        return cpu_gemv.linear(x, weight, params["bias"])
    out: Tensor = linear(x)
    return out


def unhooked(m: nn.Module) -> bool:
    """No forward hook on ``m`` and none registered for every module: calling its parts instead of
    ``m`` itself skips nothing a user asked to see."""
    return not (
        m._forward_hooks or m._forward_pre_hooks or _module._global_forward_hooks or _module._global_forward_pre_hooks
    )


def _plain(m: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a LoRA or quantized replacement, whose forward must run; PyTorch's
    ``NonDynamicallyQuantizableLinear`` is one) without hooks (:func:`unhooked`)."""
    return type(m) in _LINEARS and unhooked(m)


def project_qkv(layer: nn.Module, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``layer.q_proj(query), layer.k_proj(key), layer.v_proj(value)``, joined as the module
    docstring says: ``(B, Lq, Hq·D), (B, Lk, Hkv·D), (B, Lk, Hkv·D)`` (``L`` first when the
    inputs are). ``key is query`` (and ``value is key``) is how a caller says self-attention."""
    modules = layer._modules  # read once: each attribute read of a submodule is a Python call
    q_proj, k_proj, v_proj = modules["q_proj"], modules["k_proj"], modules["v_proj"]
    assert q_proj is not None and k_proj is not None and v_proj is not None  # set in the layer's __init__
    if torch.compiler.is_compiling():  # apart: the compiler fuses what it can
        return q_proj(query), k_proj(key), v_proj(value)
    if not torch.is_grad_enabled():
        if query.is_cuda and key is query and value is query and _fusable(q_proj, k_proj, v_proj):
            q, k, v = _fused_linear(query, (q_proj, k_proj, v_proj), *_concatenated((q_proj, k_proj, v_proj)))
            return q, k, v
        return project(q_proj, query), project(k_proj, key), project(v_proj, value)
    if key is query and value is query and _fusable(q_proj, k_proj, v_proj):
        q, k, v = _fused(query, (q_proj, k_proj, v_proj))
        return q, k, v
    q = q_proj(query)
    if value is key and _fusable(k_proj, v_proj):
        k, v = _fused(key, (k_proj, v_proj))
        return q, k, v
    return q, k_proj(key), v_proj(value)


def _fused(x: Tensor, linears: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """``linears`` applied to one input ``x`` with gradients on: one matmul by the joined weights
    when any of them wants a gradient (the join is then in the graph), else apart."""
    if not any(p.requires_grad for m in linears for p in m.parameters()):
        return tuple(m(x) for m in linears)
    return _fused_linear(x, linears, *_concatenated(linears))


def _fusable(*linears: nn.Module) -> bool:
    """Whether these projections may be run as one matmul: plain ``nn.Linear`` (not a LoRA or
    quantized replacement, whose forward must run), without hooks, biased alike."""
    if not all(_plain(m) for m in linears):
        return False
    first = linears[0]._parameters  # (a plain nn.Linear's parameters, read without __getattr__)
    return all(
        (m._parameters["bias"] is None) == (first["bias"] is None)
        and m._parameters["weight"].dtype == first["weight"].dtype  # type: ignore[union-attr]
        for m in linears
    )


def _concatenated(linears: tuple[nn.Module, ...]) -> tuple[Tensor, Tensor | None]:
    """The weights ``(sum of out_features, in_features)`` and biases of :func:`_fusable` linears,
    joined now, from the parameters as they are now."""
    params = [m._parameters for m in linears]
    weight = torch.cat([p["weight"] for p in params])  # type: ignore[misc]
    bias = None if params[0]["bias"] is None else torch.cat([p["bias"] for p in params])  # type: ignore[misc]
    return weight, bias


def _fused_linear(x: Tensor, linears: tuple[nn.Module, ...], weight: Tensor, bias: Tensor | None) -> tuple[Tensor, ...]:
    return tuple(F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1))
