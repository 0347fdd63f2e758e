"""``multihead walkthrough`` (alias ``multihead explain``): one attention layer on random data,
every step printed with its shapes.

The walk-through of seed 001, generated from the real code path instead of written by hand: it
builds a real :class:`multihead.MultiHeadAttention`, runs its own projections and head split,
spells out scores / scale / mask / softmax / weighted sum on those tensors, then checks that
:func:`multihead.attention` (whatever backend it picks) and the layer's own ``forward`` give the
same result, and prints :func:`multihead.explain`'s account of which backend ran and why.

    print(walkthrough(d_model=512, heads=8, kv_heads=2, seq=10, batch=2, causal=True))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from multihead.attention import attention
from multihead.conventions import repeat_kv
from multihead.explain import Explanation, explain
from multihead.layers import MultiHeadAttention
from multihead.layers.heads import merge_heads, split_heads
from multihead.masks import causal as causal_mask
from multihead.masks import sliding_window

__all__ = ["walkthrough", "Walkthrough", "Step"]

_PICTURE_MAX = 16  # mask pictures larger than this are cut (and say so)


@dataclass(frozen=True)
class Step:
    """One step of the walk-through: lines of ``(code, resulting shape, what it means)``, and an
    optional note printed under them (a mask picture, a table)."""

    title: str
    lines: tuple[tuple[str, tuple, str], ...]
    note: str = ""


@dataclass
class Walkthrough:
    """The steps, the checks against the real code path, and the dispatch report."""

    header: list[str]
    steps: list[Step]
    checks: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (max |difference|, tolerance)
    explanation: Explanation | None = None

    @property
    def ok(self) -> bool:
        return all(diff <= tol for diff, tol in self.checks.values())

    def __str__(self) -> str:
        lines = list(self.header) + [""]
        code_width = max(len(code) for s in self.steps for code, _, _ in s.lines)
        for i, s in enumerate(self.steps, 1):
            lines.append(f"{i:>2}. {s.title}")
            for code, shape, legend in s.lines:
                shape_text = "(" + ", ".join(str(n) for n in shape) + ")" if shape else ""
                lines.append(f"    {code:<{code_width}}  -> {shape_text:<16} {legend}")
            lines += [f"      {line}" for line in s.note.splitlines()]
        lines += ["", "checks (the steps above against the real code path):"]
        for name, (diff, tol) in self.checks.items():
            verdict = "ok" if diff <= tol else f"MISMATCH (tolerance {tol:.1e})"
            lines.append(f"  {name}: max |difference| = {diff:.2e}  {verdict}")
        if self.explanation is not None:
            lines += ["", "which backend ran, and why (multihead.explain):"]
            lines += [f"  {line}" for line in str(self.explanation).splitlines()]
        return "\n".join(lines)


@torch.no_grad()
def walkthrough(
    *,
    d_model: int = 512,
    heads: int = 8,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    seq: int = 10,
    batch: int = 2,
    causal: bool = False,
    window: int | None = None,
    seed: int = 0,
    backend: str = "auto",
    device: str | torch.device = "cpu",
) -> Walkthrough:
    """Run one layer on random ``(batch, seq, d_model)`` data and record every step.

    ``kv_heads`` < ``heads`` gives grouped-query attention; ``causal``/``window`` pick the mask.
    Invalid sizes raise the layer's own ``ValueError`` (naming the argument).
    """
    for name, value in (("seq", seq), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int, got {window!r}")
    torch.manual_seed(seed)
    layer = MultiHeadAttention(
        d_model, heads, num_kv_heads=kv_heads, head_dim=head_dim, causal=causal, backend=backend, device=device
    ).eval()
    B, L, E = batch, seq, d_model
    Hq, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    G = Hq // Hkv
    x = torch.randn(B, L, E, device=device)
    mask = sliding_window(window) if window is not None else None  # the call-time mask, if any
    # What the layer passes to the core: the call's mask, `& causal()` when the layer is causal
    # (checked below: the layer's own forward must give the same output).
    full_mask = (mask & causal_mask() if mask is not None else causal_mask()) if causal else mask

    kind = "multi-head (MHA)" if Hkv == Hq else ("multi-query (MQA)" if Hkv == 1 else "grouped-query (GQA)")
    header = [
        f"multihead walkthrough: one {kind} attention layer, step by step, on random data (seed {seed})",
        f"layer: MultiHeadAttention({layer.extra_repr()})",
        f"sizes: B={B} batch, L={L} tokens, E={E} model dim, Hq={Hq} query heads, Hkv={Hkv} key/value heads, "
        f"D={D} head dim" + (f", G={G} query heads per KV head" if G > 1 else ""),
    ]
    steps = [
        Step("input", (("x = torch.randn(B, L, E)", tuple(x.shape), "(B, L, E)  one vector of E numbers per token"),))
    ]

    # 1. Projections: the layer's own nn.Linear modules.
    q_flat, k_flat, v_flat = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    steps.append(
        Step(
            "project to queries, keys and values (the layer's nn.Linear modules)",
            (
                ("q = layer.q_proj(x)", tuple(q_flat.shape), "(B, L, Hq*D)  what each token is looking for"),
                ("k = layer.k_proj(x)", tuple(k_flat.shape), "(B, L, Hkv*D)  what each token offers to be found by"),
                ("v = layer.v_proj(x)", tuple(v_flat.shape), "(B, L, Hkv*D)  what each token hands over when found"),
            ),
            f"q_proj: {E} -> {Hq}*{D} features; k_proj, v_proj: {E} -> {Hkv}*{D}",
        )
    )

    # 2. Split into heads: features [h*D, (h+1)*D) are head h; a view, no copy.
    q = split_heads(q_flat, Hq, D, True)
    k = split_heads(k_flat, Hkv, D, True)
    v = split_heads(v_flat, Hkv, D, True)
    steps.append(
        Step(
            "split into heads",
            (
                ("q.view(B, L, Hq, D).transpose(1, 2)", tuple(q.shape), "(B, Hq, L, D)"),
                ("k.view(B, L, Hkv, D).transpose(1, 2)", tuple(k.shape), "(B, Hkv, L, D)"),
                ("v.view(B, L, Hkv, D).transpose(1, 2)", tuple(v.shape), "(B, Hkv, L, D)"),
            ),
            "head h = features [h*D, (h+1)*D) of the projection; views, no copy",
        )
    )

    # 3. GQA grouping: query head h reads KV head h // G.
    k_rep = repeat_kv(k, Hq)  # (B, Hq, L, D), for the spelled-out steps only
    v_rep = repeat_kv(v, Hq)
    if G > 1:
        steps.append(
            Step(
                "group query heads onto key/value heads",
                (
                    (
                        "k.repeat_interleave(G, dim=1)",
                        tuple(k_rep.shape),
                        f"(B, Hq, L, D)  query head h reads KV head h // {G}",
                    ),
                    ("v.repeat_interleave(G, dim=1)", tuple(v_rep.shape), "(B, Hq, L, D)"),
                ),
                _gqa_table(Hq, Hkv) + "\n(written out to show it; the backends read the shared head without copying)",
            )
        )

    # 4-8. Scores, scale, mask, softmax, weighted sum.
    scores = q @ k_rep.transpose(-2, -1)  # (B, Hq, L, L)
    steps.append(
        Step(
            "scores: every query against every key",
            (
                (
                    "scores = q @ k.transpose(-2, -1)",
                    tuple(scores.shape),
                    "(B, Hq, Lq, Lk)  how well key j matches query i",
                ),
            ),
        )
    )
    scale = D**-0.5
    scaled = scores * scale
    steps.append(
        Step(
            "scale",
            ((f"scores * D**-0.5  (= {scale:.4g})", tuple(scaled.shape), "(B, Hq, Lq, Lk)"),),
            "keeps the scores' spread independent of D, so the softmax does not saturate",
        )
    )
    if full_mask is not None:
        allowed = full_mask.materialize(B, Hq, L, L, device=device)  # bool, broadcastable
        scaled = scaled.masked_fill(~allowed, float("-inf"))
        steps.append(
            Step(
                f"mask: {full_mask._describe()}",
                (
                    (
                        "scores.masked_fill(~mask, -inf)",
                        tuple(scaled.shape),
                        "(B, Hq, Lq, Lk)  blocked pairs get weight 0",
                    ),
                ),
                _mask_picture(full_mask, L),
            )
        )
    else:
        steps.append(Step("mask: none", (("(no mask)", (), "every query may see every key"),)))
    weights = torch.softmax(scaled.float(), dim=-1).to(x.dtype)
    row_error = (weights.sum(-1) - 1).abs().max().item()
    steps.append(
        Step(
            "softmax over keys",
            (
                (
                    "weights = scores.softmax(dim=-1)",
                    tuple(weights.shape),
                    "(B, Hq, Lq, Lk)  how query i splits its attention",
                ),
            ),
            f"every row sums to 1 (max |sum - 1| = {row_error:.1e}); query {L - 1} of head 0, batch 0:\n"
            + _row(weights[0, 0, L - 1]),
        )
    )
    y = weights @ v_rep  # (B, Hq, L, D)
    steps.append(
        Step(
            "weighted sum of values",
            (("y = weights @ v", tuple(y.shape), "(B, Hq, Lq, D)  the values a query attends to, mixed by weight"),),
        )
    )
    merged = merge_heads(y)
    steps.append(
        Step(
            "merge heads",
            (
                (
                    "y.transpose(1, 2).reshape(B, L, Hq*D)",
                    tuple(merged.shape),
                    "(B, L, Hq*D)  the heads side by side again",
                ),
            ),
        )
    )
    out = layer.out_proj(merged)
    steps.append(
        Step(
            "output projection",
            (("out = layer.out_proj(y)", tuple(out.shape), "(B, L, E)  mixes the heads back into the model dim"),),
        )
    )

    # Checks: the functional core on the same q, k, v, and the layer's own forward.
    # The output call is the one the layer makes (no weights asked, so the fast path runs); the
    # weights come from a second call, which may be served by another backend.
    core = attention(q, k, v, mask=full_mask, backend=backend)
    core_weights = attention(q, k, v, mask=full_mask, backend=backend, return_weights=True).weights
    assert core_weights is not None  # asked for
    checks = {
        "multihead.attention(q, k, v) vs step 'weighted sum'": _compare(core, y),
        "multihead.attention(..., return_weights=True) vs step 'softmax'": _compare(core_weights, weights),
        "layer(x) vs step 'output projection'": _compare(layer(x, mask=mask), out),
    }
    return Walkthrough(header, steps, checks, explain(q, k, v, mask=full_mask, backend=backend))


def _compare(got: Tensor, spelled_out: Tensor) -> tuple[float, float]:
    """Max difference, and a tolerance of fp32 rounding relative to the values' magnitude
    (the spelled-out steps and the backends sum in different orders)."""
    diff = (got.float() - spelled_out.float()).abs().max().item()
    return diff, 1e-5 * max(1.0, spelled_out.abs().max().item())


def _gqa_table(Hq: int, Hkv: int) -> str:
    G = Hq // Hkv
    groups_q = " | ".join(" ".join(str(h) for h in range(g * G, (g + 1) * G)) for g in range(Hkv))
    groups_kv = " | ".join(" ".join(str(g).rjust(len(str(h))) for h in range(g * G, (g + 1) * G)) for g in range(Hkv))
    return f"query head : {groups_q}\nkv head    : {groups_kv}"


def _mask_picture(mask, L: int) -> str:
    n = min(L, _PICTURE_MAX)
    # The top-left n x n corner of the L x L mask: rows are queries, columns keys.
    rows = mask.materialize(1, 1, L, L)[0, 0, :n, :n]
    picture = ["keys ->  " + "".join(str(j % 10) for j in range(n))]
    picture += [f"query {i:>2} " + "".join("1" if a else "." for a in row.tolist()) for i, row in enumerate(rows)]
    if n < L:
        picture.append(f"(first {n} of {L} queries and keys)")
    return "\n".join(picture) + "\n1 = may attend, . = blocked"


def _row(row: Tensor) -> str:
    values = [f"{w:.2f}" for w in row.tolist()[:_PICTURE_MAX]]
    more = " ..." if row.numel() > _PICTURE_MAX else ""
    return "[" + " ".join(values) + more + "]"
