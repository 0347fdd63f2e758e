"""Attention sinks: a per-head logit that joins every row's softmax and contributes no value.

gpt-oss and "Efficient Streaming Language Models with Attention Sinks" give each query head a
learned logit ``s_h``; the softmax of a row is taken over its visible scores *and* ``s_h``, and
the sink's share of the probability mass is dropped (it has no value)::

    P'_ij = exp(S_ij) / (exp(s_h) + sum_j exp(S_ij))     (the sink takes exp(s_h) / ...)
    out'  = sum_j P'_ij V_j = out · sigmoid(lse - s_h)    lse' = logaddexp(lse, s_h)

so every backend runs it through the log-sum-exp it already returns, and gradients reach
``q, k, v`` (through ``out`` and ``lse``) and the sink logits. A fully masked row (``lse = -inf``)
attends only to the sink: output 0, ``lse' = s_h``. A sink of ``-inf`` is no sink.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_sinks", "check_sinks"]


def check_sinks(sinks: object, q: Tensor) -> None:
    """Raise unless ``sinks`` is a float tensor ``(Hq,)`` on q's device (``None`` passes)."""
    if sinks is None:
        return
    Hq = q.shape[1]
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = f"a tensor of dtype {sinks.dtype}" if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a float tensor (Hq,) = ({Hq},) of per-head logits, got {got}")
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), one logit per query head, got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on the device of q, {q.device}, got {sinks.device}")
    if not torch.compiler.is_compiling() and bool(torch.isnan(sinks).any() | torch.isposinf(sinks).any()):
        raise ValueError(
            "sinks must not hold NaN or +inf (a sink of +inf would take every row's whole mass); "
            "-inf means no sink for that head"
        )


def apply_sinks(output: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``output (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)`` of an attention without sinks -> with
    them, and the factor ``exp(lse - lse')`` ``(B, Hq, Lq)`` by which each row's probabilities shrink."""
    # In float64: the sink's gradient sums sigmoid terms over every row (B·Lq of them); in fp32 that
    # sum's rounding exceeded the relative rule (tests/backends/test_position_scores.py). (B, Hq, Lq) only.
    out_lse_dtype = lse.dtype
    wide = torch.float32 if lse.device.type == "mps" else torch.float64  # MPS has no float64
    lse = lse.to(wide)
    s = sinks.to(wide).view(1, -1, 1)  # (1, Hq, 1)
    # A fully masked row of a head without sink (lse = s = -inf) stays as it is: -inf - -inf would
    # be NaN, in the forward and in the gradients, so it is computed on zeros and put back.
    both_empty = torch.isneginf(lse) & torch.isneginf(s)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    lse_safe, s_safe = torch.where(both_empty, zero, lse), torch.where(both_empty, zero, s)
    new_lse = torch.where(both_empty, lse, torch.logaddexp(lse_safe, s_safe))
    # sigmoid(lse - s) = exp(lse - lse'): 0 for a fully masked row (lse = -inf), 1 for a sink of -inf.
    factor = torch.where(both_empty, zero, torch.sigmoid(lse_safe - s_safe))
    return output * factor.unsqueeze(-1).to(output.dtype), new_lse.to(out_lse_dtype), factor.to(out_lse_dtype)
