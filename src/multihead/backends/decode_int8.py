"""Attention over int8 keys and values as they are stored: integer GEMMs, no conversion to floats.

The int8 slots of :class:`multihead.caches.QuantizedKVCache` hold, per KV head::

    k[t, c] = K8[t, c] · kc[j, c] · kt[t]      kc: per channel, one row per span j of `span` tokens
    v[t, c] = V8[t, c] · vt[t]                 kt, vt: per token

PyTorch converts int8 to a float dtype at a cost per element above that of reading it from memory
(docs/inference.md#measured-quantized-caches), so a piece dequantized before a float GEMM makes the
8-bit cache slower than the bf16 one. Here the float factors move to the small operands and both
GEMMs of the step run int8 x int8 -> int32 (``torch._int_mm``, oneDNN's VNNI/AMX kernels)::

    q'[r, c] = q[r, c] · scale · kc[j, c]           R = G·Lq query rows per KV head; one q' per span j
    s[r, t]  = kt[t] · Σ_c q'[r, c] K8[t, c]         int_mm(K8 (n, D), digits of q' (D, L·R))
    p        = exp(s - max),  l = Σ_t p,  lse = max + log l     fp32
    p'[r, t] = p[r, t] · vt[t]
    o[r, :]  = Σ_t p'[r, t] V8[t, :] / l             int_mm(digits of p' (L·R, n), V8 (n, Dv))

``q'`` and ``p'`` are written as ``L`` base-128 int8 digits, ``x ≈ σ · Σ_l a_l · 128^(L-1-l)``
with ``σ = max|x| / (127 · 128^(L-1))`` per row (per span): ``a_0`` signed, the others in
``[0, 127]``. ``L`` digits are one GEMM over ``L·R`` columns instead of ``R``, which costs about
the same (the GEMM's cost is reading ``K8``/``V8``; a few more columns ride along). The error of
``x`` is at most ``σ / 2``: ``max|x| / 32512`` with two digits (below fp16/bf16 rounding), about
``max|x| / 4.2e6`` with three (fp32 compute). Attention weights span many orders of magnitude on
long contexts (one key at 0.5, thousands at 1e-5): one digit would round such a tail to 0, two
keep it to a few percent of each weight and three to a few parts per million, per span.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["int8_attention", "digits_for"]

_BASE = 7  # bits per digit after the first: 128 levels, so that every digit fits an int8
_TINY = torch.finfo(torch.float32).tiny


def digits_for(dtype: torch.dtype) -> int | None:
    """Digits of ``q'`` and ``p'`` for a compute dtype: two below fp32, three for fp32, ``None``
    for fp64 (its rounding is below what three int8 digits hold: dequantize instead)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2
    if dtype == torch.float32:
        return 3
    return None


