"""Where the layer's time goes on CUDA: host (Python) time per call against the GPU's.

``MultiHeadAttention(E, H, causal=True)`` and the fused-QKV + SDPA module of ``gpu.py`` at
``B=8, L=1024, E=768, H=12`` in bf16, forward under ``no_grad`` (the row of ``gpu.py --only
layer`` whose target is ``<= 1.1x`` the fused module). For each, in one process:

* ``host_us``: the wall time of queueing ``N`` calls (the loop returns before the GPU finishes,
  as long as the queue does not fill), per call: the Python and launch cost alone;
* ``total_us``: the same ``N`` calls and a synchronisation, per call: ``max(host, GPU)`` when the
  queue keeps the GPU busy;
* then a ``cProfile`` of the layer's calls, the 25 functions with the most own time.

A layer whose ``host_us`` exceeds the fused module's ``total_us`` is bound by its Python path.

    python benchmarks/gpu_layer_host.py            # on a CUDA machine
    python benchmarks/gpu_layer_host.py --dry-run  # tiny, on CPU: every code path
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import multihead as mh
from gpu import FusedSDPA


def timed(fn, n: int, sync) -> tuple[float, float]:
    """(host us per call, total us per call) of ``n`` calls of ``fn``, the fastest of 5 rounds."""
    host, total = [], []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / n * 1e6)
        total.append((t2 - t0) / n * 1e6)
    return min(host), min(total)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    B, L, E, H = (2, 64, 64, 4) if args.dry_run else (8, 1024, 768, 12)
    n = 20 if args.dry_run else 100
    dtype = torch.bfloat16
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    ours = mh.MultiHeadAttention(E, H, causal=True)
    fused = FusedSDPA(E, H)
    with torch.no_grad():
        fused.qkv.weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        fused.qkv.bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        fused.out.load_state_dict(ours.out_proj.state_dict())
    ours, fused = (m.to(device=device, dtype=dtype).eval() for m in (ours, fused))
    x = torch.randn(B, L, E, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"# {name}, torch {torch.__version__}; B={B} L={L} E={E} H={H} bf16 causal, forward, no_grad")
    with torch.no_grad():
        err = (ours(x).float() - fused(x).float()).abs().max().item()
        print(f"max |multihead - fused| = {err:.2e}")
        for _ in range(20):
            ours(x), fused(x)
        rows = {}
        # 20 calls queue fewer launches than CUDA's queue holds, so the host loop never waits on it
        for label, module in (("multihead", ours), ("fused_sdpa", fused), ("multihead", ours)):
            rows[label] = timed(lambda m=module: m(x), 20, sync)  # multihead twice: the second kept
        for label, (host, total) in rows.items():
            print(f"{label:12s} host_us {host:8.1f}  total_us {total:8.1f}")
        print(f"multihead/fused total: {rows['multihead'][1] / rows['fused_sdpa'][1]:.3f}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(n):
            ours(x)
        profile.disable()
        sync()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    if device == "cuda":  # the kernels each module launches, and their GPU time
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as kernels

        for label, module in (("multihead", ours), ("fused_sdpa", fused)):
            with torch.no_grad(), kernels(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    module(x)
                sync()
            print(f"## {label}: 10 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
