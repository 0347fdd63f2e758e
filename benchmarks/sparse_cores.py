"""NSA's and MoBA's attention against dense causal attention of the same shape, as L grows: the
attention alone (given q, k, v; no projections), forward and forward+backward, with where the
time goes and the bound that the keys each query reads put on the ratio.

``Hq = 12`` query heads of ``D = 64`` on ``Hkv = 2`` KV heads, ``B = 1``, fp32, causal:

* ``dense``: :func:`multihead.attention` with ``causal()`` (what the plain layer runs);
* ``nsa``: :class:`multihead.layers.nsa.NsaCore` with the paper's sizes (compressed blocks of 32
  every 16, 16 selected blocks of 64, a window of 512): the three branches and their gates;
* ``moba``: :class:`multihead.layers.moba.MobaCore`, blocks of 64, 16 read (the own one included);
* ``nsa (PyTorch pieces)``, ``moba (PyTorch pieces)``: the same with multihead's CPU kernels off
  (``cpu_sparse.c``: the selected attention on PyTorch's kernels, ``key_major.py``; ``cpu_topk.c``:
  the choice's ranking by ``torch.topk``): what ran before them, timed in the same run.

The bound: keys read per query, summed over the queries (causal: query ``i`` reads ``i + 1``
keys dense; NSA ``min(i + 1, w) + (selected keys at or before i) + (compressed blocks complete
at i)``; MoBA the keys of its chosen blocks at or before ``i``). ``bound`` = dense keys / sparse
keys: the speed-up if a sparse key cost what a dense one costs. Printed next to the measured one.

Timer: process CPU time per call on one thread (the machine is shared: the other jobs' time is
not counted, their contention for caches and memory is), the fastest of interleaved rounds, after
a check against the fp64 reference at ``L = 512``. The load average is printed before and after.

    python benchmarks/sparse_cores.py                                 # L = 4096, 8192, 16384
    python benchmarks/sparse_cores.py --lengths 16384 --rounds 1 --forward-only
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

from common import check_close, context, cpu_ms, machine_state, mh, print_table, write_csv
from multihead.backends import cpu_sparse, cpu_topk
from multihead.layers.moba import MobaCore
from multihead.layers.nsa import NsaCore
from multihead.masks import causal, sliding_window

H, HKV, D = 12, 2, 64
NSA = {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16, "window": 512}
MOBA_BLOCK, MOBA_TOP = 64, 16


def keys_read(L: int) -> dict[str, float]:
    """Keys read by all the queries of one head, per contender (module docstring)."""
    i = torch.arange(L, dtype=torch.float64)
    l, d, ls, n, w = (NSA[k] for k in ("compress_block", "compress_stride", "select_block", "select_count", "window"))
    own = torch.div(i, ls, rounding_mode="floor")
    # n blocks (or as many as exist), all whole but the own one, which is read up to i
    selected = torch.minimum(own, torch.tensor(n - 1.0)) * ls + (i - own * ls + 1)
    compressed = torch.where(i >= l - 1, torch.div(i - l + 1, d, rounding_mode="floor") + 1, 0.0)
    window = torch.minimum(i + 1, torch.tensor(float(w)))
    mown = torch.div(i, MOBA_BLOCK, rounding_mode="floor")
    moba = torch.minimum(mown, torch.tensor(MOBA_TOP - 1.0)) * MOBA_BLOCK + (i - mown * MOBA_BLOCK + 1)
    return {
        "dense": float((i + 1).sum()),
        "nsa": float((selected + compressed + window).sum()),
        "moba": float(moba.sum()),
    }


@contextlib.contextmanager
def pytorch_pieces():
    """multihead's CPU kernels off: the selected attention on PyTorch's kernels (``key_major.py``),
    the choice ranked by ``torch.topk``."""
    saved = cpu_sparse.supports, cpu_topk.supports
    cpu_sparse.supports = cpu_topk.supports = lambda *args, **kwargs: False  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_sparse.supports, cpu_topk.supports = saved  # type: ignore[assignment]


def without_kernel(fn):
    def run(*args):
        with pytorch_pieces():
            return fn(*args)

    return run


def contenders(layer: mh.NativeSparseAttention, gates: torch.Tensor) -> dict:
    def nsa(q, k, v):
        return NsaCore(layer, gates, None)(q, k, v)

    def moba(q, k, v):
        return MobaCore(MOBA_BLOCK, MOBA_TOP)(q, k, v)

    return {
        "dense": lambda q, k, v: mh.attention(q, k, v, mask=causal()),
        "nsa": nsa,
        "moba": moba,
        "nsa (PyTorch pieces)": without_kernel(nsa),
        "moba (PyTorch pieces)": without_kernel(moba),
    }


def branches(layer: mh.NativeSparseAttention, gates: torch.Tensor, q, k, v) -> dict:
    """The forward's parts, each timed alone: NSA's compressed branch with its choice, its
    selected and window branches; MoBA's gate and its attention over the chosen blocks."""
    core, moba = NsaCore(layer, gates, None), MobaCore(MOBA_BLOCK, MOBA_TOP)
    with torch.no_grad():
        _, idx = core.compressed_and_chosen(q, k, v)
        selected = core._selected(idx, q.shape[1])
        chosen = moba._mask(q, k, None)
    return {
        "nsa: compressed + choice": lambda: core.compressed_and_chosen(q, k, v),
        "nsa: selected": lambda: mh.attention(q, k, v, mask=selected),
        "nsa: window": lambda: mh.attention(q, k, v, mask=sliding_window(NSA["window"] - 1)),
        "moba: choice": lambda: moba._mask(q, k, None),
        "moba: attention": lambda: mh.attention(q, k, v, mask=chosen),
        "nsa: compressed + choice (PyTorch pieces)": without_kernel(lambda: core.compressed_and_chosen(q, k, v)),
        "nsa: selected (PyTorch pieces)": without_kernel(lambda: mh.attention(q, k, v, mask=selected)),
        "moba: choice (PyTorch pieces)": without_kernel(lambda: moba._mask(q, k, None)),
        "moba: attention (PyTorch pieces)": without_kernel(lambda: mh.attention(q, k, v, mask=chosen)),
    }


