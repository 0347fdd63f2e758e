"""Decoding through ``CacheRead.blocks`` (:mod:`multihead.backends.decode_blocks`): pages read
through their block table and quantized slots dequantized a piece at a time give what attention
over the read's dense keys and values gives.

* paged: random page layouts (fragmented, out of order, rows of different lengths, pages shared
  out between rows) against the fp64 reference over the same tokens held contiguously; one row's
  pages read in pool order (runs consecutive in the pool but out of order in the table, read as
  views with their slot numbers; short runs copied), lengths a multiple of the page size ± 1,
  windows and hidden tails whose pages hold tokens outside the keys read (never touched: NaN
  there changes nothing), fp64 exactly and fp32/bf16/fp16 within the relative rule;
* a layer decoding through a paged or quantized cache takes the blocks path and equals the same
  layer on the dense read (weights asked for: the slow path), in fp32, bf16 and fp16.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.backends import decode_blocks as blocks_module
from multihead.backends.decode_blocks import decode_blocks
from multihead.caches import PagedKVCache, QuantizedKVCache, paged_blocks

HKV, D = 2, 16
# every test twice: multihead's CPU decode kernel and PyTorch's GEMMs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("decode_kernel")


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 64 slots (the fewest a piece holds), so that short caches are read in several."""
    monkeypatch.setattr(blocks_module, "PIECE_BYTES", 1)


