"""``multihead.attention`` against the raw SDPA call it issues, in every dtype: what the path around
the kernel costs, with the non-finite rules off (the default) and on (``check_finite=True``); and
``MultiHeadAttention`` against the hand-fused layer (one ``E -> 3E`` linear, SDPA, the output
linear) with the same weights, ``E = H·D``, no mask and ``causal=True``.

``attention(q, k, v, mask=m)`` beside ``F.scaled_dot_product_attention(q, k, v, is_causal=...)``,
B=2, H=8, D=64, forward under ``torch.no_grad``, fp32 / bf16 / fp16, no mask and ``causal()``,
L = 256, 1024, 4096 (``--quick``: 256 and 1024). Each pair is timed in interleaved rounds keeping
its fastest (:func:`common.fastest_ms`), so both see the same machine; the ratios are the result,
with the load printed. The machine's ceilings are measured in the same run (memory read bandwidth,
fp32 and bf16 matmul GFLOP/s) and the kernel's rate is given as a fraction of the matmul peak of
its dtype.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, fastest_ms, machine_state, memory_read_gbps, mh, print_table, write_csv

B, H, D = 2, 8, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_gflops(dtype: torch.dtype, n: int = 1024, min_run_time: float = 0.3) -> float:
    """The machine's matmul rate in ``dtype`` (an ``n x n`` product, fastest of three rounds)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    fn = lambda: torch.mm(a, b)  # noqa: E731
    return 2 * n**3 / (fastest_ms({fn: fn}, 3, min_run_time)[fn] * 1e-3) / 1e9


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="L in {256, 1024}, shorter rounds")
    args = parser.parse_args(argv)
    lengths = [256, 1024] if args.quick else [256, 1024, 4096]
    rounds, min_run_time = (3, 0.1) if args.quick else (5, 0.2)
    peaks = {name: matmul_gflops(dtype) for name, dtype in DTYPES.items() if name != "fp16"}
    print(f"# attention() vs raw SDPA by dtype: B={B} H={H} D={D}, forward, no_grad  ({context()})")
    print(
        f"# ceilings measured now: memory read {memory_read_gbps():.1f} GB/s, matmul fp32 {peaks['fp32']:.0f} "
        f"GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s; {machine_state()}"
    )
    rows = []
    with torch.no_grad():
        for name, dtype in DTYPES.items():
            for causal in (False, True):
                for L in lengths:
                    gen = torch.Generator().manual_seed(L)
                    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(3))
                    mask = mh.causal() if causal else None
                    ours = lambda: mh.attention(q, k, v, mask=mask)  # noqa: E731
                    checked = lambda: mh.attention(q, k, v, mask=mask, check_finite=True)  # noqa: E731
                    raw = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                    atol = 2e-4 if dtype == torch.float32 else 2e-2
                    check_close(f"{name} L={L} causal={causal}", ours().float(), raw().float(), atol=atol)
                    best = fastest_ms({ours: ours, checked: checked, raw: raw}, rounds, min_run_time)
                    flops = 4 * B * H * L * L * D / (2 if causal else 1)
                    peak = peaks.get(name)
                    rows.append(
                        {
                            "dtype": name,
                            "mask": "causal" if causal else "none",
                            "L": L,
                            "raw_ms": best[raw],
                            "/ raw": best[ours] / best[raw],
                            "check_finite / raw": best[checked] / best[raw],
                            "raw_of_matmul_peak": flops / (best[raw] * 1e-3) / 1e9 / peak if peak else float("nan"),
                            "torch": torch.__version__,
                        }
                    )
    print_table(
        "attention() / raw SDPA, default and check_finite=True (fastest of interleaved rounds; ratios from one run)",
        rows,
    )
    layer_rows = layers(lengths, rounds, min_run_time)
    print_table("MultiHeadAttention / the hand-fused layer (fastest of interleaved rounds; one run)", layer_rows)
    print(f"# {machine_state()}")
    suffix = "_quick" if args.quick else ""
    write_csv("dtypes" + suffix, rows)
    write_csv("dtypes_layer" + suffix, layer_rows)
    return rows + layer_rows


class Fused(torch.nn.Module):
    """The layer written by hand, as fused as it gets: one ``E -> 3E`` linear, heads as views, SDPA."""

    def __init__(self, layer: mh.MultiHeadAttention):
        super().__init__()
        E, self.H, self.causal = layer.d_model, layer.num_heads, layer.causal
        self.qkv = torch.nn.Linear(E, 3 * E).to(layer.q_proj.weight.dtype)
        self.out = layer.out_proj
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
            self.qkv.bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))

    def forward(self, x):
        Bx, L, E = x.shape
        q, k, v = self.qkv(x).view(Bx, L, 3, self.H, E // self.H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, L, D)
        return self.out(y.transpose(1, 2).reshape(Bx, L, E))


def layers(lengths: list[int], rounds: int, min_run_time: float) -> list[dict]:
    """``MultiHeadAttention`` against :class:`Fused`, forward under ``no_grad``, each dtype and mask."""
    rows = []
    with torch.no_grad():
        for name, dtype in DTYPES.items():
            for causal in (False, True):
                torch.manual_seed(0)
                layer = mh.MultiHeadAttention(H * D, H, causal=causal).to(dtype).eval()
                fused = Fused(layer).eval()
                for L in lengths:
                    x = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(L)).to(dtype)
                    ours = lambda: layer(x)  # noqa: E731
                    hand = lambda: fused(x)  # noqa: E731
                    atol = 2e-3 if dtype == torch.float32 else 5e-2
                    check_close(f"layer {name} L={L} causal={causal}", ours().float(), hand().float(), atol=atol)
                    best = fastest_ms({ours: ours, hand: hand}, rounds, min_run_time)
                    rows.append(
                        {
                            "dtype": name,
                            "mask": "causal" if causal else "none",
                            "L": L,
                            "fused_ms": best[hand],
                            "layer / fused": best[ours] / best[hand],
                            "torch": torch.__version__,
                        }
                    )
    return rows


if __name__ == "__main__":
    main()