def int8_attention(
    qg: Tensor,
    scale: float,
    keys: Tensor,
    key_channel: Tensor,
    key_token: Tensor,
    values: Tensor,
    value_token: Tensor,
    blocked: Tensor | None,
    G: int,
    Lq: int,
    digits: int,
) -> tuple[Tensor, Tensor]:
    """One partial attention over ``n`` int8 slots of one span: ``(out (B, Hkv, R, Dv) fp32,
    lse (B, Hkv, R) fp32)``, ``out`` normalised over these slots (0 and ``-inf`` on rows that see none).

    ``qg (B, Hkv, R = G·Lq, D)``: the folded query rows (``conventions.fold_query_heads``), times
    ``scale``; ``keys (B, Hkv, n, D)`` and ``values (B, Hkv, n, Dv)`` int8; ``key_channel (B, Hkv, D)``:
    the span's channel scales; ``key_token`` and ``value_token (B, Hkv, n)``; ``blocked``: ``None``
    or ``(B|1, Hkv|1, G|1, Lq, n)``, True where a row may not see the slot. A span at a time, so that
    every buffer of the step stays in cache (the caller joins the spans by their LSE)."""
    B, Hkv, R, D = qg.shape
    n, Dv = keys.shape[2], values.shape[3]
    top = 127 * (1 << (_BASE * (digits - 1)))

    # q' = q · scale · kc, as digits: (B, Hkv, L, R, D) int8
    qc = qg.float() * key_channel.float().unsqueeze(2)  # (B, Hkv, R, D)
    if scale != 1.0:
        qc = qc.mul_(scale)
    q_step = qc.abs().amax(dim=-1, keepdim=True).div_(top).clamp_(min=_TINY)  # (B, Hkv, R, 1)
    q_digits = torch.empty(B, Hkv, digits, R, D, dtype=torch.int8, device=qg.device)
    _digits(qc.div_(q_step), q_digits.unbind(2))

    # integer scores, slot-major (B, Hkv, n, L·R) int32; then s = kt · q_step · Σ_l S_l 128^(L-1-l)
    raw = torch.empty(B, Hkv, n, digits * R, dtype=torch.int32, device=qg.device)
    for b in range(B):
        for h in range(Hkv):
            torch._int_mm(keys[b, h], q_digits[b, h].view(digits * R, D).t(), out=raw[b, h])
    combined = _combine(raw.view(B, Hkv, n, digits, R), dim=3, exact=D <= 512)  # (B, Hkv, n, R)
    scores = torch.empty(B, Hkv, R, n, device=qg.device)  # row-major for the reductions
    torch.mul(combined.transpose(2, 3), q_step, out=scores)
    scores.mul_(key_token.float().unsqueeze(2))
    if blocked is not None:  # masked_fill: a blocked slot's score goes whatever it was
        scores.view(B, Hkv, G, Lq, n).masked_fill_(blocked, float("-inf"))

    # p = exp(s - max) in place; rows that see no slot: max -inf -> 0, every p 0, l 0
    peak = scores.amax(dim=-1, keepdim=True)  # (B, Hkv, R, 1)
    peak.masked_fill_(torch.isneginf(peak), 0.0)
    probs = scores.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    lse = torch.where(total > 0, peak + torch.log(total), float("-inf")).squeeze(-1)  # (B, Hkv, R)

    # p' = p · vt as digits (B, Hkv, L, R, n) int8; o = p_step · Σ_l O_l 128^(L-1-l) / l
    probs.mul_(value_token.float().unsqueeze(2))
    p_step = probs.amax(dim=-1, keepdim=True).div_(top).clamp_(min=_TINY)  # (B, Hkv, R, 1)
    p_digits = torch.empty(B, Hkv, digits, R, n, dtype=torch.int8, device=qg.device)
    _digits(probs.div_(p_step), p_digits.unbind(2))
    raw_out = torch.empty(B, Hkv, digits * R, Dv, dtype=torch.int32, device=qg.device)
    for b in range(B):
        for h in range(Hkv):
            torch._int_mm(p_digits[b, h].view(digits * R, n), values[b, h], out=raw_out[b, h])
    out = _combine(raw_out.view(B, Hkv, digits, R, Dv), dim=2, exact=False).mul_(p_step)  # (B, Hkv, R, Dv)
    return out.div_(total.masked_fill_(total == 0, 1.0)), lse


def _digits(x: Tensor, out: list[Tensor] | tuple[Tensor, ...]) -> None:
    """``x`` (already divided by its step: ``|x| <= 127 · 128^(L-1)``) as ``L`` int8 digits
    written into ``out`` (views of ``x``'s shape): ``x ≈ Σ_l a_l · 128^(L-1-l)``, round to
    nearest; ``a_0`` signed, the others in ``[0, 127]``. In fp32, whose integers are exact up to
    ``2^24``, beyond ``127 · 128^2``; ``x`` is overwritten."""
    whole = x.round_()
    for level, digit in enumerate(out):
        if level == len(out) - 1:
            digit.copy_(whole)
            break
        base = float(1 << (_BASE * (len(out) - 1 - level)))
        high = torch.floor(whole * (1.0 / base))
        digit.copy_(high)
        whole = whole.add_(high, alpha=-base)  # the rest, in [0, base)


def _combine(raw: Tensor, dim: int, exact: bool) -> Tensor:
    """``Σ_l raw_l · 128^(L-1-l)`` over the digit axis ``dim`` of int32 products. ``exact``: two
    digits whose sum fits int32 (``D <= 512``) are joined in int32, one pass fewer; otherwise fp32."""
    if exact and raw.shape[dim] == 2:
        return torch.add(raw.select(dim, 1), raw.select(dim, 0), alpha=1 << _BASE)
    total = raw.select(dim, 0).float()
    for level in range(1, raw.shape[dim]):
        total = total.mul_(1 << _BASE).add_(raw.select(dim, level))
    return total
