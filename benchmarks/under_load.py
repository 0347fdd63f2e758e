"""The paths ``auto`` picks for their speed, idle and under load, side by side in one run.

Three comparisons (fp32, B=1, H=8, D=64, 2 threads unless ``BENCH_THREADS`` says otherwise):

* **packed documents**: 8 documents of lengths 2048 .. 256 packed in one 8192-token sequence,
  ``document(ids) & causal()`` (auto), against the padded batch of 8 rows through SDPA with a
  dense causal & padding mask (``benchmarks/documents.py``'s pair), forward;
* **dropout with a window**: ``attention(mask=sliding_window(512), dropout_p=0.1)`` (auto)
  against SDPA with the dense mask and the same dropout (its math kernel), forward+backward,
  L=4096 (``--quick``: 2048);
* **sliding window**: ``sliding_window(512)`` (auto) against SDPA with the dense mask, forward,
  L=16384 (``--quick``: 4096);
* **decode step**: one query token of 32 heads over an fp32 cache of 8 KV heads of 128 features,
  32768 tokens (``--quick``: 4096): auto (the ``decode`` backend, on the CPU through multihead's
  own kernel, ``backends/cpu_decode.c``) against SDPA with ``enable_gqa`` (issue 29: ``auto`` takes
  the kernel for these steps, so its speed-up must hold under load).

Each comparison runs once with no load added and once while :func:`common.background_load`
keeps every core busy (default ``--load torch-threads``: ONE other process doing 512x512 matmuls
on as many threads as there are cores, as another PyTorch job does; ``python``: a pure-Python loop
per core), started before and stopped after the timing. The six contenders are timed in
interleaved rounds (:func:`common.fastest_ms`); each ratio is given from the fastest round (each
contender's least disturbed) and from the median round. The load average before each condition
and the machine's ceilings measured inside it (memory read bandwidth, fp32 matmul GFLOP/s) are
printed with the rows: on a shared machine, other people's jobs add to the load this script adds.

Beside them (not with ``--quick``, or ``--no-grid``), ``blocksparse`` on the first wave's block
grid: a few kernel calls (with dropout, a few dozen ops) per block of 256 queries, without the
batched band interior (``backends/band_runs.py``) and the one call per document
(``backends/document_runs.py``): the same run's "before".

Targets (issue 27, at the full sizes, under load): documents >= 3x, dropout with a window >= 1.0x,
sliding window >= 8x the dense-mask SDPA contender.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F

from common import (
    LOAD_KINDS,
    THREADS,
    background_load,
    check_close,
    context,
    fastest_ms,
    machine_state,
    memory_read_gbps,
    mh,
    print_table,
    write_csv,
)
from documents import LENGTHS, STARTS, padded_batch
from dtypes import matmul_gflops

H, D = 8, 64
#: (ours / baseline) targets under load at the full sizes (issue 27).
TARGETS = {"documents": 3.0, "dropout_window": 1.0, "window": 8.0, "decode": 1.0}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller dropout and window cases, shorter rounds")
    parser.add_argument("--load", choices=LOAD_KINDS, default="torch-threads", help="what the background runs")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per condition")
    parser.add_argument(
        "--grid",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time blocksparse on the first wave's block grid (default: on, off with --quick)",
    )
    parser.add_argument("--cases", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    args = parser.parse_args(argv)
    dropout_len, window_len = (2048, 4096) if args.quick else (4096, 16384)
    decode_len = 4096 if args.quick else 32768
    wanted = args.cases.split(",")
    if unknown := sorted(set(wanted) - set(TARGETS)):
        parser.error(f"--cases: unknown {unknown}; expected some of {sorted(TARGETS)}")
    rounds = args.rounds or (2 if args.quick else 3)
    min_run_time = 0.3 if args.quick else 0.5
    print(f"# under load  ({context()})")
    mh.register_backend(BlockGrid())  # no priority: used only by name (checked even when not timed)
    try:
        build = {
            "documents": _documents,
            "dropout_window": lambda: _dropout_window(dropout_len),
            "window": lambda: _window(window_len),
            "decode": lambda: _decode(decode_len),
        }
        cases = {case: build[case]() for case in wanted}
        if not (args.grid if args.grid is not None else not args.quick):
            cases = {
                case: ({n: f for n, f in fns.items() if n != "block_grid"}, what) for case, (fns, what) in cases.items()
            }
        return _run(args, cases, rounds, min_run_time)
    finally:
        mh.unregister_backend(BlockGrid.name)


def _run(args, cases, rounds, min_run_time) -> list[dict]:
    contenders = {f"{case}/{name}": fn for case, (fns, _) in cases.items() for name, fn in fns.items()}
    rows = []
    for loaded in (False, True):
        before = machine_state()
        rounds_ms: dict[str, list[float]] = {key: [] for key in contenders}
        with background_load(args.load) if loaded else contextlib.nullcontext({}) as report:
            ceilings = f"read {memory_read_gbps():.1f} GB/s, fp32 matmul {matmul_gflops(torch.float32):.0f} GFLOP/s"
            best = fastest_ms(contenders, rounds, min_run_time, log=lambda key, ms: rounds_ms[key].append(ms))
        after = machine_state()
        load = f"{args.load} x{report['procs']} ({report['load_cpu']:.1f} cores)" if loaded else "none added"
        print(f"\n# load: {load}; before: {before}; after: {after}; ceilings inside: {ceilings}", flush=True)
        for case, (fns, what) in cases.items():
            ours, base, *old = (f"{case}/{name}" for name in fns)
            median = {key: statistics.median(rounds_ms[key]) for key in (ours, base)}
            rows.append(
                {
                    "case": what,
                    "load": load,
                    "multihead_ms": best[ours],
                    "sdpa_dense_ms": best[base],
                    "speedup": best[base] / best[ours],
                    "speedup_median_round": median[base] / median[ours],
                    "block_grid_ms": best[old[0]] if old else float("nan"),
                    "block_grid_speedup": best[base] / best[old[0]] if old else float("nan"),
                    "target_loaded": TARGETS[case],
                    "threads": THREADS,
                    "machine_before": before,
                    "ceilings": ceilings,
                }
            )
    columns = ("case", "load", "multihead_ms", "sdpa_dense_ms", "speedup", "speedup_median_round", "block_grid_ms",
               "block_grid_speedup")  # fmt: skip
    print_table(
        f"idle vs loaded, speed-up over SDPA (with the dense mask; for the decode step enable_gqa) (fastest and "
        f"median of {rounds} interleaved rounds; "
        "block grid: blocksparse without its batched band interior and one call per document, the first wave's plan)",
        [{c: r[c] for c in columns} for r in rows],
    )
    write_csv("under_load" + ("_quick" if args.quick else ""), rows)
    for r in rows[len(cases) :]:
        met = "met" if r["speedup"] >= r["target_loaded"] else "NOT met"
        size = "" if not args.quick else " (the target is for the full sizes)"
        print(f"under load: {r['case']}: {r['speedup']:.2f}x (target >= {r['target_loaded']:g}: {met}{size})")
    return rows


def _documents():
    """Packed ``document(ids) & causal()`` (auto) vs the padded batch with a dense mask, forward."""
    total, n = sum(LENGTHS), len(LENGTHS)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, total, D, generator=gen) for _ in range(3))
    mask = mh.document(torch.repeat_interleave(torch.arange(n), torch.tensor(LENGTHS))) & mh.causal()
    qp, kp, vp, dense = padded_batch(q, k, v)  # one row per document, dense causal & padding mask
    fns = {
        "multihead": lambda: mh.attention(q, k, v, mask=mask),
        "sdpa_padded_dense": lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=dense),
        "block_grid": lambda: mh.attention(q, k, v, mask=mask, backend=BlockGrid.name),
    }
    want = fns["sdpa_padded_dense"]()
    for name in ("multihead", "block_grid"):
        got = fns[name]()
        for i, (s, length) in enumerate(zip(STARTS, LENGTHS)):
            check_close(f"{name}, document {i}", got[0, :, s : s + length], want[i, :, :length])
    backend = mh.explain(q, k, v, mask=mask).backend
    return fns, f"packed documents, {n} docs, {total} tokens, fwd ({backend} vs padded)"


def _dropout_window(L: int):
    """``sliding_window(512)`` with dropout 0.1 (auto) vs SDPA's math kernel on the dense mask, fwd+bwd."""
    gen = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, H, L, D, generator=gen, requires_grad=True) for _ in range(3))
    mask = mh.sliding_window(512)
    dense = mask.materialize(1, H, L, L)  # (1, 1, L, L) bool

    def step(fn):
        def run():
            for t in (q, k, v):
                t.grad = None
            fn().sum().backward()

        return run

    ours = lambda p: mh.attention(q, k, v, mask=mask, dropout_p=p)  # noqa: E731
    sdpa = lambda p: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=p)  # noqa: E731
    # The same two paths with a dropout too small to drop anything here (~1e-5 odds of one drop):
    # the outputs must agree.
    grid = lambda p: mh.attention(q, k, v, mask=mask, dropout_p=p, backend=BlockGrid.name)  # noqa: E731
    with torch.no_grad():
        check_close(f"dropout path, L={L}", ours(1e-12), sdpa(1e-12))
        check_close(f"dropout path, block grid, L={L}", grid(1e-12), sdpa(1e-12))
    backend = mh.explain(q.detach(), k.detach(), v.detach(), mask=mask, dropout_p=0.1).backend
    fns = {
        "multihead": step(lambda: ours(0.1)),
        "sdpa_dense_dropout": step(lambda: sdpa(0.1)),
        "block_grid": step(lambda: grid(0.1)),
    }
    return fns, f"sliding_window(512) + dropout 0.1, L={L}, fwd+bwd ({backend})"


