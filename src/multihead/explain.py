"""``multihead.explain``: which backend runs a call, why the others were refused, how, and
what would run faster.

The advice (:func:`advise`) names every slow-path cause it sees with its fix: a dense mask tensor
that a mask object spells out (recognised by :func:`multihead.masks.recognize.from_dense`, with the
speed-up measured by a quick probe or estimated from the blocks the object skips, and said which),
dropout (no fused CPU kernel has it), PyTorch's math kernel, a dense additive bias, the reference
backend, and full weights where a selection would do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from multihead.attention import prepare
from multihead.backends.registry import AUTO_ORDER, available_backends, get_backend, select_backend
from multihead.blocks import Block, Extent
from multihead.call import AttentionCall, ScoreModArg, Selection
from multihead.masks import BlockState, Mask, additive_blocked
from multihead.masks.recognize import from_dense
from multihead.scores import Bias

__all__ = ["explain", "Explanation"]


@dataclass(frozen=True)
class Explanation:
    """The dispatch decision for one call. ``str()`` gives the readable report."""

    backend: str  # the backend that runs
    shape: tuple[int, ...]  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    dtype: str
    device: str
    mask: str
    refused: dict[str, list[str]] = field(default_factory=dict)  # backend name -> reasons
    plan: tuple[str, ...] = ()  # how the chosen backend runs the call
    requested: str = "auto"
    advice: tuple[str, ...] = ()  # what would run faster, each with its fix (advise)

    def __str__(self) -> str:
        B, Hq, Hkv, Lq, Lk, D, Dv = self.shape
        lines = [
            f"attention call: B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lk={Lk} D={D} Dv={Dv} {self.dtype} on {self.device}",
            f"mask: {self.mask}",
            f"backend: {self.backend}" + (" (chosen by auto)" if self.requested == "auto" else " (forced)"),
        ]
        lines += [f"  - {line}" for line in self.plan]
        if self.refused:
            lines.append("refused:")
            lines += [f"  {name}: {'; '.join(reasons)}" for name, reasons in self.refused.items()]
        if self.requested == "auto":
            lines.append("auto order: " + " > ".join(AUTO_ORDER))
        if self.advice:
            lines.append("advice:")
            lines += [f"  - {line}" for line in self.advice]
        return "\n".join(lines)


def explain(
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
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    probe: bool | None = None,
) -> Explanation:
    """Explain what :func:`multihead.attention` would do with these arguments, and advise.

    Nothing runs, except with ``probe``: where a dense mask tensor is a mask object written out,
    ``probe=True`` times both (a warm-up and the best of two runs each, on these inputs) to say how
    much faster the object is here; ``probe=None`` (default) does so only when one call is cheap
    (``B·Hq·Lq·Lk·D <= 2^27``) and otherwise estimates from the blocks the object skips;
    ``probe=False`` always estimates. The report says which it did."""
    call = prepare(  # the arguments checked as attention() checks them, every one named
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        softcap=softcap,
        sinks=sinks,
        scale=scale,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
        return_weights=return_weights,
        return_lse=return_lse,
        weights_heads=weights_heads,
        weights_rows=weights_rows,
        max_weights_bytes=None,  # (explained, not refused: the report gives the weights' size)
        backend=backend,
    )
    heads, rows = (None, None) if call.returns is None else (call.returns.heads, call.returns.rows)
    mask_text = "none" if call.mask is None else call.mask._describe()
    if call.score_mod is not None:
        mask_text += f"; score_mod: {call.score_mod._describe()}"
    notes = []
    if call.sinks is not None:
        notes.append("sinks: one logit per head joins each softmax's denominator, through the LSE (multihead.sinks)")
    if call.scale_folded:
        notes.append(
            f"scale {scale!r} <= 0 folded into q (q * scale, kernel scale 1): PyTorch's fused kernels "
            "compute -inf * scale for masked scores (NaN or +inf)"
        )
    if call.empty:
        return Explanation(
            "none",
            call.shape,
            str(q.dtype),
            str(q.device),
            mask_text,
            {},
            tuple(notes + ["Lq or Lk is 0: no kernel runs; every row sees no key (output 0, LSE -inf)"]),
            backend,
        )
    chosen, refused = select_backend(call, backend)
    if backend == "auto":  # also say why backends after the chosen one would not do
        for name in available_backends():
            if name != chosen.name and name not in refused:
                reasons = get_backend(name).refusals(call)
                if reasons:
                    refused[name] = reasons
    plan = notes + list(chosen.plan(call))
    if return_weights:
        nh = q.shape[1] if heads is None else len(heads)
        nr = q.shape[2] if rows is None else len(rows)
        size = q.shape[0] * nh * nr * k.shape[2] * q.element_size()
        plan.append(
            f"weights: {nh} head(s) x {nr} row(s) recomputed block by block from q, k and the LSE "
            f"({size / 2**20:.1f} MiB; attention() refuses more than max_weights_bytes, default 2 GiB)"
        )
    advice = advise(
        call,
        chosen.name,
        plan,
        mask,
        score_mod,
        scale,
        backend,
        probe,
        return_weights and heads is None and rows is None,
    )
    return Explanation(
        chosen.name, call.shape, str(q.dtype), str(q.device), mask_text, refused, tuple(plan), backend, tuple(advice)
    )


# ---------------------------------------------------------------------------------- advice
#: A probe runs by default when one call is at most this many multiply-adds (B·Hq·Lq·Lk·D).
PROBE_ELEMENTS = 1 << 27
_BLOCK = 256  # blocksparse's default query/key block (docs/performance.md)


def advise(
    call: AttentionCall,
    chosen: str,
    plan: list[str],
    mask: Mask | Tensor | None,
    score_mod: ScoreModArg,
    scale: float | None,
    backend: str,
    probe: bool | None,
    full_weights: bool,
) -> list[str]:
    """The slow-path causes of ``call`` that explain can see, each with its fix."""
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    advice = []
    if isinstance(mask, Tensor):
        advice += _dense_mask_advice(call, mask, score_mod, scale, backend, probe)
    if call.dropout_p > 0:
        kernel = (
            "PyTorch's math kernel, which materialises the (B, Hq, Lq, Lk) scores"
            if chosen == "sdpa"
            else f"the {chosen} backend's dropout path"
        )
        advice.append(
            f"dropout_p={call.dropout_p}: no fused CPU kernel applies dropout, so this call runs {kernel}; "
            "fix: dropout only while training (layers pass 0 in eval mode), or dropout=0.0 (attention "
            "dropout is off in most current LLMs)"
        )
    elif any(line.endswith("PyTorch kernel: MATH") for line in plan):
        advice.append(
            f"PyTorch's math kernel runs (it materialises the (B, Hq, Lq, Lk) scores) for {call.q.dtype} "
            f"on {call.q.device.type} with D={D}; fix: a dtype and head dim its fused kernels take "
            "(CPU flash: fp32/bf16/fp16/fp64; CUDA flash: fp16/bf16, D <= 256)"
        )
    bias = [m for m in getattr(call.score_mod, "mods", (call.score_mod,)) if isinstance(m, Bias)]
    for b in bias:
        dense = b.tensor.shape[2] > 1 and b.tensor.shape[3] > 1
        if dense and not (isinstance(mask, Tensor) and mask.is_floating_point() and b.name == "mask"):
            advice.append(
                f"a dense additive bias {tuple(b.tensor.shape)} ({b.name}) is read on every call and "
                "keeps the scores from being skipped; fix: a bias of the head and the distance alone is "
                "a scores.RelativeBias (positions.ALiBi, RelativePositionBias: a strided view per block), "
                "and a bias of 0 and -inf is a mask (a mask object or a bool tensor)"
            )
    if chosen == "reference":
        advice.append(
            "the reference backend runs (plain math in the softmax dtype, the slowest): every other "
            "backend refused, see 'refused:'"
            + ("; fix: drop dropout_mask (a testing aid)" if call.dropout_mask is not None else "")
        )
    if full_weights and B * Hq * Lq * Lk * 4 >= 1 << 26:
        advice.append(
            f"return_weights materialises all of (B, Hq, Lq, Lk) = {(B, Hq, Lq, Lk)}, "
            f"{B * Hq * Lq * Lk * call.q.element_size() / 2**20:.0f} MiB; fix: weights_heads=/weights_rows= "
            "compute only the heads and rows you read, one block at a time"
        )
    return advice


def _dense_mask_advice(
    call: AttentionCall, mask: Tensor, score_mod: ScoreModArg, scale: float | None, backend: str, probe: bool | None
) -> list[str]:
    """What a dense mask tensor is, as an object, and how much faster the object runs."""
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    given = mask.shape  # the caller's tensor, which may broadcast: (1, 1, Lq, 1), (B, 1, 1, Lk), ...
    mask = mask.expand(torch.broadcast_shapes(given, (Lq, Lk)))  # read over the whole (Lq, Lk)
    found = from_dense(mask)
    kind = "float (additive)" if mask.is_floating_point() else "bool"
    if found is None:
        return []
    stand_in = _stand_in(mask) if found.bias else None
    if stand_in is not None:  # -1e9 written for -inf: read the 0 entries as the pattern
        found = from_dense(mask == 0)
        if found is None or found.mask is None:
            return []
    if found.mask is None:
        what = f"this {kind} mask lets every query see every key: pass mask=None"
        other = None
    else:
        what = f"this dense {kind} mask is `{found.expression}`" + (f" ({found.where})" if found.where else "")
        what += "; pass that object instead"
        other = found.mask
    if found.bias:
        return [
            what + ", with its finite entries as score_mod=multihead.scores.bias(...) (they add a bias, not "
            "only 0)" + ("" if other is None else ": backends can then skip the blocks the object blocks")
        ]
    if stand_in is not None:
        blocked_rows = not bool((mask == 0).reshape(-1, *mask.shape[-2:]).any(dim=-1).all())
        what += (
            f" (it writes {stand_in:g} where -inf blocks: exp() underflows to 0 there, so the weights are the "
            "object's"
            + (
                ", except in rows that block every key: a uniform average with the tensor, zeros with the object"
                if blocked_rows
                else ""
            )
            + ")"
        )
    elif mask.is_floating_point():
        low = _finite_blocked(mask)
        what += (
            " (its finite entries are all 0"
            if low is None
            else f" (it writes {low:g} where it blocks, read as -inf (masks.additive_blocked); its other "
            "entries are all 0"
        ) + ": the float tensor adds a dense bias of zeros besides)"
    dense = "x".join(str(n) for n in given)
    cheap = B * Hq * Lq * Lk * D <= PROBE_ELEMENTS
    if probe or (probe is None and cheap):
        factor = _probe(call, mask, other, score_mod, scale, backend)
        how = "measured on these inputs: best of 2 runs each, after a warm-up"
        if factor < 1.1:  # measured no faster: the object is an option here, not the advice
            what = what.replace("; pass that object instead", "")
            return [
                what + f": the object is no faster at this size ({factor:.2f}x, {how}); it saves the {dense} "
                "tensor's memory and reads, and gains as L grows"
            ]
        return [what + f": {factor:.1f}x faster here ({how})"]
    fraction = _visible_fraction(other, B, Lq, Lk)
    if fraction >= 0.9:
        return [
            what + f": it needs no {dense} tensor (estimated: the object blocks too little of the "
            "square to skip work; explain(..., probe=True) measures)"
        ]
    return [
        what + f": about {1 / fraction:.1f}x less work (estimated: the object's backends compute "
        f"{fraction:.0%} of the {_BLOCK}x{_BLOCK} blocks; explain(..., probe=True) measures)"
    ]


#: A float mask whose entries that do not block are 0 or at most this uses them for "blocked":
#: -1e4 (BERT in fp16) and -1e9 (many tutorials) underflow exp() to 0 but are a bias by the one
#: rule (masks.additive_blocked), unlike torch.finfo(dtype).min (Hugging Face), which blocks.
STAND_IN = -1e4


def _stand_in(mask: Tensor) -> float | None:
    """The largest value a float ``mask`` writes for "blocked" without blocking (``-1e9``), when
    every entry that does not block is 0 or at most :data:`STAND_IN`; else ``None``."""
    kept = mask[~additive_blocked(mask) & torch.isfinite(mask)]
    low = kept[kept != 0]
    if low.numel() == 0 or bool((low > STAND_IN).any()):
        return None
    return float(low.max())


def _finite_blocked(mask: Tensor) -> float | None:
    """The largest finite value a float ``mask`` blocks with (``finfo.min``), ``None`` when it blocks
    with ``-inf`` only."""
    low = mask[additive_blocked(mask) & torch.isfinite(mask)]
    return float(low.max()) if low.numel() else None


def _probe(
    call: AttentionCall, mask: Tensor, other: Mask | None, score_mod: ScoreModArg, scale: float | None, backend: str
) -> float:
    """Time attention with the dense ``mask`` and with ``other``: the dense time over the object's."""
    from multihead.attention import attention  # the entry point imports nothing from here

    q, k, v = (t.detach() for t in (call.q, call.k, call.v))
    times = []
    with torch.no_grad():
        for m in (mask, other):
            best = math.inf
            for run in range(3):  # a warm-up (plans, caches), then the best of two
                start = time.perf_counter()
                attention(q, k, v, mask=m, score_mod=score_mod, scale=scale, dropout_p=call.dropout_p, backend=backend)
                if q.device.type == "cuda":
                    torch.cuda.synchronize(q.device)
                if run:
                    best = min(best, time.perf_counter() - start)
            times.append(best)
    return times[0] / max(times[1], 1e-9)


def _visible_fraction(mask: Mask | None, B: int, Lq: int, Lk: int) -> float:
    """The fraction of ``_BLOCK``-square blocks that ``mask`` does not block entirely."""
    if mask is None:
        return 1.0
    size = max(_BLOCK, math.ceil(max(Lq, Lk) / 64))  # at most 64 x 64 blocks to ask about
    blocks = [
        Block(q0, min(q0 + size, Lq), k0, min(k0 + size, Lk)) for q0 in range(0, Lq, size) for k0 in range(0, Lk, size)
    ]
    extent = Extent(B, 1, Lq, Lk)
    visible = sum(mask.block_state(extent, block) != BlockState.EMPTY for block in blocks)
    return max(visible, 1) / len(blocks)
