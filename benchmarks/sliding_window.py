"""Sliding window: multihead (auto -> blocksparse) vs SDPA with a dense boolean mask.

B=1, H=8, D=64, fp32, forward. Time should grow linearly in L at a fixed window for multihead
and quadratically for the dense mask. ``--quick``: L in {4096, 16384}, window 512 only.

Then the same comparison idle and loaded: at L=16384 (4096 with ``--quick``), window 512,
``multihead`` (auto: ``blocksparse``, whose interior query blocks run as one batched kernel
call, ``multihead.backends.band_runs``), the same with the batching off (one call per piece of
every block, the first wave's plan) and SDPA with the dense mask, timed once
with no load added and once while :func:`common.background_load` keeps every core busy
(``--load python``: a pure-Python loop per core; ``--load torch``: single-threaded matmuls).
The block-sparse path's many short parallel regions wait on descheduled threads under load; the
dense call is one long region. The target is ``SDPA + dense mask / multihead >= 8`` under load.
Each condition times the contenders in interleaved rounds and keeps each one's fastest
(:func:`common.fastest_ms`). The machine's last-level cache and memory read bandwidth are
printed beside the working sets.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from common import (
    THREADS,
    background_load,
    check_close,
    context,
    fastest_ms,
    last_level_cache_bytes,
    machine_state,
    memory_read_gbps,
    mh,
    plot,
    print_table,
    time_ms,
    used_backend,
    write_csv,
)

MiB = 1 << 20


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    lengths = [4096, 16384] if args.quick else [4096, 8192, 16384, 32768]
    windows = [512] if args.quick else [256, 512, 1024]
    print(f"# sliding window  ({context()})")
    llc = last_level_cache_bytes()
    print(
        f"# {machine_state()}; last-level cache {llc / MiB if llc else float('nan'):.0f} MiB (cpu0, sysfs; "
        f"on a VM the host's, shared), memory read bandwidth {memory_read_gbps():.1f} GB/s ({THREADS} threads)"
    )
    rows = [] if args.no_sweep else _sweep(args, lengths, windows, llc)
    loaded = _idle_and_loaded(4096 if args.quick else 16384, 512, args.load, *((0.3, 2) if args.quick else (1.0, 2)))
    return rows + loaded


def _sweep(args, lengths, windows, llc) -> list[dict]:
    rows = []
    for window in windows:
        for L in lengths:
            gen = torch.Generator().manual_seed(L)
            q, k, v = (torch.randn(1, 8, L, 64, generator=gen) for _ in range(3))
            mask = mh.sliding_window(window)
            ours = lambda: mh.attention(q, k, v, mask=mask)  # noqa: E731
            dense_ok = L <= 16384  # at 32k the dense bool mask alone is 1 GiB and SDPA's math path far more
            qkvo = 4 * q.numel() * q.element_size()  # q, k, v and the output
            row = {
                "window": window,
                "L": L,
                "backend": used_backend(q, k, v, mask=mask),
                "load": "none added",
                "qkvo_MiB": qkvo / MiB,
                "qkvo_in_LLC": bool(llc and qkvo <= llc),
                "dense_mask_MiB": L * L / MiB,
            }
            if dense_ok:
                dense = mask.materialize(1, 8, L, L)  # (1, 1, L, L) bool
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
                rows_checked = slice(0, 2048)
                check_close(f"window {window} L {L}", ours()[:, :, rows_checked], sdpa()[:, :, rows_checked])
                t_dense = time_ms(sdpa, 0.3)
            else:
                t_dense = float("nan")
            t_ours = time_ms(ours)
            row.update(
                {
                    "multihead_ms": t_ours,
                    "sdpa_dense_mask_ms": t_dense,
                    "speedup": t_dense / t_ours,
                    "ms_per_1k_tokens": t_ours / (L / 1024),
                }
            )
            rows.append(row)
            print(row, flush=True)
    print_table("sliding window, all", rows)
    write_csv("sliding_window" + ("_quick" if args.quick else ""), rows)
    if not args.quick:
        series = {}
        for window in windows:
            sel = [r for r in rows if r["window"] == window]
            series[f"multihead, window {window}"] = ([r["L"] for r in sel], [r["multihead_ms"] for r in sel])
        sel = [r for r in rows if r["window"] == 512 and r["sdpa_dense_mask_ms"] == r["sdpa_dense_mask_ms"]]
        series["SDPA + dense bool mask, window 512"] = ([r["L"] for r in sel], [r["sdpa_dense_mask_ms"] for r in sel])
        plot(
            "sliding_window",
            "Sliding window, B=1 H=8 D=64 fp32 forward",
            "L",
            "ms",
            series,
            update_docs=args.update_docs,
        )
    return rows


def _idle_and_loaded(L: int, window: int, load: str, min_run_time: float, rounds: int) -> list[dict]:
    """multihead, blocksparse without band batching, and dense-mask SDPA, idle and under load."""
    print(f"\n# sliding window idle vs loaded: L={L}, window {window}, B=1 H=8 D=64 fp32 forward, {THREADS} threads")
    gen = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, 8, L, 64, generator=gen) for _ in range(3))
    mask = mh.sliding_window(window)
    dense = mask.materialize(1, 8, L, L)  # (1, 1, L, L) bool
    per_block = _PerBlock()
    contenders = {
        "multihead": lambda: mh.attention(q, k, v, mask=mask),
        "per_block": lambda: mh.attention(q, k, v, mask=mask, backend=per_block.name),
        "sdpa_dense_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
    }
    mh.register_backend(per_block)  # no priority: used only by name
    try:
        want = contenders["sdpa_dense_mask"]()
        for name in ("multihead", "per_block"):
            check_close(f"{name}, window {window} L {L}", contenders[name](), want)
        rows = _time_idle_and_loaded(contenders, L, window, load, min_run_time, rounds)
    finally:
        mh.unregister_backend(per_block.name)
    return rows


class _PerBlock(mh.backends.BlockSparseBackend):
    """blocksparse with the band batching off: every query block as its own pieces."""

    name = "blocksparse_per_block"

    def _plan(self, call):
        plan = super()._plan(call)
        from multihead.backends.blocksparse import Plan, block_plan

        return Plan(None, block_plan(call.mask, call.extent, self.block_size)) if plan.run is not None else plan


def _time_idle_and_loaded(contenders, L, window, load, min_run_time, rounds) -> list[dict]:
    rows = []
    for loaded in (False, True):
        state = machine_state()
        with background_load(load) if loaded else contextlib.nullcontext({}) as report:
            bandwidth = memory_read_gbps()
            ms = fastest_ms(contenders, rounds, min_run_time)
        row = {
            "load": f"{load} x{report['procs']}" if loaded else "none added",
            "L": L,
            "window": window,
            "load_cores_used": report.get("load_cpu", 0.0),
            "read_GBps": bandwidth,
            **{f"{name}_ms": t for name, t in ms.items()},
            "dense/multihead": ms["sdpa_dense_mask"] / ms["multihead"],
            "dense/per_block": ms["sdpa_dense_mask"] / ms["per_block"],
            "per_block/multihead": ms["per_block"] / ms["multihead"],
            "threads": THREADS,
            "machine_before": state,
        }
        rows.append(row)
        print(row, flush=True)
    print_table(
        f"sliding window L={L} w={window}, fastest of {rounds} interleaved rounds: idle vs loaded "
        "(speed-ups over SDPA + dense mask; target >= 8 loaded)",
        [
            {
                c: r[c]
                for c in (
                    "load",
                    "load_cores_used",
                    "read_GBps",
                    "multihead_ms",
                    "per_block_ms",
                    "sdpa_dense_mask_ms",
                    "dense/multihead",
                    "dense/per_block",
                    "per_block/multihead",
                )
            }
            for r in rows
        ],
    )
    write_csv(f"sliding_window_loaded_L{L}_{load}", rows)
    return rows


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short version for make bench-quick")
    parser.add_argument("--no-sweep", action="store_true", help="only the idle vs loaded comparison")
    parser.add_argument(
        "--load",
        choices=["python", "torch"],
        default="python",
        help="what the background children run (default: a pure-Python loop per core)",
    )
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="write the plot to docs/img/sliding_window.png (default: benchmarks/results/)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
