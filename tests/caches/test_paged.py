"""``PagedKVCache``: random interleavings of appends, releases, crops and new sequences always read
back what a contiguous cache of the same tokens holds; running out of pages changes nothing; a
layer decoding through it equals the full forward."""

from __future__ import annotations

import random

import pytest
import torch
from cache_state import everything, identical

import multihead as mh
from helpers import DEVICES
from multihead.backends.decode_blocks import decode_blocks
from multihead.caches import PagedKVCache
from multihead.caches.base import EMPTY_POSITION

# every test twice: multihead's CPU decode kernel and PyTorch's GEMMs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("decode_kernel")

HKV, D, DV = 2, 3, 4


def _kv(B, L, gen, device="cpu"):
    return (  # drawn on CPU, then moved
        torch.randn(B, HKV, L, D, generator=gen, dtype=torch.float64).to(device),
        torch.randn(B, HKV, L, DV, generator=gen, dtype=torch.float64).to(device),
    )


def _check_read(read, rows: list[tuple[torch.Tensor, torch.Tensor]]):
    """Row ``b`` of the read holds exactly ``rows[b]`` at positions 0.. and nothing visible after.
    Rows of one length read contiguously (slot ``j`` holds position ``j``, no slot past it)."""
    if read.contiguous:
        assert len({k.shape[1] for k, _ in rows}) == 1, "a contiguous read of rows of several lengths"
        assert read.slots == rows[0][0].shape[1]
    for b, (k, v) in enumerate(rows):
        n = k.shape[1]
        assert torch.equal(read.keys[b, :, :n], k) and torch.equal(read.values[b, :, :n], v), b
        if read.contiguous:
            continue
        positions = read.key_positions[b].cpu()
        assert positions[:n].tolist() == list(range(n)) and bool((positions[n:] == EMPTY_POSITION).all()), b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(12))
