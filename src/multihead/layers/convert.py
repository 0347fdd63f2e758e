"""Conversion between :class:`MultiHeadAttention` and ``torch.nn.MultiheadAttention``.

PyTorch packs the three input projections into ``in_proj_weight (3E, E)`` (rows ``[0, E)`` the
query, ``[E, 2E)`` the key, ``[2E, 3E)`` the value) when ``kdim == vdim == E``, or keeps them as
``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` otherwise; the biases are always packed in
``in_proj_bias (3E,)``. Head ``h`` occupies rows ``[h·D, (h+1)·D)`` of each block, the layout of
``q_proj``/``k_proj``/``v_proj`` here, so conversion is a copy of slices in both directions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn

from multihead.layers.compat import MultiheadAttention as CompatMHA

__all__ = ["Convertible", "from_torch", "to_torch"]


class Convertible(Protocol):
    """What conversion reads and writes of a layer: :class:`MultiHeadAttention` is one. (The layer
    imports this module, so this module names the layer by what it has, not by its class: no
    import cycle, not even one for type checking.)"""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kdim: int
    vdim: int
    causal: bool
    dropout: float
    batch_first: bool
    training: bool
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Linear

    def train(self, mode: bool = True) -> nn.Module: ...


Layer = TypeVar("Layer", bound=Convertible)


def from_torch(module: nn.Module, layer_class: Callable[..., Layer]) -> Layer:
    """See :meth:`MultiHeadAttention.from_torch`; ``layer_class`` is the class to build (the layer
    passes itself)."""
    if not isinstance(module, (nn.MultiheadAttention, CompatMHA)):
        raise TypeError(
            "MultiHeadAttention.from_torch expects a torch.nn.MultiheadAttention "
            f"(or multihead.compat.MultiheadAttention), got {type(module).__name__}"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "MultiHeadAttention.from_torch: this module uses add_bias_kv/add_zero_attn, which "
            "MultiHeadAttention does not model; use multihead.compat.MultiheadAttention and "
            "load_state_dict(module.state_dict()) instead"
        )
    E, reference = module.embed_dim, module.out_proj.weight
    has_in_bias = module.in_proj_bias is not None
    layer = layer_class(
        E,
        module.num_heads,
        kdim=module.kdim,
        vdim=module.vdim,
        qkv_bias=has_in_bias,
        out_bias=module.out_proj.bias is not None,
        dropout=float(module.dropout),
        batch_first=module.batch_first,
        device=reference.device,
        dtype=reference.dtype,
    )
    with torch.no_grad():
        weights: tuple[Tensor, ...]
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.chunk(3)
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        biases: tuple[Tensor | None, ...] = module.in_proj_bias.chunk(3) if has_in_bias else (None, None, None)
        for proj, weight, bias in zip((layer.q_proj, layer.k_proj, layer.v_proj), weights, biases):
            proj.weight.copy_(weight)
            if bias is not None:
                proj.bias.copy_(bias)
        layer.out_proj.weight.copy_(module.out_proj.weight)
        if module.out_proj.bias is not None:
            layer.out_proj.bias.copy_(module.out_proj.bias)
    layer.train(module.training)
    return layer


def to_torch(layer: Convertible) -> nn.MultiheadAttention:
    """See :meth:`MultiHeadAttention.to_torch`."""
    problems = []
    if layer.num_kv_heads != layer.num_heads:
        problems.append(
            f"num_kv_heads={layer.num_kv_heads} != num_heads={layer.num_heads} "
            "(nn.MultiheadAttention has no grouped-query attention)"
        )
    if layer.num_heads * layer.head_dim != layer.d_model:
        problems.append(
            f"num_heads * head_dim = {layer.num_heads * layer.head_dim} != d_model={layer.d_model} "
            "(nn.MultiheadAttention fixes head_dim = embed_dim // num_heads)"
        )
    if layer.causal:
        problems.append(
            "causal=True (nn.MultiheadAttention has no causal flag: build the layer with "
            "causal=False and pass is_causal=True with a causal attn_mask at call time)"
        )
    if problems:
        raise ValueError("MultiHeadAttention.to_torch: cannot convert: " + "; ".join(problems))
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    in_bias = any(p.bias is not None for p in projections)
    bias = in_bias or layer.out_proj.bias is not None  # one flag in PyTorch; a missing bias becomes zeros
    reference = layer.out_proj.weight
    module = nn.MultiheadAttention(
        layer.d_model,
        layer.num_heads,
        dropout=layer.dropout,
        bias=bias,
        kdim=layer.kdim,
        vdim=layer.vdim,
        batch_first=layer.batch_first,
        device=reference.device,
        dtype=reference.dtype,
    )
    with torch.no_grad():
        weights: tuple[Tensor, ...]
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.chunk(3)  # views: writing them fills in_proj_weight
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        for target, proj in zip(weights, projections):
            target.copy_(proj.weight)
        if bias:
            sources: list[Tensor | None] = [*(p.bias for p in projections), layer.out_proj.bias]
            targets = [*module.in_proj_bias.chunk(3), module.out_proj.bias]
            for target, source in zip(targets, sources):
                target.copy_(source if source is not None else torch.zeros_like(target))
        module.out_proj.weight.copy_(layer.out_proj.weight)
    return module.train(layer.training)
