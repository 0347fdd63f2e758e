"""Named hook points inside every `multihead` layer: read or replace what attention sees.

Each layer that ends in :func:`multihead.layers.heads.attend_heads` (``MultiHeadAttention`` and
its GQA/MQA aliases, ``MultiHeadLatentAttention``, the ``nn.MultiheadAttention`` drop-in, and
every model built of them) has six points, in the order a forward pass reaches them::

    q        (B, Hq, Lq, D)    queries after the head split and the rotary embedding
    k        (B, Hkv, Lk, D)   keys after rotation, as attention reads them (with a cache: every slot)
    v        (B, Hkv, Lk, Dv)  values, likewise
    scores   (B, Hq, Lq, Lk)   scale · q kᵀ after every score modifier, -inf where masked (softmax dtype)
    pattern  (B, Hq, Lq, Lk)   the probabilities, before dropout (softmax dtype)
    output   (B, Hq, Lq, Dv)   each head's attention output, before the heads merge and out_proj

A hook is ``fn(tensor, name) -> tensor | None``: returning ``None`` keeps the tensor (reading),
returning a tensor of the same shape replaces it (activation patching); ``name`` is the point's
full name (``"layers.0.attn.pattern"`` under :func:`hooked`, the bare point for
:meth:`HookPoints.add_hook`). Ablating head ``h`` is ``output[:, h] = 0``::

    def ablate_head_3(output, name):
        output = output.clone(); output[:, 3] = 0; return output

    with multihead.hooks.hooked(model, {"layers.0.attn.output": ablate_head_3}):
        logits = model(tokens)

Hugging Face models running on the `multihead` backend (``attn_implementation="multihead"``,
:mod:`multihead.integrations.hf`) have the same six points at each attention module, named by the
model's own module paths (``"model.layers.0.self_attn.pattern"``): that integration registers a
:func:`register_layer_finder`. A model with no point raises, saying why (:func:`layers_of`).

Cost: a layer with no hook runs its fast path exactly as before (one dictionary lookup tells it
none is set). ``q``/``k``/``v``/``output`` hooks keep the fast kernels. ``scores``/``pattern``
hooks need the ``(B, Hq, Lq, Lk)`` tensors, so while one is set the layer computes attention
explicitly (:func:`explicit_attention`: ``softmax(scores) · v`` in the softmax dtype), which
equals the fast path to rounding when the hooks change nothing. Weights asked for with
``need_weights`` and those recorded by :func:`multihead.capture_attention` are then the pattern
as the hooks left it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from multihead.attention import attention, prepare
from multihead.call import ScoreModArg, Selection
from multihead.capture import AttentionCapture, found_by_finders, layers_of, record, register_layer_finder, take, union
from multihead.conventions import repeat_kv
from multihead.masks import Mask
from multihead.scoring import score_block
from multihead.validation import validate_weights_selection

__all__ = [
    "POINTS",
    "HookPoints",
    "HookHandle",
    "add_hook",
    "hook_points",
    "hooked",
    "layers_of",
    "register_layer_finder",
    "explicit_attention",
    "observed_attention",
]

#: The hook points of every layer, in the order a forward pass reaches them.
POINTS = ("q", "k", "v", "scores", "pattern", "output")

#: The attribute (in the layer's ``__dict__``, not a buffer or parameter) that holds its hooks:
#: ``{point: [(fn, name, handle id), ...]}``, absent while the layer has none.
ATTRIBUTE = "_multihead_hooks"

Hook = Callable[[Tensor, str], "Tensor | None"]
#: A layer's hooks: point -> [(fn, the name it is called with, its handle's id)].
Hooks = dict[str, list[tuple[Hook, str, int]]]


class HookHandle:
    """What :meth:`HookPoints.add_hook` returns: ``handle.remove()`` takes the hook away (also
    usable as a context manager: the hook is removed at the end of the ``with`` block)."""

    _next_id = 0

    def __init__(self, layer: HookPoints | nn.Module, point: str):
        self.layer, self.point = layer, point
        HookHandle._next_id += 1
        self.id = HookHandle._next_id

    def remove(self) -> None:
        hooks = self.layer.__dict__.get(ATTRIBUTE)
        if not hooks or self.point not in hooks:
            return
        hooks[self.point] = [h for h in hooks[self.point] if h[2] != self.id]
        if not hooks[self.point]:
            del hooks[self.point]
        if not hooks:  # no hook left: the fast path's one lookup finds nothing again
            del self.layer.__dict__[ATTRIBUTE]

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"HookHandle({type(self.layer).__name__}.{self.point}, id={self.id})"


def add_hook(layer: HookPoints | nn.Module, point: str, fn: Hook, *, name: str | None = None) -> HookHandle:
    """Call ``fn(tensor, name)`` at ``point`` of ``layer`` on every forward (module docstring);
    hooks at one point run in the order they were added. Returns a :class:`HookHandle`."""
    if not isinstance(layer, HookPoints) and not found_by_finders(layer):
        raise TypeError(
            f"add_hook: layer must be a multihead attention layer (MultiHeadAttention, "
            f"MultiHeadLatentAttention, compat.MultiheadAttention) or an attention module that "
            f"hook_points(model) named (a Hugging Face model on the multihead backend), got "
            f"{type(layer).__name__}; hint: hooked(model, {{'<module name>.<point>': fn}}) finds them"
        )
    if point not in POINTS:
        raise ValueError(f"add_hook: point must be one of {POINTS}, got {point!r}")
    if not callable(fn):
        raise TypeError(f"add_hook: fn must be callable as fn(tensor, name) -> tensor or None, got {type(fn).__name__}")
    if getattr(layer, "context_parallel", None) is not None:
        raise ValueError(
            f"add_hook: {type(layer).__name__} has context_parallel set: its attention runs "
            "sharded over a process group, where no hook point exists; hint: hook a layer without it"
        )
    handle = HookHandle(layer, point)
    layer.__dict__.setdefault(ATTRIBUTE, {}).setdefault(point, []).append((fn, name or point, handle.id))
    return handle


class HookPoints:
    """Mixed into every `multihead` attention layer: :meth:`add_hook` and :meth:`hook_points`."""

    def add_hook(self, point: str, fn: Hook) -> HookHandle:
        """Call ``fn(tensor, point)`` at ``point`` (one of :data:`POINTS`) on every forward;
        ``fn`` may return a replacement of the same shape. See :mod:`multihead.hooks`."""
        return add_hook(self, point, fn)

    def hook_points(self) -> tuple[str, ...]:
        """The names of this layer's hook points (:data:`POINTS`)."""
        return POINTS


