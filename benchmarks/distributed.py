"""Context-parallel attention on CPU with gloo: ring and Ulysses against one process.

For each configuration a fresh world of ``P`` processes (``torch.multiprocessing``, gloo,
file rendezvous) runs after a correctness check of its output against single-process
:func:`multihead.attention` on rank 0. Per rank it records:

* **memory**: the peak bytes of tensors alive at once during the forward, and during forward
  and backward (:class:`multihead.distributed.memory.TensorMemory`: every storage an ATen op
  creates, from its creation until it is freed; the inputs and the output gradient exist before
  and are not counted), for one process and for each rank. Not ``ru_maxrss``: at these sizes the
  resident size is mostly the allocator, gloo and the interpreter;
* **time**: forward and forward+backward wall time (median of ``--reps``, after a warm-up), and
  the **compute** of the forward's and the backward's block calls, as CPU time of the calling
  thread (``time.thread_time``; each rank runs one thread, so this is the work done, whatever
  else the machine runs and however long the rank waits for messages);
* the pairs of queries and keys the plan scores (``RingPlan.elements``), the steps it walks and
  the K/V messages it receives.

``P = 1`` is plain :func:`multihead.attention` in one process (one thread for the compute
column, all cores for the times). The load average is printed before and after every world.
Usage: ``python benchmarks/distributed.py [--quick] [--length 8192] [--reps 5] [--only memory] [--worlds 2,4,8]
[--methods ulysses]``; ``--only decode`` measures context-parallel decoding instead
(:class:`~multihead.distributed.ShardedKVCache`: per-rank cache bytes, bytes moved and time per
step, against one process's :class:`~multihead.caches.DynamicKVCache`);
writes ``benchmarks/results/distributed[_quick|_L<length>].csv``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multihead as mh  # noqa: E402
from common import context, machine_state, print_table, write_csv  # noqa: E402
from multihead.caches import DynamicKVCache  # noqa: E402
from multihead.distributed import (  # noqa: E402
    Mesh2D,
    ShardedKVCache,
    document_layout,
    hybrid_attention,
    hybrid_shard,
    plan_ring,
    ring_attention,
    ring_steps,
    shard_sequence,
    ulysses,
    ulysses_attention,
)
from multihead.distributed.checks import Shards  # noqa: E402
from multihead.distributed.cost import hybrid_traffic, ring_traffic, ulysses_traffic  # noqa: E402
from multihead.distributed.layout import pieces  # noqa: E402
from multihead.distributed.memory import TensorMemory  # noqa: E402
from multihead.distributed.ring import _cached_plan  # noqa: E402
from multihead.distributed.traffic import TrafficMeter  # noqa: E402

CORES = os.cpu_count() or 1
MIB = 2**20


def mask_of(name: str):
    return {"causal": mh.causal(), "none": None, "window": mh.sliding_window(512)}[name]


def inputs(B, H, L, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g) for _ in range(4))  # q, k, v, the output gradient


class ComputeClock:
    """CPU seconds of this thread inside the block calls of the forward (``attention``) and of the
    backward (the ring's ``block_backward``, in ``ring_steps``): patched into the modules for the
    timed runs."""

    def __init__(self):
        self.forward = self.backward = 0.0
        self._originals = (ring_steps.attention, ulysses.attention, ring_steps.block_backward)

    def _wrap(self, fn, field):
        def timed(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                setattr(self, field, getattr(self, field) + time.thread_time() - t)

        return timed

    def __enter__(self):
        self.forward = self.backward = 0.0
        ring_steps.attention = ulysses.attention = self._wrap(self._originals[0], "forward")
        ring_steps.block_backward = self._wrap(self._originals[2], "backward")
        return self

    def __exit__(self, *exc):
        ring_steps.attention, ulysses.attention, ring_steps.block_backward = self._originals


def _worker(rank, world, folder, cfg, out_queue):
    torch.set_num_threads(max(1, CORES // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/rdzv",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=900),
    )
    B, H, L, D, reps = cfg["B"], cfg["H"], cfg["L"], cfg["D"], cfg["reps"]
    layout, mask = cfg["layout"], mask_of(cfg["mask"])
    if cfg["method"] == "hybrid":  # R ring ranks by U = cfg["U"] Ulysses ranks, rank r·U + u
        U = cfg["U"]
        R = world // U
        rings = [dist.new_group([r * U + u for r in range(R)]) for u in range(U)]
        groups = [dist.new_group([r * U + u for u in range(U)]) for r in range(R)]
        mesh = Mesh2D(rings[rank % U], groups[rank // U])
        fn = lambda q, k, v, mask, layout: hybrid_attention(q, k, v, mesh=mesh, mask=mask, layout=layout)  # noqa: E731
        shard = lambda t: hybrid_shard(t, mesh=mesh, dim=2, layout=layout)  # noqa: E731
    else:
        fn = {"ring": ring_attention, "ulysses": ulysses_attention}[cfg["method"]]
        shard = lambda t: shard_sequence(t, layout=layout, dim=2)  # noqa: E731
    qs, ks, vs, gs = (shard(t).contiguous() for t in inputs(B, H, L, D))
    # warm-up on a small sequence: first-call imports and allocations
    small = [shard(t).requires_grad_() for t in inputs(B, H, 64 * world, D)[:3]]
    fn(*small, mask=mask, layout=layout).sum().backward()
    row = {"rank": rank}
    if cfg["only"] in (None, "memory"):
        row.update(_memory(lambda q, k, v: fn(q, k, v, mask=mask, layout=layout), qs, ks, vs, gs))
    if cfg["only"] in (None, "time"):
        row.update(
            _times(
                lambda q, k, v: fn(q, k, v, mask=mask, layout=layout),
                qs,
                ks,
                vs,
                gs,
                reps,
                barrier=dist.barrier,
                threads=max(1, CORES // world),
            )
        )
    if cfg["only"] in (None, "memory", "traffic"):
        row.update(_traffic(lambda q, k, v: fn(q, k, v, mask=mask, layout=layout), qs, ks, vs, gs))
        row.update(_formula(cfg, world, rank, mask, layout))
    if cfg["method"] != "ring":
        row.pop("compute_bwd_s", None)  # its backward is autograd through local calls: not clocked
    if cfg["method"] == "ring":
        S = L // world
        plan = _cached_plan(world, rank, Shards(B, H, H, S, S, D, D, world), mask, layout)
        row.update(
            elements=plan.elements, steps=len(plan.steps) + 1, computed=plan.steps_computed, messages=plan.messages
        )
    with torch.no_grad():  # correctness: rank 0's rows against single-process attention
        got = fn(qs, ks, vs, mask=mask, layout=layout)
    if rank == 0:
        q, k, v, _ = inputs(B, H, L, D)
        with torch.no_grad():
            row["max_err"] = float((got - shard(mh.attention(q, k, v, mask=mask))).abs().max())
    out_queue.put(row)
    dist.barrier()
    dist.destroy_process_group()


def _memory(run, q, k, v, grad) -> dict:
    """Peak tensor bytes of one forward (without autograd, and with it), of forward+backward, and
    what was alive at the peak."""
    with torch.no_grad(), TensorMemory() as memory:
        run(q, k, v)
    inference = memory.peak
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with TensorMemory() as memory:
        out = run(q, k, v)
        forward = memory.peak
        out.backward(grad)
        del out
    top = ", ".join(f"{b / MIB:.0f} {op}{list(shape)}" for b, op, shape in memory.at_peak(8) if b >= MIB)
    return {
        "fwd_nograd_mib": inference / MIB,
        "fwd_mib": forward / MIB,
        "fwd_bwd_mib": memory.peak / MIB,
        "at_peak": top,
    }


def _traffic(run, q, k, v, grad) -> dict:
    """Bytes this rank sends through torch.distributed in one forward and one backward
    (:class:`TrafficMeter`: the payload of every call; the agreement checks' objects apart)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with TrafficMeter() as meter:
        out = run(q, k, v)
        forward, control = meter.sent, meter.control_bytes
        out.backward(grad)
    return {"sent_fwd_b": forward, "sent_bwd_b": meter.sent - forward, "control_fwd_b": control}


def _formula(cfg, world, rank, mask, layout) -> dict:
    """The bytes :mod:`multihead.distributed.cost` gives for this rank (the ring's messages from its plan)."""
    B, H, D, S = cfg["B"], cfg["H"], cfg["D"], cfg["L"] // world
    if cfg["method"] == "ring":
        plan = _cached_plan(world, rank, Shards(B, H, H, S, S, D, D, world), mask, layout)
        sends, recvs = sum(plan.send[s] for s in plan.steps), sum(plan.recv[s] for s in plan.steps)
        model = ring_traffic(B=B, Hkv=H, S=S, D=D, Dv=D, P=world, b=4, b_acc=4, messages=sends, returns=recvs)
    elif cfg["method"] == "ulysses":
        model = ulysses_traffic(B=B, Hq=H, Hkv=H, S=S, D=D, Dv=D, P=world, b=4)
    else:
        U = cfg["U"]
        model = hybrid_traffic(B=B, Hq=H, Hkv=H, S=S, D=D, Dv=D, R=world // U, U=U, b=4, b_acc=4)
    return {"formula_fwd_b": model.forward, "formula_bwd_b": model.backward}


def _times(run, q, k, v, grad, reps, barrier, threads) -> dict:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fwd, both, compute_f, compute_b = [], [], [], []
    clock = ComputeClock()
    for _ in range(reps):
        barrier()
        t = time.perf_counter()
        with torch.no_grad():
            run(q, k, v)
        fwd.append(time.perf_counter() - t)
        barrier()
        t = time.perf_counter()
        run(q, k, v).backward(grad)
        both.append(time.perf_counter() - t)
        if threads == 1:  # thread CPU time is the work only where one thread does all of it
            barrier()
            with clock:
                run(q, k, v).backward(grad)
            compute_f.append(clock.forward)
            compute_b.append(clock.backward)
    row = {"fwd_s": statistics.median(fwd), "fwd_bwd_s": statistics.median(both)}
    if compute_f:
        row.update(compute_fwd_s=statistics.median(compute_f), compute_bwd_s=statistics.median(compute_b))
    return row


def single(cfg) -> dict:
    """P = 1: attention() in a fresh process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_single_worker, args=(cfg, queue))
    p.start()
    row = queue.get()
    p.join()
    return row


def _single_worker(cfg, queue):
    B, H, L, D, reps = cfg["B"], cfg["H"], cfg["L"], cfg["D"], cfg["reps"]
    mask = mask_of(cfg["mask"])
    small = [t.requires_grad_() for t in inputs(B, H, 64, D)[:3]]
    mh.attention(*small, mask=mask).sum().backward()
    q, k, v, grad = inputs(B, H, L, D)
    run = lambda q, k, v: mh.attention(q, k, v, mask=mask)  # noqa: E731
    row = {"rank": 0}
    if cfg["only"] in (None, "memory"):
        row.update(_memory(run, q, k, v, grad))
    if cfg["only"] in (None, "time"):
        torch.set_num_threads(CORES)
        row.update(_times(run, q, k, v, grad, reps, barrier=lambda: None, threads=CORES))
        torch.set_num_threads(1)  # the compute of one thread, comparable with a rank's
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        fwd, bwd = [], []
        for _ in range(reps):
            t = time.thread_time()
            out = run(qd, kd, vd)
            fwd.append(time.thread_time() - t)
            t = time.thread_time()
            out.backward(grad)
            bwd.append(time.thread_time() - t)
        row.update(compute_fwd_s=statistics.median(fwd), compute_bwd_s=statistics.median(bwd))
    queue.put(row)


def world_run(world: int, cfg: dict, worker=None) -> list[dict]:
    folder = tempfile.mkdtemp(prefix="multihead_bench_")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(
        worker or _worker, args=(world, folder, cfg, queue), nprocs=world, join=False, start_method="spawn"
    )
    rows = [queue.get() for _ in range(world)]
    procs.join()
    return sorted(rows, key=lambda r: r["rank"])


# ------------------------------------------------------------------------------------ decoding
def _decode_inputs(cfg):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, T = cfg["B"], cfg["H"], cfg["Hkv"], cfg["D"], cfg["L"] + cfg["steps"]
    return tuple(torch.randn(B, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))


def _decode_worker(rank, world, folder, cfg, out_queue):
    """A sharded KV cache: prefill ``L`` tokens (zigzag), then ``steps`` one-token steps, each
    timed; per rank the cache's bytes and tokens, and the bytes the last step moved."""
    torch.set_num_threads(max(1, CORES // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/rdzv",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=900),
    )
    L, steps = cfg["L"], cfg["steps"]
    q, k, v = _decode_inputs(cfg)
    cache = ShardedKVCache(layout="zigzag", capacity=(L + steps) // world + steps)
    times = []
    with torch.no_grad():
        cache.prefill(*(shard_sequence(t[:, :, :L], layout="zigzag", dim=2) for t in (q, k, v)))
        for t in range(L, L + steps):
            dist.barrier()
            start = time.perf_counter()
            y = cache.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            times.append(time.perf_counter() - start)
    traffic = cache.last_traffic
    row = {
        "rank": rank,
        "tokens": cache.local_length,
        "cache_mib": cache.nbytes / MIB,
        "step_ms": 1e3 * statistics.median(times[1:]),
        "query_b": traffic.query,
        "kv_b": traffic.kv,
        "partial_b": traffic.partial,
        "received_b": traffic.received_per_rank,
    }
    if rank == 0:  # the last step against one process over every token
        with torch.no_grad():
            want = mh.attention(q[:, :, -1:], k, v)
        row["max_err"] = float((y - want).abs().max())
    out_queue.put(row)
    dist.barrier()
    dist.destroy_process_group()


def _decode_single(cfg, queue):
    torch.set_num_threads(CORES)
    L, steps = cfg["L"], cfg["steps"]
    q, k, v = _decode_inputs(cfg)
    cache = DynamicKVCache(capacity=L + steps)
    times = []
    with torch.no_grad():
        cache.update(k[:, :, :L], v[:, :, :L])
        for t in range(L, L + steps):
            start = time.perf_counter()
            read = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            mh.attention(q[:, :, t : t + 1], read.keys, read.values)
            times.append(time.perf_counter() - start)
    queue.put(
        {
            "rank": 0,
            "tokens": cache.length,
            "cache_mib": cache.nbytes / MIB,
            "step_ms": 1e3 * statistics.median(times[1:]),
        }
    )


def decode_main(args, L: int) -> None:
    """``--only decode``: context-parallel decoding against one process's cache."""
    cfg = {"B": 1, "H": 32, "Hkv": 8, "D": 128, "L": L, "steps": args.reps or 16}
    print(f"decode: B=1, Hq=32, Hkv=8, D=128, fp32, prompt L={L}, {cfg['steps']} one-token steps (zigzag prefill)\n")
    table = []
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_decode_single, args=(cfg, queue))
    p.start()
    one = queue.get()
    p.join()
    gather_b = L * cfg["Hkv"] * 2 * cfg["D"] * 4  # what gathering the cache would move per step
    table.append({"P": 1, "load": f"{os.getloadavg()[0]:.1f}", **one, "cache_vs_1": 1.0})
    for world in sorted({int(w) for w in args.worlds.split(",")}):
        rows = world_run(world, cfg, worker=_decode_worker)
        worst = {key: max(r[key] for r in rows) for key in ("tokens", "cache_mib", "step_ms", "received_b")}
        table.append(
            {
                "P": world,
                "load": f"{os.getloadavg()[0]:.1f}",
                **worst,
                "cache_vs_1": worst["cache_mib"] / one["cache_mib"],
                "query_b": rows[0]["query_b"],
                "partial_b": rows[0]["partial_b"],
                "gather_cache_b": gather_b,
                "max_err": rows[0]["max_err"],
            }
        )
    print_table("decoding over a sharded KV cache (the largest rank; bytes per step and layer)", _uniform(table))
    write_csv(f"distributed_decode_L{L}", _uniform(table))


# ------------------------------------------------------------------------------------ balance
def document_lengths(total: int, seed: int = 0) -> list[int]:
    """Packed documents of a long-tailed length distribution (Pareto, shape 1.2, at least 64 and
    at most 32768 tokens) filling ``total`` tokens; the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = float(torch.rand((), generator=g))
        lengths.append(min(32768, int(64 * (1 - u) ** (-1 / 1.2))))
    lengths[-1] -= sum(lengths) - total
    return lengths


def causal_pairs(positions: torch.Tensor, starts: torch.Tensor) -> int:
    """Query-key pairs a document-causal mask shows the queries at ``positions``: each sees its
    document's keys up to itself."""
    return int((positions - starts[positions] + 1).sum())


def balance_main(L: int, worlds: list[int]) -> None:
    """``--only balance``: the work of each rank under ``document_causal`` for packed documents,
    read from the layouts themselves (``document_layout`` is the object the ring runs with): the
    visible query-key pairs of each rank's positions, and the pairs each rank's ring plan scores
    (``RingPlan.elements``: a partial block counted whole), its runs, its messages, and the time
    to make every rank's plan. No processes."""
    lengths = document_lengths(L)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)[ids]  # (L,): the start of each token's document
    mask = mh.masks.document_causal(ids.view(1, -1))
    print(
        f"balance: L={L} tokens in {len(lengths)} documents (Pareto 1.2, 64..32768 tokens; longest "
        f"{max(lengths)}, median {sorted(lengths)[len(lengths) // 2]}); work = visible pairs of document_causal\n"
    )
    table = []
    for world in worlds:
        S = L // world
        layouts = {"contiguous": "contiguous", "zigzag": "zigzag"}
        for min_chunk in (16, 64, 256):
            layouts[f"document_layout(min_chunk={min_chunk})"] = document_layout(ids, world, min_chunk=min_chunk)
        for name, layout in layouts.items():
            held = [
                torch.cat([torch.arange(p.start, p.start + p.length) for p in pieces(S, r, world, layout)])
                for r in range(world)
            ]
            work = [causal_pairs(pos, starts) for pos in held]
            start = time.perf_counter()
            plans = [
                plan_ring(world=world, rank=r, batch=1, heads=1, q_shard=S, kv_shard=S, mask=mask, layout=layout)
                for r in range(world)
            ]
            plan_s = time.perf_counter() - start
            scored = [p.elements for p in plans]
            mean = sum(work) / world
            table.append(
                {
                    "P": world,
                    "layout": name,
                    "runs_per_rank_max": max(len(pieces(S, r, world, layout)) for r in range(world)),
                    "work_max_mean": max(work) / mean,
                    "work_min_mean": min(work) / mean,
                    "slowest_speedup_vs_1": sum(work) / max(work),
                    "scored_max_mean": max(scored) / (sum(scored) / world),
                    "scored_over_visible": sum(scored) / sum(work),
                    "messages_max": max(p.messages for p in plans),
                    "plans_s": plan_s,
                }
            )
    print_table("document-causal work per rank (max / mean: the slowest rank against a balanced one)", table)
    write_csv(f"distributed_balance_L{L}", table)


CONFIGS = [
    ("single", 1, "-", "causal"),
    ("ring", 2, "zigzag", "causal"),
    ("ring", 2, "contiguous", "causal"),
    ("ring", 4, "zigzag", "causal"),
    ("ring", 4, "contiguous", "causal"),
    ("ulysses", 2, "zigzag", "causal"),
    ("ulysses", 4, "zigzag", "causal"),
    ("single", 1, "-", "window"),
    ("ring", 2, "contiguous", "window"),
    ("ring", 2, "zigzag", "window"),
    ("ring", 4, "contiguous", "window"),
    ("ring", 4, "zigzag", "window"),
    ("ulysses", 4, "zigzag", "window"),
    ("ring", 8, "zigzag", "causal"),
    ("ring", 8, "contiguous", "window"),
    ("ulysses", 8, "zigzag", "causal"),
    ("hybrid", 4, "zigzag", "causal"),
    ("hybrid", 8, "zigzag", "causal"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 2048, one repetition, fewer worlds")
    parser.add_argument("--length", type=int, default=None, help="total sequence length L (default 8192)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per timing (default 3)")
    parser.add_argument(
        "--only",
        choices=["memory", "time", "traffic", "decode", "balance"],
        default=None,
        help="measure only this (decode, balance: their own tables)",
    )
    parser.add_argument("--worlds", default="2,4", help="world sizes, e.g. 2,4,8 (8 processes share the cores)")
    parser.add_argument(
        "--methods", default="ring,ulysses,hybrid", help="ring, ulysses, hybrid (one process always runs)"
    )
    parser.add_argument("--masks", default="causal,window", help="causal, window or both (default both)")
    parser.add_argument("--batch", type=int, default=1, help="B, sequences per rank (default 1)")
    parser.add_argument("--ulysses", type=int, default=2, help="U, the Ulysses size of the 2-D mesh (default 2)")
    args = parser.parse_args()
    L = args.length or (2048 if args.quick else 8192)
    reps = args.reps or (1 if args.quick else 3)
    base = {"B": args.batch, "H": 8, "D": 64, "L": L, "reps": reps, "only": args.only, "U": args.ulysses}
    print(context())
    print(machine_state())
    if args.only == "decode":
        return decode_main(args, L)
    if args.only == "balance":
        return balance_main(args.length or 131072, sorted({2, 4, 8} | {int(w) for w in args.worlds.split(",")}))
    print(
        f"B={args.batch}, H=8, D=64, L={L}, fp32, 2-D mesh (P/{args.ulysses}) x {args.ulysses}; "
        f"P processes get {CORES}//P threads each (P=1: {CORES} threads; "
        f"compute columns: one thread)\n"
    )

    worlds = {1} | {int(w) for w in args.worlds.split(",")}
    methods = {"single"} | set(args.methods.split(","))
    configs = [
        c
        for c in CONFIGS
        if c[1] in worlds
        and c[0] in methods
        and (not args.quick or c[1] <= 2 or c[0] == "ring")
        and not (c[0] == "single" and args.only == "traffic")
        and c[3] in args.masks.split(",")
    ]
    table, summary, single_rows = [], [], {}
    for method, world, layout, mask in configs:
        cfg = dict(base, method=method, layout=layout, mask=mask)
        load_before = os.getloadavg()[0]
        rows = [single(cfg)] if method == "single" else world_run(world, cfg)
        if method == "hybrid":
            layout = f"{world // args.ulysses}x{args.ulysses} {layout}"
        load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
        print(f"{method} P={world} {layout} {mask}: {machine_state()}")
        if method == "single":
            single_rows[mask] = rows[0]
        for r in rows:
            table.append({"method": method, "P": world, "layout": layout, "mask": mask, "load": load, **r})
        summary.append(_summary_line(method, world, layout, mask, load, rows, single_rows.get(mask)))
        if rows[0].get("at_peak"):
            print(f"  rank 0, alive at the forward+backward peak (MiB op[shape]): {rows[0]['at_peak']}")
    print_table("summary (memory: the largest rank; times: the slowest rank; ratios vs one process)", _uniform(summary))
    name = "distributed_quick" if args.quick else f"distributed_L{L}" + (f"_{args.only}" if args.only else "")
    write_csv(name, _uniform(table))


def _summary_line(method, world, layout, mask, load, rows, ref) -> dict:
    def worst(key):
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None

    def ratio(key):
        return worst(key) / ref[key] if ref and worst(key) is not None and ref.get(key) else None

    line = {
        "method": method,
        "P": world,
        "layout": layout,
        "mask": mask,
        "load": load,
        "fwd_nograd_mib": worst("fwd_nograd_mib"),
        "fwd_mib": worst("fwd_mib"),
        "fwd_vs_1": ratio("fwd_mib"),
        "fwd_bwd_mib": worst("fwd_bwd_mib"),
        "fwd_bwd_vs_1": ratio("fwd_bwd_mib"),
        "fwd_bwd_s": worst("fwd_bwd_s"),
        "speed_vs_1": (ref["fwd_bwd_s"] / worst("fwd_bwd_s")) if ref and worst("fwd_bwd_s") else None,
    }
    for key, short in (("compute_fwd_s", "fwd"), ("compute_bwd_s", "bwd")):
        if key in rows[0]:
            values = [r[key] for r in rows]
            line[key] = "/".join(f"{x:.2f}" for x in values)
            if world > 1:
                line[f"{short}_max_min"] = max(values) / max(min(values), 1e-9)
    if "elements" in rows[0]:
        el = [r["elements"] for r in rows]
        line.update(
            work_max_min=max(el) / min(el),
            steps_walked=rows[0]["steps"],
            steps_computed="/".join(str(r["computed"]) for r in rows),
            messages="/".join(str(r["messages"]) for r in rows),
        )
    if "sent_fwd_b" in rows[0]:
        line.update(
            sent_fwd_mib=worst("sent_fwd_b") / MIB,
            sent_bwd_mib=worst("sent_bwd_b") / MIB,
            formula_equal="yes"
            if all((r["sent_fwd_b"], r["sent_bwd_b"]) == (r["formula_fwd_b"], r["formula_bwd_b"]) for r in rows)
            else "NO",
        )
    if "max_err" in rows[0]:
        line["max_err"] = rows[0]["max_err"]
    return line


def _uniform(rows: list[dict]) -> list[dict]:
    """Every row with every column (blank where a row has none), in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in keys} for r in rows]


if __name__ == "__main__":
    main()