def _paged(seed: int, B: int, dtype: torch.dtype):
    """A paged cache whose rows grew in turns from a shuffled free list: every row's pages are
    fragmented and out of order. Returns the cache, each row's tokens (k, v) and the last read."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    page_size = rng.choice([1, 3, 4, 16])
    cache = PagedKVCache(B * (800 // page_size + 2), page_size, HKV, D, batch_size=B, dtype=dtype)
    rng.shuffle(cache.free)
    rows = [(torch.zeros(HKV, 0, D, dtype=dtype), torch.zeros(HKV, 0, D, dtype=dtype)) for _ in range(B)]
    read = None
    for _ in range(rng.randint(3, 8)):
        new = rng.choice([1, 2, 7, 40, 90])
        k = torch.randn(B, HKV, new, D, generator=gen).to(dtype)
        v = torch.randn(B, HKV, new, D, generator=gen).to(dtype)
        read = cache.update(k, v)
        rows = [(torch.cat([r[0], k[b]], 1), torch.cat([r[1], v[b]], 1)) for b, r in enumerate(rows)]
        if B > 1 and rng.random() < 0.3:  # rows of different lengths
            lengths = [rng.randint(1, cache.lengths[b].item()) for b in range(B)]
            cache.crop(torch.tensor(lengths))
            rows = [(r[0][:, :n], r[1][:, :n]) for r, n in zip(rows, lengths)]
    k = torch.randn(B, HKV, 1, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, 1, D, generator=gen).to(dtype)
    read = cache.update(k, v)
    rows = [(torch.cat([r[0], k[b]], 1), torch.cat([r[1], v[b]], 1)) for b, r in enumerate(rows)]
    return cache, rows, read


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("B", [1, 3])
def test_random_page_layouts_equal_the_reference_over_the_same_tokens(seed, B, small_pieces):
    cache, rows, read = _paged(seed, B, torch.float64)
    Hq = 2 * HKV
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    got = decode_blocks(q, read.blocks, read.mask(None, causal=True, heads=Hq))
    for b, (k, v) in enumerate(rows):  # each row against its own tokens, contiguous
        want = mh.reference_attention(q[b : b + 1], k[None], v[None]).output
        torch.testing.assert_close(got[b : b + 1], want, rtol=1e-12, atol=1e-12)
    # and the dense read of the same slots (the slow path) agrees
    dense = mh.attention(q, read.keys, read.values, mask=read.mask(None, causal=True, heads=Hq), backend="reference")
    torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)


def test_runs_of_consecutive_pages_are_read_as_views_of_the_pool(small_pieces):
    """One row whose pages come in two long runs and a few stray pages: each run is one piece, a
    view of the pool (no copy), the stray pages are gathered; together they read the row's tokens.
    The first page holds tokens before the keys read (slot 3 on): it is read alone, trimmed."""
    cache = PagedKVCache(400, 8, HKV, D, dtype=torch.float64)
    order = list(range(0, 150)) + [390, 370, 380] + list(range(200, 340))  # pages in the order rows take them
    cache.free = list(reversed(order))
    L = 8 * len(order) - 5
    k, v = torch.randn(1, HKV, L, D, dtype=torch.float64), torch.randn(1, HKV, L, D, dtype=torch.float64)
    read = cache.update(k, v)
    pieces = list(read.blocks.pieces(3, L, read.blocks.piece_size()))
    pool = cache.key_pages.untyped_storage().data_ptr()
    views = [start for start, piece, _ in pieces if piece.untyped_storage().data_ptr() == pool]
    assert views[:3] == [3, 8, 8 * 153] and pieces[0][1].shape[2] == 5 and pieces[1][1].shape[2] == 8 * 149
    got_k, got_v = _by_slot(pieces, L)
    assert torch.equal(got_k[:, :, 3:], k[:, :, 3:]) and torch.equal(got_v[:, :, 3:], v[:, :, 3:])


def test_a_run_in_pool_order_out_of_order_in_the_table_is_one_view_with_its_slots():
    """Table [200..299, 100..199, 7, 3]: pages 100..299 are one run in the pool, read as one view
    whose keys carry their slot numbers; the two stray pages are copied into one piece."""
    cache = PagedKVCache(400, 8, HKV, D, dtype=torch.float64)
    order = list(range(200, 300)) + list(range(100, 200)) + [7, 3]
    cache.free = list(reversed(order))
    L = 8 * len(order) - 5
    k, v = torch.randn(1, HKV, L, D, dtype=torch.float64), torch.randn(1, HKV, L, D, dtype=torch.float64)
    read = cache.update(k, v)
    pieces = list(read.blocks.pieces(0, L, read.blocks.piece_size()))
    pool = cache.key_pages.untyped_storage().data_ptr()
    assert len(pieces) == 2 and pieces[0][1].untyped_storage().data_ptr() == pool
    slots = pieces[0][0]
    assert isinstance(slots, torch.Tensor) and slots.tolist() == list(range(800, 1600)) + list(range(800))
    assert pieces[1][1].untyped_storage().data_ptr() != pool and pieces[1][0].tolist()[:8] == list(range(1608, 1616))
    got_k, got_v = _by_slot(pieces, L)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def _by_slot(pieces, S):
    """The pieces' keys and values put back at their slots (``S`` of them); each slot read once."""
    first = pieces[0][1]
    k = torch.full((*first.shape[:2], S, first.shape[3]), float("nan"), dtype=first.dtype)
    v = torch.full((*first.shape[:2], S, pieces[0][2].shape[3]), float("nan"), dtype=first.dtype)
    seen = torch.zeros(S, dtype=torch.int64)
    for where, piece_k, piece_v in pieces:
        n = piece_k.shape[2]
        slots = torch.arange(where, where + n) if isinstance(where, int) else where
        inside = slots < S  # past the read: none here
        k[:, :, slots[inside]], v[:, :, slots[inside]] = piece_k[:, :, inside], piece_v[:, :, inside]
        seen.index_add_(0, slots[inside], torch.ones_like(slots[inside]))
    assert int(seen.max()) <= 1, "a slot was read twice"
    return k, v


def _shuffled_runs(rng: random.Random, pages: int) -> list[int]:
    """Every page of a pool once, as runs of consecutive pages (1 to 12 long, some reversed) in
    shuffled order: the order in which a row claims them. Runs next to each other in the pool but
    apart in this order make runs in pool order whose table positions are out of order."""
    runs, p = [], 0
    while p < pages:
        n = min(rng.randint(1, 12), pages - p)
        run = list(range(p, p + n))
        runs.append(run[::-1] if rng.random() < 0.3 else run)
        p += n
    rng.shuffle(runs)
    return [page for run in runs for page in run]