def _multihead_layers(model: nn.Module) -> tuple[list[nn.Module], str | None]:
    """The finder of `multihead`'s own layers (:func:`layers_of`)."""
    return [m for m in model.modules() if isinstance(m, HookPoints)], None


register_layer_finder("multihead", _multihead_layers)


def hook_points(model: nn.Module) -> list[str]:
    """Every ``"<module name>.<point>"`` of the attention layers of ``model`` (:func:`layers_of`:
    `multihead` layers, and a Hugging Face model's attention modules on the `multihead` backend;
    the model itself named by its point alone). Raises when there is none, saying why."""
    return [f"{name}.{p}" if name else p for name in layers_of(model, "hook_points") for p in POINTS]


@contextmanager
def hooked(model: nn.Module, hooks: dict[str, Hook]) -> Iterator[list[HookHandle]]:
    """Set ``hooks`` (``{"<module name>.<point>": fn}``) on the layers of ``model`` for the
    ``with`` block; names may hold ``fnmatch`` wildcards (``"*.pattern"``: every layer's
    pattern). A name that matches no point raises, listing the points there are."""
    if not isinstance(hooks, dict):
        raise TypeError(f"hooked: hooks must be a dict {{'<module name>.<point>': fn}}, got {type(hooks).__name__}")
    layers = layers_of(model, "hooked")
    handles: list[HookHandle] = []
    try:
        for pattern, fn in hooks.items():
            matched = [
                (name, m, p)
                for name, m in layers.items()
                for p in POINTS
                if fnmatch.fnmatchcase(f"{name}.{p}" if name else p, pattern)
            ]
            if not matched:
                known = [f"{name}.{p}" if name else p for name in layers for p in POINTS]
                raise ValueError(
                    f"hooked: {pattern!r} names no hook point of this model; expected one of "
                    f"{known[:12]}{' ...' if len(known) > 12 else ''} (wildcards allowed: '*.pattern')"
                )
            for name, m, p in matched:
                handles.append(add_hook(m, p, fn, name=f"{name}.{p}" if name else p))
        yield handles
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------- used by attend_heads
def run_hooks(hooks: Hooks, point: str, tensor: Tensor) -> Tensor:
    """``tensor`` through every hook at ``point`` in order; a replacement must keep the shape, the
    dtype and the device."""
    for fn, name, _ in hooks.get(point, ()):
        out = fn(tensor, name)
        if out is None:
            continue
        if not isinstance(out, Tensor) or out.shape != tensor.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"hook {getattr(fn, '__name__', fn)!r} at {name!r} returned {got}; expected None "
                f"or a tensor of the shape it was given, {tuple(tensor.shape)}"
            )
        if out.dtype != tensor.dtype or out.device != tensor.device:
            raise TypeError(
                f"hook {getattr(fn, '__name__', fn)!r} at {name!r} returned a {out.dtype} tensor on "
                f"{out.device}; expected None or a tensor of the dtype and device it was given, "
                f"{tensor.dtype} on {tensor.device} (cast it back: .to(tensor))"
            )
        tensor = out
    return tensor


