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
    first: int,
    span: int,
    blocked: Tensor | None,
    G: int,
    Lq: int,
    digits: int,
) -> tuple[Tensor, Tensor]:
    """One partial attention over ``n`` int8 slots: ``(out (B, Hkv, R, Dv) fp32, lse (B, Hkv, R) fp32)``,
    ``out`` normalised over these slots (0 and ``-inf`` on rows that see none).

    ``qg (B, Hkv, R = G·Lq, D)``: the folded query rows (``conventions.fold_query_heads``), times
    ``scale``; ``keys (B, Hkv, n, D)`` and ``values (B, Hkv, n, Dv)`` int8; ``key_token`` and
    ``value_token (B, Hkv, n)``; ``key_channel (B, Hkv, spans, D)``, row ``j`` for the slots
    ``[j·span, (j+1)·span)`` of the region, whose slot ``first`` is ``keys[:, :, 0]``;
    ``blocked``: ``None`` or ``(B|1, Hkv|1, G|1, Lq, n)``, True where a row may not see the slot.
    The GEMMs run a span at a time (one ``q'`` per span); the passes between them over every span
    at once (few ops: on a shared machine each op waits for every thread)."""
    B, Hkv, R, D = qg.shape
    n, Dv = keys.shape[2], values.shape[3]
    j0, j1 = first // span, (first + n - 1) // span + 1
    spans, off = j1 - j0, first - j0 * span  # slots padded to whole spans: [off, off + n) of spans·span
    padded = spans * span
    chunks = [(max(j * span, off) - off, min((j + 1) * span, off + n) - off) for j in range(spans)]
    top = 127 * (1 << (_BASE * (digits - 1)))

    # q' = q · scale · kc per span, as digits (B, Hkv, spans, D, L, R) int8: the GEMM's right operand
    # as it lies (oneDNN's int8 GEMM read a transposed one at well under half the speed)
    qc = qg.float().unsqueeze(2) * key_channel[:, :, j0:j1].float().unsqueeze(3)  # (B, Hkv, spans, R, D)
    if scale != 1.0:
        qc = qc.mul_(scale)
    q_step = qc.abs().amax(dim=-1, keepdim=True).div_(top).clamp_(min=_TINY)  # (B, Hkv, spans, R, 1)
    q_digits = torch.empty(B, Hkv, spans, D, digits, R, dtype=torch.int8, device=qg.device)
    _digits(qc.div_(q_step), [d.transpose(3, 4) for d in q_digits.unbind(4)])

    # integer scores, slot-major (B, Hkv, padded, L·R) int32 (padding rows unwritten, then -inf)
    raw = torch.empty(B, Hkv, padded, digits * R, dtype=torch.int32, device=qg.device)
    for b in range(B):
        for h in range(Hkv):
            for j, (c0, c1) in enumerate(chunks):
                right = q_digits[b, h, j].view(D, digits * R)
                torch._int_mm(keys[b, h, c0:c1], right, out=raw[b, h, off + c0 : off + c1])
    # s = kt · q_step · Σ_l S_l 128^(L-1-l), row-major (B, Hkv, R, spans, span) for the reductions
    combined = _combine(raw.view(B, Hkv, spans, span, digits, R), dim=4, exact=D <= 512)
    scores = torch.empty(B, Hkv, R, spans, span, device=qg.device)
    torch.mul(combined.permute(0, 1, 4, 2, 3), q_step.view(B, Hkv, spans, R).transpose(2, 3).unsqueeze(-1), out=scores)
    flat = scores.view(B, Hkv, R, padded)
    flat[..., off : off + n].mul_(key_token.float().unsqueeze(2))
    if off or off + n < padded:  # the first and last spans' padding: no slot there
        flat[..., :off] = float("-inf")
        flat[..., off + n :] = float("-inf")
    if blocked is not None:  # masked_fill: a blocked slot's score goes whatever it was
        flat[..., off : off + n].unflatten(2, (G, Lq)).masked_fill_(blocked, float("-inf"))

    # A slot stored from a NaN or inf has a NaN value scale (QuantizedKVCache, "Non-finite keys and
    # values"): the rows that may see it get NaN, as 0 · NaN gives in a float P V; the rows it is
    # blocked for do not (a NaN scale times the weight 0 would spread it to every row of the GEMM).
    bad_values = torch.isnan(value_token)  # (B, Hkv, n)
    reads_bad = None
    if bool(bad_values.any()):
        reads_bad = (torch.isfinite(flat[..., off : off + n]) & bad_values.unsqueeze(2)).any(dim=-1)  # (B, Hkv, R)
        value_token = value_token.masked_fill(bad_values, 0.0)

    # p = exp(s - max) in place; rows that see no slot: max -inf -> 0, every p 0, l 0
    peak = flat.amax(dim=-1, keepdim=True)  # (B, Hkv, R, 1)
    peak.masked_fill_(torch.isneginf(peak), 0.0)
    probs = flat.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    lse = torch.where(total > 0, peak + torch.log(total), float("-inf")).squeeze(-1)  # (B, Hkv, R)

    # p' = p · vt as digits per row per span: (B, Hkv, spans, L, R, span) int8
    probs[..., off : off + n].mul_(value_token.float().unsqueeze(2))
    p_step = scores.amax(dim=-1, keepdim=True).div_(top).clamp_(min=_TINY)  # (B, Hkv, R, spans, 1)
    p_digits = torch.empty(B, Hkv, spans, digits, R, span, dtype=torch.int8, device=qg.device)
    _digits(scores.div_(p_step), [d.permute(0, 1, 3, 2, 4) for d in p_digits.unbind(3)])

    # o = Σ_j p_step · Σ_l O_l 128^(L-1-l), normalised by l
    raw_out = torch.empty(B, Hkv, spans, digits * R, Dv, dtype=torch.int32, device=qg.device)
    for b in range(B):
        for h in range(Hkv):
            for j, (c0, c1) in enumerate(chunks):
                a = off + c0 - j * span  # where the chunk starts inside span j
                rows = p_digits[b, h, j].view(digits * R, span)[:, a : a + c1 - c0]
                torch._int_mm(rows, values[b, h, c0:c1], out=raw_out[b, h, j])
    out = _combine(raw_out.view(B, Hkv, spans, digits, R, Dv), dim=3, exact=False)  # (B, Hkv, spans, R, Dv)
    out = out.mul_(p_step.view(B, Hkv, R, spans).transpose(2, 3).unsqueeze(-1)).sum(dim=2)  # (B, Hkv, R, Dv)
    out = out.div_(total.masked_fill_(total == 0, 1.0))
    if reads_bad is not None:
        out.masked_fill_(reads_bad.unsqueeze(-1), float("nan"))
    return out, lse