DTYPES_EXACT = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES_EXACT, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_one_row_read_in_pool_order_equals_the_reference(seed, dtype, monkeypatch):
    """One row, pages claimed as shuffled runs; the step's new tokens (1 or 3), under the cache's
    causal mask, a window (its first page holds tokens before the keys read) or a tensor mask that
    hides the last tokens (and, with 3 rows, every key of one row); lengths a multiple of the page
    size ± 1. Short runs are views too where ``MIN_RUN`` is small, and copies 64 slots at a time."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ps = rng.choice([3, 4, 16])
    monkeypatch.setattr(paged_blocks, "MIN_RUN", rng.choice([1, 2 * ps, 8 * ps]))
    monkeypatch.setattr(blocks_module, "PIECE_BYTES", 1)  # copied pieces of 64 slots
    L = rng.randint(20, 60) * ps + rng.choice([-1, 0, 1])
    Lq = rng.choice([1, 3])
    pool = L // ps + 1 + rng.randint(0, 10)
    cache = PagedKVCache(pool, ps, HKV, D, dtype=dtype)
    cache.free = list(reversed(_shuffled_runs(rng, pool)))
    k = torch.randn(1, HKV, L, D, generator=gen).to(dtype)
    v = torch.randn(1, HKV, L, D, generator=gen).to(dtype)
    cache.update(k[:, :, : L - Lq], v[:, :, : L - Lq])
    read = cache.update(k[:, :, L - Lq :], v[:, :, L - Lq :])
    Hq = 4 * HKV
    q = torch.randn(1, Hq, Lq, D, generator=gen).to(dtype)
    S = read.slots
    hide = torch.ones(1, 1, Lq, S, dtype=torch.bool)
    hide[..., L - rng.randint(1, ps + 1) : L] = False  # the last tokens hidden from every row
    if Lq == 3:
        hide[:, :, 1] = False  # a fully masked row: output 0
    masks = {"causal": None, "window": mh.sliding_window(rng.randint(ps + 1, L // 2)), "hidden tail": hide}
    for name, extra in masks.items():
        mask = read.mask(extra, causal=True, heads=Hq)
        got = decode_blocks(q, read.blocks, mask)
        ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=_over_tokens(mask, L)).output
        what = f"ps={ps} L={L} Lq={Lq} {name} {dtype}"
        if dtype == torch.float64:
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=what)
        else:
            base = naive_attention(q, read.keys, read.values, mask)
            assert_relative(got, ref, base, factor=2 if dtype != torch.float32 else 10, what=what)


def _over_tokens(mask, L):
    """A read's bool mask ``(1, 1|H, Lq, S)`` over its slots, cut to the ``L`` tokens (slot j holds token j);
    a contiguous read's (rows of one length: its ``S = L`` slots) is a mask object over them already."""
    return mask[..., :L] if isinstance(mask, torch.Tensor) else mask


