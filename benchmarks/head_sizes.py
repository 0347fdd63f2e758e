"""``Dv != D`` prefill on the ``sdpa`` backend against raw SDPA, which PyTorch's CPU build runs on
the MATH kernel for such shapes (it materializes every score).

Cases, fp32, causal, B=1, L=1024 (``--quick``: 512): MLA absorbed (16 query heads, one latent
"KV head", ``D = 576``, ``Dv = 512``, V the first 512 features of K), MLA naive (16 heads,
``D = 192``, ``Dv = 128``), and a wider V (8 heads, ``D = 64``, ``Dv = 96``). Interleaved rounds,
fastest kept; every pair is checked equal first.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, fastest_ms, machine_state, mh, print_table, write_csv


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    L, rounds = (512, 2) if args.quick else (1024, 3)
    print(f"# Dv != D prefill, L={L}, fp32, causal ({context()}); {machine_state()}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, H, Hkv, D, Dv, prefix in (
        ("MLA absorbed (v = k[..., :512])", 16, 1, 576, 512, True),
        ("MLA naive", 16, 16, 192, 128, False),
        ("wider V", 8, 8, 64, 96, False),
    ):
        q = torch.randn(1, H, L, D, generator=g)
        k = torch.randn(1, Hkv, L, D, generator=g)
        v = k[..., :Dv] if prefix else torch.randn(1, Hkv, L, Dv, generator=g)
        ke, ve = k.expand(1, H, L, D), v.expand(1, H, L, Dv)  # raw SDPA: heads expanded as views
        fns = {
            "raw SDPA (math kernel)": lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True),
            "multihead sdpa": lambda: mh.attention(q, k, v, mask=mh.causal(), backend="sdpa"),
        }
        with torch.no_grad():
            check_close(name, fns["multihead sdpa"](), fns["raw SDPA (math kernel)"](), atol=1e-4)
            ms = fastest_ms(fns, rounds, 0.3)
        rows.append(
            {
                "case": name,
                "raw SDPA ms": ms["raw SDPA (math kernel)"],
                "multihead ms": ms["multihead sdpa"],
                "x raw": ms["raw SDPA (math kernel)"] / ms["multihead sdpa"],
            }
        )
    print_table(f"fastest of {rounds} interleaved rounds; {machine_state()}", rows)
    write_csv("head_sizes" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
