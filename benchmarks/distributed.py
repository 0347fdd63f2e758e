"""Context-parallel attention on CPU with gloo: ring and Ulysses against one process.

For each configuration a fresh world of ``P`` processes (``torch.multiprocessing``, gloo,
file rendezvous) runs after a correctness check of its output against single-process
:func:`multihead.attention` on rank 0. Per rank it records:

* forward and forward+backward time (median of ``--reps``, after a warm-up), and the time
  spent inside the block :func:`multihead.attention` calls of the forward (its compute, without
  waiting for messages);
* the pairs of queries and keys the plan scores (``RingPlan.elements``), the steps it walks and
  the K/V messages it receives;
* peak activation memory: ``ru_maxrss`` after forward+backward minus ``ru_maxrss`` before it (the
  inputs and a warm-up already counted), in a process that ran nothing else of this size.

``P = 1`` is plain :func:`multihead.attention` in one process with the same thread budget.
Usage: ``python benchmarks/distributed.py [--quick] [--length 8192]``; writes
``benchmarks/results/distributed[_quick].csv``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import context, machine_state, print_table, write_csv  # noqa: E402

import multihead as mh  # noqa: E402
from multihead.distributed import ring, ring_attention, shard_sequence, ulysses_attention  # noqa: E402
from multihead.distributed.ring import _cached_plan  # noqa: E402

CORES = os.cpu_count() or 1


def mask_of(name: str, L: int):
    return {"causal": mh.causal(), "none": None, "window": mh.sliding_window(512)}[name]


def inputs(B, H, L, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g) for _ in range(3))


def _worker(rank, world, folder, cfg, out_queue):
    threads = max(1, CORES // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    B, H, L, D, reps = cfg["B"], cfg["H"], cfg["L"], cfg["D"], cfg["reps"]
    fn = {"ring": ring_attention, "ulysses": ulysses_attention}[cfg["method"]]
    layout, mask = cfg["layout"], mask_of(cfg["mask"], L)
    q, k, v = inputs(B, H, L, D)
    qs, ks, vs = (shard_sequence(t, layout=layout).contiguous() for t in (q, k, v))
    del q, k, v
    # warm-up on a small sequence (first-call imports and allocations), then the memory baseline
    small = [shard_sequence(t, layout=layout).requires_grad_() for t in inputs(B, H, 64 * world, D)]
    fn(*small, mask=mask, layout=layout).sum().backward()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    qs, ks, vs = (t.requires_grad_() for t in (qs, ks, vs))
    out = fn(qs, ks, vs, mask=mask, layout=layout)
    out.backward(torch.ones_like(out))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before

    # compute inside the block attention() calls of the forward (ring only)
    spent = [0.0]
    original = ring.attention

    def timed(*a, **kw):
        t = time.perf_counter()
        r = original(*a, **kw)
        spent[0] += time.perf_counter() - t
        return r

    fwd, both, compute = [], [], []
    for _ in range(reps):
        dist.barrier()
        ring.attention = timed
        spent[0] = 0.0
        t = time.perf_counter()
        with torch.no_grad():
            fn(qs, ks, vs, mask=mask, layout=layout)
        fwd.append(time.perf_counter() - t)
        compute.append(spent[0])
        ring.attention = original
        dist.barrier()
        t = time.perf_counter()
        out = fn(qs, ks, vs, mask=mask, layout=layout)
        out.backward(torch.ones_like(out))
        both.append(time.perf_counter() - t)
    row = {"rank": rank, "fwd_s": statistics.median(fwd), "fwd_bwd_s": statistics.median(both),
           "compute_s": statistics.median(compute), "peak_mib": peak_kib / 1024, "threads": threads}
    if cfg["method"] == "ring":
        from multihead.distributed.checks import Shards

        S = L // world
        plan = _cached_plan(world, rank, Shards(B, H, H, S, S, D, D, world), mask, layout)
        row.update(elements=plan.elements, steps=len(plan.steps) + 1, computed=plan.steps_computed,
                   messages=plan.messages)
    # correctness: rank 0's rows against single-process attention
    with torch.no_grad():
        got = fn(qs.detach(), ks.detach(), vs.detach(), mask=mask, layout=layout)
    if rank == 0:
        q, k, v = inputs(B, H, L, D)
        want = shard_sequence(mh.attention(q, k, v, mask=mask), layout=layout)
        row["max_err"] = float((got - want).abs().max())
    out_queue.put(row)
    dist.barrier()
    dist.destroy_process_group()


def single(cfg) -> dict:
    """P = 1: attention() in a fresh process with every core."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_single_worker, args=(cfg, queue))
    p.start()
    row = queue.get()
    p.join()
    return row


