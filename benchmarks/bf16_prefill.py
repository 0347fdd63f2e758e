"""bf16 prefill on the CPU (issue 29, item 5): where SDPA's bf16 kernel stands against the machine's
bf16 matmul ceiling, whether a blockwise path of PyTorch ops (AMX matmuls, the softmax in fp32)
beats it, and ``attention()`` (``auto``) against the raw SDPA call.

Cases: B=1, H=8, forward under ``no_grad``, bf16, D = 64 and 128, no mask and causal, L = 1024 and
4096 (``--quick``: L = 1024, D = 64). Contenders, timed in interleaved rounds (fastest kept,
:func:`common.fastest_ms`):

* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` (PyTorch's CPU flash kernel);
* ``auto``: ``multihead.attention(q, k, v, mask=causal() or None)``;
* ``blockwise b``: each block of ``b`` queries (b = 128 and 512) against every key it may see, all
  heads in one batched product: ``S = q_b kᵀ`` (a bf16 matmul: AMX, bf16 scores, as PyTorch's CPU
  matmuls return), the scale, the causal diagonal block and the softmax in fp32, ``P`` back to bf16
  and ``P v``. No online softmax: a block's scores fit the cache at b = 128 (8 heads x 128 x 4096
  fp32 is 16 MiB; at b = 512, 64 MiB), and every score is visited once.

Printed per case: the kernel's rate (``4·B·H·L²·D`` flops, half with causal) as a fraction of the
bf16 matmul peak measured in the same run, each contender's time over SDPA's, and the blockwise
path's largest difference from SDPA. The load average is printed before and after.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import context, fastest_ms, machine_state, mh, print_table, write_csv
from dtypes import matmul_gflops

B, H = 1, 8


def blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block: int) -> torch.Tensor:
    """Attention a block of queries at a time: bf16 matmuls, the softmax in fp32 (see the module)."""
    L, D = q.shape[2], q.shape[3]
    scale = D**-0.5
    out = torch.empty_like(q)
    kt = k.transpose(-1, -2)
    for s in range(0, L, block):
        e = min(s + block, L)
        end = e if causal else L  # the keys this block may see
        scores = torch.matmul(q[:, :, s:e], kt[..., :end]).float().mul_(scale)  # (B, H, b, end)
        if causal:  # only the diagonal block is partial
            diag = torch.ones(e - s, e - s, dtype=torch.bool).triu_(1)
            scores[..., s:end].masked_fill_(diag, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[:, :, s:e] = torch.matmul(probs, v[:, :, :end])
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="L = 1024, D = 64, shorter rounds")
    args = parser.parse_args(argv)
    lengths, dims = ([1024], [64]) if args.quick else ([1024, 4096], [64, 128])
    rounds, min_run_time = (2, 0.1) if args.quick else (3, 0.2)
    peak = matmul_gflops(torch.bfloat16, 2048)
    print(f"# bf16 prefill: B={B} H={H}, forward, no_grad  ({context()})")
    print(f"# bf16 matmul peak measured now: {peak:.0f} GFLOP/s; {machine_state()}")
    rows = []
    with torch.no_grad():
        for D in dims:
            for causal in (False, True):
                for L in lengths:
                    gen = torch.Generator().manual_seed(L + D)
                    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(torch.bfloat16) for _ in range(3))
                    mask = mh.causal() if causal else None
                    fns = {
                        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                        "auto": lambda: mh.attention(q, k, v, mask=mask),
                        "blockwise 128": lambda: blockwise(q, k, v, causal, 128),
                        "blockwise 512": lambda: blockwise(q, k, v, causal, 512),
                    }
                    want = fns["sdpa"]().float()
                    err = max(float((fns[n]().float() - want).abs().max()) for n in ("blockwise 128", "auto"))
                    best = fastest_ms(fns, rounds, min_run_time)
                    flops = 4 * B * H * L * L * D / (2 if causal else 1)
                    rate = flops / (best["sdpa"] * 1e-3) / 1e9
                    rows.append(
                        {
                            "D": D,
                            "mask": "causal" if causal else "none",
                            "L": L,
                            "sdpa_ms": best["sdpa"],
                            "sdpa_of_bf16_peak": rate / peak,
                            "auto / sdpa": best["auto"] / best["sdpa"],
                            "blockwise128 / sdpa": best["blockwise 128"] / best["sdpa"],
                            "blockwise512 / sdpa": best["blockwise 512"] / best["sdpa"],
                            "max_abs_diff": err,
                        }
                    )
    print_table("bf16 prefill: time / SDPA's (fastest of interleaved rounds; one run)", rows)
    print(f"# {machine_state()}")
    write_csv("bf16_prefill" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
