"""Which modules of a Hugging Face model have hook points: its attention modules, where they run
on the `multihead` backend.

A ``transformers`` model declares its attention modules for its own ``output_attentions``
collector, in ``_can_record_outputs`` (``{"attentions": LlamaAttention, ...}``: a class, a class
name ending the module's path, or an ``OutputRecorder`` with a ``target_class``/``class_name`` and
an optional ``layer_name``); each sub-model (a ``PreTrainedModel`` inside another, such as a vision
tower) declares its own for its part of the tree. :func:`attention_modules` reads those
declarations the way the collector does, so the modules it names are exactly those whose weights
``output_attentions=True`` returns: each one calls the registered attention function
(:func:`multihead.integrations.hf.attention_forward`) with itself as ``module``, which runs its
hooks and captures through :func:`multihead.hooks.observed_attention`.

Names are the model's module paths (``"model.layers.0.self_attn"``), so a hook point reads
``"model.layers.0.self_attn.pattern"``. A module counts only while its config runs one of the
names :func:`multihead.integrations.hf.register` registered; where none does, the reason is
returned (and :func:`multihead.capture.layers_of` raises with it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["REGISTERED", "attention_modules"]

#: The attention implementation names registered by :func:`multihead.integrations.hf.register`.
REGISTERED: set[str] = set()

#: The keys of ``_can_record_outputs`` whose modules attend (self- and cross-attention).
_KEYS = ("attentions", "cross_attentions")


def attention_modules(model: nn.Module) -> tuple[list[nn.Module], str | None]:
    """``(modules, reason)``: the attention modules of the Hugging Face model(s) in ``model`` that
    run on a registered `multihead` implementation, in ``named_modules`` order; when there is none
    but ``model`` holds a Hugging Face model, why (``None`` for a model that holds none)."""
    declared: list[tuple[str, nn.Module]] = []
    any_model = _walk(model, "", None, declared)
    if not any_model:
        return [], None
    mine = [m for _, m in declared if _implementation(m, model) in REGISTERED]
    if mine:
        return mine, None
    name = type(model).__name__
    if not declared:
        return [], (
            f"{name} is a Hugging Face model that declares no attention modules (its _can_record_outputs "
            "has no 'attentions'), so multihead cannot tell which of its modules attend; its weights are "
            "not recorded by output_attentions either"
        )
    running = sorted({str(_implementation(m, model)) for _, m in declared})
    classes = sorted({type(m).__name__ for _, m in declared})
    return [], (
        f"its {len(declared)} attention modules ({', '.join(classes)}) run attn_implementation="
        f"{' / '.join(repr(r) for r in running)}, not multihead: hook points exist where attention "
        "runs through multihead; hint: multihead.integrations.hf.register(); model.set_attn_implementation('multihead')"
        + ("" if REGISTERED else " (no multihead implementation is registered in this process)")
    )


def _walk(module: nn.Module, name: str, specs: list[Any] | None, out: list[tuple[str, nn.Module]]) -> bool:
    """Append ``(name, module)`` of every declared attention module under ``module`` to ``out``,
    each sub-model reading its own declarations for its part of the tree (as transformers'
    collector does); children first, then the module itself. Returns whether a Hugging Face model
    (something with ``_can_record_outputs`` and a ``config``) was met."""
    own = _declarations(module)
    met = own is not None
    if own is not None:
        specs = own
    for child_name, child in module.named_children():
        met |= _walk(child, f"{name}.{child_name}" if name else child_name, specs, out)
    if specs and any(_matches(spec, module, name) for spec in specs):
        out.append((name, module))
    return met


def _declarations(module: nn.Module) -> list[Any] | None:
    """The attention specs ``module`` declares as a Hugging Face model, ``None`` when it is none."""
    if not hasattr(type(module), "_can_record_outputs") or getattr(module, "config", None) is None:
        return None  # not a PreTrainedModel (its attention modules have a config, not this attribute)
    table = getattr(type(module), "_can_record_outputs", None) or {}
    specs = []
    for key in _KEYS:
        found = table.get(key)
        specs += found if isinstance(found, list) else ([] if found is None else [found])
    return specs


def _matches(spec: Any, module: nn.Module, name: str) -> bool:
    """Whether ``spec`` (a class, a class-name suffix or an ``OutputRecorder``) names ``module``
    at path ``name``, by transformers' rule: the class, or the path ending in ``class_name``; then
    the ``layer_name``, if any, as a whole component of the path."""
    if isinstance(spec, type):
        target, suffix, layer = spec, None, None
    elif isinstance(spec, str):
        target, suffix, layer = None, spec, None
    else:
        target = getattr(spec, "target_class", None)
        suffix, layer = getattr(spec, "class_name", None), getattr(spec, "layer_name", None)
    path = f".{name}" if name else ""  # transformers' collector names modules with a leading dot
    if not ((target is not None and isinstance(module, target)) or (suffix is not None and path.endswith(suffix))):
        return False
    return layer is None or f".{layer.strip('.')}." in path + "."


def _implementation(module: nn.Module, model: nn.Module) -> str | None:
    """The attention implementation ``module`` dispatches on: its config's, as HF's attention
    modules read it (``self.config._attn_implementation``), else the model's."""
    config = getattr(module, "config", None) or getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    return implementation if isinstance(implementation, str) else None
