"""Multi-head latent attention: cache bytes per token, and one decode step at caches of 4k-32k tokens.

Layer dims like DeepSeek-V2-Lite, scaled to this CPU: ``d_model=2048``, 16 heads,
``kv_lora_rank=512``, ``qk_rope_head_dim=64``, ``qk_nope_head_dim=128``, ``v_head_dim=128``, no
query latent; fp32, batch 1, one new token per step. Contenders, on caches of the same length:

* ``MLA absorbed``: :class:`multihead.MultiHeadLatentAttention` with ``mode="absorbed"`` over a
  :class:`multihead.LatentKVCache` (MQA over the latent rows, ``D = 576, Dv = 512``);
* ``MLA naive``: the same layer and cache with ``mode="naive"``: every step up-projects every
  cached latent to per-head K/V (``16 · (128 + 64 + 128)`` floats per token) and runs MHA;
* ``GQA``: :class:`multihead.MultiHeadAttention` with the same ``d_model``, 16 query heads of 128,
  8 KV heads, RoPE, no biases, over a ``DynamicKVCache``.

Every step runs the whole layer (projections, RoPE, cache write, attention, output projection);
the cache is cropped back after each step so every timed call sees the same length. Before
timing, each contender is checked against a float64 copy of itself on the same cache, and naive
against absorbed (BENCHMARKS.md rule 1). Contenders run in interleaved rounds keeping each one's
fastest (:func:`common.fastest_ms`); the load average is printed before and after.

"cache MB read" is what the step reads from the cache (``S`` tokens times the bytes per cached
token); naive mode in addition builds (writes, then reads) ``K/V built MB`` of up-projected keys
and values per step.

The absorbed step against the machine's ceilings (issue 29, item 4), measured in the same run:
the bytes it must read (every weight of the layer once, ``W_UK`` and ``W_UV`` included, and the
latent cache) over its time, as a fraction of the memory read bandwidth; and its flops (two per
weight, ``2·H·S·(C + R)`` for the scores, ``2·H·S·C`` for the values) over its time, as a
fraction of the fp32 matmul peak. The step reads about 8 bytes per flop's worth of matmul work
less than the peak needs (``H = 16`` query heads share each latent row), so it is memory-bound:
the fraction of the read bandwidth is its measure.

``--ceilings`` times only the absorbed step, in fp32 and bf16, at caches of 4k and 32k tokens: the
whole layer step, its attention call alone (``attention()``), and that attention as two ``torch.mm``
in the cache's dtype (the GEMM library's rate on the same call), each against the read bandwidth and the matmul peak
of its dtype (a 2048³ ``torch.mm``: fp32, and bf16 on AMX where the CPU has it), all measured in
the same run (the read bandwidth and the peaks as contenders of the same interleaved rounds), with
the backend and kernel each runs on (``explain``).
"""

from __future__ import annotations

import argparse

import torch

from common import (
    GEMMS_BACKEND,
    check_close,
    context,
    fastest_ms,
    last_level_cache_bytes,
    machine_state,
    memory_read_gbps,
    mh,
    print_table,
    torch_gemms_backend,
    write_csv,
)
from dtypes import matmul_gflops
from multihead.positions import RotaryEmbedding

E, H, C, R, N, V = 2048, 16, 512, 64, 128, 128  # d_model, heads, kv_lora_rank, rope, nope, v
GQA_KV_HEADS, HEAD_DIM = 8, E // H


