"""A layer's three input projections on the CPU without gradients: run apart (what
``MultiHeadAttention`` does, ``multihead/layers/projection.py``), joined on every call from the
parameters (one ``torch.cat`` of the weights, then one matmul: never stale), and joined once
beforehand (what a hand-fused ``qkv`` layer holds: one ``E -> 3E`` weight).

``E = 512`` (the ``dtypes.py`` layer's ``H·D``), tokens ``n = B·L`` in 1 (a decoding step) to 2048,
fp32 / bf16 / fp16, with biases. Each case is timed in interleaved rounds keeping its fastest
(:func:`common.fastest_ms`); the ratios to "apart" are the result, with the load printed. What it
answers: how much of the layer's gap to the hand-fused one at ``B=2, L=256`` (``n = 512``) is its
three matmuls, and whether joining per call would close it at every ``n``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import context, fastest_ms, machine_state, print_table, write_csv

E = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="n in {1, 512}, shorter rounds")
    args = parser.parse_args(argv)
    tokens = [1, 512] if args.quick else [1, 16, 128, 512, 2048]
    rounds, min_run_time = (3, 0.1) if args.quick else (5, 0.2)
    print(f"# q/k/v projections apart, joined per call, joined once: E={E}, no_grad  ({context()})")
    print(f"# {machine_state()}")
    rows = []
    with torch.no_grad():
        for name, dtype in DTYPES.items():
            gen = torch.Generator().manual_seed(0)
            weights = [torch.randn(E, E, generator=gen).to(dtype) for _ in range(3)]
            biases = [torch.randn(E, generator=gen).to(dtype) for _ in range(3)]
            joined_w, joined_b = torch.cat(weights), torch.cat(biases)
            for n in tokens:
                x = torch.randn(n, E, generator=gen).to(dtype)
                apart = lambda: [F.linear(x, w, b) for w, b in zip(weights, biases)]  # noqa: E731
                per_call = lambda: F.linear(x, torch.cat(weights), torch.cat(biases))  # noqa: E731
                once = lambda: F.linear(x, joined_w, joined_b)  # noqa: E731
                torch.testing.assert_close(per_call(), torch.cat(apart(), dim=-1))
                best = fastest_ms({apart: apart, per_call: per_call, once: once}, rounds, min_run_time)
                rows.append(
                    {
                        "dtype": name,
                        "tokens": n,
                        "apart_ms": best[apart],
                        "joined per call / apart": best[per_call] / best[apart],
                        "joined once / apart": best[once] / best[apart],
                        "torch": torch.__version__,
                    }
                )
    print_table("q/k/v projections (fastest of interleaved rounds; ratios from one run)", rows)
    print(f"# {machine_state()}")
    write_csv("projections" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
