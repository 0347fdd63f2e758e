"""What the decode path's look at its output costs (issue 27, reliability item 2): a masked decode
step (rows of different lengths, ``key_padding``) through ``attention(backend="decode")``, beside
the added check alone (``isfinite(out).all()`` on an output-shaped tensor) and the step whose unused
slots hold NaN (the check fires: the values no row sees zeroed, ``P V`` redone). One run, ratios
to the plain step; the load is printed.

    .venv/bin/python benchmarks/decode_unseen.py
"""

from __future__ import annotations

import torch

import multihead as mh
from common import context, fastest_ms, machine_state, print_table


def main() -> None:
    print(context())
    print(machine_state())
    rows = []
    B, Hq, Hkv, D = 4, 32, 8, 128
    for dtype in (torch.float32, torch.bfloat16):
        for Lk in (4096, 16384):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
            k, v = (torch.randn(B, Hkv, Lk, D, generator=g).to(dtype) for _ in range(2))
            lengths = torch.tensor([Lk, Lk - 100, Lk // 2, Lk - 1])
            mask = mh.key_padding(lengths)
            bad_v = v.clone()
            for b, n in enumerate(lengths.tolist()):
                bad_v[b, :, n:] = float("nan")  # unused slots of the shorter rows
            out = mh.attention(q, k, v, mask=mask, backend="decode")
            assert torch.isfinite(mh.attention(q, k, bad_v, mask=mask, backend="decode")).all()
            torch.testing.assert_close(mh.attention(q, k, bad_v, mask=mask, backend="decode"), out)
            probe = torch.randn(B, Hkv, Hq // Hkv, D)  # a chunk's output (B, Hkv, G·Lq, Dv), fp32

            def step(v=v):
                mh.attention(q, k, v, mask=mask, backend="decode")

            def step_nan(v=bad_v):
                mh.attention(q, k, v, mask=mask, backend="decode")

            def check():
                bool(torch.isfinite(probe).all())

            ms = fastest_ms(
                {"step": step, "check": check, "step, NaN in unused slots": step_nan}, rounds=3, min_run_time=0.3
            )
            rows.append(
                {
                    "dtype": str(dtype).replace("torch.", ""),
                    "Lk": Lk,
                    "step ms": ms["step"],
                    "check ms": ms["check"],
                    "check / step": ms["check"] / ms["step"],
                    "NaN step / step": ms["step, NaN in unused slots"] / ms["step"],
                }
            )
    print_table("decode step with rows of different lengths (B=4, Hq=32, Hkv=8, D=128)", rows)
    print(machine_state())


if __name__ == "__main__":
    main()