def _digits(x: Tensor, out: list[Tensor] | tuple[Tensor, ...]) -> None:
    """``x`` (already divided by its step: ``|x| <= 127 · 128^(L-1)``) as ``L`` int8 digits
    written into ``out`` (views of ``x``'s shape): ``x ≈ Σ_l a_l · 128^(L-1-l)``, each digit the
    rounded rest of the ones before (``a_0`` within 127, the others within 64): the error is at
    most one half. In fp32, exact for these integers (below ``2^24``); ``x`` is overwritten."""
    for level, digit in enumerate(out):
        base = float(1 << (_BASE * (len(out) - 1 - level)))
        high = torch.round(x * (1.0 / base)) if base != 1.0 else x.round_()
        digit.copy_(high)
        if base != 1.0:
            x = x.add_(high, alpha=-base)  # the rest, within base / 2


def _combine(raw: Tensor, dim: int, exact: bool) -> Tensor:
    """``Σ_l raw_l · 128^(L-1-l)`` over the digit axis ``dim`` of int32 products. ``exact``: two
    digits whose sum fits int32 (``D <= 512``) are joined in int32, one pass fewer; otherwise fp32."""
    if exact and raw.shape[dim] == 2:
        return torch.add(raw.select(dim, 1), raw.select(dim, 0), alpha=1 << _BASE)
    total = raw.select(dim, 0).float()
    for level in range(1, raw.shape[dim]):
        total = total.mul_(1 << _BASE).add_(raw.select(dim, level))
    return total
