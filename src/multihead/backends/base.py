"""What a backend is: declared capabilities, reasons to refuse a call, and a way to run it.

A backend never guesses silently: :meth:`Backend.refusals` lists every reason it cannot serve a
call (empty list = it can), and :meth:`Backend.plan` says how it would run it. The dispatcher in
:mod:`multihead.backends.registry` and :func:`multihead.explain` only read these.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from multihead.reference import AttentionResult
from multihead.validation import AttentionCall

__all__ = ["Backend", "Capabilities"]

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared once. Tests are generated from these declarations."""

    device_types: frozenset = frozenset({"cpu", "cuda", "mps", "xpu"})
    dtypes: frozenset = FLOAT_DTYPES
    masks: str = "every mask"  # a short sentence for docs and explain()
    gqa: bool = True
    dropout: bool = True
    injected_dropout: bool = False  # accepts dropout_mask=
    lse: bool = True
    grad: bool = True


class Backend(abc.ABC):
    """Base class. Subclasses set ``name``, ``summary`` and ``capabilities`` and implement
    :meth:`forward`; they extend :meth:`refusals` with checks of their own."""

    name: str = "backend"
    summary: str = ""
    capabilities: Capabilities = Capabilities()

    def refusals(self, call: AttentionCall) -> list[str]:
        """Every reason this backend cannot serve ``call``; empty when it can."""
        caps, reasons = self.capabilities, []
        if call.q.device.type not in caps.device_types:
            reasons.append(f"device type {call.q.device.type!r} not supported "
                           f"(supports {sorted(caps.device_types)})")
        if call.q.dtype not in caps.dtypes:
            reasons.append(f"dtype {call.q.dtype} not supported")
        _, Hq, Hkv, *_ = call.shape
        if Hq != Hkv and not caps.gqa:
            reasons.append("grouped-query attention (Hq != Hkv) not supported")
        if call.dropout_p > 0 and not caps.dropout:
            reasons.append("dropout not supported")
        if call.dropout_mask is not None and not caps.injected_dropout:
            reasons.append("an injected dropout_mask is not supported (reference backend only)")
        if call.return_lse and not caps.lse:
            reasons.append("cannot return the log-sum-exp")
        if call.requires_grad and not caps.grad:
            reasons.append("no backward pass")
        return reasons

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        """Reasons ``auto`` should prefer a later backend although this one could serve ``call``
        (the measured decision table, ``docs/performance.md``). Forcing the backend ignores them."""
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        """How this backend would run ``call``, one line per decision."""
        return []

    @abc.abstractmethod
    def forward(self, call: AttentionCall) -> AttentionResult:
        """Run ``call`` (already validated, not refused): the output, and the LSE when asked.
        Weights are never asked of a backend: :func:`multihead.attention` derives them from the LSE."""

    def __repr__(self) -> str:
        return f"<backend {self.name!r}: {self.summary}>"
