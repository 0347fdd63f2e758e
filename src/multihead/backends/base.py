"""What a backend is: declared capabilities, reasons to refuse a call, and a way to run it.

A backend never guesses silently: :meth:`Backend.refusals` lists every reason it cannot serve a
call (empty list = it can), and :meth:`Backend.plan` says how it would run it. The dispatcher in
:mod:`multihead.backends.registry`, :func:`multihead.explain` and the test matrix
(``tests/backends``) read the declared :class:`Capabilities`; most refusals follow from them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from multihead.call import AttentionCall, AttentionResult
from multihead.scores import ADDITIVE, ELEMENTWISE

__all__ = ["Backend", "Capabilities", "Runner", "MASK_KINDS", "SCORE_MOD_KINDS", "named"]

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
#: Every leaf mask kind (``Mask.kind``): bands, key padding, documents, bool tensors, custom
#: functions, and masks read at explicit position tensors.
MASK_KINDS = frozenset({"band", "key_padding", "document", "tensor", "custom", "positions"})
#: Every score-modifier kind (``ScoreMod.kind``).
SCORE_MOD_KINDS = frozenset({ADDITIVE, ELEMENTWISE})

# The relative factor F of the test rule "err(x) <= F * err(naive in the same dtype) + floor"
# (shared TESTING.md), for (outputs and LSE, gradients): 2 and 3 in fp16/bf16; fp32 about 10,
# since online softmaxes and fused kernels reorder the sums. fp64 is compared with assert_close.
DEFAULT_TOLERANCE = ((torch.float16, (2.0, 3.0)), (torch.bfloat16, (2.0, 3.0)), (torch.float32, (10.0, 10.0)))


def named(name: str, value: object) -> str:
    """``"Lq=100"`` for a reason or a note; just ``"Lq"`` under ``torch.compile``, where formatting
    a size fixes it in the graph (a symbolic length of ``dynamic=True`` would recompile for every
    value). A refusal that is not raised (``auto`` passing over a backend) is built there too."""
    return name if torch.compiler.is_compiling() else f"{name}={value}"


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared once as data: the dispatcher refuses calls outside it
    and the backend test matrix is generated from it (a refusal there is a skip with reasons)."""

    device_types: frozenset[str] = frozenset({"cpu", "cuda", "mps", "xpu"})
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
    max_head_dim: int | None = None  # the largest D and Dv; None: any
    mask_kinds: frozenset[str] = MASK_KINDS
    score_mods: frozenset[str] = SCORE_MOD_KINDS
    score_mod_grad: bool = True  # gradients of tensors a modifier reads (a trainable bias)
    gqa: bool = True
    dropout: bool = True
    injected_dropout: bool = False  # accepts dropout_mask=
    native_lse: bool = False  # the kernel itself returns the LSE (else attention() recomputes it, one pass)
    # Partial results over pieces of a row's keys are merged by their LSE: a fused kernel gives a
    # piece whose visible keys are all bad as empty (output 0, LSE -inf), which the merge weighs 0,
    # so the non-finite check reads the keys of every call (nonfinite.py), whatever its size.
    keys_in_pieces: bool = False
    grad: bool = True
    # ((dtype, (F outputs, F gradients)), ...)
    tolerance: tuple[tuple[torch.dtype, tuple[float, float]], ...] = field(default=DEFAULT_TOLERANCE)
    masks: str = ""  # a short sentence for docs and explain(); default: the declared kinds
    # torch.compile(fullgraph=True) traces what the backend serves (forward, and backward where
    # it has one) into one graph; when False, compile_note says why (auto passes over it while
    # tracing; forcing it there breaks the graph). tests/integrations/test_compile.py reads both.
    compiles: bool = True
    compile_note: str = ""

    def __post_init__(self) -> None:
        for name, declared, known in (
            ("mask_kinds", self.mask_kinds, MASK_KINDS),
            ("score_mods", self.score_mods, SCORE_MOD_KINDS),
        ):
            unknown = sorted(set(declared) - known)
            if unknown:
                raise ValueError(f"Capabilities: {name} has unknown kinds {unknown}; known: {sorted(known)}")
        if not self.compiles and not self.compile_note:
            raise ValueError("Capabilities: compiles=False needs a compile_note saying why")
        if not self.masks:
            text = (
                "every mask"
                if self.mask_kinds == MASK_KINDS
                else "masks of kinds " + ", ".join(sorted(self.mask_kinds))
            )
            object.__setattr__(self, "masks", text)

    def tolerance_factor(self, dtype: torch.dtype, gradients: bool = False) -> float:
        """``F`` of the relative error rule for this dtype (outputs/LSE, or gradients). fp64 has no
        factor: it is compared with ``assert_close`` at about 1e-10 (1.0 is returned)."""
        table = dict(self.tolerance)
        if dtype not in table:
            if dtype == torch.float64:
                return 1.0
            raise ValueError(
                f"Capabilities.tolerance_factor: no factor for {dtype}; declared: {sorted(map(str, table))}"
            )
        return float(table[dtype][1 if gradients else 0])


