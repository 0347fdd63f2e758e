"""``capture_attention``: record the attention weights of every `multihead` layer in one pass.

Layers ask :func:`is_capturing` once per forward; only while a capture is active do they compute
weights (on demand, from the fast path's inputs) and hand them to :func:`record`. Outside a
capture nothing changes on the fast path.

    with multihead.capture_attention(model) as cap:
        model(x)
    cap.names         # ['encoder.layer.0.attention', ...]
    cap.weights[0]    # (B, H, Lq, Lk) of the first layer called
    cap.as_bertviz()  # tuple of per-layer tensors, the format bertviz's head_view reads

On long inputs, select what to keep as :func:`multihead.attention` does: with
``capture_attention(model, weights_heads=0, weights_rows=slice(-1, None))`` each layer computes
only head 0's last row, ``(B, 1, 1, Lk)``, one block at a time, never the whole square.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from multihead.call import Selection
from multihead.validation import validate_weights_selection

__all__ = [
    "capture_attention",
    "AttentionCapture",
    "is_capturing",
    "captures_of",
    "record",
    "layers_of",
    "register_layer_finder",
]

_ACTIVE: list[AttentionCapture] = []

#: A finder of the attention modules of a model that can be watched (their weights captured, hooks
#: run in them): ``fn(model) -> (modules, reason)``, the modules whose attention runs through
#: :func:`multihead.hooks.observed_attention` or `multihead`'s layers, and, when it finds none
#: although the model has attention of its kind, why (``None`` otherwise). :mod:`multihead.hooks`
#: registers `multihead`'s layers; :mod:`multihead.integrations.hf` Hugging Face's attention modules.
Finder = Callable[[nn.Module], "tuple[list[nn.Module], str | None]"]
_FINDERS: dict[str, Finder] = {}
#: Every module a finder has named (weakly: a model that is dropped is forgotten).
_FOUND: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass(eq=False)  # one capture is itself, whatever it recorded (removed by identity)
class AttentionCapture:
    """What a capture recorded, in call order. ``weights_heads``/``weights_rows`` are the
    selections it was opened with (``None``: all)."""

    names: list[str] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)
    weights_heads: Selection = None
    weights_rows: Selection = None
    _module_names: dict[int, str] = field(default_factory=dict, repr=False)
    _modules: frozenset[int] | None = field(default=None, repr=False)
    _detach: bool = field(default=True, repr=False)

    def __len__(self) -> int:
        return len(self.weights)

    def __getitem__(self, name: str) -> Tensor:
        return self.weights[self.names.index(name)]

    def items(self) -> list[tuple[str, Tensor]]:
        """``(layer name, weights (B, H, Lq, Lk))`` pairs, in call order."""
        return list(zip(self.names, self.weights))

    def as_bertviz(self) -> tuple[Tensor, ...]:
        """Per-layer ``(B, H, Lq, Lk)`` tensors in call order (bertviz ``head_view(attention=...)``).
        bertviz reads every head and row against the tokens, so a capture with selections is refused."""
        if self.weights_heads is not None or self.weights_rows is not None:
            raise ValueError(
                f"as_bertviz: bertviz draws every head and row, but this capture kept only "
                f"weights_heads={self.weights_heads!r}, weights_rows={self.weights_rows!r}; "
                "open capture_attention(model) without selections for bertviz"
            )
        if not self.weights:
            raise ValueError(
                "as_bertviz: the capture recorded no layer; call the model inside the "
                "'with capture_attention(...)' block"
            )
        return tuple(self.weights)

    def stacked(self) -> Tensor:
        """``(layers, B, H, Lq, Lk)``; all layers must share a shape."""
        return torch.stack(self.weights)

    def _wants(self, module: nn.Module) -> bool:
        return self._modules is None or id(module) in self._modules


@contextmanager
def capture_attention(
    model: nn.Module | None = None,
    *,
    detach: bool = True,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
) -> Iterator[AttentionCapture]:
    """Record the weights of every `multihead` attention layer (of ``model`` if given, else of
    any model) called inside the ``with`` block. Names come from ``model.named_modules()``.

    ``weights_heads``, ``weights_rows``: keep only these query heads and rows of each layer (an
    int, a sequence of ints, a slice or an integer tensor, as for :func:`multihead.attention`):
    weights ``(B, len(heads), len(rows), Lk)``, computed for the selection alone. They are checked
    against each layer's ``Hq`` and ``Lq`` when it runs."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"capture_attention: model must be an nn.Module or None, got {type(model).__name__}")
    capture = AttentionCapture(weights_heads=weights_heads, weights_rows=weights_rows)
    if model is not None:
        layers_of(model, "capture_attention")  # a model with nothing to record is told why, never an empty capture
        capture._module_names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        capture._modules = frozenset(capture._module_names)
    capture._detach = detach
    _ACTIVE.append(capture)
    try:
        yield capture
    finally:
        _ACTIVE.remove(capture)


