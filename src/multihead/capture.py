"""``capture_attention``: record the attention weights of every `multihead` layer in one pass.

Layers ask :func:`is_capturing` once per forward; only while a capture is active do they compute
weights (on demand, from the fast path's inputs) and hand them to :func:`record`. Outside a
capture nothing changes on the fast path.

    with multihead.capture_attention(model) as cap:
        model(x)
    cap.names         # ['encoder.layer.0.attention', ...]
    cap.weights[0]    # (B, H, Lq, Lk) of the first layer called
    cap.as_bertviz()  # tuple of per-layer tensors, the format bertviz's head_view reads
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["capture_attention", "AttentionCapture", "is_capturing", "record"]

_ACTIVE: list["AttentionCapture"] = []


@dataclass
class AttentionCapture:
    """What a capture recorded, in call order."""

    names: list[str] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)
    _module_names: dict = field(default_factory=dict, repr=False)
    _modules: tuple | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.weights)

    def __getitem__(self, name: str) -> Tensor:
        return self.weights[self.names.index(name)]

    def items(self):
        return list(zip(self.names, self.weights))

    def as_bertviz(self) -> tuple[Tensor, ...]:
        """Per-layer ``(B, H, Lq, Lk)`` tensors in call order (bertviz ``head_view(attention=...)``)."""
        return tuple(self.weights)

    def stacked(self) -> Tensor:
        """``(layers, B, H, Lq, Lk)``; all layers must share a shape."""
        return torch.stack(self.weights)

    def _wants(self, module: nn.Module) -> bool:
        return self._modules is None or id(module) in self._modules


@contextmanager
def capture_attention(model: nn.Module | None = None, *, detach: bool = True):
    """Record the weights of every `multihead` attention layer (of ``model`` if given, else of
    any model) called inside the ``with`` block. Names come from ``model.named_modules()``."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"capture_attention: model must be an nn.Module or None, got {type(model).__name__}")
    capture = AttentionCapture()
    if model is not None:
        capture._module_names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        capture._modules = frozenset(capture._module_names)
    capture._detach = detach  # type: ignore[attr-defined]
    _ACTIVE.append(capture)
    try:
        yield capture
    finally:
        _ACTIVE.remove(capture)


def is_capturing(module: nn.Module) -> bool:
    """Whether an active capture wants ``module``'s weights (cheap; called on every forward)."""
    return bool(_ACTIVE) and any(c._wants(module) for c in _ACTIVE)


def record(module: nn.Module, weights: Tensor) -> None:
    """Hand ``weights (B, H, Lq, Lk)`` of ``module`` to every active capture that wants them."""
    for capture in _ACTIVE:
        if capture._wants(module):
            name = capture._module_names.get(id(module), f"{type(module).__name__}_{len(capture)}")
            capture.names.append(name)
            capture.weights.append(weights.detach() if capture._detach else weights)