def test_random_interleavings_equal_a_contiguous_cache(seed, device):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B, page_size = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4, 8])
    cache = PagedKVCache(40, page_size, HKV, D, value_dim=DV, batch_size=B, dtype=torch.float64, device=device)
    empty = [torch.zeros(HKV, 0, n, dtype=torch.float64, device=device) for n in (D, DV)]
    rows = [tuple(empty)] * B
    for _ in range(30):
        action = rng.random()
        if action < 0.6:
            new = rng.choice([1, 1, 1, 2, 3, 5])
            k, v = _kv(B, new, gen, device)
            free_before, tables_before = len(cache.free), [list(t) for t in cache.tables]
            try:
                read = cache.update(k, v)
            except ValueError as error:  # out of pages: nothing claimed, nothing written
                assert "free" in str(error)
                assert len(cache.free) == free_before and cache.tables == tables_before
                cache.release(rng.randrange(B))
                rows = [(r[0][:, : cache.lengths[b]], r[1][:, : cache.lengths[b]]) for b, r in enumerate(rows)]
                continue
            rows = [(torch.cat([r[0], k[b]], 1), torch.cat([r[1], v[b]], 1)) for b, r in enumerate(rows)]
            _check_read(read, rows)
        elif action < 0.75:
            row = rng.randrange(B)
            cache.release(row)
            rows[row] = (rows[row][0][:, :0], rows[row][1][:, :0])
        elif action < 0.9:
            target = [rng.randint(0, cache.lengths[b]) for b in range(B)]
            cache.crop(torch.tensor(target))
            rows = [(r[0][:, :t], r[1][:, :t]) for r, t in zip(rows, target)]
        else:
            order = [rng.randrange(B) for _ in range(B)]
            try:
                cache.reorder(torch.tensor(order))
            except ValueError as error:
                assert "pages" in str(error)
                continue
            rows = [rows[i] for i in order]
        # the pool is accounted for: every page is free or in exactly one table
        owned = [p for t in cache.tables for p in t]
        assert sorted(owned + cache.free) == list(range(40))
        assert all(len(t) == -(-n // page_size) for t, n in zip(cache.tables, cache.lengths))
    k, v = _kv(B, 1, gen, device)
    if sum(1 for n, t in zip(cache.lengths, cache.tables) if n % page_size == 0) <= len(cache.free):
        read = cache.update(k, v)
        _check_read(read, [(torch.cat([r[0], k[b]], 1), torch.cat([r[1], v[b]], 1)) for b, r in enumerate(rows)])


def test_out_of_pages_is_a_clear_error_with_nothing_claimed():
    cache = PagedKVCache(3, 4, HKV, D, value_dim=DV, batch_size=2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    cache.update(*_kv(2, 4, gen))  # one full page per row; one page free
    pool_k, free = cache.key_pages.clone(), list(cache.free)
    with pytest.raises(
        ValueError,
        match=r"PagedKVCache.update: 1 new tokens per row need 2 more pages of 4 tokens but 1 of "
        r"3 are free \(rows hold \[4, 4\] tokens\); hint: release\(\) finished rows",
    ):
        cache.update(*_kv(2, 1, gen))
    assert torch.equal(cache.key_pages, pool_k) and cache.free == free and cache.lengths.tolist() == [4, 4]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_a_layer_decoding_through_pages_equals_the_full_forward(Hkv, device):
    torch.manual_seed(0)  # weights and input drawn on CPU, then moved
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=Hkv, causal=True, dtype=torch.float64).to(device).eval()
    x = torch.randn(2, 13, 32, dtype=torch.float64).to(device)
    cache = PagedKVCache(16, 3, Hkv, 8, batch_size=2, dtype=torch.float64, device=device)
    with torch.no_grad():
        full = layer(x)
        parts, t = [], 0
        for n in [5, 1, 1, 4, 1, 1]:
            parts.append(layer(x[:, t : t + n], kv_cache=cache))
            t += n
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-12, atol=1e-12)


def test_a_released_row_starts_a_new_sequence_beside_a_running_one():
    """Row 1 finishes and a new request starts there while row 0 goes on: each row decodes as its
    own sequence (masks and positions per row)."""
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, dtype=torch.float64).eval()
    a, b, c = (torch.randn(1, 10, 32, dtype=torch.float64) for _ in range(3))
    cache = PagedKVCache(12, 2, 2, 8, batch_size=2, dtype=torch.float64)
    with torch.no_grad():
        first = layer(torch.cat([a[:, :4], b[:, :4]]), kv_cache=cache)
        cache.release(1)  # b is done; c starts in row 1, at position 0
        steps = [layer(torch.cat([a[:, 4 + t : 5 + t], c[:, t : t + 1]]), kv_cache=cache) for t in range(5)]
        steps = torch.cat(steps, 1)
        torch.testing.assert_close(steps[0], layer(a[:, :9])[0, 4:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(steps[1], layer(c[:, :5])[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(first[0], layer(a[:, :4])[0], rtol=1e-12, atol=1e-12)
    assert cache.lengths.tolist() == [9, 5]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("new", [1, 2, 3])
def test_nan_left_in_the_pool_never_reaches_another_sequence(new, dtype):
    """A sequence that went non-finite (an fp16 overflow) is released; its pages go back to the
    pool holding NaN and inf, and so do the tokens a crop drops. A read returns whole pages with
    the slots past a row's length hidden by the mask, but a multi-token step multiplied their
    values by a weight of 0: 0 * NaN poisoned the other rows (rows of different lengths, 2 and 3
    query tokens). Claimed pages and dropped slots are zeroed: every step equals the full
    forward of each row's own sequence."""
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, dtype=dtype).eval()
    a, b, bad = (torch.randn(1, 12, 32, dtype=dtype) for _ in range(3))
    cache = PagedKVCache(12, 4, 2, 8, batch_size=2, dtype=dtype)
    with torch.no_grad():
        layer(torch.cat([bad, bad])[:, :10], kv_cache=cache)  # a batch that went bad: NaN and inf everywhere
        cache.key_pages[:, cache.tables[0] + cache.tables[1]] = float("nan")
        cache.value_pages[:, cache.tables[0]] = float("inf")
        cache.value_pages[:, cache.tables[1]] = float("nan")
        cache.reset()  # every page back to the pool, still holding them
        layer(torch.cat([a, b])[:, :6], kv_cache=cache)
        cache.value_pages[:, cache.tables[1][-1], 1:] = float("nan")  # row 1's tokens 5.. go bad,
        cache.crop(torch.tensor([6, 5]))  # and are dropped (row 1 holds 5 tokens, in pages of 4)
        out = layer(torch.cat([a[:, 6 : 6 + new], b[:, 5 : 5 + new]]), kv_cache=cache)
        want_a = layer(a[:, : 6 + new])[:, 6:]
        want_b = layer(b[:, : 5 + new])[:, 5:]
    assert torch.isfinite(out).all()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(out[:1], want_a, **tol)
    torch.testing.assert_close(out[1:], want_b, **tol)


def test_a_crop_or_reorder_that_writes_an_inference_mode_pool_outside_it_changes_nothing():
    """A crop inside a page zeroes the dropped slots, and a reorder taking a row twice copies its
    pages: in a pool allocated under inference mode, outside it, both are refused before any
    bookkeeping changes (the reorder had given pages back to the free list when the copy
    failed); a crop to a page boundary and a permutation write nothing and are taken."""
    with torch.inference_mode():
        cache = PagedKVCache(8, 4, HKV, D, value_dim=DV, batch_size=2, dtype=torch.float64)
        cache.update(*_kv(2, 7, torch.Generator().manual_seed(0)))
    before = everything(cache)
    with pytest.raises(RuntimeError, match=r"^PagedKVCache\.crop: the cache's buffers were allocated under"):
        cache.crop(5)
    assert identical(everything(cache), before)
    with pytest.raises(RuntimeError, match=r"^PagedKVCache\.reorder: the cache's buffers were allocated under"):
        cache.reorder(torch.tensor([0, 0]))  # row 0 twice: its pages copied
    assert identical(everything(cache), before)
    cache.crop(4)
    cache.reorder(torch.tensor([1, 0]))  # no page copied
    assert cache.lengths.tolist() == [4, 4] and len(cache.free) == 6


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: PagedKVCache(0, 4, 1, 8), r"PagedKVCache: num_pages must be a positive int, got 0"),
        (lambda: PagedKVCache(4, 4, 1, 8, dtype=torch.int8), r"PagedKVCache: dtype must be a floating-point"),
    ],
)
def test_constructor_refuses_bad_sizes(make, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        make()


def test_release_refuses_rows_outside_the_batch():
    cache = PagedKVCache(4, 4, 1, 8, batch_size=2)
    with pytest.raises(ValueError, match=r"PagedKVCache.release: rows must be in \[0, 2\), got \[2\]"):
        cache.release(2)


BAD_ROWS = [  # (name, rows, message after "PagedKVCache.release: ")
    ("bool tensor", torch.tensor([False, False, True]), r"rows must be an int.* got a tensor of dtype torch.bool.*"),
    ("bool list", [False, False, True], r"rows must be ints, got \[False, False, True\]; hint"),
    ("a bool", True, r"rows must be an int, a sequence of ints or a 1-D integer tensor, got True"),
    ("a string", "1", r"rows must be an int, a sequence of ints or a 1-D integer tensor, got '1'"),
    ("a float tensor", torch.tensor([1.0]), r"rows must be .* got a tensor of dtype torch.float32"),
    ("a 2-D tensor", torch.tensor([[0, 1]]), r"rows must be .* got a tensor of dtype torch.int64, shape \(1, 2\)"),
]


@pytest.mark.parametrize("name, rows, pattern", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_release_refuses_rows_that_are_not_indices_and_changes_nothing(name, rows, pattern):
    """A "finished" bool mask ``tensor([False, False, True])`` was read as the indices 0, 0, 1 and
    released rows 0 and 1, the running ones, keeping the finished one; a bool list released
    nothing, and ``"1"`` released row 1: all with no error."""
    cache = PagedKVCache(16, 4, 1, 4, batch_size=3)
    cache.update(torch.randn(3, 1, 5, 4), torch.randn(3, 1, 5, 4))
    before = everything(cache)
    with pytest.raises(TypeError, match=r"^PagedKVCache\.release: " + pattern):
        cache.release(rows)
    assert identical(everything(cache), before)
    cache.release(torch.tensor([False, False, True]).nonzero().flatten())  # the hint
    cache.release(torch.tensor(1))
    assert cache.lengths.tolist() == [5, 0, 0] and len(cache.free) == 14


@pytest.mark.parametrize("seed", range(8))
def test_a_step_writes_the_pool_as_one_scatter_would_and_rollback_restores_the_bookkeeping(seed, monkeypatch):
    """A decode step's tokens are written through slices (page and offset known on the host) and
    a larger update through one scatter: the two give the same pool, bit for bit, over random
    updates of rows of several lengths. A rollback gives the pages its update claimed back to the
    free list in the order they left it and restores the tables and lengths, whatever the pool's
    size (the record is what the update changed, not a copy of the free list); the next read
    equals the tokens kept."""
    from multihead.caches import paged

    rng = random.Random(seed)
    B, ps = rng.choice([1, 2, 3, 5]), rng.choice([1, 3, 4, 16])
    caches = []
    for limit in (paged._SLICED_WRITES, 0):  # as it runs, and every write as one scatter
        monkeypatch.setattr(paged, "_SLICED_WRITES", limit)
        cache = PagedKVCache(200, ps, HKV, D, value_dim=DV, batch_size=B, dtype=torch.float64)
        random.Random(seed).shuffle(cache.free)
        caches.append(cache)
    gen = torch.Generator().manual_seed(seed)
    rows = [(torch.zeros(HKV, 0, D, dtype=torch.float64), torch.zeros(HKV, 0, DV, dtype=torch.float64))] * B
    for step in range(25):
        new = rng.choice([1, 1, 1, 2, 3, 7])
        k, v = _kv(B, new, gen)
        if step % 5 == 4:  # rows of several lengths
            target = [rng.randint(0, n) for n in caches[0].lengths.tolist()]
            rows = [(r[0][:, :t], r[1][:, :t]) for r, t in zip(rows, target)]
            for cache in caches:
                cache.crop(torch.tensor(target))
        undone = rng.random() < 0.3
        for limit, cache in zip((paged._SLICED_WRITES, 0), caches):
            monkeypatch.setattr(paged, "_SLICED_WRITES", limit)
            tables, lengths, free = [list(t) for t in cache.tables], cache.lengths.tolist(), list(cache.free)
            read = cache.update(k, v)
            _check_read(read, [(torch.cat([r[0], k[b]], 1), torch.cat([r[1], v[b]], 1)) for b, r in enumerate(rows)])
            if undone:
                cache.rollback()
                assert cache.tables == tables and cache.lengths.tolist() == lengths and cache.free == free
        assert torch.equal(caches[0].key_pages, caches[1].key_pages), step
        assert torch.equal(caches[0].value_pages, caches[1].value_pages), step
        if not undone:
            rows = [(torch.cat([r[0], k[b]], 1), torch.cat([r[1], v[b]], 1)) for b, r in enumerate(rows)]
    with torch.no_grad():  # the last read, through the decode path, against the fp64 reference
        k, v = _kv(B, 1, gen)
        read = caches[0].update(k, v)
        q = torch.randn(B, 2 * HKV, 1, D, generator=gen, dtype=torch.float64)
        got = mh.attention(q, read.keys, read.values, mask=read.mask(None, True, 2 * HKV))
    for b, (kb, vb) in enumerate(rows):
        keys, values = torch.cat([kb, k[b]], 1)[None], torch.cat([vb, v[b]], 1)[None]
        ref = mh.reference_attention(q[b : b + 1], keys, values, mask=mh.causal()).output
        torch.testing.assert_close(got[b : b + 1], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B", [1, 3])
def test_rows_of_one_length_read_their_filled_slots_in_order(B):
    """Rows of one length ``T`` read their ``T + new`` filled slots in order, as a static cache
    does: a contiguous read (no slot positions), ``slots(new)`` announcing it, and the causal
    rule ``causal()`` itself (no mask tensor for a decode step); rows of several lengths read
    every slot of the longest table with their positions. Both equal the fp64 attention over each
    row's tokens, through the decode path, with masks over the slots that leave rows fully masked."""
    gen = torch.Generator().manual_seed(B)
    cache = PagedKVCache(40, 4, HKV, 16, value_dim=16, batch_size=B, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, 22, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    cache.update(k[:, :, :21], v[:, :, :21])
    assert cache.slots(1) == 22
    read = cache.update(k[:, :, 21:], v[:, :, 21:])
    assert read.contiguous and read.slots == 22 and read.query_positions.tolist() == [21]
    assert read.mask(None, True, 4 * HKV) == mh.causal()
    q = torch.randn(B, 4 * HKV, 1, 16, generator=gen, dtype=torch.float64)
    hide = torch.ones(B, 4 * HKV, 1, 22, dtype=torch.bool)
    hide[:, 1, :, :] = False  # query head 1 sees nothing in any row
    hide[..., 3:9] = False
    for extra in (None, mh.sliding_window(5), hide):
        mask = read.mask(extra, True, 4 * HKV)
        got = decode_blocks(q, read.blocks, mask)
        want = mh.reference_attention(q, k, v, mask=(mh.causal() if extra is None else mh.causal() & extra)).output
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        if extra is hide:
            assert torch.equal(got[:, 1], torch.zeros_like(got[:, 1]))
    cache.rollback()
    if B > 1:  # rows of several lengths: every slot of the longest table, positions per row
        cache.crop(torch.tensor([21] + [13] * (B - 1)))
        assert cache.slots(1) == 24
        read = cache.update(k[:, :, 21:], v[:, :, 21:])
        assert not read.contiguous and read.slots == 24 and read.key_positions.shape == (B, 24)
        got = decode_blocks(q, read.blocks, read.mask(None, True, 4 * HKV))
        want = mh.reference_attention(q[:1], k[:1], v[:1], mask=mh.causal()).output
        torch.testing.assert_close(got[:1], want, rtol=1e-12, atol=1e-12)


def test_a_refused_step_changes_nothing_and_the_next_reads_right():
    """Positions that do not continue the rows, keys of another shape, and too few pages: refused
    before any change (block tables, free list, lengths, the table tensor reads use, the undo
    record); the next step and its rollback work as on a cache that saw no refusal."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(7, 4, HKV, D, value_dim=DV, batch_size=2, dtype=torch.float64)
    k, v = _kv(2, 8, gen)
    cache.update(k[:, :, :7], v[:, :, :7])
    before = everything(cache)
    for call, error in (
        (lambda: cache.update(k[:, :, 7:], v[:, :, 7:], positions=torch.tensor([8])), ValueError),
        (lambda: cache.update(k[:, :, 7:, :2], v[:, :, 7:], None), ValueError),
        (lambda: cache.update(*_kv(2, 10, gen)), ValueError),  # 3 more pages per row, 3 free
    ):
        with pytest.raises(error):
            call()
        assert identical(everything(cache), before)
    read = cache.update(k[:, :, 7:], v[:, :, 7:])
    assert torch.equal(read.keys, k) and torch.equal(read.values, v)
    cache.rollback()
    assert cache.lengths.tolist() == [7, 7] and torch.equal(cache.update(k[:, :, 7:], v[:, :, 7:]).keys, k)
