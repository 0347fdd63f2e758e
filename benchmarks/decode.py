"""Decode step: one new token per sequence against a KV cache, ``Hq=32, Hkv=8, D=128``, fp32 and
bf16 (``--dtypes``), cache lengths 1k / 4k / 8k / 32k, batch 1 and 8 (``--quick``: batch 1 at 4k
and 32k, and batch 8 at 8k, whose 512 MiB of fp32 K/V exceed the last-level cache). The matmul
peaks (2048³, fp32 and bf16) are printed first.

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

``--caches``: one new token (B=1) after 4k and 32k cached tokens through each cache, a full step
(update, attention, rollback): a contiguous ``StaticKVCache``, a ``PagedKVCache`` of ``--page-size``
tokens per page (16 by default: one run of pages; fragmented pages, a shuffled free list of the
row's own pool; shared, the row's pages a random quarter of a pool four times its size, the
others being other rows'; and the gather of every page that the read did before), a
``SlidingWindowKVCache`` ring against the static cache with the same window, and a
``QuantizedKVCache`` (int8 and fp8 through the CPU decode kernel, and the int8 slots dequantized a
piece at a time as before it) against the contiguous step of the same dtype (``decode_caches.csv``).

Every call is timed in interleaved rounds keeping its fastest (:func:`common.fastest_ms`): on a
shared machine other processes only ever add time. With one thread, the cache ratios are also
taken from this process's CPU time (:func:`common.cpu_ms`, columns ``cpu: ...``), which the
scheduler's time given to other processes does not inflate. Threads: the suite's (``BENCH_THREADS=1`` for
one; that run writes ``decode_1threads.csv``): with two, a parallel region waits for a thread the
scheduler took away, which on a loaded 2-core machine turns milliseconds into tens of them. The K/V
of the short caches fit in the
last-level cache (printed): there a contender can read faster than memory, and "% of read
bandwidth" exceeds 100; the 32k caches (256 MiB per sequence) are the memory-bound case.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from common import (
    THREADS,
    context,
    cpu_ms,
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
    """Batch element 0 against the fp64 reference: correctness before timing (BENCHMARKS.md rule 1).
    fp16/bf16: within 3 times the error of the grouped matmul done naively in that dtype."""
    ref = mh.reference_attention(q[:1].double(), k[:1].double(), v[:1].double()).output
    err = float((out[:1].double() - ref).abs().max())
    bound = 1e-4
    if q.dtype != torch.float32:
        bound = 3 * float((grouped_matmul(q[:1], k[:1], v[:1]).double() - ref).abs().max()) + 1e-3
    if not err <= bound:
        raise AssertionError(f"{name}: max error {err:.2e} against the fp64 reference; not timing a wrong result")


def run_case(B: int, Lk: int, read_buffer: torch.Tensor, rounds: int, min_run_time: float, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(B * 100003 + Lk)
    q = torch.randn(B, HQ, 1, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, Lk, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, Lk, D, generator=gen).to(dtype)
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
        "dtype": str(dtype).replace("torch.", ""),
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
    row["auto/grouped"] = best["grouped matmul"] / best["multihead auto"]
    row["auto backend"] = used_backend(q, k, v, mask=mask)
    row["step_ms decode"] = best["multihead decode"]
    return row


def matmul_peaks(min_run_time: float) -> dict:
    """GFLOP/s of a 2048³ matmul in fp32 and bf16 (AMX where the CPU has it): the arithmetic ceilings."""
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(2048, 2048).to(dtype)
        peaks[str(dtype).replace("torch.", "")] = (
            2 * 2048**3 / (fastest_ms({"mm": lambda: a @ a}, 2, min_run_time)["mm"] * 1e6)
        )
    return peaks


def _fill(cache, k, v, chunk: int = 4096):
    """Prefill ``cache`` with ``k, v (1, Hkv, L, D)`` in chunks (a prefill's own attention is not timed)."""
    for t in range(0, k.shape[2], chunk):
        cache.update(k[:, :, t : t + chunk], v[:, :, t : t + chunk])
    return cache


def _step(cache, q, k1, v1, attend):
    """One decode step as a layer runs it: store the token, attend over the read, then undo the
    write so that every timed call sees the same cache."""
    read = cache.update(k1, v1)
    out = attend(read)
    cache.rollback()
    return out


class _Pieces:
    """A read's blocks without their own partials: the 8-bit slots dequantized a piece at a time
    and read by bf16 GEMMs (the int8 read before integer GEMMs), for the comparison."""

    def __init__(self, blocks):
        self.shape, self.dtype, self.device = blocks.shape, blocks.dtype, blocks.device
        self.pieces, self.dense, self.piece_size = blocks.pieces, blocks.dense, blocks.piece_size

    def partials(self, *args):
        return None


def run_caches(
    Lk: int, dtype: torch.dtype, read_buffer: torch.Tensor, rounds: int, min_run_time: float, ps: int = 16
) -> dict:
    """One new token (``B = 1``) after ``Lk - 1`` cached: the same tokens in a contiguous
    ``StaticKVCache``, a ``PagedKVCache`` (pages in one run, and fragmented: a shuffled free list),
    a ``SlidingWindowKVCache`` ring of ``Lk`` slots (``sliding_window(Lk - 1)``, against the static
    cache with that mask) and a ``QuantizedKVCache`` (int8 and fp8). Paged and quantized
    reads go through ``decode_blocks`` (what a layer runs for a decode step); the paged gather of
    every page into one tensor (the read before) beside them."""
    from multihead.backends.decode_blocks import decode_blocks
    from multihead.caches import PagedKVCache, QuantizedKVCache, SlidingWindowKVCache, StaticKVCache

    gen = torch.Generator().manual_seed(Lk)
    k = torch.randn(1, HKV, Lk, D, generator=gen).to(dtype)
    v = torch.randn(1, HKV, Lk, D, generator=gen).to(dtype)
    q = torch.randn(1, HQ, 1, D, generator=gen).to(dtype)
    old_k, old_v, k1, v1 = k[:, :, :-1], v[:, :, :-1], k[:, :, -1:], v[:, :, -1:]
    static = _fill(StaticKVCache(1, Lk, HKV, D, dtype=dtype), old_k, old_v)
    run = _fill(PagedKVCache(Lk // ps + 1, ps, HKV, D, dtype=dtype), old_k, old_v)
    fragmented = PagedKVCache(Lk // ps + 1, ps, HKV, D, dtype=dtype)
    random.Random(0).shuffle(fragmented.free)
    _fill(fragmented, old_k, old_v)
    shared = PagedKVCache(4 * (Lk // ps + 1), ps, HKV, D, dtype=dtype)  # pages not in its free list: other rows'
    shared.free = random.Random(1).sample(range(4 * (Lk // ps + 1)), Lk // ps + 1)
    _fill(shared, old_k, old_v)
    ring = _fill(SlidingWindowKVCache(Lk - 1, 1, HKV, D, dtype=dtype), old_k, old_v)
    int8 = _fill(QuantizedKVCache(1, Lk, HKV, D, dtype=dtype), old_k, old_v)
    window = mh.sliding_window(Lk - 1)
    windowed = lambda r: mh.attention(q, r.keys, r.values, mask=r.mask(window, True, HQ))  # noqa: E731, F841
    contiguous = lambda r: mh.attention(q, r.keys, r.values, mask=r.mask(None, True, HQ))  # noqa: E731
    blocks = lambda r: decode_blocks(q, r.blocks, r.mask(None, True, HQ))  # noqa: E731
    fns = {
        "memory read": lambda: read_buffer.sum(),
        "contiguous": lambda: _step(static, q, k1, v1, contiguous),
        "contiguous decode": lambda: _step(
            static, q, k1, v1, lambda r: mh.attention(q, r.keys, r.values, mask=mh.causal(), backend="decode")
        ),
        "paged run": lambda: _step(run, q, k1, v1, blocks),
        "paged fragmented": lambda: _step(fragmented, q, k1, v1, blocks),
        "paged shared": lambda: _step(shared, q, k1, v1, blocks),
        "paged gather": lambda: _step(fragmented, q, k1, v1, contiguous),
        "ring": lambda: _step(
            ring, q, k1, v1, lambda r: mh.attention(q, r.keys, r.values, mask=r.mask(window, True, HQ))
        ),
        "contiguous window": lambda: _step(
            static, q, k1, v1, lambda r: mh.attention(q, r.keys, r.values, mask=r.mask(window, True, HQ))
        ),
        "int8": lambda: _step(int8, q, k1, v1, blocks),
        "int8 dequantized": lambda: _step(
            int8, q, k1, v1, lambda r: decode_blocks(q, _Pieces(r.blocks), r.mask(None, True, HQ))
        ),
    }
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = _fill(QuantizedKVCache(1, Lk, HKV, D, format="fp8", dtype=dtype), old_k, old_v)
        fns["fp8"] = lambda: _step(fp8, q, k1, v1, blocks)
    with torch.no_grad():
        ref = mh.reference_attention(q.double(), k.double(), v.double()).output
        naive = float((grouped_matmul(q, k, v).double() - ref).abs().max())
        for name, fn in fns.items():  # correctness before timing; quantized: within its documented error
            if name != "memory read":
                err = float((fn().double() - ref).abs().max())
                bound = (0.05 if name.startswith(("int8", "fp8")) else 0.0) + 3 * naive + 1e-4
                if not err <= bound:
                    raise AssertionError(f"{name}: max error {err:.2e} > {bound:.1e}; not timing a wrong result")
        best = fastest_ms(fns, rounds=rounds, min_run_time=min_run_time)
    read_gbps = read_buffer.numel() * read_buffer.element_size() / best.pop("memory read") / 1e6
    kv_bytes = 2 * k.numel() * k.element_size()
    row = {"dtype": str(dtype).replace("torch.", ""), "Lk": Lk, "page": ps, "read_GBps": read_gbps}
    for name, ms in best.items():
        row[f"{name} ms"] = ms
    row["contiguous %read"] = 100 * kv_bytes / best["contiguous"] / 1e6 / read_gbps
    row["paged run / contiguous"] = best["paged run"] / best["contiguous"]
    row["paged fragmented / contiguous"] = best["paged fragmented"] / best["contiguous"]
    row["paged shared / contiguous"] = best["paged shared"] / best["contiguous"]
    row["paged gather / contiguous"] = best["paged gather"] / best["contiguous"]
    row["ring / contiguous window"] = best["ring"] / best["contiguous window"]
    if THREADS == 1:  # this process's CPU time too: other engineers' load moves it less than the wall clock
        pairs = {
            "paged run": "contiguous",
            "paged fragmented": "contiguous",
            "paged shared": "contiguous",
            "ring": "contiguous window",
        }
        with torch.no_grad():
            calls = max(1, round(min_run_time * 1e3 / best["contiguous"]))
            cpu = cpu_ms({name: fns[name] for name in {*pairs, *pairs.values()}}, rounds=rounds, calls=calls)
        for name, base in pairs.items():
            row[f"cpu: {name} / {base}"] = cpu[name] / cpu[base]
    row["int8 tokens/s / contiguous"] = best["contiguous"] / best["int8"]
    row["int8 dequantized tokens/s / contiguous"] = best["contiguous"] / best["int8 dequantized"]
    if "fp8" in best:
        row["fp8 tokens/s / contiguous"] = best["contiguous"] / best["fp8"]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="three cases, fewer and shorter rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5, quick 3)")
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated dtypes of the K/V (default fp32, bf16)"
    )
    parser.add_argument("--caches", action="store_true", help="only the cache comparisons (paged, ring, int8)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page of the paged caches (--caches)")
    parser.add_argument(
        "--lengths", default="4096,32768", help="comma-separated cache lengths of --caches (default 4096,32768)"
    )
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    cases = (
        [(1, 4096), (1, 32768), (8, 8192)]
        if args.quick
        else [(B, Lk) for B in (1, 8) for Lk in (1024, 4096, 8192, 32768)]
    )
    rounds = args.rounds or (3 if args.quick else 5)
    min_run_time = 0.1 if args.quick else 0.2
    llc = last_level_cache_bytes()
    print(f"# decode step  ({context()})")
    print(
        f"Hq={HQ} Hkv={HKV} D={D}, Lq=1, {THREADS} threads; last-level cache "
        f"{'unknown' if llc is None else f'{llc / 2**20:.0f} MiB'} (sysfs, cpu0; on a VM the host's, shared)"
    )
    # Twice the last-level cache (at least 256 MiB, at most 1 GiB): x.sum() streams it from memory.
    read_buffer = torch.ones(min(max(256 << 20, 2 * (llc or 0)), 1 << 30) // 4)
    print(
        f"memory read bandwidth: x.sum() over {read_buffer.numel() * 4 / 2**20:.0f} MiB fp32, "
        f"in the same interleaved rounds as each case"
    )
    print(f"before: {machine_state()}")
    peaks = matmul_peaks(min_run_time)
    print("matmul peak (2048³): " + ", ".join(f"{name} {g:.0f} GFLOP/s" for name, g in peaks.items()))
    rows = []
    if args.caches:
        for dtype in dtypes:
            for Lk in (int(n) for n in args.lengths.split(",")):
                row = run_caches(Lk, dtype, read_buffer, rounds, min_run_time, args.page_size)
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        print(f"after: {machine_state()}")
        print_table("Decode step through each cache (B=1, one new token): ms and ratios", rows)
        page = "" if args.page_size == 16 else f"_page{args.page_size}"
        lengths = "" if args.lengths == "4096,32768" else "_" + args.lengths.replace(",", "_")
        write_csv("decode_caches" + page + lengths + ("" if THREADS == 2 else f"_{THREADS}threads"), rows)
        return rows
    for dtype in dtypes:
        for B, Lk in cases:
            row = run_case(B, Lk, read_buffer, rounds, min_run_time, dtype)
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    print(f"after: {machine_state()}")
    table = [
        {
            "dtype": r["dtype"],
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
                f"{r['dtype']} B={r['B']} Lk={r['Lk']}: multihead auto ({r['auto backend']}) "
                f"{r['auto/sdpa_gqa']:.2f}x sdpa gqa, {r['multihead auto %read']:.0f}% of read bandwidth"
                + (" (K/V beyond the LLC)" if r["KV_vs_LLC"] == "beyond" else "")
                + f"; forced decode {r['decode/sdpa_gqa']:.2f}x, {r['multihead decode %read']:.0f}%, "
                f"{r['decode/grouped']:.2f}x the grouped matmul"
            )
    write_csv("decode" + ("_quick" if args.quick else "") + ("" if THREADS == 2 else f"_{THREADS}threads"), rows)
    return rows


if __name__ == "__main__":
    main()
