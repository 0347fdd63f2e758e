"""Paged decode step against a contiguous one of the same tokens: the designs side by side (issue 29,
item 3). ``Hq=32, Hkv=8, D=128``, B=1, one query token, attention only (no cache update), after a
check of every contender against the fp64 reference. Page layouts of the row's ``Lk`` tokens:

* ``own shuffled``: a pool of the row's pages and one more, claimed from a shuffled free list (the
  ``--caches`` "fragmented" case of ``decode.py``): out of order in the table, one run in the pool;
* ``shared runs``: the row's pages come in runs of 1 to 16 pages with gaps of 1 to 16 pages
  (other rows' pages) between them, the runs in shuffled table order;
* ``shared random``: the row holds a random quarter of a pool four times its size (the other
  pages are other rows'): runs in the pool of about one page.

Contenders (``contiguous``: ``attention(q, k, v, backend="decode")`` on the same tokens in one
tensor, through multihead's CPU decode kernel where it is built):

* ``cpu kernel``: what the library runs where the kernel is built (``decode_blocks`` over
  ``CacheRead.blocks``): every page read through the block table in one call, no copy;
* ``contiguous (PyTorch GEMMs)``: the contiguous step without the kernel (what runs without a C
  compiler); the contenders below are PyTorch-only designs too (the kernel switched off):
* ``pool order``: what the library runs without the kernel: runs of
  pages consecutive in the pool as views, short runs copied 8 MiB at a time, partials joined by LSE;
* ``pool order, 1 MiB copies``: the same with copies sized to stay in the L2 cache
  (``PIECE_BYTES``);
* ``table order (before)``: every page copied in table order, 8 MiB at a time (the read before
  pool order, for a fragmented table);
* ``two passes``: the same pieces, but all scores first into one buffer, one softmax, then ``P V``
  accumulated piece by piece (no per-piece softmax and LSE merge);
* ``pool span``: scores over every page of the pool between the row's first and last page (one
  strided view), masked to the row's pages: no copy, but the other rows' pages are read too.

Timed in interleaved rounds, fastest kept (:func:`common.fastest_ms`); load printed before and after.
With one thread (``BENCH_THREADS=1``) each contender's CPU time per call is measured too, in
interleaved rounds of its own (the fastest kept): on a machine shared with other jobs the wall
time of a call includes the time the scheduler gave them, the thread's CPU time does not (memory
contention still shows in both). ``--quick``: Lk 4k and 32k at page size 16, bf16 only;
``--contenders``: a subset (``contiguous`` is always run). ``--primitives``: instead, the two
costs behind the table (bf16, CPU time of one thread): eight 2-D ``torch.mm`` (one per KV head, as
a view whose heads lie apart is read) against one batched GEMM of the same shapes, and
``index_select`` of scattered pages against a contiguous ``copy_`` of as many bytes.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from common import (
    GEMMS_BACKEND,
    THREADS,
    context,
    fastest_ms,
    machine_state,
    mh,
    print_table,
    torch_gemms_backend,
    write_csv,
)
from multihead.backends import cpu_kernels
from multihead.backends import decode_blocks as blocks_module
from multihead.backends.decode import _attend
from multihead.backends.decode_blocks import KVBlocks, _per_head, decode_blocks
from multihead.caches import PagedKVCache

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
LAYOUTS = ("own shuffled", "shared runs", "shared random")


def layout(kind: str, pages: int, rng: random.Random) -> tuple[list[int], int]:
    """``(the row's pages in table order, pool size)``."""
    if kind == "own shuffled":
        order = list(range(pages + 1))
        rng.shuffle(order)
        return order[:pages], pages + 1
    if kind == "shared random":
        order = list(range(4 * pages))
        rng.shuffle(order)
        return order[:pages], 4 * pages
    runs, p = [], 0
    while sum(len(r) for r in runs) < pages:
        n = rng.randint(1, 16)
        runs.append(list(range(p, p + n)))
        p += n + rng.randint(1, 16)
    rng.shuffle(runs)
    return [page for run in runs for page in run][:pages], p


def torch_gemms(fn):
    """``fn`` with the CPU kernel switched off (pieces read by PyTorch's GEMMs)."""

    def run():
        old, cpu_kernels.supports = cpu_kernels.supports, lambda *args, **kwargs: False
        try:
            return fn()
        finally:
            cpu_kernels.supports = old

    return run


class TableOrder(KVBlocks):
    """A paged read's pages in table order, every one copied (the read before pool order)."""

    def __init__(self, blocks):
        self.blocks, self.shape, self.dtype, self.device = blocks, blocks.shape, blocks.dtype, blocks.device

    def pieces(self, lo, hi, size):
        return self.blocks._table_order(lo, hi, size)

    def dense(self):
        return self.blocks.dense()


def with_piece_bytes(nbytes: int, fn):
    def run():
        old, blocks_module.PIECE_BYTES = blocks_module.PIECE_BYTES, nbytes
        try:
            return fn()
        finally:
            blocks_module.PIECE_BYTES = old

    return run


def two_passes(q, blocks, length: int):
    """All scores first (each piece's GEMMs writing into one buffer), one softmax, then ``P V``
    piece by piece into an fp32 accumulator; the pieces are asked for twice (K, then V)."""
    half = q.dtype != torch.float32
    qg = q.view(1, HKV, G, D)
    size = blocks.piece_size()
    S = blocks.shape[2]
    scores = torch.full((1, HKV, G, S), float("-inf"), dtype=torch.float32)  # by slot: unread slots stay -inf
    for where, k, _ in blocks.pieces(0, length, size):
        n = k.shape[2]
        mm = _per_head if (half and k.stride(1) != n * k.stride(2)) else torch.matmul
        part = mm(k, qg.transpose(-1, -2)).transpose(-1, -2) if half else mm(qg, k.transpose(-1, -2))
        if isinstance(where, int):
            scores[..., where : where + n] = part
        else:
            inside = where < length
            scores[..., where[inside]] = part[..., inside].float()
    probs = torch.softmax(scores.mul_(D**-0.5), dim=-1)
    if half:
        probs = probs.to(q.dtype)
    out = torch.zeros(1, HKV, G, D, dtype=torch.float32)
    for where, _, v in blocks.pieces(0, length, size):
        n = v.shape[2]
        mm = _per_head if (half and v.stride(1) != n * v.stride(2)) else torch.matmul
        p = probs[..., where : where + n] if isinstance(where, int) else probs[..., where.clamp(max=S - 1)]
        if not isinstance(where, int):
            p = p.masked_fill(where >= length, 0)
        out += mm(p.contiguous(), v)
    return out.to(q.dtype).view(1, HQ, 1, D)


def pool_span(q, key_pages, value_pages, table: list[int], length: int):
    """One strided view over the pool's pages ``min(table) .. max(table)``, masked to the row's
    pages (and to its length in its last page)."""
    ps = key_pages.shape[2]
    p0, p1 = min(table), max(table) + 1
    n = (p1 - p0) * ps
    k = key_pages[:, p0:p1].reshape(1, HKV, n, D)
    v = value_pages[:, p0:p1].reshape(1, HKV, n, D)
    used = torch.zeros(p1 - p0, ps, dtype=torch.bool)
    used[torch.tensor(table) - p0] = True
    last = table[(length - 1) // ps] - p0
    used[last, length - ((length - 1) // ps) * ps :] = False
    blocked = ~used.view(1, 1, 1, 1, n)
    half = q.dtype != torch.float32
    qg = q.view(1, HKV, G, D)
    scale = D**-0.5
    if not half:
        qg, scale = qg * scale, 1.0
    out, _ = _attend(qg, k, v, blocked, scale, torch.float32, G, 1, half, False, _per_head if half else torch.matmul)
    return out.to(q.dtype).view(1, HQ, 1, D)


def fastest_cpu_ms(fns: dict, rounds: int, min_cpu_time: float) -> dict:
    """Milliseconds of this thread's CPU time per call of each ``fns[key]()``: the fastest of
    ``rounds`` interleaved rounds, each averaging calls over ``min_cpu_time`` CPU seconds."""
    best = {key: float("inf") for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            fn()
            calls, start = 0, time.thread_time()
            while time.thread_time() - start < min_cpu_time:
                fn()
                calls += 1
            best[key] = min(best[key], (time.thread_time() - start) / calls * 1e3)
    return best


def run_case(dtype, Lk: int, ps: int, kinds, rounds: int, min_run_time: float, contenders=None) -> list[dict]:
    gen = torch.Generator().manual_seed(Lk + ps)
    k = torch.randn(1, HKV, Lk, D, generator=gen).to(dtype)
    v = torch.randn(1, HKV, Lk, D, generator=gen).to(dtype)
    q = torch.randn(1, HQ, 1, D, generator=gen).to(dtype)
    ref = mh.reference_attention(q.double(), k.double(), v.double()).output
    naive = float((mh.attention(q, k, v, backend="decode").double() - ref).abs().max())
    rows = []
    for kind in kinds:
        pages = -(-Lk // ps)
        table, pool = layout(kind, pages, random.Random(Lk + ps))
        cache = PagedKVCache(pool, ps, HKV, D, dtype=dtype)
        cache.free = list(reversed(table))
        cache.update(k[:, :, :-1], v[:, :, :-1])  # the cached tokens, then the step's one new token
        read = cache.update(k[:, :, -1:], v[:, :, -1:])
        mask = read.mask(None, True, HQ)
        fns = {
            "contiguous": lambda: mh.attention(q, k, v, backend="decode"),
            "cpu kernel": lambda read=read, mask=mask: decode_blocks(q, read.blocks, mask),
            "contiguous (PyTorch GEMMs)": lambda: mh.attention(q, k, v, backend=GEMMS_BACKEND),
            "pool order": torch_gemms(lambda read=read, mask=mask: decode_blocks(q, read.blocks, mask)),
            "pool order, 1 MiB copies": torch_gemms(
                with_piece_bytes(1 << 20, lambda read=read, mask=mask: decode_blocks(q, read.blocks, mask))
            ),
            "table order (before)": torch_gemms(
                lambda read=read, mask=mask: decode_blocks(q, TableOrder(read.blocks), mask)
            ),
            "two passes": torch_gemms(lambda read=read: two_passes(q, read.blocks, Lk)),
            "pool span": torch_gemms(
                lambda cache=cache, table=table: pool_span(q, cache.key_pages, cache.value_pages, table, Lk)
            ),
        }
        if contenders:
            fns = {name: fn for name, fn in fns.items() if name == "contiguous" or name in contenders}
        pieces = list(read.blocks.pieces(0, Lk, read.blocks.piece_size()))
        pool_ptr = cache.key_pages.untyped_storage().data_ptr()
        views = sum(p[1].untyped_storage().data_ptr() == pool_ptr for p in pieces)
        with torch.no_grad():
            for name, fn in fns.items():
                err = float((fn().double() - ref).abs().max())
                if not err <= 3 * naive + 1e-4:
                    raise AssertionError(f"{name} ({kind}): max error {err:.2e}; not timing a wrong result")
            best = fastest_ms(fns, rounds=rounds, min_run_time=min_run_time)
            cpu = fastest_cpu_ms(fns, rounds, min_run_time) if THREADS == 1 else None
        row = {
            "dtype": str(dtype).replace("torch.", ""),
            "Lk": Lk,
            "page": ps,
            "layout": kind,
            "pieces": f"{views} views + {len(pieces) - views} copies",
            "span / Lk": (max(table) - min(table) + 1) * ps / Lk,
            "contiguous ms": best["contiguous"],
        }
        for name in fns:
            if name != "contiguous":
                row[name] = best[name] / best["contiguous"]
        if cpu is not None:
            row["contiguous cpu ms"] = cpu["contiguous"]
            for name in fns:
                if name != "contiguous":
                    row[f"{name} (cpu)"] = cpu[name] / cpu["contiguous"]
        rows.append(row)
        print({key: (round(x, 3) if isinstance(x, float) else x) for key, x in row.items()}, flush=True)
    return rows


def primitives() -> list[dict]:
    """Per-head half GEMMs against one batched GEMM; page copies against a contiguous copy."""
    rows = []
    for n in (1024, 2848, 4096):
        k = torch.randn(HKV, n, D).to(torch.bfloat16)
        qt = torch.randn(HKV, G, D).to(torch.bfloat16).transpose(-1, -2)  # (Hkv, D, G), as decode reads it
        p = torch.randn(HKV, G, n).to(torch.bfloat16)
        heads = list(zip(k.unbind(0), qt.unbind(0), p.unbind(0)))
        cpu = fastest_cpu_ms(
            {
                "K q^T batched": lambda: torch.bmm(k, qt),
                "K q^T per head": lambda: [torch.mm(kh, qh) for kh, qh, _ in heads],
                "P V batched": lambda: torch.bmm(p, k),
                "P V per head": lambda: [torch.mm(ph, kh) for kh, _, ph in heads],
            },
            3,
            0.3,
        )
        rows.append({"what": f"{n} keys per head", **{key: round(ms, 3) for key, ms in cpu.items()}})
        rows[-1]["per head / batched (K, PV)"] = (
            f"{cpu['K q^T per head'] / cpu['K q^T batched']:.2f}, {cpu['P V per head'] / cpu['P V batched']:.2f}"
        )
    for ps in (16, 256):
        n = 4096 // ps
        pool = torch.randn(HKV, 4 * n, ps, D).to(torch.bfloat16)
        pages = torch.randperm(4 * n)[:n].sort().values
        buf = torch.empty(HKV, n, ps, D, dtype=torch.bfloat16)
        cpu = fastest_cpu_ms(
            {
                "copy_ (contiguous)": lambda: buf.copy_(pool[:, :n]),
                "index_select": lambda: torch.index_select(pool, 1, pages, out=buf),
                "index_select as int64": lambda: torch.index_select(
                    pool.view(torch.int64), 1, pages, out=buf.view(torch.int64)
                ),
            },
            3,
            0.3,
        )
        rows.append({"what": f"copy 4096 slots, page {ps}", **{key: round(ms, 3) for key, ms in cpu.items()}})
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="bf16, page size 16, Lk 4k and 32k")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--page-sizes", default="16,64,256")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default="", help="comma-separated subset of the contenders")
    parser.add_argument("--primitives", action="store_true", help="only the GEMM and copy costs behind the table")
    args = parser.parse_args(argv)
    if args.primitives:
        print(f"# per-head half GEMMs, page copies: CPU ms of one thread ({context()}); {machine_state()}")
        rows = primitives()
        print_table("CPU ms per call: GEMMs", [r for r in rows if "keys" in r["what"]])
        print_table("CPU ms per call: copies", [r for r in rows if "copy" in r["what"]])
        return rows
    torch_gemms_backend()
    dtypes = ["bfloat16"] if args.quick else args.dtypes.split(",")
    sizes = [16] if args.quick else [int(x) for x in args.page_sizes.split(",")]
    print(f"# paged decode step: designs side by side ({context()})")
    print(f"before: {machine_state()}")
    rows = []
    for name in dtypes:
        for Lk in (int(x) for x in args.lengths.split(",")):
            for ps in sizes:
                rows += run_case(
                    getattr(torch, name),
                    Lk,
                    ps,
                    args.layouts.split(","),
                    args.rounds,
                    0.2,
                    [c for c in args.contenders.split(",") if c],
                )
    print(f"after: {machine_state()}")
    print_table("Paged decode step: time / the contiguous step's (same tokens, same rounds)", rows)
    write_csv("decode_paged" + ("" if THREADS == 2 else f"_{THREADS}threads"), rows)
    return rows


if __name__ == "__main__":
    main()
