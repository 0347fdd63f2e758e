"""One sequence over several processes: ring and Ulysses attention against one process.

    torchrun --nproc-per-node 4 examples/context_parallel.py            # CPU: gloo
    torchrun --nproc-per-node 4 examples/context_parallel.py --length 65536 --mask window

On GPUs (one per process) it uses NCCL. Every rank builds the same whole sequence from a seed,
keeps its shard (zigzag layout), runs ring attention (forward and backward) and Ulysses
attention, checks its rows of the output and of the gradients of q, k and v against
single-process ``multihead.attention`` on the whole sequence in float64 (the oracle), beside the
same single-process attention in float32 (what one process would get: the baseline of
``shared/TESTING.md``'s relative rule), skipped with ``--no-check`` for lengths one process cannot
hold, and prints its time and peak
memory of a second run (the first pays for first-call imports): on GPUs
``torch.cuda.max_memory_allocated``, on CPUs the peak bytes of the tensors it created
(:class:`multihead.distributed.memory.TensorMemory`; the inputs are not counted).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import multihead as mh  # noqa: E402
from multihead.distributed import ContextParallel, plan_ring  # noqa: E402
from multihead.distributed.memory import TensorMemory  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="whole sequence length L")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mask", choices=["causal", "window", "documents", "none"], default="causal")
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    L, H, Hkv, D = args.length, args.heads, args.kv_heads, args.head_dim
    mask = {
        "causal": mh.causal(),
        "window": mh.sliding_window(1024),
        "none": None,
        "documents": mh.document_causal(torch.arange(L).div(L // 7 + 1, rounding_mode="floor").view(1, L)),
    }[args.mask]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, L, D, generator=g) for h in (H, Hkv, Hkv))  # the whole sequence, on every rank
    if not args.no_check:  # one process on the whole sequence: the fp64 oracle and the fp32 baseline
        oracle, single = whole_sequence(q, k, v, mask, torch.float64), whole_sequence(q, k, v, mask, torch.float32)

    for method in ("ring", "ulysses"):
        if method == "ulysses" and (H % world or (Hkv % world and world % Hkv)):
            if rank == 0:
                print(f"ulysses: skipped (Hq={H}, Hkv={Hkv} do not split over {world} ranks)")
            continue
        cp = ContextParallel(layout=args.layout, method=method)
        qs, ks, vs = (cp.shard(t, dim=2).to(device).requires_grad_() for t in (q, k, v))  # (1, H, L/P, D)
        grad = torch.ones(qs.shape[:3] + (vs.shape[3],), device=device)  # (1, H, L/P, D)
        for _ in range(2):  # the first run pays for first-call imports and allocations: timed, not reported
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            meter = contextlib.nullcontext() if cuda else TensorMemory()
            dist.barrier()
            start = time.perf_counter()
            for t in (qs, ks, vs):
                t.grad = None  # each run's own gradients, not the sum of both
            with meter:
                out = cp.attention(qs, ks, vs, mask=mask)
                out.backward(grad)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            memory = (torch.cuda.max_memory_allocated() if cuda else meter.peak) / 2**20
        line = (
            f"{method:8s} rank {rank}/{world}: forward+backward {seconds * 1e3:8.1f} ms, peak memory {memory:7.1f} MiB"
        )
        if method == "ring":
            plan = plan_ring(
                world=world,
                rank=rank,
                batch=1,
                heads=H,
                q_shard=L // world,
                kv_shard=L // world,
                mask=mask,
                layout=args.layout,
            )
            line += f", {plan.steps_computed} of {world} steps computed, {plan.messages} K/V shards received"
        if not args.no_check:
            # This rank's rows of the output and of every gradient, against the oracle's rows; the
            # same for one fp32 process: context parallelism should err about as much as that.
            mine = [out.detach(), qs.grad, ks.grad, vs.grad]
            errs = [errors(mine, oracle, cp), errors([cp.shard(t, dim=2) for t in single], oracle, cp)]
            line += (
                f", max |out - fp64| = {errs[0][0]:.2e} (one process: {errs[1][0]:.2e})"
                f", max |grad - fp64| = {errs[0][1]:.2e} (one process: {errs[1][1]:.2e})"
            )
        for r in range(world):  # one line per rank, in order
            dist.barrier()
            if r == rank:
                print(line, flush=True)
    dist.destroy_process_group()


def whole_sequence(q, k, v, mask, dtype) -> list:
    """Single-process attention on the whole sequence in ``dtype``: the output and the gradients of
    ``q``, ``k`` and ``v`` for an upstream gradient of ones (the one the ranks use)."""
    q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (q, k, v))  # copies: inputs stay grad-free
    out = mh.attention(q, k, v, mask=mask)
    out.backward(torch.ones_like(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def errors(mine, oracle, cp) -> tuple[float, float]:
    """``(max |out - oracle|, max over q, k, v of max |grad - oracle|)`` on this rank's rows."""
    diffs = [float((m.detach().cpu().double() - cp.shard(r, dim=2)).abs().max()) for m, r in zip(mine, oracle)]
    return diffs[0], max(diffs[1:])


if __name__ == "__main__":
    main()