def _single_worker(cfg, queue):
    torch.set_num_threads(CORES)
    B, H, L, D, reps = cfg["B"], cfg["H"], cfg["L"], cfg["D"], cfg["reps"]
    mask = mask_of(cfg["mask"], L)
    small = [t.requires_grad_() for t in inputs(B, H, 64, D)]
    mh.attention(*small, mask=mask).sum().backward()
    q, k, v = (t.requires_grad_() for t in inputs(B, H, L, D))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = mh.attention(q, k, v, mask=mask)
    out.backward(torch.ones_like(out))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    fwd, both = [], []
    for _ in range(reps):
        t = time.perf_counter()
        with torch.no_grad():
            mh.attention(q, k, v, mask=mask)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = mh.attention(q, k, v, mask=mask)
        out.backward(torch.ones_like(out))
        both.append(time.perf_counter() - t)
    queue.put({"rank": 0, "fwd_s": statistics.median(fwd), "fwd_bwd_s": statistics.median(both),
               "compute_s": statistics.median(fwd), "peak_mib": peak_kib / 1024, "threads": CORES})


def world_run(world: int, cfg: dict) -> list[dict]:
    folder = tempfile.mkdtemp(prefix="multihead_bench_")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(_worker, args=(world, folder, cfg, queue), nprocs=world, join=False,
                               start_method="spawn")
    rows = [queue.get() for _ in range(world)]
    procs.join()
    return sorted(rows, key=lambda r: r["rank"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short length and one repetition")
    parser.add_argument("--length", type=int, default=None, help="total sequence length L")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    L = args.length or (2048 if args.quick else 8192)
    reps = args.reps or (1 if args.quick else 3)
    base = {"B": 1, "H": 8, "D": 64, "L": L, "reps": reps}
    print(context())
    print(machine_state())
    print(f"B=1, H=8, D=64, L={L}, fp32; P processes get {CORES}//P threads each (P=1: {CORES} threads)\n")

    configs = [("single", 1, "-", "causal"),
               ("ring", 2, "zigzag", "causal"), ("ring", 2, "contiguous", "causal"),
               ("ring", 4, "zigzag", "causal"), ("ring", 4, "contiguous", "causal"),
               ("ulysses", 2, "zigzag", "causal"), ("ulysses", 4, "zigzag", "causal"),
               ("single", 1, "-", "window"),
               ("ring", 4, "contiguous", "window"), ("ring", 4, "zigzag", "window")]
    if args.quick:
        configs = [c for c in configs if c[1] <= 2 or c[0] == "ring"]
    table, summary = [], []
    single_rows = {}
    for method, world, layout, mask in configs:
        cfg = dict(base, method=method, layout=layout, mask=mask)
        rows = [single(cfg)] if method == "single" else world_run(world, cfg)
        if method == "single":
            single_rows[mask] = rows[0]
        for r in rows:
            table.append({"method": method, "P": world, "layout": layout, "mask": mask, **r})
        ref = single_rows.get(mask)
        worst = max(rows, key=lambda r: r["fwd_bwd_s"])
        line = {"method": method, "P": world, "layout": layout, "mask": mask,
                "fwd_s": max(r["fwd_s"] for r in rows), "fwd_bwd_s": worst["fwd_bwd_s"],
                "vs_1proc_fwd_bwd": (ref["fwd_bwd_s"] / worst["fwd_bwd_s"]) if ref else None,
                "peak_mib_max": max(r["peak_mib"] for r in rows),
                "peak_vs_1proc": (max(r["peak_mib"] for r in rows) / ref["peak_mib"]) if ref and ref["peak_mib"] else None}
        if "elements" in rows[0]:
            el = [r["elements"] for r in rows]
            comp = [r["compute_s"] for r in rows]
            line.update(work_max_min=max(el) / min(el), compute_max_min=max(comp) / max(min(comp), 1e-9),
                        steps_walked=rows[0]["steps"], steps_computed="/".join(str(r["computed"]) for r in rows),
                        messages="/".join(str(r["messages"]) for r in rows))
        if "max_err" in rows[0]:
            line["max_err"] = rows[0]["max_err"]
        summary.append(line)
        print_table(f"{method} P={world} {layout} {mask}", _uniform(rows))
    print_table("summary (times: slowest rank; ratios vs one process with all cores)", _uniform(summary))
    name = "distributed_quick" if args.quick else "distributed"
    print("wrote", write_csv(name, _uniform(table)))


def _uniform(rows: list[dict]) -> list[dict]:
    """Every row with every column (blank where a row has none), in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in keys} for r in rows]


if __name__ == "__main__":
    main()
