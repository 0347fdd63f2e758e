"""Viewer sources recorded from a model: the weights with the query and key vectors of every
head (for the neuron view), and the attention of each decode step of a generation.

    source = record_attention(model, ids, tokens=names, name="encoder")       # one forward
    source = record_generation(decoder, prompt_ids, 12, token_names=names)  # prefill + 11 steps
    write_viewer("attention.html", [source])

Weights come from :func:`multihead.capture_attention`, query and key vectors from the layers'
``q`` and ``k`` hook points (:mod:`multihead.hooks`: after the head split, the rotary embedding
and the cache, as attention reads them), so every `multihead` layer gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from multihead.capture import capture_attention, layers_of
from multihead.hooks import add_hook
from multihead.viz.viewer import ViewerSource

__all__ = ["record_vectors", "QueryKeyCapture", "record_attention", "record_generation"]


@dataclass
class QueryKeyCapture:
    """The vectors each attention call scored, in call order: ``queries[i] (B, Hq, Lq, D)`` and
    ``keys[i] (B, Hkv, Lk, D)``, every key the call read (with a cache: every slot), after rotary
    positions; ``names[i]`` the layer's module name."""

    names: list[str] = field(default_factory=list)
    queries: list[Tensor] = field(default_factory=list)
    keys: list[Tensor] = field(default_factory=list)


@contextmanager
def record_vectors(model: nn.Module):
    """Record the query and key vectors of every attention layer in ``model`` with hook points
    (:func:`multihead.hooks.hook_points`: `multihead` layers, a Hugging Face model's attention
    modules on the backend) called inside the ``with`` block, through their ``q`` and ``k`` hook
    points (layers with ``context_parallel``, which have none, are skipped)."""
    layers = layers_of(model, "record_vectors")
    capture = QueryKeyCapture()

    def on_q(q: Tensor, name: str) -> None:
        capture.names.append(name)
        capture.queries.append(q.detach().float().cpu())

    def on_k(k: Tensor, name: str) -> None:  # a layer's k hook runs right after its q hook
        capture.keys.append(k.detach().float().cpu())

    handles = []
    try:
        for name, module in layers.items():
            if getattr(module, "context_parallel", None) is None:
                label = name or type(module).__name__
                handles += [add_hook(module, "q", on_q, name=label), add_hook(module, "k", on_k, name=label)]
        yield capture
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def record_attention(
    model: nn.Module,
    *inputs,
    tokens: list[str],
    k_tokens: list[str] | None = None,
    name: str = "model",
    caption: str = "",
    highlight=None,
    batch: int | None = None,
    segments: list[int] | None = None,
    **kwargs,
) -> ViewerSource:
    """One forward ``model(*inputs, **kwargs)`` as a :class:`ViewerSource` with queries and keys
    (the neuron view), for sequence ``batch`` of the batch (needed when there are several).
    ``tokens`` name its query tokens, ``k_tokens`` its keys when they differ (cross-attention).
    ``model`` is a model of `multihead` layers or a Hugging Face model on the backend
    (:func:`multihead.hooks.hook_points`). ``segments`` marks a sentence pair (0 = A, 1 = B per
    token); by default a ``token_type_ids=`` keyword argument that holds a sentence B gives it
    (the page's A→B filter)."""
    with capture_attention(model) as cap, record_vectors(model) as vec:
        model(*inputs, **kwargs)
    if not cap.weights:
        raise ValueError(f"record_attention: {type(model).__name__} called no multihead attention layer")
    if len(vec.queries) != len(cap.weights):
        raise ValueError(
            f"record_attention: {len(cap.weights)} attention calls recorded weights but "
            f"{len(vec.queries)} recorded vectors; only multihead attention layers give their vectors"
        )
    # A Hugging Face module's scale is its own (Gemma 2's is not 1/sqrt(D)): the neuron view splits
    # each score into q_d k_d scale.
    scales = {getattr(m, "scaling", None) for m in layers_of(model, "record_attention").values()}
    B = cap.weights[0].shape[0]
    if batch is None and B != 1:  # never sequence 0 in silence: the tokens name one sequence
        raise ValueError(
            f"record_attention: the inputs hold B={B} sequences and the tokens name one; pass batch=i "
            f"(0 <= i < {B}) with the tokens of sequence i"
        )
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or not -B <= batch < B):
        raise ValueError(f"record_attention: batch must be an int in [0, {B}) (the sequence shown), got {batch!r}")
    i = 0 if batch is None else batch
    types = kwargs.get("token_type_ids")
    if segments is None and isinstance(types, Tensor) and bool((types[i] == 1).any()):
        segments = types[i].tolist()
    return ViewerSource(
        name,
        tokens,
        tokens if k_tokens is None else k_tokens,
        [w[i] for w in cap.weights],
        list(cap.names),
        caption=caption,
        highlight=highlight,
        queries=[q[i] for q in vec.queries],
        keys=[k[i] for k in vec.keys],
        scale=scales.pop() if len(scales) == 1 else None,
        segments=segments,
    )


