"""An attention oracle written from first principles, for the differential fuzzer.

Independent of ``multihead.reference``, ``multihead.scoring``, ``multihead.blockwise`` and
``Mask.materialize`` on purpose: a bug there must not hide in both sides of a comparison. What it
reads from ``multihead`` is only what the conventions (docs/conventions.md) define as the meaning
of the arguments:

* a mask object through ``mask.mask_mod(b, h, q_idx, kv_idx, q_len=Lq, kv_len=Lk)`` on index grids;
* a bool tensor: ``True`` = may attend, broadcast right-aligned to ``(B, Hq, Lq, Lk)``;
* a float ``mask=`` tensor: additive, ``-inf`` blocks, added before any ``score_mod``;
* ``multihead.scores.Bias.tensor`` (added) and ``multihead.scores.Softcap.cap`` (``c·tanh(s/c)``),
  applied to ``scale · q·k`` in list order, before the mask blocks anything;
* position biases as the papers define them, dense (:func:`alibi_bias`, :func:`t5_bias`), from the
  case's description rather than from the multihead objects: query ``i`` sits at key position
  ``i + Lk - Lq`` (bottom-right alignment) or ``i`` (top-left).

For each ``(b, h, i)``: query head ``h`` reads KV head ``h // (Hq // Hkv)``; the softmax runs over
the keys the row may see; a row that sees none gives output 0, LSE ``-inf``, weights 0 and zero
gradients; a row that reads a non-finite input is NaN (the policy of docs/conventions.md). Blocked
scores never enter an ``exp`` (no ``inf · 0`` in forward or backward), and the
row maximum is taken over visible scores only, so rows whose scores are all very negative are exact.

:func:`attend` runs in any dtype: in float64 it is the oracle; in the inputs' own dtype, with no
upcast, it is the *naive baseline* of the relative rule (shared/TESTING.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.scores import Bias, Softcap

__all__ = ["visible", "mods_of", "attend", "attend_flash", "Attended", "alibi_bias", "t5_buckets", "t5_bias"]


def visible(mask, B: int, Hq: int, Lq: int, Lk: int) -> Tensor:
    """The bool ``(B, Hq, Lq, Lk)`` grid of what each query may see (``True`` = may attend)."""
    if mask is None:
        return torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    if isinstance(mask, Tensor):
        # conventions.md: -inf and values at or below finfo(dtype).min / 2 block (written here again: an oracle)
        allowed = mask if mask.dtype == torch.bool else ~(mask <= torch.finfo(mask.dtype).min / 2)
        return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).expand(B, Hq, Lq, Lk)
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(Hq).view(1, -1, 1, 1)
    i = torch.arange(Lq).view(1, 1, -1, 1)
    j = torch.arange(Lk).view(1, 1, 1, -1)
    allowed = mask.mask_mod(b, h, i, j, q_len=Lq, kv_len=Lk)
    assert allowed.dtype == torch.bool, f"mask_mod returned {allowed.dtype}"
    allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    return allowed.expand(B, Hq, Lq, Lk)


def mods_of(mask, score_mod) -> list[tuple[str, object]]:
    """The score modifiers of a call in the order they apply: ``("bias", tensor)`` (additive,
    finite where it matters) and ``("softcap", cap)``. A float ``mask=`` comes first, with its
    ``-inf`` entries replaced by 0 (those keys are blocked anyway; no ``-inf`` enters the math)."""
    out: list[tuple[str, object]] = []
    if isinstance(mask, Tensor) and mask.is_floating_point():
        out.append(("bias", mask.masked_fill(mask == float("-inf"), 0.0)))
    if score_mod is None:
        return out
    for m in score_mod if isinstance(score_mod, (list, tuple)) else [score_mod]:
        if isinstance(m, Bias):
            out.append(("bias", m.tensor))
        elif isinstance(m, Softcap):
            out.append(("softcap", float(m.cap)))
        else:
            raise TypeError(f"the oracle does not know the modifier {m!r}")
    return out


def _distance(Lq: int, Lk: int, align: str) -> Tensor:
    """``(Lq, Lk)`` int64: key position minus the aligned query position."""
    i = torch.arange(Lq).view(-1, 1) + (Lk - Lq if align == "bottom_right" else 0)
    return torch.arange(Lk).view(1, -1) - i


def paper_slopes(n: int) -> list[float]:
    """ALiBi's slopes (Press et al.): ``2^(-8(h+1)/n)`` for ``n`` a power of two; otherwise those
    of the largest power of two ``p < n``, then every other slope of ``2p`` heads."""
    p = 1 << (n.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    return slopes + [2.0 ** (-8.0 * (h + 1) / (2 * p)) for h in range(0, 2 * (n - p), 2)]


def alibi_bias(Hq: int, Lq: int, Lk: int, symmetric: bool, align: str, steep: float) -> Tensor:
    """``(1, Hq, Lq, Lk)`` float64: ``m_h (j - i)`` (the paper's form; it grows for keys after
    the query), or ``-m_h |j - i|``, with the paper's slopes times ``steep``."""
    m = torch.tensor(paper_slopes(Hq), dtype=torch.float64).view(-1, 1, 1) * steep
    d = _distance(Lq, Lk, align).to(torch.float64)
    return (-m * d.abs() if symmetric else m * d).unsqueeze(0)


