"""fp32 decode steps with two head sizes (``D != Dv``): ``sdpa`` against ``decode``, and what ``auto``
picks. MLA's absorbed step attends with ``V`` the first ``Dv`` features of ``K`` (``D = 576``,
``Dv = 512``, one KV head); the naive step and other ``D != Dv`` layers have their own ``V``.
PyTorch's CPU flash kernel takes one head size, so ``sdpa`` first makes them one (a wider output
over ``v = k``, or ``V`` padded with zeros), while ``decode`` folds the query heads into one matmul
per KV head at any head sizes. One query token, batch 1, forward under ``no_grad``; ``D == Dv``
rows beside them for the rule ``auto`` keeps there. Timed in interleaved rounds (fastest kept,
:func:`common.fastest_ms`), load printed.
"""

from __future__ import annotations

import torch

from common import context, fastest_ms, machine_state, mh, print_table, write_csv

CASES = [  # (Hq, Hkv, D, Dv, V a view of K, Lk)
    (32, 8, 128, 128, False, 8192),
    (16, 1, 512, 512, False, 8192),
    (16, 1, 576, 512, True, 1024),
    (16, 1, 576, 512, True, 8192),
    (16, 1, 576, 512, True, 32768),
    (128, 1, 576, 512, True, 8192),
    (16, 2, 192, 128, False, 8192),
    (16, 16, 192, 128, False, 8192),
]


def main() -> list[dict]:
    print(f"# fp32 decode steps, two head sizes ({context()}); {machine_state()}")
    rows = []
    with torch.no_grad():
        for Hq, Hkv, D, Dv, view, Lk in CASES:
            gen = torch.Generator().manual_seed(Lk + D)
            q, k = torch.randn(1, Hq, 1, D, generator=gen), torch.randn(1, Hkv, Lk, D, generator=gen)
            v = k[..., :Dv] if view else torch.randn(1, Hkv, Lk, Dv, generator=gen)
            fns = {name: (lambda name=name: mh.attention(q, k, v, backend=name)) for name in ("sdpa", "decode")}
            err = float((fns["sdpa"]() - fns["decode"]()).abs().max())
            if not err < 1e-4:
                raise AssertionError(f"sdpa and decode differ by {err:.2e}; not timing a wrong result")
            best = fastest_ms(fns, 3, 0.2)
            rows.append(
                {
                    "Hq": Hq,
                    "Hkv": Hkv,
                    "D": D,
                    "Dv": Dv,
                    "V in K": view,
                    "Lk": Lk,
                    "sdpa_ms": best["sdpa"],
                    "decode / sdpa": best["decode"] / best["sdpa"],
                    "auto": mh.explain(q, k, v).backend,
                }
            )
    print_table("decode / sdpa per fp32 step (fastest of 3 interleaved rounds; one run)", rows)
    print(f"# {machine_state()}")
    write_csv("decode_head_sizes", rows)
    return rows


if __name__ == "__main__":
    main()