@torch.no_grad()
def record_generation(
    model: nn.Module,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    token_names: Callable[[list[int]], list[str]],
    name: str = "generation",
    caption: str = "",
    **generate_kwargs,
) -> ViewerSource:
    """Greedy (or sampled, through ``generate_kwargs``) decoding of one prompt ``(1, P)`` by a
    model with ``generate(prompt_ids, max_new_tokens, cache=...)`` (:class:`~multihead.models.CausalDecoder`),
    recorded step by step: the prefill's rows, then one query row per decode step against the
    keys so far. Returns a generation source (``prompt_len=P``): ``P + max_new_tokens - 1`` rows
    (the last token produced is never fed back), ``generated`` the ``max_new_tokens`` tokens."""
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        got = tuple(prompt_ids.shape) if isinstance(prompt_ids, Tensor) else type(prompt_ids).__name__
        raise ValueError(f"record_generation: prompt_ids must be one prompt (1, P), got {got}")
    generate_kwargs.setdefault("cache", "dynamic")  # a step reads exactly the tokens so far: one row of T keys
    with capture_attention(model) as cap, record_vectors(model) as vec:
        generate = cast("Callable[..., Tensor]", model.generate)  # a multihead.models.CausalDecoder's
        out = generate(prompt_ids, max_new_tokens, **generate_kwargs)  # (1, N)
    layer_names = list(dict.fromkeys(cap.names))
    n_layers, P = len(layer_names), prompt_ids.shape[1]
    L = P + max_new_tokens - 1  # rows fed in: the prompt, then every produced token but the last
    calls = len(cap.weights) // max(1, n_layers)
    if n_layers == 0 or calls != max_new_tokens or len(vec.queries) != len(cap.weights):
        raise ValueError(
            f"record_generation: expected a prefill and {max_new_tokens - 1} one-token steps through "
            f"{n_layers} multihead attention layers, recorded {len(cap.weights)} weight and "
            f"{len(vec.queries)} vector calls"
        )
    H = cap.weights[0].shape[1]
    weights = torch.zeros(n_layers, H, L, L)  # causal: zeros above the diagonal
    queries: list[list[Tensor]] = [[] for _ in range(n_layers)]
    keys: list[Tensor | None] = [None] * n_layers  # set by every call below
    row = 0
    for call in range(calls):
        for layer in range(n_layers):
            i = call * n_layers + layer
            w = cap.weights[i][0].float()  # (H, rows, T)
            if w.shape[2] != row + w.shape[1]:  # a ring buffer (cache="sliding") holds slots, not positions
                when = "the prefill" if call == 0 else f"decode step {call}"
                raise ValueError(
                    f"record_generation: {when} of {layer_names[layer]!r} read {w.shape[2]} cached "
                    f"keys for {row + w.shape[1]} tokens so far; the viewer needs every key in position "
                    f"order: cache='dynamic' (the default) or 'static', got "
                    f"cache={generate_kwargs['cache']!r}"
                )
            weights[layer, :, row : row + w.shape[1], : w.shape[2]] = w
            queries[layer].append(vec.queries[i][0])  # (H, rows, D)
            keys[layer] = vec.keys[i][0]  # (Hkv, T, D): every key so far, in position order (dynamic cache)
        row += cap.weights[call * n_layers][0].shape[1]
    ids = torch.cat([prompt_ids[0], out[0]]).tolist()
    tokens = list(token_names(ids))
    if len(tokens) != len(ids):
        raise ValueError(f"record_generation: token_names gave {len(tokens)} names for {len(ids)} ids")
    return ViewerSource(
        name,
        tokens[:L],
        tokens[:L],
        weights,
        layer_names,
        caption=caption,
        queries=[torch.cat(q, dim=1) for q in queries],
        keys=[k for k in keys if k is not None],
        prompt_len=P,
        generated=tokens[P:],
    )