@pytest.mark.parametrize("seed", range(4))
def test_tokens_outside_the_keys_read_are_never_touched(seed, monkeypatch):
    """NaN in the keys and values of the tokens before a window and of a tail every row hides (the
    keys read are those from the first to the last visible one): the pages holding such tokens are
    read alone and trimmed, so the output is finite and exact. (A hidden token *between* visible
    ones is read and masked: a NaN value there gives NaN, as on the contiguous decode path.)"""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ps = rng.choice([4, 16])
    monkeypatch.setattr(paged_blocks, "MIN_RUN", rng.choice([1, 4 * ps]))
    L = rng.randint(30, 50) * ps + rng.choice([-1, 0, 1])
    cache = PagedKVCache(L // ps + 4, ps, HKV, D, dtype=torch.float64)
    cache.free = list(reversed(_shuffled_runs(rng, L // ps + 4)))
    k = torch.randn(1, HKV, L, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, HKV, L, D, generator=gen, dtype=torch.float64)
    cache.update(k[:, :, :-1], v[:, :, :-1])
    read = cache.update(k[:, :, -1:], v[:, :, -1:])
    q = torch.randn(1, 4 * HKV, 1, D, generator=gen, dtype=torch.float64)
    window = rng.randint(2 * ps, L // 2) + rng.choice([1, 2])  # starts inside a page
    tail = rng.randint(1, ps - 1)
    hide = torch.ones(1, 1, 1, read.slots, dtype=torch.bool)
    hide[..., L - tail : L] = False  # the last tokens, hidden: the keys read end before them
    mask = read.mask(mh.sliding_window(window) & hide, causal=True, heads=4 * HKV)
    want = decode_blocks(q, read.blocks, mask)
    # a read of one row is contiguous (its L filled slots): the mask an object over them
    dense = mask if isinstance(mask, torch.Tensor) else mask.materialize(1, 4 * HKV, 1, read.slots)
    visible = dense[0, 0, 0, :L]
    for slot in (~visible).nonzero()[:, 0].tolist():  # poison every token the query may not see
        page, offset = cache.tables[0][slot // ps], slot % ps
        cache.key_pages[:, page, offset] = float("nan")
        cache.value_pages[:, page, offset] = float("nan")
    got = decode_blocks(q, read.blocks, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = mh.reference_attention(q, k, v, mask=dense[..., :L]).output
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def _layer(dtype, Hkv=HKV):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(4 * D, 4, num_kv_heads=Hkv, causal=True, dtype=dtype).eval()


CACHES = {
    "paged": lambda dtype, B: PagedKVCache(200, 4, HKV, D, batch_size=B, dtype=dtype),
    "int8": lambda dtype, B: QuantizedKVCache(B, 400, HKV, D, residual=8, sinks=2, group=4, dtype=dtype),
    "fp8": lambda dtype, B: QuantizedKVCache(B, 400, HKV, D, format="fp8", residual=8, sinks=2, group=4, dtype=dtype),
}


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("Hq", [HKV, 4 * HKV], ids=["mha", "gqa"])
def test_steps_through_blocks_follow_the_relative_rule_over_the_dense_read(kind, dtype, Hq, small_pieces):
    """A prefill then steps of one and of three tokens: each step's ``decode_blocks`` against the fp64
    reference over the read's dense slots (``read.keys``, dequantized where quantized), within the
    relative rule (baseline: the same attention computed naively in the dtype)."""
    B, gen = 2, torch.Generator().manual_seed(3)
    cache = CACHES[kind](dtype, B)
    cache.update(
        torch.randn(B, HKV, 150, D, generator=gen).to(dtype), torch.randn(B, HKV, 150, D, generator=gen).to(dtype)
    )
    for new in (1, 1, 3, 1):
        k = torch.randn(B, HKV, new, D, generator=gen).to(dtype)
        v = torch.randn(B, HKV, new, D, generator=gen).to(dtype)
        q = torch.randn(B, Hq, new, D, generator=gen).to(dtype)
        read = cache.update(k, v)
        mask = read.mask(None, causal=True, heads=Hq)
        got = decode_blocks(q, read.blocks, mask)
        ref = mh.reference_attention(q.double(), read.keys.double(), read.values.double(), mask=mask).output
        base = naive_attention(q, read.keys, read.values, mask)
        assert_relative(got, ref, base, factor=2 if dtype != torch.float32 else 10, what=f"{kind} {dtype} +{new}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(CACHES))
def test_a_layer_decoding_through_blocks_equals_the_dense_read(kind, dtype, small_pieces, monkeypatch, decode_kernel):
    """Each step twice on copies of the cache: ``need_weights=False`` reads the blocks (counted:
    with PyTorch's GEMMs a piece at a time, partials merged; with the CPU kernel through the
    layer's blocks path), ``need_weights=True`` the dense keys and values through ``attention()``."""
    from multihead.layers import heads

    layer, B = _layer(dtype), 2
    x = torch.randn(B, 140, 4 * D, generator=torch.Generator().manual_seed(1)).to(dtype)
    cache = CACHES[kind](dtype, B)
    calls = []
    if decode_kernel == "cpu_kernel":  # the table or the int8 slots read in one call: nothing to merge
        monkeypatch.setattr(heads, "decode_blocks", _counting(heads.decode_blocks, calls))
    else:
        monkeypatch.setattr(blocks_module, "merge_partials", _counting(blocks_module.merge_partials, calls))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        layer(x[:, :130], kv_cache=cache)  # a prefill: the dense read
        for t in range(130, 140):
            twin = copy.deepcopy(cache)
            fast = layer(x[:, t : t + 1], kv_cache=cache)
            slow, _ = layer(x[:, t : t + 1], kv_cache=twin, need_weights=True)
            torch.testing.assert_close(fast, slow, rtol=tol, atol=tol)
    assert len(calls) == 10, "the steps were not read a piece at a time"


def _counting(fn, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted
