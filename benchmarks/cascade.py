"""Cascade attention: 64 requests sharing a 4096-token prompt, each with its own 64 tokens.

Two shapes, fp32, ``Hq = Hkv = 8``, ``D = 64``:

* **decode**: one new token per request (``Lq = 1``), over prefix + its 64-token suffix;
* **suffix prefill**: the 64 suffix tokens of every request at once (``Lq = 64``, causal).

``cascade_attention`` (queries of all requests against one copy of the prefix, then each against
its suffix, merged by LSE) against ``multihead.attention`` over 64 concatenated copies
``prefix + suffix`` (what a server without prefix sharing holds in its caches: the copies exist
before the step, so building them is not timed). The two must agree (checked). Interleaved
rounds, fastest kept; the ratio is the issue's target (cascade >= 5x the concatenated baseline).
The bytes of K/V each method reads per step are printed beside it.
"""

from __future__ import annotations

import argparse

import torch

from common import check_close, context, fastest_ms, machine_state, mh, print_table, write_csv

REQUESTS, PREFIX, SUFFIX, H, D = 64, 4096, 64, 8, 64


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="prefix 1024, fewer rounds")
    args = parser.parse_args(argv)
    prefix = 1024 if args.quick else PREFIX
    rounds, min_run_time = (2, 0.2) if args.quick else (4, 0.5)
    print(
        f"# cascade: {REQUESTS} requests, shared prefix {prefix}, suffix {SUFFIX}, H={H}, D={D}, fp32 "
        f"({context()}); {machine_state()}"
    )
    g = torch.Generator().manual_seed(0)
    pk, pv = (torch.randn(1, H, prefix, D, generator=g) for _ in range(2))
    k, v = (torch.randn(REQUESTS, H, SUFFIX, D, generator=g) for _ in range(2))
    full_k = torch.cat([pk.expand(REQUESTS, -1, -1, -1), k], dim=2).contiguous()  # the 64 copies, built beforehand
    full_v = torch.cat([pv.expand(REQUESTS, -1, -1, -1), v], dim=2).contiguous()
    rows = []
    for shape, Lq in (("decode", 1), ("suffix prefill", SUFFIX)):
        q = torch.randn(REQUESTS, H, Lq, D, generator=g)
        causal = mh.causal()
        fns = {
            "cascade": lambda: mh.cascade_attention(q, pk, pv, k, v, mask=causal),
            "concatenated": lambda: mh.attention(q, full_k, full_v, mask=causal),
        }
        check_close(f"cascade {shape}", fns["cascade"](), fns["concatenated"](), atol=1e-4)
        with torch.no_grad():
            ms = fastest_ms(fns, rounds, min_run_time)
        kv_bytes = {
            "cascade": (pk.numel() + pv.numel() + k.numel() + v.numel()) * 4,
            "concatenated": (full_k.numel() + full_v.numel()) * 4,
        }
        for name in fns:
            rows.append(
                {
                    "shape": shape,
                    "method": name,
                    "ms": ms[name],
                    "K/V MB read": kv_bytes[name] / 2**20,
                    "x concatenated": ms["concatenated"] / ms[name],
                }
            )
    print_table(f"fastest of {rounds} interleaved rounds; {machine_state()}", rows)
    write_csv("cascade" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