def _decode(Lk: int):
    """One decode step, fp32, ``Hq=32, Hkv=8, D=128`` over ``Lk`` cached keys: auto vs SDPA ``enable_gqa``."""
    gen = torch.Generator().manual_seed(Lk)
    q = torch.randn(1, 32, 1, 128, generator=gen)
    k, v = (torch.randn(1, 8, Lk, 128, generator=gen) for _ in range(2))
    fns = {
        "multihead": lambda: mh.attention(q, k, v),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    check_close(f"decode step, Lk={Lk}", fns["multihead"](), fns["sdpa_gqa"]())
    backend = mh.explain(q, k, v).backend
    return fns, f"decode step fp32, Hq=32/Hkv=8, D=128, Lk={Lk} ({backend} vs SDPA enable_gqa)"


class BlockGrid(mh.backends.BlockSparseBackend):
    """``blocksparse`` as the first wave ran it: a few calls (or, with dropout, a few dozen ops)
    per block of 256 queries, without the batched band interior and the one call per document."""

    name = "blocksparse_block_grid"

    def _plan(self, call):
        from multihead.backends.blocksparse import Plan, block_plan

        return Plan(None, block_plan(call.mask, call.extent, self.block_size))


def _window(L: int):
    """``sliding_window(512)`` (auto) vs SDPA with the dense mask, forward."""
    gen = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, H, L, D, generator=gen) for _ in range(3))
    mask = mh.sliding_window(512)
    dense = mask.materialize(1, H, L, L)  # (1, 1, L, L) bool
    fns = {
        "multihead": lambda: mh.attention(q, k, v, mask=mask),
        "sdpa_dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
    }
    rows = slice(0, 2048)
    check_close(f"window, L={L}", fns["multihead"]()[:, :, rows], fns["sdpa_dense"]()[:, :, rows])
    return fns, f"sliding_window(512), L={L}, fwd ({mh.explain(q, k, v, mask=mask).backend})"


if __name__ == "__main__":
    main()
