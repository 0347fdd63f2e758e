"""A decode step of NSA against plain GQA attention at a long cache: time per step, tokens/s, and
the K/V bytes each reads per step against the whole cache.

One layer, ``E = 768``, 12 query heads of 64 on 2 KV heads, fp32, a ``DynamicKVCache`` holding
``--cached`` tokens (32768) of random keys and values (the same for both layers), then one token
per step, ``B = 1`` (``--batch``):

* ``gqa``: :class:`multihead.MultiHeadAttention` (causal): the decode path reads every cached key;
* ``nsa``: :class:`multihead.NativeSparseAttention`, the paper's sizes (compressed blocks of 32
  every 16, 16 selected blocks of 64, a window of 512): its compressed blocks extended by the one
  block a step completes, the selected branch gathering its 16 blocks, the window a band.

Bytes per step (K and V, one layer, every row of the batch): ``gqa`` reads ``Lk`` keys and
values; ``nsa`` at least ``Lk / d`` compressed ones + ``n · l'`` selected + ``w`` in the window
(what its three branches must read; the gather of the selected blocks copies them once more).
``GB/s`` is the bound's bytes over the measured time, next to this machine's read bandwidth.

Timer: process CPU time per step on one thread (the machine is shared), steps interleaved
(one ``gqa`` step, one ``nsa`` step), the median of ``--steps``; each layer is checked first
(prefill + steps == the full forward at 300 tokens, against its fp64 copy).

    python benchmarks/nsa_decode.py                       # 32768 cached tokens, 40 steps
    python benchmarks/nsa_decode.py --cached 8192,32768 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from common import THREADS, check_close, context, machine_state, memory_read_gbps, mh, print_table, write_csv

E, H, HKV = 768, 12, 2
NSA = {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16, "window": 512}


def layers() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "gqa": mh.MultiHeadAttention(E, H, num_kv_heads=HKV, causal=True),
        "nsa": mh.NativeSparseAttention(E, H, num_kv_heads=HKV, **NSA),
    }


def check(name: str, layer: torch.nn.Module) -> None:
    """Prefill 260 tokens, then 40 steps (the selected branch gathers once the cache is long
    enough) == the full forward of the fp64 copy."""
    x = torch.randn(1, 300, E, generator=torch.Generator().manual_seed(3))
    want = copy.deepcopy(layer).double()(x.double())
    cache = mh.DynamicKVCache()
    with torch.no_grad():
        steps = [layer(x[:, :260], kv_cache=cache)] + [layer(x[:, t : t + 1], kv_cache=cache) for t in range(260, 300)]
    check_close(name, torch.cat(steps, dim=1), want, atol=1e-4)


def kv_bytes(name: str, Lk: int, B: int) -> float:
    per_key = B * HKV * 2 * (E // H) * 4  # K and V, fp32
    if name == "gqa":
        return Lk * per_key
    l, d, ls, n, w = (NSA[k] for k in ("compress_block", "compress_stride", "select_block", "select_count", "window"))
    return ((Lk - l) // d + 1 + n * ls + w) * per_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cached", default="32768")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    contenders = layers()
    for name, layer in contenders.items():
        check(name, layer)
    bandwidth = memory_read_gbps()
    print(f"memory read bandwidth (x.sum() over 256 MiB+, {THREADS} threads): {bandwidth:.1f} GB/s")
    rows = []
    B = args.batch
    for Lk in (int(s) for s in args.cached.split(",")):
        g = torch.Generator().manual_seed(Lk)
        D = E // H
        k = torch.randn(B, HKV, Lk, D, generator=g)
        v = torch.randn(B, HKV, Lk, D, generator=g)
        caches = {}
        for name in contenders:
            cache = mh.DynamicKVCache(capacity=Lk + args.steps + 8)  # no growth while timed
            cache.update(k, v)
            caches[name] = cache
        xs = torch.randn(args.steps + 1, B, 1, E, generator=g)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                for name, layer in contenders.items():  # warm-up: NSA compresses the cache once here
                    layer(xs[0], kv_cache=caches[name])
                for t in range(1, args.steps + 1):
                    for name, layer in contenders.items():
                        start = time.process_time()
                        layer(xs[t], kv_cache=caches[name])
                        times[name].append((time.process_time() - start) * 1e3)
        finally:
            torch.set_num_threads(THREADS)
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        for name in contenders:
            nbytes = kv_bytes(name, Lk, B)
            rows.append(
                {
                    "cached": Lk,
                    "layer": name,
                    "ms per step": ms[name],
                    "tokens/s": 1e3 * B / ms[name],
                    "x gqa speed": ms["gqa"] / ms[name],
                    "K/V MB read": nbytes / 1e6,
                    "share of cache": nbytes / kv_bytes("gqa", Lk, B),
                    "GB/s": nbytes / (ms[name] * 1e-3) / 1e9,
                }
            )
        print_table(
            f"decode step, fp32, E={E}, Hq={H}, Hkv={HKV}, B={B}, {Lk} cached (one thread, CPU time)", rows[-2:]
        )
        print("load:", machine_state())
    print("after:", machine_state())
    write_csv("nsa_decode", rows)


if __name__ == "__main__":
    main()
