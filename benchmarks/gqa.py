"""GQA / MQA: Hq=32, Hkv in {32, 8, 1}, B=1, L=2048 (1024 with --quick), D=64, fp32, causal
forward. multihead auto vs raw SDPA (enable_gqa=True) vs SDPA on K/V repeated to Hq heads."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, mh, print_table, time_ms, used_backend, write_csv


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    L = 1024 if args.quick else 2048
    print(f"# GQA/MQA  ({context()})")
    rows = []
    for window in (None, 256):
        for Hkv in (32, 8, 1):
            gen = torch.Generator().manual_seed(Hkv)
            q = torch.randn(1, 32, L, 64, generator=gen)
            k, v = (torch.randn(1, Hkv, L, 64, generator=gen) for _ in range(2))
            mask = mh.causal() if window is None else mh.sliding_window(window)
            ours = lambda: mh.attention(q, k, v, mask=mask)  # noqa: E731
            dense = None if window is None else mask.materialize(1, 32, L, L)
            native = lambda: F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=dense,
                is_causal=dense is None,  # noqa: E731
                enable_gqa=True,
            )
            rep = lambda: F.scaled_dot_product_attention(  # noqa: E731
                q,
                k.repeat_interleave(32 // Hkv, 1),
                v.repeat_interleave(32 // Hkv, 1),
                attn_mask=dense,
                is_causal=dense is None,
            )
            check_close(f"Hkv={Hkv}", ours(), native())
            check_close(f"Hkv={Hkv} repeat", ours(), rep())
            t_ours, t_native, t_rep = time_ms(ours), time_ms(native), time_ms(rep)
            rows.append(
                {
                    "mask": "causal" if window is None else f"window {window}",
                    "Hq": 32,
                    "Hkv": Hkv,
                    "L": L,
                    "backend": used_backend(q, k, v, mask=mask),
                    "multihead_ms": t_ours,
                    "sdpa_enable_gqa_ms": t_native,
                    "sdpa_repeat_kv_ms": t_rep,
                    "multihead/sdpa_gqa": t_ours / t_native,
                }
            )
            print(rows[-1], flush=True)
    print_table("GQA / MQA", rows)
    write_csv("gqa" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