def observed_attention(
    layer: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    hooks: Hooks | None,
    captures: Sequence[AttentionCapture] = (),
    need_weights: bool = False,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    check_finite: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention of ``layer`` while hooks (its ``hooks``) or captures watch it: the one way every
    layer, and the Hugging Face backend, runs a watched call.

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` pass the ``q``/``k``/``v``
    hooks, attention runs (explicitly, :func:`explicit_attention`, when a ``scores`` or ``pattern``
    hook is set; else :func:`multihead.attention` with the weights the call and the captures ask
    for, computed once for the union of their selections), the ``output`` hook sees each head's
    ``(B, Hq, Lq, Dv)``, and every capture records its selection of the weights. The other
    arguments are :func:`multihead.attention`'s (``check_finite`` applies to the fast path only:
    the explicit one computes plainly).

    Returns ``(y (B, Hq, Lq, Dv), weights)``: ``weights (B, h, r, Lk)`` for ``need_weights``'s own
    ``weights_heads``/``weights_rows`` selection, else ``None``.
    """
    asked = validate_weights_selection(weights_heads, weights_rows, q=q, return_weights=need_weights)
    if hooks is not None:
        q, k, v = run_hooks(hooks, "q", q), run_hooks(hooks, "k", k), run_hooks(hooks, "v", v)
    wanted = ([asked] if need_weights else []) + [
        validate_weights_selection(c.weights_heads, c.weights_rows, q=q, return_weights=True) for c in captures
    ]
    held = (union([h for h, _ in wanted]), union([r for _, r in wanted]))
    weights = None
    if hooks is not None and ("scores" in hooks or "pattern" in hooks):
        y, pattern = explicit_attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            softcap=softcap,
            sinks=sinks,
            scale=scale,
            dropout_p=dropout_p,
            hooks=hooks,
        )  # (B, Hq, Lq, Dv), (B, Hq, Lq, Lk)
        if wanted:
            weights = take(pattern, (None, None), held).to(q.dtype)
    elif wanted:
        result = attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            softcap=softcap,
            sinks=sinks,
            scale=scale,
            dropout_p=dropout_p,
            return_weights=True,
            backend=backend,
            check_finite=check_finite,
            weights_heads=held[0],
            weights_rows=held[1],
        )
        y, weights = result.output, result.weights  # (B, Hq, Lq, Dv), (B, h, r, Lk)
    else:
        y = attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            softcap=softcap,
            sinks=sinks,
            scale=scale,
            dropout_p=dropout_p,
            backend=backend,
            check_finite=check_finite,
        )
    if hooks is not None:
        y = run_hooks(hooks, "output", y)  # (B, Hq, Lq, Dv): head h at y[:, h]
    if captures:
        record(layer, weights, q=q, held=held)
    return y, (take(weights, held, asked) if need_weights and weights is not None else None)


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    hooks: Hooks | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention with the scores and the pattern materialised, through the ``scores`` and
    ``pattern`` hooks: ``(output (B, Hq, Lq, Dv) in q's dtype, pattern (B, Hq, Lq, Lk))``.

    The same meaning as :func:`multihead.attention` with the same arguments (conventions: a row
    that sees no key gives 0; ``sinks (Hq,)`` join each row's denominator; ``softcap`` after the
    other score modifiers), computed plainly in the softmax dtype. Dropout, when ``dropout_p > 0``,
    is drawn here (not the fast path's stream).
    """
    hooks = hooks or {}
    call = prepare(
        q, k, v, mask=mask, score_mod=score_mod, softcap=softcap, sinks=sinks, scale=scale, dropout_p=dropout_p
    )
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    scores, _ = score_block(call.q, call.k, call.mask, call.score_mod, call.scale, 0, Lq, Lq)  # (B, Hq, Lq, Lk)
    scores = run_hooks(hooks, "scores", scores)
    # softmax over the keys (and the sink), with m finite so that a row of -inf gives exp(-inf) = 0,
    # never -inf - (-inf) = NaN; a row that sees no key has denominator 0 and pattern 0.
    m = scores.amax(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, Hq, 1, 1)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(scores - m)
    denominator = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - m)
    pattern = e / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    pattern = run_hooks(hooks, "pattern", pattern)
    kept = torch.nn.functional.dropout(pattern, dropout_p) if dropout_p > 0 else pattern
    output = torch.matmul(kept, repeat_kv(v.to(kept.dtype), Hq))  # (B, Hq, Lq, Dv)
    return output.to(q.dtype), pattern
