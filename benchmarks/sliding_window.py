"""Sliding window: multihead (auto -> blocksparse) vs SDPA with a dense boolean mask.

B=1, H=8, D=64, fp32, forward. Time should grow linearly in L at a fixed window for multihead
and quadratically for the dense mask. ``--quick``: L in {4096, 16384}, window 512 only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, mh, plot, print_table, time_ms, used_backend, write_csv


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    lengths = [4096, 16384] if args.quick else [4096, 8192, 16384, 32768]
    windows = [512] if args.quick else [256, 512, 1024]
    print(f"# sliding window  ({context()})")
    rows = []
    for window in windows:
        for L in lengths:
            gen = torch.Generator().manual_seed(L)
            q, k, v = (torch.randn(1, 8, L, 64, generator=gen) for _ in range(3))
            mask = mh.sliding_window(window)
            ours = lambda: mh.attention(q, k, v, mask=mask)  # noqa: E731
            dense_ok = L <= 16384  # at 32k the dense bool mask alone is 1 GiB and SDPA's math path far more
            row = {"window": window, "L": L, "backend": used_backend(q, k, v, mask=mask)}
            if dense_ok:
                dense = mask.materialize(1, 8, L, L)  # (1, 1, L, L) bool
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
                rows_checked = slice(0, 2048)
                check_close(f"window {window} L {L}", ours()[:, :, rows_checked], sdpa()[:, :, rows_checked])
                t_dense = time_ms(sdpa, 0.3)
            else:
                t_dense = float("nan")
            t_ours = time_ms(ours)
            row.update({"multihead_ms": t_ours, "sdpa_dense_mask_ms": t_dense, "speedup": t_dense / t_ours,
                        "ms_per_1k_tokens": t_ours / (L / 1024)})
            rows.append(row)
            print(row, flush=True)
    print_table("sliding window, all", rows)
    write_csv("sliding_window" + ("_quick" if args.quick else ""), rows)
    if not args.quick:
        series = {}
        for window in windows:
            sel = [r for r in rows if r["window"] == window]
            series[f"multihead, window {window}"] = ([r["L"] for r in sel], [r["multihead_ms"] for r in sel])
        sel = [r for r in rows if r["window"] == 512 and r["sdpa_dense_mask_ms"] == r["sdpa_dense_mask_ms"]]
        series["SDPA + dense bool mask, window 512"] = ([r["L"] for r in sel], [r["sdpa_dense_mask_ms"] for r in sel])
        plot("sliding_window", "Sliding window, B=1 H=8 D=64 fp32 forward", "L", "ms", series)
    return rows


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short version for make bench-quick")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
