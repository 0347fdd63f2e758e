"""The attention variants' cost next to the plain layer: gated and differential attention.

One causal self-attention layer, fp32, ``d_model=768``, in one process on the same input
(``B, L`` from the command line). Contenders:

* ``plain``: :class:`multihead.MultiHeadAttention` with 12 heads of 64;
* ``gated elementwise`` / ``gated headwise``: :class:`multihead.GatedAttention`, the same layer
  with a gate projection ``768 -> 768`` (or ``768 -> 12``) and the sigmoid gate before ``out_proj``;
* ``differential``: :class:`multihead.DifferentialAttention` with 6 heads of 128 (two maps of 64
  per head), the paper's way of keeping the parameters of the 12-head layer: the same projections,
  two attention calls with keys of 64 and values of 128, the per-head RMSNorm;
* ``differential 12x64``: 12 heads of 64 (maps of 32), the same arithmetic in smaller pieces.

Targets (issue 31): gated <= 1.15x and differential <= 2.1x the plain layer, forward and
forward+backward. Each contender is first checked against its own float64 copy (BENCHMARKS.md
rule 1); then they run in interleaved rounds keeping each one's fastest
(:func:`common.fastest_ms`). The load average is printed before and after: on the shared
machine the absolute times move, the ratios in one run are what the docs quote.

    python benchmarks/variants.py            # B=2, L=1024 and L=2048
    python benchmarks/variants.py --quick    # B=1, L=512: a smoke run
"""

from __future__ import annotations

import argparse
import copy

import torch

from common import check_close, context, fastest_ms, machine_state, mh, print_table, write_csv

E = 768


def contenders() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "plain": mh.MultiHeadAttention(E, 12, causal=True),
        "gated elementwise": mh.GatedAttention(E, 12, causal=True),
        "gated headwise": mh.GatedAttention(E, 12, gate="headwise", causal=True),
        "differential": mh.DifferentialAttention(E, 6, causal=True, depth=2),
        "differential 12x64": mh.DifferentialAttention(E, 12, causal=True, depth=2),
    }


def check(layers: dict[str, torch.nn.Module], x: torch.Tensor) -> None:
    """Each layer in fp32 against a float64 copy of itself on the same input."""
    with torch.no_grad():
        for name, layer in layers.items():
            check_close(name, layer(x), copy.deepcopy(layer).double()(x.double()), atol=1e-4)


def run(B: int, L: int, rounds: int, min_run_time: float) -> list[dict]:
    layers = contenders()
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
    best = fastest_ms(fns, rounds, min_run_time)
    rows = []
    for (name, kind), ms in best.items():
        plain = best[("plain", kind)]
        rows.append({"B": B, "L": L, "layer": name, "pass": kind, "ms": ms, "x plain": ms / plain})
    return sorted(rows, key=lambda r: (r["pass"], list(layers).index(r["layer"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=1, L=512, one round: a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    shapes = [(1, 512)] if args.quick else [(2, 1024), (2, 2048)]
    rounds, min_run_time = (1, 0.1) if args.quick else (args.rounds, 0.5)
    rows = []
    for B, L in shapes:
        rows += run(B, L, rounds, min_run_time)
        print_table(f"causal self-attention layer, fp32, E={E}, B={B}, L={L}", [r for r in rows if r["L"] == L])
    print("after:", machine_state())
    if not args.quick:
        write_csv("variants", rows)


if __name__ == "__main__":
    main()