def t5_buckets(Lq: int, Lk: int, bidirectional: bool, num_buckets: int, max_distance: int, align: str) -> Tensor:
    """``(Lq, Lk)`` int64: T5's bucket of each distance (Raffel et al., and ``transformers``'
    ``_relative_position_bucket``), written as a loop over the distances present."""
    d = _distance(Lq, Lk, align)
    table = {}
    for x in range(int(d.min()), int(d.max()) + 1) if d.numel() else ():
        n = num_buckets // 2 if bidirectional else num_buckets
        ret = n if bidirectional and x > 0 else 0
        r = abs(x) if bidirectional else max(-x, 0)
        exact = n // 2
        if r < exact:
            table[x] = ret + r
        else:  # in float32, as T5 computes it
            large = exact + int(
                float(torch.log(torch.tensor(r / exact, dtype=torch.float32)))
                / math.log(max_distance / exact)
                * (n - exact)
            )
            table[x] = ret + min(large, n - 1)
    return d.apply_(lambda x: table[x]) if d.numel() else d


def t5_bias(table: Tensor, buckets: Tensor) -> Tensor:
    """``(1, Hq, Lq, Lk)``: ``table[bucket, h]`` by indexing (differentiable in ``table``)."""
    return table[buckets].permute(2, 0, 1).unsqueeze(0)


@dataclass
class Attended:
    out: Tensor  # (B, Hq, Lq, Dv)
    lse: Tensor  # (B, Hq, Lq), -inf on rows that see nothing
    weights: Tensor  # (B, Hq, Lq, Lk)


