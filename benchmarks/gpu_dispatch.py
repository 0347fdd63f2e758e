"""The CUDA dispatch table, measured: for structured masks, ``sdpa`` (one fused kernel over a dense
``Lq x Lk`` boolean mask) against ``flex`` (compiled FlexAttention over a cached ``BlockMask``,
cost proportional to the visible blocks), both through :func:`multihead.attention`.

CUDA only. ``auto`` on CUDA sends a structured mask to ``flex`` from the sizes this table says
flex wins (``multihead.backends.flex.CUDA_MIN_WORK`` and ``CUDA_MIN_WORK_BAND``); the rows
printed here are the evidence. Every config: B=1, H=16, D=128, bf16, self-attention; forward, and forward+backward
at the middle length. Masks: sliding window 1024 (causal), packed documents of 2048 tokens
(causal within each), key padding to half the keys, and dense causal (which ``sdpa`` runs with
``is_causal`` on cuDNN/flash: the bar every structured mask is measured against, per visible
FLOP). Times: ``triton.testing.do_bench`` medians; the first flex call's compile time is
reported apart.

    python benchmarks/gpu_dispatch.py            # about 3 minutes on an H100, compiles included
    python benchmarks/gpu_dispatch.py --lengths 2048 8192
"""

from __future__ import annotations

import argparse
import time

import torch

from common import mh, print_table, write_csv

H, D = 16, 128


def _masks(L: int, device: str) -> dict:
    ids = (torch.arange(L, device=device) // 2048).unsqueeze(0)
    return {
        "causal": mh.causal(),
        "window_1024": mh.sliding_window(1024),
        "documents_2k": mh.document_causal(ids, ids),
        "padding_half": mh.key_padding(torch.tensor([L // 2], device=device)),
    }


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _visible(mask, L: int, device: str) -> int:
    return int(mask.materialize(1, H, L, L, device=device).expand(1, H, L, L)[0, 0].sum())


def _row(name: str, mask, L: int, passes: str, device: str) -> list[dict]:
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, H, L, D, device=device, dtype=torch.bfloat16, requires_grad=passes != "fwd") for _ in "qkv"
    )
    grad = torch.randn_like(q)
    visible = _visible(mask, L, device)
    flops = 4 * H * D * visible * (1.0 if passes == "fwd" else 3.5)
    rows = []
    outs = {}
    for backend in ("sdpa", "flex"):

        def step(backend=backend):
            out = mh.attention(q, k, v, mask=mask, backend=backend)
            if passes != "fwd":
                out.backward(grad)
            return out

        started = time.perf_counter()
        try:
            outs[backend] = step().detach().float()
        except Exception as exc:  # a refusal or a kernel error: reported, not fatal
            rows.append({"mask": name, "L": L, "passes": passes, "backend": backend, "error": str(exc)[:120]})
            continue
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        ms = _bench(step)
        rows.append(
            {
                "mask": name,
                "L": L,
                "passes": passes,
                "backend": backend,
                "visible_fraction": visible / (L * L),
                "ms": ms,
                "tflops_per_visible": flops / (ms * 1e-3) / 1e12,
                "first_call_s": first_s,
            }
        )
    if len(outs) == 2:
        err = float((outs["sdpa"] - outs["flex"]).abs().max())
        scale = float(outs["sdpa"].abs().max())
        if not err <= 0.05 * scale + 1e-2:
            raise AssertionError(f"{name} L={L}: flex and sdpa differ by {err:.3g} (outputs up to {scale:.3g})")
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_dispatch.py measures the CUDA dispatch table: no CUDA device here")
    torch._dynamo.config.recompile_limit = 256  # one compile per (mask, length, pass) here, by design
    print(f"# CUDA dispatch table: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    middle = args.lengths[len(args.lengths) // 2]
    for L in args.lengths:
        for name, mask in _masks(L, "cuda").items():
            for passes in ("fwd",) + (("fwd+bwd",) if L == middle else ()):
                try:
                    got = _row(name, mask, L, passes, "cuda")
                    rows += got
                    for r in got:
                        print("  ", {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                except Exception as exc:
                    print(f"{name} L={L} {passes}: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.empty_cache()
            print(f"done {L}", flush=True)
    ok = [r for r in rows if "ms" in r]
    for r in ok:
        same = [s for s in ok if (s["mask"], s["L"], s["passes"]) == (r["mask"], r["L"], r["passes"])]
        best = min(s["ms"] for s in same)
        r["vs_best"] = r["ms"] / best
        dense = [
            s for s in ok if (s["mask"], s["L"], s["passes"], s["backend"]) == ("causal", r["L"], r["passes"], "sdpa")
        ]
        r["vs_dense_causal"] = r["tflops_per_visible"] / dense[0]["tflops_per_visible"] if dense else float("nan")
    keys = list(dict.fromkeys(key for r in rows for key in r))
    rows = [{key: r.get(key, "") for key in keys} for r in rows]
    print_table("CUDA dispatch: sdpa (dense mask) vs flex (block mask), time and TFLOP/s per visible FLOP", rows)
    if rows:
        write_csv("gpu_dispatch", [{"gpu": torch.cuda.get_device_name(), **r} for r in rows])
    return rows


if __name__ == "__main__":
    main()
