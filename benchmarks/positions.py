"""Position biases on the fast path (issue: positions and score modifiers).

Cases (B=1, H=8, D=64, fp32, 2 threads), forward and forward+backward:

* causal + ALiBi: ``attention(q, k, v, mask=causal(), score_mod=ALiBi(8))`` (auto picks
  blocksparse: the bias runs as a strided view per block) vs SDPA with the dense float bias
  ``(1, H, L, L)`` that a user of SDPA builds once and reuses (its construction is not timed), and
  vs compiled FlexAttention with the same bias as ``score_mod`` (forward only: flex on CPU has no
  backward; full run only, its compile takes about a minute per shape);
* causal + a learned T5 relative bias (its table gets a gradient): multihead vs SDPA with the
  dense bias gathered from the table inside the timed step (the table must be differentiated
  through it, so a user cannot build it once);
* sliding window 512 + ALiBi vs the sliding window alone, at L=16384.

Targets: at L=4096 at least 2x faster than dense-bias SDPA, forward and forward+backward; peak
extra memory not growing with H·L² (at 16k the dense bias alone is 8 GiB: measured in
subprocesses, ``memory.measure``); window + ALiBi within 1.3x of the window alone.
``--quick``: L in {1024, 4096}, no flex, no memory subprocesses at 16k.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import THREADS, check_close, context, fastest_ms, machine_state, mh, print_table, write_csv
from memory import measure
from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes, relative_position_bucket

H, D = 8, 64
DENSE_LIMIT = 4096  # (1, 8, L, L) fp32 bias: 512 MiB at 4096, 8 GiB at 16384 (not built)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--lengths", type=int, nargs="*")
    args = parser.parse_args(argv)
    lengths = args.lengths or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    flex = not (args.quick or args.no_flex)
    print(f"# position biases ({context()}); {machine_state()}")
    rows = []
    for L in lengths:
        rows.append(_alibi(L, flex=flex and L <= DENSE_LIMIT))
        rows.append(_relative(L))
    rows.append(_window(16384 if not args.quick else 8192))
    print_table("position biases: ms, and dense-bias SDPA / multihead (target >= 2 at L=4096)", rows[:-1])
    print_table("sliding window + ALiBi: ms, and the ratio to the window alone (target <= 1.3)", rows[-1:])
    columns = list(dict.fromkeys(c for r in rows for c in r))  # every row's columns, first seen first
    write_csv("positions" + ("_quick" if args.quick else ""), [{c: r.get(c) for c in columns} for r in rows])
    if not args.quick:
        mem = _memory()
        print_table("peak memory of one forward+backward (MiB, subprocess each; extra = above inputs only)", mem)
        write_csv("positions_memory", mem)
    print(f"# after: {machine_state()}")
    return rows


def _inputs(L: int, grad: bool):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, L, D, generator=gen, requires_grad=grad) for _ in range(3)]


def _step(fn, leaves):
    def run():
        for t in leaves:
            t.grad = None
        fn().sum().backward()

    return run


def _alibi_dense(L: int) -> torch.Tensor:
    i = torch.arange(L)
    d = (i.view(1, L) - i.view(L, 1)).float()  # j - i
    bias = alibi_slopes(H).float().view(H, 1, 1) * d
    return bias.masked_fill(d > 0, float("-inf")).unsqueeze(0)  # (1, H, L, L), causal as -inf


def _alibi(L: int, flex: bool) -> dict:
    q, k, v = _inputs(L, grad=True)
    alibi, causal = ALiBi(H), mh.causal()
    ours = lambda: mh.attention(q, k, v, mask=causal, score_mod=alibi)
    fwd = {"multihead": lambda: mh.attention(q.detach(), k.detach(), v.detach(), mask=causal, score_mod=alibi)}
    fb = {"multihead": _step(ours, (q, k, v))}
    row = {
        "case": f"causal + ALiBi, L={L}",
        "backend": mh.explain(q.detach(), k.detach(), v.detach(), mask=causal, score_mod=alibi).backend,
    }
    if L <= DENSE_LIMIT:
        dense = _alibi_dense(L)
        check_close(
            f"ALiBi L={L}",
            fwd["multihead"](),
            F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=dense),
            atol=2e-4,
        )
        fwd["sdpa dense bias"] = lambda: F.scaled_dot_product_attention(
            q.detach(), k.detach(), v.detach(), attn_mask=dense
        )
        fb["sdpa dense bias"] = _step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), (q, k, v))
    if flex:
        fwd["flex compiled"] = _flex_forward(q.detach(), k.detach(), v.detach(), L)
    return _row(row, fwd, fb)


def _flex_forward(q, k, v, L):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    slopes = alibi_slopes(H).float()
    block_mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, L, L, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    fn = lambda: compiled(q, k, v, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), block_mask=block_mask)
    check_close(f"flex ALiBi L={L}", fn(), F.scaled_dot_product_attention(q, k, v, attn_mask=_alibi_dense(L)))
    return fn


def _relative(L: int) -> dict:
    q, k, v = _inputs(L, grad=True)
    torch.manual_seed(0)
    rel = RelativePositionBias(H, bidirectional=False)
    causal = mh.causal()
    row = {
        "case": f"causal + T5 relative bias (table trains), L={L}",
        "backend": mh.explain(q.detach(), k.detach(), v.detach(), mask=causal, score_mod=rel()).backend,
    }
    fwd = {"multihead": lambda: mh.attention(q.detach(), k.detach(), v.detach(), mask=causal, score_mod=rel())}
    fb = {"multihead": _step(lambda: mh.attention(q, k, v, mask=causal, score_mod=rel()), (q, k, v, rel.weight))}
    if L <= DENSE_LIMIT:
        i = torch.arange(L)
        bucket = relative_position_bucket(i.view(1, L) - i.view(L, 1), bidirectional=False)  # (L, L), built once
        blocked = i.view(1, L) > i.view(L, 1)

        def dense():  # gathered from the table in every step: the table is differentiated through it
            return rel.weight[bucket].permute(2, 0, 1).unsqueeze(0).masked_fill(blocked, float("-inf"))

        with torch.no_grad():
            check_close(f"T5 L={L}", fwd["multihead"](), F.scaled_dot_product_attention(q, k, v, attn_mask=dense()))
        fwd["sdpa dense bias"] = lambda: F.scaled_dot_product_attention(
            q.detach(), k.detach(), v.detach(), attn_mask=dense().detach()
        )
        fb["sdpa dense bias"] = _step(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense()), (q, k, v, rel.weight)
        )
    return _row(row, fwd, fb)


def _window(L: int) -> dict:
    q, k, v = _inputs(L, grad=True)
    mask, alibi = mh.sliding_window(512), ALiBi(H)
    fwd = {
        "multihead": lambda: mh.attention(q.detach(), k.detach(), v.detach(), mask=mask, score_mod=alibi),
        "window alone": lambda: mh.attention(q.detach(), k.detach(), v.detach(), mask=mask),
    }
    fb = {
        "multihead": _step(lambda: mh.attention(q, k, v, mask=mask, score_mod=alibi), (q, k, v)),
        "window alone": _step(lambda: mh.attention(q, k, v, mask=mask), (q, k, v)),
    }
    row = {
        "case": f"sliding_window(512) + ALiBi vs window alone, L={L} (target <= 1.3)",
        "backend": mh.explain(q.detach(), k.detach(), v.detach(), mask=mask, score_mod=alibi).backend,
    }
    return _row(row, fwd, fb)


def _row(row: dict, fwd: dict, fb: dict) -> dict:
    f = fastest_ms(fwd, rounds=2, min_run_time=0.5)
    b = fastest_ms(fb, rounds=2, min_run_time=0.5)
    row.update({"fwd_ms": f["multihead"], "fwd+bwd_ms": b["multihead"]})
    for name in ("sdpa dense bias", "window alone"):
        if name in f:
            ratio = "window+ALiBi / window" if name == "window alone" else "dense / multihead"
            val_f = f["multihead"] / f[name] if name == "window alone" else f[name] / f["multihead"]
            val_b = b["multihead"] / b[name] if name == "window alone" else b[name] / b["multihead"]
            row.update(
                {
                    f"{name} fwd_ms": f[name],
                    f"{name} fwd+bwd_ms": b[name],
                    f"{ratio} fwd": val_f,
                    f"{ratio} fwd+bwd": val_b,
                }
            )
    if "flex compiled" in f:
        row.update({"flex fwd_ms": f["flex compiled"], "flex / multihead fwd": f["flex compiled"] / f["multihead"]})
    row["threads"] = THREADS
    print(row, flush=True)
    return row


def _memory() -> list[dict]:
    base = {L: measure(L, "pass") for L in (4096, 16384)}
    step = "q.requires_grad_(); k.requires_grad_(); v.requires_grad_(); ({}).sum().backward()"
    configs = [
        (4096, "multihead causal + ALiBi", "mh.attention(q, k, v, mask=mh.causal(), score_mod=ALiBi(8))"),
        (4096, "SDPA + dense ALiBi bias", "F.scaled_dot_product_attention(q, k, v, attn_mask=dense_alibi(L))"),
        (16384, "multihead causal + ALiBi", "mh.attention(q, k, v, mask=mh.causal(), score_mod=ALiBi(8))"),
        (16384, "multihead causal + T5 bias", "mh.attention(q, k, v, mask=mh.causal(), score_mod=rel())"),
        (16384, "multihead causal (no bias)", "mh.attention(q, k, v, mask=mh.causal())"),
    ]
    prelude = (
        "from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes\n"
        "rel = RelativePositionBias(8, bidirectional=False)\n"
        "def dense_alibi(L):\n"
        "    i = torch.arange(L); d = (i.view(1, L) - i.view(L, 1)).float()\n"
        "    return (alibi_slopes(8).float().view(8, 1, 1) * d).masked_fill(d > 0, float('-inf')).unsqueeze(0)\n"
    )
    rows = []
    for L, name, code in configs:
        peak = measure(L, prelude + step.format(code))
        rows.append({"config": f"{name}, fwd+bwd, L={L}", "peak_MiB": peak, "extra_MiB": peak - base[L]})
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
