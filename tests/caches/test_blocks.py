"""Decoding through ``CacheRead.blocks`` (:mod:`multihead.backends.decode_blocks`): pages read
through their block table and quantized slots dequantized a piece at a time give what attention
over the read's dense keys and values gives.

* paged: random page layouts (fragmented, out of order, rows of different lengths, pages shared
  out between rows) against the fp64 reference over the same tokens held contiguously;
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
from multihead.caches import PagedKVCache, QuantizedKVCache

HKV, D = 2, 16


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
    view of the pool (no copy), the stray pages are gathered; together they read the row's tokens."""
    cache = PagedKVCache(400, 8, HKV, D, dtype=torch.float64)
    order = list(range(0, 150)) + [390, 370, 380] + list(range(200, 340))  # pages in the order rows take them
    cache.free = list(reversed(order))
    L = 8 * len(order) - 5
    k, v = torch.randn(1, HKV, L, D, dtype=torch.float64), torch.randn(1, HKV, L, D, dtype=torch.float64)
    read = cache.update(k, v)
    pieces = list(read.blocks.pieces(3, L, read.blocks.piece_size()))
    pool = cache.key_pages.untyped_storage().data_ptr()
    views = [start for start, piece, _ in pieces if piece.untyped_storage().data_ptr() == pool]
    assert views[:2] == [3, 8 * 153] and pieces[0][1].shape[2] == 8 * 150 - 3
    got_k, got_v = _by_slot(pieces, L)
    assert torch.equal(got_k[:, :, 3:], k[:, :, 3:]) and torch.equal(got_v[:, :, 3:], v[:, :, 3:])


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
def test_a_layer_decoding_through_blocks_equals_the_dense_read(kind, dtype, small_pieces, monkeypatch):
    """Each step twice on copies of the cache: ``need_weights=False`` reads the blocks a piece at a
    time (counted), ``need_weights=True`` the dense keys and values through ``attention()``."""
    layer, B = _layer(dtype), 2
    x = torch.randn(B, 140, 4 * D, generator=torch.Generator().manual_seed(1)).to(dtype)
    cache = CACHES[kind](dtype, B)
    calls = []
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