def cache_bytes_per_token(
    d_model: int = E,
    num_heads: int = H,
    *,
    kv_lora_rank: int = C,
    rope_dim: int = R,
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Bytes one token takes in one layer's cache (one sequence), for MHA, GQA (8 KV heads), MQA
    of head dim ``d_model // num_heads`` and MLA, each measured from a real cache after a prefill
    and checked against its formula (``2 · Hkv · D`` and ``C + R`` elements)."""
    T, size = 64, torch.empty((), dtype=dtype).element_size()
    x = torch.randn(1, T, d_model, dtype=dtype)
    rows = []
    with torch.no_grad():
        for name, kv_heads in (("MHA", num_heads), (f"GQA ({GQA_KV_HEADS} KV heads)", GQA_KV_HEADS), ("MQA", 1)):
            cache = mh.DynamicKVCache(capacity=T)
            mh.MultiHeadAttention(d_model, num_heads, num_kv_heads=kv_heads, causal=True, dtype=dtype)(
                x, kv_cache=cache
            )
            rows.append({"layer": name, "elements": 2 * kv_heads * (d_model // num_heads), "bytes": cache.nbytes // T})
        mla = _mla(d_model, num_heads, dtype=dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
        cache = mh.LatentKVCache(capacity=T)
        mla(x, kv_cache=cache)
        rows.append({"layer": "MLA", "elements": kv_lora_rank + rope_dim, "bytes": cache.nbytes // T})
    mla_bytes = rows[-1]["bytes"]
    for row in rows:
        if row["bytes"] != row["elements"] * size:
            raise AssertionError(
                f"{row['layer']}: the cache holds {row['bytes']} bytes per token, the formula "
                f"says {row['elements'] * size}"
            )
        row["bf16 bytes"] = row["elements"] * 2
        row["x MLA"] = row["bytes"] / mla_bytes
    return rows


def _mla(d_model=E, num_heads=H, *, dtype=torch.float32, kv_lora_rank=C, rope_dim=R):
    return MLA(
        d_model,
        num_heads,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=N,
        qk_rope_head_dim=rope_dim,
        v_head_dim=V,
        dtype=dtype,
    ).eval()


MLA = mh.MultiHeadLatentAttention


def _filled(layer, S: int, capacity: int, gen) -> mh.KVCache:
    """A cache of ``S`` tokens for ``layer`` (random contents of the right scale; filling it by a
    real prefill would cost more than the whole benchmark)."""
    if isinstance(layer, MLA):
        latent = layer.kv_a_layernorm(torch.randn(1, 1, S, C, generator=gen))  # normalised, as stored
        rows = torch.cat([latent, torch.randn(1, 1, S, R, generator=gen)], -1)  # (1, 1, S, C + R)
        cache = mh.LatentKVCache(capacity=capacity)
        cache.update(rows, rows[..., :C])
        return cache
    cache = mh.DynamicKVCache(capacity=capacity)
    cache.update(
        torch.randn(1, GQA_KV_HEADS, S, HEAD_DIM, generator=gen),
        torch.randn(1, GQA_KV_HEADS, S, HEAD_DIM, generator=gen),
    )
    return cache


def _copy64(cache: mh.KVCache, dtype: torch.dtype = torch.float64) -> mh.KVCache:
    """A copy of a filled cache in ``dtype`` (float64: for the check against the float64 layer)."""
    if isinstance(cache, mh.LatentKVCache):
        copy = mh.LatentKVCache(capacity=cache.length + 1)
        rows = cache.keys.to(dtype)
        copy.update(rows, rows[..., :C])
        return copy
    copy = mh.DynamicKVCache(capacity=cache.length + 1)
    copy.update(cache.keys.double(), cache.values.double())
    return copy


def _step(layer, x, cache, S: int, mode: str | None = None):
    def run():
        if mode is not None:
            layer.mode = mode
        out = layer(x, kv_cache=cache)
        cache.crop(S)  # the next timed call sees the same S tokens
        return out

    return run


def _explained(layer, x, cache, mode: str) -> str:
    layer.mode = mode
    report = layer.explain(x, kv_cache=cache)
    B, Hq, Hkv, Lq, Lk, D, Dv = report.shape
    named = (line.split(": ", 1)[1] for line in report.plan if line.startswith(("PyTorch kernel", "kernel:")))
    kernel = next((line.split(":")[0] for line in named), None)  # the kernel's name, not its description
    return f"{mode}: Hq={Hq} Hkv={Hkv} D={D} Dv={Dv} -> backend {report.backend}" + (
        f" (kernel {kernel})" if kernel else ""
    )


def run_case(S: int, layers: dict, rounds: int, min_run_time: float, check64: bool) -> dict:
    gen = torch.Generator().manual_seed(S)
    mla, gqa = layers["mla"], layers["gqa"]
    x = torch.randn(1, 1, E, generator=gen)  # the new token
    with torch.no_grad():
        latent, kv = _filled(mla, S, S + 8, gen), _filled(gqa, S, S + 8, gen)
        fns = {
            "MLA absorbed": _step(mla, x, latent, S, "absorbed"),
            "MLA naive": _step(mla, x, latent, S, "naive"),
            "GQA": _step(gqa, x, kv, S),
        }
        outs = {name: fn() for name, fn in fns.items()}
        check_close("MLA naive vs absorbed", outs["MLA naive"], outs["MLA absorbed"], atol=1e-4)
        if check64:  # each contender against a float64 copy of itself on the same cache
            for name, layer, cache in (("MLA absorbed", mla, latent), ("MLA naive", mla, latent), ("GQA", gqa, kv)):
                layer64 = layers[f"{'mla' if layer is mla else 'gqa'}64"]
                if layer is mla:
                    layer64.mode = name.split()[1]
                want = layer64(x.double(), kv_cache=_copy64(cache))
                check_close(f"{name} vs float64", outs[name], want, atol=1e-4)
        notes = [_explained(mla, x, latent, "absorbed"), _explained(mla, x, latent, "naive")]
        best = fastest_ms(fns, rounds=rounds, min_run_time=min_run_time)
    mla_token, gqa_token = (C + R) * 4, 2 * GQA_KV_HEADS * HEAD_DIM * 4
    read = {"MLA absorbed": S * mla_token, "MLA naive": S * mla_token, "GQA": S * gqa_token}
    row = {"cache": S}
    for name, ms in best.items():
        row[f"{name} ms"] = ms
    for name, ms in best.items():
        row[f"{name} tok/s"] = 1e3 / ms
    for name in best:
        row[f"{name} cache MB read"] = read[name] / 1e6
    row["MLA naive K/V built MB"] = S * H * (N + R + V) * 4 / 1e6
    row["naive / absorbed"] = best["MLA naive"] / best["MLA absorbed"]
    row["GQA / absorbed"] = best["GQA"] / best["MLA absorbed"]
    weight_bytes = sum(p.numel() * p.element_size() for p in mla.parameters())
    step_bytes = weight_bytes + read["MLA absorbed"]
    step_flops = 2 * weight_bytes / 4 + 2 * H * S * (C + R) + 2 * H * S * C
    row["absorbed MB read"] = step_bytes / 1e6
    row["absorbed MFLOP"] = step_flops / 1e6
    row["absorbed GB/s"] = step_bytes / (best["MLA absorbed"] * 1e-3) / 1e9
    row["absorbed GFLOP/s"] = step_flops / (best["MLA absorbed"] * 1e-3) / 1e9
    row["notes"] = "; ".join(notes)
    return row


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def absorbed_ceilings(lengths, rounds: int, min_run_time: float) -> tuple[list[dict], float, dict]:
    """The absorbed step in fp32 and bf16 against the ceilings of its dtype (issue 29, item 4).

    Four contenders per dtype and cache, interleaved in one :func:`common.fastest_ms`: the whole
    layer step (as :func:`run_case` times it), its attention call alone (16 query heads over the
    one latent head, ``D = C + R``, ``Dv = C`` a view of the rows), since the layer's weights
    (55 MB in fp32) hide the attention's own rate at short caches, the same call on the decode
    backend with its CPU kernel off (PyTorch's GEMMs), and that attention by hand
    (:func:`_absorbed_by_hand`). Each is checked against float64
    first (fp32: 1e-4; bf16: 2% of the output's largest magnitude, a bf16 rounding of weights and
    cache). The memory read bandwidth (``x.sum()`` over twice the last-level cache, at most 1 GiB) is a
    contender of the same interleaved rounds, its fastest round against theirs, as ``decode.py``
    does; so are the matmul peaks (a 2048³ ``torch.mm`` in fp32 and in bf16), since a peak measured
    once, in a minute the host is busy, reads low and flatters every ratio to it. Returns the rows,
    that bandwidth and the peaks (GFLOP/s by dtype)."""
    base = _mla()
    layer64 = _mla(dtype=torch.float64)
    layer64.load_state_dict(base.state_dict())
    layer64.mode = "absorbed"
    llc = last_level_cache_bytes()
    read_buffer = torch.ones(min(max(256 << 20, 2 * (llc or 0)), 1 << 30) // 4)
    fns, cases = {("memory", 0, "read"): lambda: read_buffer.sum()}, {}
    square = {dtype: torch.randn(2048, 2048).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, a in square.items():
        fns[("peak", 0, str(dtype).replace("torch.", ""))] = lambda a=a: a @ a
    with torch.no_grad():
        for S in lengths:
            gen = torch.Generator().manual_seed(S)
            x = torch.randn(1, 1, E, generator=gen)
            rows32 = _filled(base, S, S + 8, gen)
            for name, dtype in DTYPES.items():
                layer = _mla(dtype=dtype)
                layer.load_state_dict(base.state_dict())
                cache = _copy64(rows32, dtype)
                xd = x.to(dtype)
                want = layer64(xd.double(), kv_cache=_copy64(cache))  # the same rounded inputs, in float64
                layer.mode = "absorbed"
                got = layer(xd, kv_cache=cache)
                cache.crop(S)
                tol = 1e-4 if dtype == torch.float32 else 2e-2 * float(want.abs().max())
                check_close(f"MLA absorbed {name} S={S} vs float64", got, want, atol=tol)
                rows = cache.keys  # (1, 1, S, C + R): the latent head
                q = torch.randn(1, H, 1, C + R, generator=gen).to(dtype)
                fns[(name, S, "layer")] = _step(layer, xd, cache, S, "absorbed")
                fns[(name, S, "attention")] = lambda q=q, rows=rows: mh.attention(q, rows, rows[..., :C])
                fns[(name, S, "decode, torch GEMMs")] = lambda q=q, rows=rows: mh.attention(
                    q, rows, rows[..., :C], backend=GEMMS_BACKEND
                )
                fns[(name, S, "by hand")] = lambda q=q, rows=rows: _absorbed_by_hand(q, rows)
                check_close(
                    f"absorbed attention by hand {name} S={S}",
                    _absorbed_by_hand(q, rows),
                    mh.attention(q, rows, rows[..., :C])[0, :, 0],
                    atol=1e-4 if dtype == torch.float32 else 2e-2,
                )
                report = mh.explain(q, rows, rows[..., :C])
                kernel = next((line for line in report.plan if line.startswith(("kernel:", "PyTorch kernel"))), "")
                cases[(name, S)] = {
                    "layer": _explained(layer, xd, cache, "absorbed"),
                    "attention": f"backend {report.backend}, {kernel.split(':', 1)[0]}: "
                    + kernel.split(": ", 1)[-1].split(":")[0],
                    "decode, torch GEMMs": f"backend {GEMMS_BACKEND}: the decode path's fold with PyTorch's GEMMs",
                    "by hand": "torch.mm in the cache's dtype (oneDNN; AMX for bf16 where the CPU has it)",
                    "weights": sum(p.numel() for p in layer.parameters()),
                    "size": torch.empty((), dtype=dtype).element_size(),
                }
        best = fastest_ms(fns, rounds=rounds, min_run_time=min_run_time)
    read_gbps = read_buffer.numel() * read_buffer.element_size() / best.pop(("memory", 0, "read")) / 1e6
    peaks = {dtype: 2 * 2048**3 / (best.pop(("peak", 0, dtype)) * 1e6) for dtype in ("float32", "bfloat16")}
    out = []
    for (name, S, what), ms in best.items():
        case = cases[(name, S)]
        attn_flops = 2 * H * S * (C + R) + 2 * H * S * C  # scores, then values
        cache_bytes = S * (C + R) * case["size"]
        if what == "layer":  # every weight once (two flops each), then the attention
            flops, nbytes = 2 * case["weights"] + attn_flops, case["weights"] * case["size"] + cache_bytes
        else:
            flops, nbytes = attn_flops, cache_bytes
        peak = peaks["float32" if name == "fp32" else "bfloat16"]
        out.append(
            {
                "dtype": name,
                "cache": S,
                "timed": what,
                "ms": ms,
                "MB read": nbytes / 1e6,
                "MFLOP": flops / 1e6,
                "flop/byte": flops / nbytes,
                "GB/s": nbytes / (ms * 1e-3) / 1e9,
                "of read BW": nbytes / (ms * 1e-3) / 1e9 / read_gbps,
                "GFLOP/s": flops / (ms * 1e-3) / 1e9,
                "of its matmul peak": flops / (ms * 1e-3) / 1e9 / peak,
                "runs on": case[what],
            }
        )
    return out, read_gbps, peaks


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="caches 4k and 8k, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, quick 2)")
    parser.add_argument(
        "--ceilings",
        action="store_true",
        help="only the absorbed step in fp32 and bf16 at caches 4k and 32k (quick: 4k) against the read "
        "bandwidth and the matmul peak of its dtype, measured in the same run",
    )
    parser.add_argument(
        "--caches",
        action="store_true",
        help="only the absorbed bf16 step over a LatentKVCache, a PagedKVCache and an int8 QuantizedKVCache "
        "at caches 4k and 32k (quick: 4k), side by side",
    )
    args = parser.parse_args(argv)
    if args.ceilings:
        return _ceilings_main(args)
    if args.caches:
        return _caches_main(args)
    lengths = (4096, 8192) if args.quick else (4096, 8192, 16384, 32768)
    rounds = args.rounds or (2 if args.quick else 3)
    torch.manual_seed(0)
    print(f"# MLA decode ({context()})")
    print(
        f"d_model={E}, heads={H}, kv_lora_rank={C}, rope={R}, nope={N}, v={V}; GQA: {H} heads of {HEAD_DIM}, "
        f"{GQA_KV_HEADS} KV heads; fp32, batch 1, one token per step"
    )

    sizes = cache_bytes_per_token()
    print_table(f"Cache bytes per token and layer (d_model={E}, {H} heads of {HEAD_DIM}; MLA: C={C}, R={R})", sizes)
    gqa_row = next(r for r in sizes if r["layer"].startswith("GQA"))
    print(f"MLA cache is {gqa_row['x MLA']:.2f}x smaller per token than GQA with {GQA_KV_HEADS} KV heads (target >= 4)")

    layers = {
        "mla": _mla(),
        "gqa": mh.MultiHeadAttention(
            E, H, num_kv_heads=GQA_KV_HEADS, causal=True, qkv_bias=False, out_bias=False, rope=RotaryEmbedding(HEAD_DIM)
        ).eval(),
    }
    layers["mla64"] = _mla(dtype=torch.float64)
    layers["mla64"].load_state_dict(layers["mla"].state_dict())
    layers["gqa64"] = mh.MultiHeadAttention(
        E,
        H,
        num_kv_heads=GQA_KV_HEADS,
        causal=True,
        qkv_bias=False,
        out_bias=False,
        rope=RotaryEmbedding(HEAD_DIM),
        dtype=torch.float64,
    ).eval()
    layers["gqa64"].load_state_dict(layers["gqa"].state_dict())
    print(f"before: {machine_state()}")
    read_gbps, peak = memory_read_gbps(), matmul_gflops(torch.float32)
    llc = last_level_cache_bytes()
    print(
        f"ceilings measured now: memory read {read_gbps:.1f} GB/s, fp32 matmul {peak:.0f} GFLOP/s; "
        f"last-level cache {llc / 2**20 if llc else float('nan'):.0f} MiB"
    )
    rows = []
    for i, S in enumerate(lengths):
        row = run_case(S, layers, rounds, min_run_time=0.3 if args.quick else 0.5, check64=i == 0)
        rows.append(row)
        print(f"cache {S}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if isinstance(v, float)), flush=True)
    after = machine_state()
    print(f"after: {after}")
    print("dispatch: " + rows[0]["notes"])
    table = [
        {
            "cache": r["cache"],
            **{f"{name} tok/s": r[f"{name} tok/s"] for name in ("MLA absorbed", "MLA naive", "GQA")},
            "MLA MB read": r["MLA absorbed cache MB read"],
            "naive K/V built MB": r["MLA naive K/V built MB"],
            "GQA MB read": r["GQA cache MB read"],
            "naive / absorbed": r["naive / absorbed"],
            "GQA / absorbed": r["GQA / absorbed"],
        }
        for r in rows
    ]
    print_table(f"Decode step, tokens/s (batch 1), fastest of {rounds} interleaved rounds; {after}", table)
    ceiling = [
        {
            "cache": r["cache"],
            "MB read": r["absorbed MB read"],
            "MFLOP": r["absorbed MFLOP"],
            "GB/s": r["absorbed GB/s"],
            "of read bandwidth": r["absorbed GB/s"] / read_gbps,
            "GFLOP/s": r["absorbed GFLOP/s"],
            "of fp32 matmul peak": r["absorbed GFLOP/s"] / peak,
        }
        for r in rows
    ]
    print_table(
        f"The absorbed step against the ceilings measured in this run (read {read_gbps:.1f} GB/s, "
        f"fp32 matmul {peak:.0f} GFLOP/s)",
        ceiling,
    )
    for r in rows:
        print(
            f"cache {r['cache']}: absorbed {r['naive / absorbed']:.1f}x faster than naive (target > 1 at >= 4k), "
            f"{r['GQA / absorbed']:.2f}x the GQA layer's speed"
        )
    write_csv("mla" + ("_quick" if args.quick else ""), [{k: v for k, v in r.items() if k != "notes"} for r in rows])
    return rows


def _absorbed_by_hand(q, rows):
    """The absorbed attention as two GEMMs in the cache's dtype, all 16 query heads as the rows of
    one product (the ceiling a GEMM library reaches on this call): ``q (1, H, 1, C + R)``, ``rows
    (1, 1, S, C + R)`` -> ``(H, C)``. Scores and softmax in fp32, as the decode path keeps them."""
    qh, kv = q[0, :, 0], rows[0, 0]  # (H, C + R), (S, C + R)
    scores = torch.mm(qh, kv.t()).float() * (C + R) ** -0.5  # (H, S)
    return torch.mm(torch.softmax(scores, -1).to(kv.dtype), kv[:, :C])  # (H, C)


def _ceilings_main(args) -> list[dict]:
    torch_gemms_backend()
    lengths = (4096,) if args.quick else (4096, 32768)
    rounds = args.rounds or (2 if args.quick else 3)
    print(f"# MLA absorbed decode step against the machine's ceilings ({context()})")
    print(f"d_model={E}, heads={H}, kv_lora_rank={C}, rope={R}, nope={N}, v={V}; batch 1, one token per step")
    print(f"before: {machine_state()}")
    llc = last_level_cache_bytes()
    print(
        f"last-level cache {llc / 2**20 if llc else float('nan'):.0f} MiB; the memory read bandwidth and the "
        "matmul peaks are contenders of the interleaved rounds (below)"
    )
    rows, read_gbps, peaks = absorbed_ceilings(lengths, rounds, 0.3 if args.quick else 0.5)
    print(
        f"memory read bandwidth: {read_gbps:.1f} GB/s (x.sum()); matmul fp32 {peaks['float32']:.0f} GFLOP/s, "
        f"bf16 {peaks['bfloat16']:.0f} GFLOP/s (a 2048³ torch.mm): each the fastest of the same {rounds} "
        "interleaved rounds"
    )
    after = machine_state()
    print(f"after: {after}")
    print_table(
        f"The absorbed step (the whole layer; its attention call three ways), fastest of {rounds} interleaved rounds, "
        f"against read {read_gbps:.1f} GB/s and matmul fp32 {peaks['float32']:.0f} / bf16 {peaks['bfloat16']:.0f} "
        f"GFLOP/s measured in this run; {after}",
        [{k: v for k, v in r.items() if k != "runs on"} for r in rows],
    )
    for r in rows:
        if r["cache"] == lengths[0]:
            print(f"{r['dtype']} {r['timed']}: {r['runs on']}")
    for r in rows:
        met = r["of its matmul peak"] >= 0.5 or r["of read BW"] >= 0.7
        print(
            f"{r['dtype']} cache {r['cache']} {r['timed']}: {100 * r['of its matmul peak']:.0f}% of the matmul peak, "
            f"{100 * r['of read BW']:.0f}% of the read bandwidth (target >= 50% or >= 70%): "
            + ("met" if met else "not met")
        )
    write_csv("mla_ceilings" + ("_quick" if args.quick else ""), [{k: v for k, v in r.items()} for r in rows])
    return rows


#: The caches of :func:`_caches_main`: name -> ``make(S, capacity)``, each holding MLA's rows
#: ``[c_kv | k_rope]`` (bf16) once (paged: ``values_in_keys``) or quantized (keys per channel
#: group, the latent values per token, a bf16 residual window of 64 and 4 sinks; "rows once": the
#: values read from the keys' codes, ``values_in_keys``).
LATENT_CACHES = {
    "LatentKVCache": lambda S, capacity: mh.LatentKVCache(capacity=capacity),
    "PagedKVCache (pages of 64)": lambda S, capacity: mh.PagedKVCache(
        capacity // 64 + 2, 64, 1, C + R, value_dim=C, values_in_keys=True, dtype=torch.bfloat16
    ),
    "QuantizedKVCache int8": lambda S, capacity: mh.QuantizedKVCache(
        1, capacity, 1, C + R, value_dim=C, residual=64, sinks=4, dtype=torch.bfloat16
    ),
    "QuantizedKVCache int8, rows once": lambda S, capacity: mh.QuantizedKVCache(
        1, capacity, 1, C + R, value_dim=C, values_in_keys=True, residual=64, sinks=4, dtype=torch.bfloat16
    ),
}


def _caches_main(args) -> list[dict]:
    """The absorbed bf16 layer step over each of :data:`LATENT_CACHES` holding the same rows, timed
    side by side; each step is first checked against the latent cache's (paged: the same bf16 rows,
    1e-2 of the output's scale; int8: within its rounding, 2e-2), and its path printed (``explain``:
    a paged or quantized cache is read as blocks, in place)."""
    lengths = (4096,) if args.quick else (4096, 32768)
    rounds = args.rounds or (2 if args.quick else 3)
    print(f"# MLA absorbed bf16 decode step through each cache ({context()})")
    print(f"d_model={E}, heads={H}, kv_lora_rank={C}, rope={R}, nope={N}, v={V}; batch 1, one token per step")
    print(f"before: {machine_state()}")
    base = _mla()
    layer = _mla(dtype=torch.bfloat16)
    layer.load_state_dict(base.state_dict())
    layer.mode = "absorbed"
    fns, paths, sizes = {}, {}, {}
    with torch.no_grad():
        for S in lengths:
            gen = torch.Generator().manual_seed(S)
            rows = _filled(base, S, S + 8, gen).keys.bfloat16()  # (1, 1, S, C + R)
            x = torch.randn(1, 1, E, generator=gen).bfloat16()
            want = None
            for name, make in LATENT_CACHES.items():
                cache = make(S, S + 64)
                cache.update(rows, rows[..., :C])
                got = layer(x, kv_cache=cache)
                cache.crop(S)
                if want is None:
                    want = got
                else:
                    tol = (2e-2 if "int8" in name else 1e-2) * float(want.abs().max())
                    check_close(f"MLA absorbed bf16 S={S} {name} vs LatentKVCache", got, want, atol=tol)
                report = layer.explain(x, kv_cache=cache)
                paths[name] = "read as blocks" if "read as blocks" in str(report) else f"dense, {report.backend}"
                sizes[(name, S)] = cache.nbytes if hasattr(cache, "nbytes") else cache.keys.nbytes
                fns[(name, S)] = _step(layer, x, cache, S)
        best = fastest_ms(fns, rounds=rounds, min_run_time=0.3 if args.quick else 0.5)
    after = machine_state()
    print(f"after: {after}")
    table = [
        {
            "cache": S,
            "kind": name,
            "path": paths[name],
            "cache MB": sizes[(name, S)] / 1e6,
            "ms": ms,
            "x LatentKVCache time": ms / best[(next(iter(LATENT_CACHES)), S)],
        }
        for (name, S), ms in best.items()
    ]
    print_table(f"Absorbed bf16 layer step, fastest of {rounds} interleaved rounds; {after}", table)
    write_csv("mla_caches" + ("_quick" if args.quick else ""), table)
    return table


if __name__ == "__main__":
    main()