@dataclass(frozen=True)
class Runner:
    """What a backend decided for the calls of one signature (:meth:`Backend.runner`):
    ``run(q, k, v) -> output`` with the decisions made once (the mask tensor, the kernel, the GQA
    fold), holding no tensor of the call it was made from.

    ``any_kv_len``: ``run`` serves every key length (nothing in it was prepared for the call's
    ``Lk``: no mask tensor, no causal diagonal), so one runner serves each step of a growing KV
    cache (:func:`multihead.plans.growing_signature`)."""

    run: Callable[[Tensor, Tensor, Tensor], Tensor]
    backend: str
    any_kv_len: bool = False

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.run(q, k, v)


class Backend(abc.ABC):
    """Base class. Subclasses set ``name``, ``summary`` and ``capabilities`` and implement
    :meth:`forward`; they extend :meth:`refusals` with checks of their own."""

    name: str = "backend"
    summary: str = ""
    capabilities: Capabilities = Capabilities()

    def refusals(self, call: AttentionCall) -> list[str]:
        """Every reason this backend cannot serve ``call``; empty when it can."""
        caps, reasons = self.capabilities, []
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        if call.q.device.type not in caps.device_types:
            reasons.append(f"device type {call.q.device.type!r} not supported (supports {sorted(caps.device_types)})")
        if call.q.dtype not in caps.dtypes:
            reasons.append(f"dtype {call.q.dtype} not supported")
        if caps.max_head_dim is not None and max(D, Dv) > caps.max_head_dim:
            reasons.append(f"head dim {max(D, Dv)} > {caps.max_head_dim}")
        if Hq != Hkv and not caps.gqa:
            reasons.append("grouped-query attention (Hq != Hkv) not supported")
        if call.mask is not None:
            unsupported = sorted(call.mask.kinds() - caps.mask_kinds)
            if unsupported:
                reasons.append(f"mask kinds {unsupported} not supported ({caps.masks})")
        if call.score_mod is not None:
            if call.score_mod.kind not in caps.score_mods:
                reasons.append(
                    f"score modifier {call.score_mod._describe()} is {call.score_mod.kind}; "
                    f"this backend runs {sorted(caps.score_mods) or 'none'}"
                )
            elif call.score_mod.requires_grad and not caps.score_mod_grad:
                reasons.append("a score modifier tensor requires grad; this backend gives it no gradient")
        if call.dropout_p > 0 and not caps.dropout:
            reasons.append("dropout not supported")
        if call.dropout_mask is not None and not caps.injected_dropout:
            reasons.append("an injected dropout_mask is not supported (reference backend only)")
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

    def runner(self, call: AttentionCall) -> Runner:
        """A :class:`Runner` for calls like ``call`` (which is not refused), differing only in the
        values of ``q, k, v``: same shapes, strides, dtypes, devices, autograd state, mask value
        and scale. :mod:`multihead.plans` keeps it for calls that repeat (only plain ones: no score
        modifier, dropout, sinks, weights or LSE), so it must hold no tensor of ``call``. The
        default runs :meth:`forward`; a backend overrides it to skip the work it can decide once
        (sdpa: the mask tensor, the GQA choice)."""
        mask, scale = call.mask, call.scale

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return self.forward(AttentionCall(q, k, v, mask, None, scale, 0.0, None, False)).output

        return Runner(run, self.name)

    def backward_from_lse(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(dq, dk, dv)`` of ``call`` when it is one block of a larger attention (some of its
        rows' keys), from the *merged* ``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)`` of whole
        rows and their gradients ``dout`` and ``dlse`` (``None``: none), without running the
        block's forward again: the ring's backward (:mod:`multihead.distributed.ring`) asks the
        backend that runs a block for it. ``None`` when not offered for this call (the default):
        the caller then differentiates through :meth:`forward`."""
        return None

    @abc.abstractmethod
    def forward(self, call: AttentionCall) -> AttentionResult:
        """Run ``call`` (already validated, not refused): the output, and the LSE when asked for
        and the kernel gives it (``None`` otherwise: :func:`multihead.attention` then recomputes
        it with the weights in one blockwise pass). Weights are never asked of a backend."""

    def __repr__(self) -> str:
        return f"<backend {self.name!r}: {self.summary}>"