def attend(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, mods, scale: float, dtype: torch.dtype = torch.float64
) -> Attended:
    """Attention of ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` computed in
    ``dtype`` (float64: the oracle; the inputs' dtype: the naive baseline). Differentiable in
    ``q, k, v`` and in every bias tensor of ``mods``."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    # A key that no query of its KV head may see cannot change anything: it is read as 0 here,
    # so that whatever it holds (even NaN) reaches neither the output nor a gradient.
    group = Hq // Hkv
    seen = allowed.reshape(B, Hkv, group, Lq, Lk).any(dim=2).any(dim=2)  # (B, Hkv, Lk)
    k = torch.where(seen.unsqueeze(-1), k, torch.zeros((), dtype=dtype))
    v = torch.where(seen.unsqueeze(-1), v, torch.zeros((), dtype=dtype))

    kv_head = torch.arange(Hq) // group  # query head h reads KV head h // G
    k_h, v_h = k[:, kv_head], v[:, kv_head]  # (B, Hq, Lk, D), (B, Hq, Lk, Dv)

    s = torch.einsum("bhid,bhjd->bhij", q, k_h) * scale  # (B, Hq, Lq, Lk)
    for kind, arg in mods:
        if kind == "bias":
            # PyTorch's promotion, as plain code gets it: an fp32 bias on fp16 scores gives fp32
            # scores from here on (the oracle: fp64 throughout).
            t = arg.to(torch.promote_types(dtype, arg.dtype))
            s = s + t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
        else:
            s = arg * torch.tanh(s / arg)
    sdt = s.dtype

    has_key = allowed.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    # The row maximum over visible scores only (a constant for the gradient: softmax is
    # shift-invariant); 0 on rows that see nothing.
    neg_inf = torch.tensor(float("-inf"), dtype=sdt)
    m = torch.where(allowed, s.detach(), neg_inf).amax(dim=-1, keepdim=True) if Lk else has_key.to(sdt)
    m = torch.where(has_key, m, torch.zeros((), dtype=sdt))
    # Visible: s - m <= 0. Blocked: replaced by -inf *before* exp, so exp gives exactly 0 and the
    # gradient reaching a blocked score is exactly 0 (torch.where routes none to it).
    z = torch.where(allowed, s - m, neg_inf)
    e = torch.exp(z)
    denom = e.sum(dim=-1, keepdim=True)
    safe = torch.where(has_key, denom, torch.ones((), dtype=sdt))
    p = e / safe  # rows that see nothing: 0 / 1 = 0
    # A row reads the values it may see only (0 · NaN must not reach the others); rows that may
    # see a non-finite value are NaN by the policy below.
    v_read = torch.where(torch.isfinite(v_h), v_h, torch.zeros((), dtype=dtype))
    out = torch.einsum("bhij,bhjd->bhid", p.to(dtype), v_read)
    lse = torch.where(has_key, torch.log(safe) + m, neg_inf).squeeze(-1)

    # Non-finite inputs (docs/conventions.md): a row that sees a key at all, and whose query holds
    # a NaN/inf or that may see a key or value holding one, is NaN in output, LSE and weights (the
    # math alone would leave the other columns of a row finite when one value column is NaN).
    bad_q = ~torch.isfinite(q).all(dim=-1)  # (B, Hq, Lq)
    bad_kv = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))[:, kv_head]  # (B, Hq, Lk)
    poisoned = has_key.squeeze(-1) & (bad_q | (allowed & bad_kv.unsqueeze(2)).any(dim=-1))
    if bool(poisoned.any()):
        nan = torch.tensor(float("nan"), dtype=dtype)
        out = torch.where(poisoned.unsqueeze(-1), nan, out)
        lse = torch.where(poisoned, nan.to(lse.dtype), lse)
        p = torch.where(poisoned.unsqueeze(-1), nan.to(p.dtype), p)
    return Attended(out, lse, p)


def attend_flash(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, mods, scale: float, dtype: torch.dtype, dout: Tensor | None
) -> tuple[Attended, dict]:
    """The second baseline: the same naive computation arranged the way fused kernels arrange it.

    Scores and softmax in the accumulation dtype (fp32; fp64 for fp64), the output rounded to
    ``dtype``, the LSE kept; weights recomputed as ``P = exp(s - lse)``; the backward of flash
    attention, ``dS = P (dP - rowsum(dO * O))``. Its rounding differs from the autograd softmax:
    where a result is 0 in theory (the gradient of a bias constant along keys, of a key seen by
    one-key rows) or exactly 1 (a weight), the autograd softmax gets it exactly and this does not,
    by a few ulps of the LSE's dtype at |lse|. A backend is held to F times the worse of the two
    baselines. Returns the forward and, with ``dout``, the gradients ``{"q", "k", "v"}`` of the
    (B, H, L, D) inputs as given and ``{i: d bias}`` for each bias in ``mods`` (at its 4-D shape).
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    seen = allowed.reshape(B, Hkv, group, Lq, Lk).any(dim=2).any(dim=2)
    qa, ka, va = (t.detach().to(dtype).to(acc) for t in (q, k, v))  # the rounded inputs, accumulated
    ka = torch.where(seen.unsqueeze(-1), ka, torch.zeros((), dtype=acc))
    va = torch.where(seen.unsqueeze(-1), va, torch.zeros((), dtype=acc))
    kv_head = torch.arange(Hq) // group
    k_h, v_h = ka[:, kv_head], va[:, kv_head]

    s = torch.einsum("bhid,bhjd->bhij", qa, k_h) * scale
    caps = []  # (index, pre-softcap scores, cap)
    for i, (kind, arg) in enumerate(mods):
        if kind == "bias":
            t = arg.detach().to(acc)
            s = s + t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
        else:
            caps.append((i, s, arg))
            s = arg * torch.tanh(s / arg)
    has_key = allowed.any(dim=-1, keepdim=True)
    neg_inf = torch.tensor(float("-inf"), dtype=acc)
    m = torch.where(allowed, s, neg_inf).amax(dim=-1, keepdim=True) if Lk else has_key.to(acc)
    m = torch.where(has_key, m, torch.zeros((), dtype=acc))
    e = torch.exp(torch.where(allowed, s - m, neg_inf))
    denom = torch.where(has_key, e.sum(dim=-1, keepdim=True), torch.ones((), dtype=acc))
    out = torch.einsum("bhij,bhjd->bhid", e / denom, v_h).to(dtype)  # the output as returned
    lse = torch.where(has_key, torch.log(denom) + m, neg_inf)  # the LSE as kept
    # Probabilities recomputed from the kept LSE (rows that see nothing: LSE +inf, P = 0).
    p = torch.exp(torch.where(allowed, s - torch.where(has_key, lse, -neg_inf), neg_inf))
    fwd = Attended(out, lse.squeeze(-1), p.to(dtype))
    if dout is None:
        return fwd, {}

    do = dout.detach().to(dtype).to(acc)
    dp = torch.einsum("bhid,bhjd->bhij", do, v_h)
    delta = (do * out.to(acc)).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)  # d loss / d (scores after every modifier)
    grads: dict = {}
    for i in reversed(range(len(mods))):
        kind, arg = mods[i]
        if kind == "bias":
            shape = arg.reshape((1,) * (4 - arg.dim()) + tuple(arg.shape)).shape
            dims = [d for d in range(4) if shape[d] == 1]
            grads[i] = ds.sum(dim=dims, keepdim=True) if dims else ds  # (an empty list sums all)
        else:
            pre = next(x for j, x, _ in caps if j == i)
            ds = ds * (1 - torch.tanh(pre / arg) ** 2)
    ds = ds * scale
    grads["q"] = torch.einsum("bhij,bhjd->bhid", ds, k_h)
    grads["k"] = torch.einsum("bhij,bhid->bhjd", ds, qa).reshape(B, Hkv, group, Lk, D).sum(2)
    grads["v"] = torch.einsum("bhij,bhid->bhjd", p, do).reshape(B, Hkv, group, Lk, v.shape[-1]).sum(2)
    return fwd, grads