def inputs(L: int, grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, L, D, generator=g)
    k = torch.randn(1, HKV, L, D, generator=g)
    v = torch.randn(1, HKV, L, D, generator=g)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def check(layer, gates_of) -> None:
    """Each contender against the fp64 reference on the same mask, ``L = 512``."""
    L = 512
    q, k, v = inputs(L)
    qd, kd, vd = (t.double() for t in (q, k, v))
    check_close(
        "dense", mh.attention(q, k, v, mask=causal()), mh.attention(qd, kd, vd, mask=causal(), backend="reference")
    )
    moba = MobaCore(MOBA_BLOCK, MOBA_TOP)
    want = mh.attention(qd, kd, vd, mask=moba._mask(q, k, None), backend="reference")
    check_close("moba", moba(q, k, v), want)
    check_close("moba (PyTorch pieces)", without_kernel(moba)(q, k, v), want)
    gates = gates_of(L)
    core, core64 = NsaCore(layer, gates, None), NsaCore(copy.deepcopy(layer).double(), gates.double(), None)
    with torch.no_grad():
        _, idx = core.compressed_and_chosen(q, k, v)
        o_cmp, _ = core64.compressed(qd, kd, vd)  # the whole table, the definition
        g = gates.double().view(1, L, 3, H).permute(2, 0, 3, 1).unsqueeze(-1)
        want = (
            g[0] * o_cmp
            + g[1] * mh.attention(qd, kd, vd, mask=core._selected(idx, H), backend="reference")
            + g[2] * mh.attention(qd, kd, vd, mask=sliding_window(NSA["window"] - 1), backend="reference")
        )
        check_close("nsa", core(q, k, v), want)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--no-branches", action="store_true", help="skip the per-branch forward times")
    args = parser.parse_args()
    print(context())
    print("CPU sparse kernel (cpu_sparse.c):", cpu_sparse.unavailable() or "built; nsa and moba run it")
    print("CPU best-first kernel (cpu_topk.c):", cpu_topk.unavailable() or "built; nsa and moba run it")
    print("before:", machine_state())
    torch.manual_seed(0)
    layer = mh.NativeSparseAttention(H * D, H, num_kv_heads=HKV, **NSA)

    def gates_of(L):
        return torch.sigmoid(torch.randn(1, L, 3 * H, generator=torch.Generator().manual_seed(1)))

    check(layer, gates_of)
    rows, parts = [], []
    for L in (int(s) for s in args.lengths.split(",")):
        gates = gates_of(L)
        fns_of = contenders(layer, gates)
        q, k, v = inputs(L)
        qg, kg, vg = inputs(L, grad=True)

        def forward(fn):
            def run():
                with torch.no_grad():
                    fn(q, k, v)

            return run

        def training(fn):
            def run():
                fn(qg, kg, vg).sum().backward()

            return run

        fns = {(n, "forward"): forward(f) for n, f in fns_of.items()}
        if not args.forward_only:
            fns |= {(n, "forward+backward"): training(f) for n, f in fns_of.items()}
        ms = cpu_ms(fns, args.rounds, warmup=False)
        keys = keys_read(L)
        these = []
        for name, kind in fns:
            t = ms[(name, kind)]
            these.append(
                {
                    "L": L,
                    "attention": name,
                    "pass": kind,
                    "cpu ms": t,
                    "dense / this": ms[("dense", kind)] / t,
                    "bound": keys["dense"] / keys[name.split()[0]],
                    "keys per query": keys[name.split()[0]] / L,
                    "us per token": t * 1e3 / L,
                }
            )
        these.sort(key=lambda r: (r["pass"], list(fns_of).index(r["attention"])))
        print_table(f"causal attention, fp32, Hq={H}, Hkv={HKV}, D={D}, B=1, L={L} (one thread, CPU time)", these)
        print("load:", machine_state())
        rows += these
        if not args.no_branches:
            with torch.no_grad():
                bms = cpu_ms(branches(layer, gates, q, k, v), args.rounds, warmup=False)
            mine = [
                {"L": L, "part": p, "cpu ms": t, "share of dense": t / ms[("dense", "forward")]} for p, t in bms.items()
            ]
            print_table(f"forward, part by part, L={L} (share: of dense causal's forward)", mine)
            parts += mine
    print("after:", machine_state())
    write_csv("sparse_cores", rows)
    if parts:
        write_csv("sparse_cores_parts", parts)


if __name__ == "__main__":
    main()
