"""Where the time of multihead's CPU sparse kernel (``backends/cpu_sparse.c``) goes: its GFLOP/s
on one thread, forward and backward, against the fp32 matmul of the same thread, for selections
that reuse each key block more or less.

* ``matmul``: a 2048³ fp32 ``torch.mm`` on one thread (MKL): the ceiling of any fp32 kernel here;
* ``every row, the same 16 blocks``: each key block read by all 1024 rows of a tile, no mask (the
  register tiles and the softmax alone, nothing wasted on padding rows or on reading blocks);
* ``moba``, ``nsa``: the selections of ``benchmarks/sparse_cores.py`` (MoBA's gate: 16 blocks of 64
  per query and head; NSA's choice: 16 blocks of 64 per query and KV group, ``& causal()``).

FLOPs: ``4 · D`` per visible (query, key) pair forward (``Q Kᵀ`` and ``P V``), ``2.5x`` that for the
backward (five products), the pairs counted from the selection table (causal keys excluded).
Timer: process CPU time, the fastest of ``--rounds``; the load average is printed before and after.

    python benchmarks/sparse_kernel.py                   # L = 16384
"""

from __future__ import annotations

import argparse
import time

import torch

from common import context, machine_state, mh, print_table
from multihead.backends import cpu_sparse
from multihead.backends.block_gather import Selection, selection_of
from multihead.layers.moba import MobaCore
from multihead.layers.nsa import NsaCore
from multihead.masks import block_select

H, HKV, D = 12, 2, 64
NSA = {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16, "window": 512}


def fastest(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def visible_pairs(sel: Selection, Lq: int, Lk: int) -> float:
    """The (query head, query, key) triples the selection's mask lets through (per-token selections)."""
    table = sel.select._host_table()[0]  # (Hs, Lq, nK) for query_block_size 1
    bs, Hs = sel.select.block_size, table.shape[0]
    d = -1 if sel.rest is None else sel.rest.causal_offset(Lq, Lk)
    i = torch.arange(Lq).view(-1, 1)
    first = torch.arange(table.shape[-1]).view(1, -1) * bs
    keys = (torch.minimum(torch.full_like(first, bs), Lk - first)).expand(Lq, -1)
    if sel.rest is not None:
        keys = torch.clamp(torch.minimum(keys, i + d - first + 1), min=0)
    per_row = sum(float((table[h].to(torch.int64) * keys).sum()) for h in range(Hs))
    return per_row * H / Hs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    torch.set_num_threads(1)
    lib = cpu_sparse.kernel()
    if lib is None:
        raise SystemExit(f"the CPU sparse kernel is unavailable: {cpu_sparse.unavailable()}")
    L = args.length
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, L, D, generator=g) for h in (H, HKV, HKV))
    a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
    rows = [{"case": "matmul 2048³ (one thread)", "pass": "-", "ms": (t := fastest(lambda: a @ b, 3))}]
    rows[0]["GFLOP/s"] = 2 * 2048**3 / t / 1e6
    peak = rows[0]["GFLOP/s"]
    layer = mh.NativeSparseAttention(H * D, H, num_kv_heads=HKV, **NSA)
    gates = torch.sigmoid(torch.randn(1, L, 3 * H, generator=g))
    core = NsaCore(layer, gates, None)
    with torch.no_grad():
        _, idx = core.compressed_and_chosen(q, k, v)
    same = torch.arange(16).expand(1, 1, L, 16)
    selections = {
        "every row, the same 16 blocks": selection_of(block_select(same, 64, query_block_size=1)),
        "moba": selection_of(MobaCore(64, 16)._mask(q, k, None)),
        "nsa (selected branch)": selection_of(core._selected(idx, H)),
    }
    for name, sel in selections.items():
        assert sel is not None
        call = cpu_sparse._Call(q, k, v, sel, D**-0.5, backward=True)
        flops = 4 * D * visible_pairs(sel, L, L)
        out, lse = cpu_sparse._forward(lib, call, 1)
        dout = torch.randn(out.shape, generator=g)
        fwd = fastest(lambda: cpu_sparse._forward(lib, call, 1), args.rounds)
        bwd = fastest(lambda: cpu_sparse._backward(lib, call, out, lse, dout, None, 1), args.rounds)
        for kind, ms, f in (("forward", fwd, flops), ("backward", bwd, 2.5 * flops)):
            rows.append({"case": name, "pass": kind, "ms": ms, "GFLOP/s": f / ms / 1e6})
    for row in rows:
        row["of matmul"] = row["GFLOP/s"] / peak
    print_table(f"CPU sparse kernel, fp32, Hq={H}, Hkv={HKV}, D={D}, L={L}, one thread (CPU time)", rows)
    print("after:", machine_state())


if __name__ == "__main__":
    main()
