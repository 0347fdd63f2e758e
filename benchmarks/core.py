"""Core sweep: B=1, H=8, D=64, fp32 forward, L from 128 to 8192, causal and not.

Contenders on the same inputs: ``multihead.attention`` (auto), raw ``F.scaled_dot_product_attention``,
and the math path (``multihead.reference_attention`` in fp32, the plain matmul-softmax-matmul).
GFLOP/s with the FlashAttention count ``4*B*H*L^2*D`` (halved when causal).
``--quick``: L in {512, 2048}.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, gflops, mh, plot, print_table, time_ms, used_backend, write_csv


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="write the plot to docs/img/core.png (default: benchmarks/results/core.png)",
    )
    args = parser.parse_args(argv)
    lengths = [512, 2048] if args.quick else [128, 256, 512, 1024, 2048, 4096, 8192]
    print(f"# core sweep  ({context()})")
    rows = []
    for causal in (False, True):
        for L in lengths:
            gen = torch.Generator().manual_seed(L)
            q, k, v = (torch.randn(1, 8, L, 64, generator=gen) for _ in range(3))
            mask = mh.causal() if causal else None
            ours = lambda: mh.attention(q, k, v, mask=mask)  # noqa: E731
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            math = lambda: mh.reference_attention(q, k, v, mask=mask).output  # noqa: E731
            check_close(f"L={L} causal={causal} vs sdpa", ours(), sdpa())
            run_math = L <= 4096
            if run_math:
                check_close(f"L={L} causal={causal} vs math", ours(), math())
            t_ours, t_sdpa = time_ms(ours), time_ms(sdpa)
            t_math = time_ms(math, 0.3) if run_math else float("nan")
            flops = 4 * 8 * L * L * 64 / (2 if causal else 1)
            rows.append(
                {
                    "causal": causal,
                    "L": L,
                    "backend": used_backend(q, k, v, mask=mask),
                    "multihead_ms": t_ours,
                    "sdpa_ms": t_sdpa,
                    "math_ms": t_math,
                    "multihead/sdpa": t_ours / t_sdpa,
                    "math/multihead": t_math / t_ours,
                    "multihead_GFLOPs": gflops(flops, t_ours),
                }
            )
            print(rows[-1], flush=True)
    print_table("core sweep (ratio multihead/sdpa: 1.00 = same speed)", rows)
    write_csv("core" + ("_quick" if args.quick else ""), rows)
    if not args.quick:
        series = {}
        for causal in (False, True):
            sel = [r for r in rows if r["causal"] == causal]
            tag = "causal" if causal else "dense"
            series[f"multihead auto, {tag}"] = ([r["L"] for r in sel], [r["multihead_GFLOPs"] for r in sel])
            series[f"math path, {tag}"] = (
                [r["L"] for r in sel if r["math_ms"] == r["math_ms"]],
                [
                    gflops(4 * 8 * r["L"] ** 2 * 64 / (2 if causal else 1), r["math_ms"])
                    for r in sel
                    if r["math_ms"] == r["math_ms"]
                ],
            )
        plot(
            "core",
            "Core sweep, B=1 H=8 D=64 fp32 forward",
            "L",
            "GFLOP/s",
            series,
            logy=False,
            update_docs=args.update_docs,
        )
    return rows


if __name__ == "__main__":
    main()
