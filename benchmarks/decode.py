"""Decode step: one new token per sequence against a KV cache, ``Hq=32, Hkv=8, D=128``, fp32,
cache lengths 1k / 4k / 8k / 32k, batch 1 and 8 (``--quick``: batch 1 at 4k and 32k, and batch 8 at
8k, whose 512 MiB of K/V exceed the last-level cache).

A decode step is bound by reading K/V from memory, so the unit is bytes of K/V read per second
(``2·B·Hkv·Lk·D·4`` bytes per step) against the machine's memory read bandwidth, measured in
the same run and in the same interleaved rounds as the contenders (``x.sum()`` over an fp32
buffer twice the last-level cache). Contenders, on the same inputs, after a check against the
fp64 reference (batch element 0):

* ``sdpa gqa``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``;
* ``repeat_kv + sdpa``: K/V repeated to ``Hq`` heads each step (Hugging Face's ``repeat_kv``),
  then SDPA; skipped where the copy would exceed 2 GiB;
* ``grouped matmul``: by hand, the ``G = Hq/Hkv`` query heads of each KV head folded into the
  rows of one matmul per KV head, ``softmax(q Kᵀ) V``;
* ``multihead auto``: ``multihead.attention(q, k, v, mask=causal())`` (the backend auto
  chose is printed), and ``multihead decode``: the same with ``backend="decode"``.

Every call is timed in interleaved rounds keeping its fastest (:func:`common.fastest_ms`): on a
shared machine other processes only ever add time. Threads: the suite's (``BENCH_THREADS=1`` for
one; that run writes ``decode_1threads.csv``): with two, a parallel region waits for a thread the
scheduler took away, which on a loaded 2-core machine turns milliseconds into tens of them. The K/V
of the short caches fit in the
last-level cache (printed): there a contender can read faster than memory, and "% of read
bandwidth" exceeds 100; the 32k caches (256 MiB per sequence) are the memory-bound case.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import (
    THREADS,
    context,
    fastest_ms,
    last_level_cache_bytes,
    machine_state,
    mh,
    print_table,
    used_backend,
    write_csv,
)

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
EXPANDED_LIMIT = 2 << 30  # bytes: repeat_kv + sdpa is skipped where the repeated K/V would exceed this


def grouped_matmul(q, k, v):
    """The hand-written baseline: query heads folded per KV head, one matmul each, no expansion."""
    B, Hq, Lq, Dh = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, (Hq // Hkv) * Lq, Dh)  # (B, Hkv, G·Lq, D)
    probs = torch.softmax(torch.matmul(qg, k.transpose(-2, -1)) * Dh**-0.5, dim=-1)  # (B, Hkv, G·Lq, Lk)
    return torch.matmul(probs, v).view(B, Hq, Lq, v.shape[-1])


def _reference_check(name: str, out: torch.Tensor, q, k, v) -> None:
    """Batch element 0 against the fp64 reference: correctness before timing (BENCHMARKS.md rule 1)."""
    ref = mh.reference_attention(q[:1].double(), k[:1].double(), v[:1].double()).output
    err = float((out[:1].double() - ref).abs().max())
    if not err <= 1e-4:
        raise AssertionError(f"{name}: max error {err:.2e} against the fp64 reference; not timing a wrong result")


def run_case(B: int, Lk: int, read_buffer: torch.Tensor, rounds: int, min_run_time: float) -> dict:
    gen = torch.Generator().manual_seed(B * 100003 + Lk)
    q = torch.randn(B, HQ, 1, D, generator=gen)
    k = torch.randn(B, HKV, Lk, D, generator=gen)
    v = torch.randn(B, HKV, Lk, D, generator=gen)
    kv_bytes = 2 * k.numel() * k.element_size()
    mask = mh.causal()  # one new token sees the whole cache (bottom-right): no mask is built
    fns = {
        "memory read": lambda: read_buffer.sum(),
        "sdpa gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "repeat_kv + sdpa": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        ),
        "grouped matmul": lambda: grouped_matmul(q, k, v),
        "multihead auto": lambda: mh.attention(q, k, v, mask=mask),
        "multihead decode": lambda: mh.attention(q, k, v, mask=mask, backend="decode"),
    }
    skipped = G * kv_bytes > EXPANDED_LIMIT
    if skipped:
        del fns["repeat_kv + sdpa"]
    with torch.no_grad():
        for name, fn in fns.items():
            if name != "memory read":
                _reference_check(name, fn(), q, k, v)
        best = fastest_ms(fns, rounds=rounds, min_run_time=min_run_time)
    read_gbps = read_buffer.numel() * read_buffer.element_size() / best.pop("memory read") / 1e6
    llc = last_level_cache_bytes()
    row = {
        "B": B,
        "Lk": Lk,
        "KV_MiB": kv_bytes / 2**20,
        "KV_vs_LLC": "n/a" if llc is None else ("beyond" if kv_bytes > llc else "within"),
        "read_GBps": read_gbps,
    }
    for name, ms in best.items():
        row[f"{name} GB/s"] = kv_bytes / ms / 1e6
    for name in best:
        row[f"{name} %read"] = 100 * row[f"{name} GB/s"] / read_gbps
    if skipped:
        row["repeat_kv + sdpa GB/s"] = row["repeat_kv + sdpa %read"] = None
    row["decode/sdpa_gqa"] = best["sdpa gqa"] / best["multihead decode"]
    row["auto/sdpa_gqa"] = best["sdpa gqa"] / best["multihead auto"]
    row["decode/grouped"] = best["grouped matmul"] / best["multihead decode"]
    row["auto backend"] = used_backend(q, k, v, mask=mask)
    row["step_ms decode"] = best["multihead decode"]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="three cases, fewer and shorter rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5, quick 3)")
    args = parser.parse_args(argv)
    cases = (
        [(1, 4096), (1, 32768), (8, 8192)]
        if args.quick
        else [(B, Lk) for B in (1, 8) for Lk in (1024, 4096, 8192, 32768)]
    )
    rounds = args.rounds or (3 if args.quick else 5)
    llc = last_level_cache_bytes()
    print(f"# decode step  ({context()})")
    print(
        f"Hq={HQ} Hkv={HKV} D={D} fp32, Lq=1, {THREADS} threads; last-level cache "
        f"{'unknown' if llc is None else f'{llc / 2**20:.0f} MiB'} (sysfs, cpu0; on a VM the host's, shared)"
    )
    # Twice the last-level cache (at least 256 MiB, at most 1 GiB): x.sum() streams it from memory.
    read_buffer = torch.ones(min(max(256 << 20, 2 * (llc or 0)), 1 << 30) // 4)
    print(
        f"memory read bandwidth: x.sum() over {read_buffer.numel() * 4 / 2**20:.0f} MiB fp32, "
        f"in the same interleaved rounds as each case"
    )
    print(f"before: {machine_state()}")
    rows = []
    for B, Lk in cases:
        row = run_case(B, Lk, read_buffer, rounds, min_run_time=0.1 if args.quick else 0.2)
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    print(f"after: {machine_state()}")
    table = [
        {
            "B": r["B"],
            "Lk": r["Lk"],
            "K/V MiB": r["KV_MiB"],
            "K/V vs LLC": r["KV_vs_LLC"],
            "read GB/s": r["read_GBps"],
            **{
                name: (None if r[f"{name} GB/s"] is None else f"{r[f'{name} GB/s']:.1f} ({r[f'{name} %read']:.0f}%)")
                for name in ("sdpa gqa", "repeat_kv + sdpa", "grouped matmul", "multihead auto", "multihead decode")
            },
            "decode / sdpa gqa": r["decode/sdpa_gqa"],
            "decode / grouped": r["decode/grouped"],
            "auto backend": r["auto backend"],
        }
        for r in rows
    ]
    print_table("Decode step: K/V GB/s (% of the measured read bandwidth)", table)
    for r in rows:  # the targets are about what attention() runs: auto (forced decode beside it)
        if r["Lk"] >= 4096:
            print(
                f"B={r['B']} Lk={r['Lk']}: multihead auto ({r['auto backend']}) {r['auto/sdpa_gqa']:.2f}x sdpa gqa "
                f"(target >= 2), {r['multihead auto %read']:.0f}% of read bandwidth"
                + (" (target >= 60%: K/V beyond the LLC)" if r["KV_vs_LLC"] == "beyond" else "")
                + f"; forced decode {r['decode/sdpa_gqa']:.2f}x, {r['multihead decode %read']:.0f}%"
            )
    write_csv("decode" + ("_quick" if args.quick else "") + ("" if THREADS == 2 else f"_{THREADS}threads"), rows)
    return rows


if __name__ == "__main__":
    main()
