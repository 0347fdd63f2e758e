"""The attention variants' cost next to the plain layer: gated and differential attention.

One causal self-attention layer, fp32, ``d_model=768``, in one process on the same input
(``B, L`` from the command line). Contenders:

* ``plain``: :class:`multihead.MultiHeadAttention` with 12 heads of 64;
* ``gated elementwise`` / ``gated headwise``: :class:`multihead.GatedAttention`, the same layer
  with a gate projection ``768 -> 768`` (or ``768 -> 12``) and the sigmoid gate before ``out_proj``;
* ``differential``: :class:`multihead.DifferentialAttention` with 6 heads of 128 (two maps of 64
  per head), the paper's way of keeping the parameters of the 12-head layer: the same projections,
  two attention calls with keys of 64 and values of 128, the per-head RMSNorm;
* ``differential 12x64``: 12 heads of 64 (maps of 32), the same arithmetic in smaller pieces;
* ``moba 64x8``: :class:`multihead.MixtureOfBlockAttention`, blocks of 64, 8 read per query (its
  own and the best 7 earlier ones): the gate, then attention through the ``block_select`` mask.

Targets (issue 31): gated <= 1.15x and differential <= 2.1x the plain layer, forward and
forward+backward. Each contender is first checked against its own float64 copy (BENCHMARKS.md
rule 1); then they run in interleaved rounds on the same input. Two clocks:

* ``cpu ms``: the process's CPU time per call on one thread, the fastest of the rounds. On a
  machine shared with other jobs, wall time counts the time the scheduler gave to them (under a
  load of many times the cores, the wall-time ratio of two layers doing nearly the same work moves
  far from 1, in both directions: docs/variants.md); CPU time counts this process's work only
  (one thread: no OpenMP worker spinning between parallel regions either). The docs quote these.
* ``wall ms`` (``--wall``): :func:`common.fastest_ms` on the benchmark threads, for reference.

The load average is printed before and after.

    python benchmarks/variants.py            # B=2, L=1024 and L=2048, CPU time
    python benchmarks/variants.py --wall     # and wall time on the benchmark threads
    python benchmarks/variants.py --quick    # B=1, L=512: a smoke run
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from common import THREADS, check_close, context, fastest_ms, machine_state, mh, print_table, write_csv

E = 768


def contenders() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "plain": mh.MultiHeadAttention(E, 12, causal=True),
        "gated elementwise": mh.GatedAttention(E, 12, causal=True),
        "gated headwise": mh.GatedAttention(E, 12, gate="headwise", causal=True),
        "differential": mh.DifferentialAttention(E, 6, causal=True, depth=2),
        "differential 12x64": mh.DifferentialAttention(E, 12, causal=True, depth=2),
        "moba 64x8": mh.MixtureOfBlockAttention(E, 12, block_size=64, top_k=8),
    }


def check(layers: dict[str, torch.nn.Module], x: torch.Tensor) -> None:
    """Each layer in fp32 against a float64 copy of itself on the same input."""
    with torch.no_grad():
        for name, layer in layers.items():
            check_close(name, layer(x), copy.deepcopy(layer).double()(x.double()), atol=1e-4)


def cpu_ms(fns: dict, rounds: int, calls: int) -> dict:
    """Milliseconds of process CPU time per ``fns[key]()`` on one thread: the fastest of ``rounds``
    interleaved rounds of ``calls`` calls each (every contender warmed up once first)."""
    torch.set_num_threads(1)
    try:
        for fn in fns.values():
            fn()
        best = {key: float("inf") for key in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                start = time.process_time()
                for _ in range(calls):
                    fn()
                best[key] = min(best[key], (time.process_time() - start) / calls * 1e3)
        return best
    finally:
        torch.set_num_threads(THREADS)


def run(B: int, L: int, rounds: int, calls: int, wall: bool, only: list[str] | None = None) -> list[dict]:
    layers = {name: layer for name, layer in contenders().items() if not only or name in only or name == "plain"}
    x = torch.randn(B, L, E)
    check(layers, x)
    xg = x.clone().requires_grad_()

    def forward(layer):
        def fn():
            with torch.no_grad():
                layer(x)

        return fn

    def training(layer):
        def fn():
            layer(xg).sum().backward()

        return fn

    fns = {(name, "forward"): forward(layer) for name, layer in layers.items()}
    fns |= {(name, "forward+backward"): training(layer) for name, layer in layers.items()}
    cpu = cpu_ms(fns, rounds, calls)
    walls = fastest_ms(fns, rounds, min_run_time=0.5) if wall else {}
    rows = []
    for name, kind in fns:
        row = {"B": B, "L": L, "layer": name, "pass": kind, "cpu ms": cpu[(name, kind)]}
        row["cpu x plain"] = cpu[(name, kind)] / cpu[("plain", kind)]
        if wall:
            row["wall ms"] = walls[(name, kind)]
            row["wall x plain"] = walls[(name, kind)] / walls[("plain", kind)]
        rows.append(row)
    return sorted(rows, key=lambda r: (r["pass"], list(layers).index(r["layer"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=1, L=512, one round: a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="calls per round on the CPU clock")
    parser.add_argument("--wall", action="store_true", help="also wall time on the benchmark threads")
    parser.add_argument("--layers", help="comma-separated contenders to run beside plain (default: all)")
    parser.add_argument("--lengths", help="comma-separated L (default 1024,2048; B=2)")
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [1024, 2048]
    shapes = [(1, 512)] if args.quick else [(2, L) for L in lengths]
    only = args.layers.split(",") if args.layers else None
    rounds, calls = (1, 1) if args.quick else (args.rounds, args.calls)
    rows = []
    for B, L in shapes:
        rows += run(B, L, rounds, calls, args.wall, only)
        print_table(f"causal self-attention layer, fp32, E={E}, B={B}, L={L}", [r for r in rows if r["L"] == L])
    print("after:", machine_state())
    if not args.quick:
        write_csv("variants" if only is None else "variants-" + "-".join(n.replace(" ", "_") for n in only), rows)


if __name__ == "__main__":
    main()
