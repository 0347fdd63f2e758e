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

import torch

from common import check_layers, context, cpu_ms, fastest_ms, layer_passes, machine_state, mh, print_table, write_csv

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


def run(B: int, L: int, rounds: int, calls: int, wall: bool, only: list[str] | None = None) -> list[dict]:
    layers = {name: layer for name, layer in contenders().items() if not only or name in only or name == "plain"}
    x = torch.randn(B, L, E)
    check_layers(layers, x)
    fns = layer_passes(layers, x)
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