def register_layer_finder(name: str, finder: Finder) -> None:
    """Let :func:`layers_of` (and so :func:`capture_attention`, :func:`multihead.hooks.hook_points`,
    :func:`multihead.hooks.hooked` and the viewer's recording) find a kind of attention module;
    registered again under the same ``name``: replaced."""
    if not callable(finder):
        raise TypeError(f"register_layer_finder: finder must be callable as fn(model), got {type(finder).__name__}")
    _FINDERS[name] = finder


def found_by_finders(module: nn.Module) -> bool:
    """Whether a finder has named ``module`` (a Hugging Face attention module on the backend)."""
    return module in _FOUND


def layers_of(model: nn.Module, who: str = "layers_of") -> dict[str, nn.Module]:
    """``{module name: layer}`` of every attention layer of ``model`` that can be watched, in
    ``model.named_modules()`` order (``model`` itself named ``""``): `multihead` layers and the
    modules registered finders name. Raises ``ValueError`` saying why when there is none (never
    an empty answer: a model that cannot be watched is told so); ``who`` names the caller."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    found: set[int] = set()
    reasons = []
    for finder in list(_FINDERS.values()):
        modules, reason = finder(model)
        _FOUND.update(modules)
        found.update(id(m) for m in modules)
        if reason:
            reasons.append(reason)
    layers = {name: m for name, m in model.named_modules() if id(m) in found}
    if layers:
        return layers
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not reasons and isinstance(implementation, str):  # a Hugging Face model, and no finder for it
        reasons.append(
            f"it is a Hugging Face model running attn_implementation={implementation!r}, and its attention "
            "modules can be watched only on the multihead backend: import multihead.integrations.hf as "
            "mh_hf; mh_hf.register(); model.set_attn_implementation('multihead')"
        )
    if not reasons:
        reasons.append(
            "it holds no multihead attention layer (MultiHeadAttention, MultiHeadLatentAttention, "
            "compat.MultiheadAttention); hint: build it of those (an nn.MultiheadAttention converts with "
            "MultiHeadAttention.from_torch(module))"
        )
    raise ValueError(f"{who}: {type(model).__name__} has no attention layer to watch: {'; '.join(reasons)}")


def is_capturing(module: nn.Module) -> bool:
    """Whether an active capture wants ``module``'s weights (cheap; called on every forward)."""
    return bool(_ACTIVE) and any(c._wants(module) for c in _ACTIVE)


def captures_of(module: nn.Module) -> list[AttentionCapture]:
    """The active captures that want ``module``'s weights."""
    return [c for c in _ACTIVE if c._wants(module)]


def record(
    module: nn.Module,
    weights: Tensor | None,
    *,
    q: Tensor | None = None,
    held: tuple[Tensor | None, Tensor | None] = (None, None),
) -> None:
    """Hand ``weights (B, h, r, Lk)`` of ``module`` to every active capture that wants them, each
    taking its own selection of heads and rows. ``held`` says which query heads and rows
    ``weights`` hold (sorted indices, ``None``: all; :func:`union` of what was asked); ``q`` is the
    call's ``(B, Hq, Lq, D)`` queries, against which selections are checked (needed with any)."""
    if weights is None:
        raise ValueError(f"record: {type(module).__name__} handed no weights to the active captures")
    for capture in captures_of(module):
        name = capture._module_names.get(id(module), f"{type(module).__name__}_{len(capture)}")
        mine = weights
        if capture.weights_heads is not None or capture.weights_rows is not None:
            if q is None:
                raise ValueError("record: q (B, Hq, Lq, D) is needed to read a capture's weights_heads/weights_rows")
            mine = take(
                weights,
                held,
                validate_weights_selection(capture.weights_heads, capture.weights_rows, q=q, return_weights=True),
            )
        capture.names.append(name)
        capture.weights.append(mine.detach() if capture._detach else mine)


# ------------------------------------------------------------- selections shared by several asks
def union(selections: list[Tensor | None]) -> Tensor | None:
    """Sorted unique indices selected by any of ``selections`` (``None``: all, which wins)."""
    chosen = [s for s in selections if s is not None]
    if not selections or len(chosen) < len(selections):
        return None
    indices: Tensor = torch.unique(torch.cat(chosen))  # sorted
    return indices


def take(
    weights: Tensor, held: tuple[Tensor | None, Tensor | None], wanted: tuple[Tensor | None, Tensor | None]
) -> Tensor:
    """From ``weights (B, h, r, Lk)`` holding the heads and rows ``held`` (sorted indices or
    ``None``: all), the heads and rows ``wanted``, in the order asked (``wanted`` lies within ``held``)."""
    for dim, have, want in ((1, held[0], wanted[0]), (2, held[1], wanted[1])):
        if want is None or (have is not None and have.shape == want.shape and bool((have == want).all())):
            continue
        where = want if have is None else torch.searchsorted(have, want)
        weights = weights.index_select(dim, where.to(weights.device))
    return weights
