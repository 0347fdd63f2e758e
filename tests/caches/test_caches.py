"""The three caches on their own: what an update stores and returns, growth, nbytes, crop,
reorder, reset, rollback, and refused calls that change nothing."""

from __future__ import annotations

import re

import pytest
import torch
from cache_state import everything, identical

import multihead as mh
from helpers import DEVICES
from multihead.caches import (
    CacheRead,
    DynamicKVCache,
    KVCache,
    LatentKVCache,
    PagedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from multihead.caches.base import EMPTY_POSITION

B, HKV, D, DV = 2, 3, 5, 7


def _kv(L, B=B, Hkv=HKV, D=D, Dv=DV, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)  # drawn on CPU, then moved
    k, v = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype), torch.randn(B, Hkv, L, Dv, generator=g, dtype=dtype)
    return k.to(device), v.to(device)


def _static(max_len=12, device=None):
    return StaticKVCache(B, max_len, HKV, D, value_dim=DV, dtype=torch.float64, device=device)


def _sliding(window=3, extra=0, device=None):
    return SlidingWindowKVCache(window, B, HKV, D, value_dim=DV, extra=extra, dtype=torch.float64, device=device)


MAKERS = {"dynamic": DynamicKVCache, "static": _static, "sliding": _sliding}


def _state(cache) -> list:
    """Everything a cache holds, copied, to compare before and after a refused call."""
    if isinstance(cache, DynamicKVCache):
        return [
            cache.length,
            None if cache.keys is None else cache.keys.clone(),
            None if cache.values is None else cache.values.clone(),
        ]
    if isinstance(cache, StaticKVCache):
        return [cache.keys.clone(), cache.values.clone(), cache.lengths.clone()]
    return [cache.length, cache.keys.clone(), cache.values.clone(), cache.positions.clone()]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (isinstance(x, torch.Tensor) and torch.equal(x, y)) or x == y for x, y in zip(a, b)
    )


# ---------------------------------------------------------------------------- storage
@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_cache_returns_every_token_oldest_first_and_grows_by_doubling(device):
    cache = DynamicKVCache(capacity=4)
    assert cache.length == 0 and cache.keys is None and cache.nbytes == 0
    chunks = [_kv(L, seed=i, device=device) for i, L in enumerate([3, 1, 1, 3, 1])]
    capacities = []
    for n, (k, v) in enumerate(chunks, start=1):
        read = cache.update(k, v)
        expected_k = torch.cat([c[0] for c in chunks[:n]], dim=2)
        assert isinstance(read, CacheRead) and read.contiguous and read.keys.device == k.device
        assert torch.equal(read.keys, expected_k) and torch.equal(read.values, torch.cat([c[1] for c in chunks[:n]], 2))
        positions = read.query_positions.cpu()
        assert torch.equal(positions, torch.arange(expected_k.shape[2] - k.shape[2], expected_k.shape[2]))
        capacities.append(cache.capacity)
    assert capacities == [4, 4, 8, 8, 16]  # 3, 4, 5 (doubled), 8, 9 (doubled): amortised, not one cat per step
    assert cache.nbytes == 16 * B * HKV * (D + DV) * 8


@pytest.mark.parametrize("device", DEVICES)
def test_static_cache_writes_each_row_at_its_own_length_and_returns_all_slots(device):
    cache = _static(max_len=6, device=device)
    k, v = _kv(3, device=device)
    cache.update(k, v)
    cache.crop(torch.tensor([3, 1]))  # row 1 keeps one token (lengths on CPU, as a caller has them)
    k1, v1 = _kv(1, seed=1, device=device)
    read = cache.update(k1, v1)
    assert read.keys is cache.keys and read.keys.shape == (B, HKV, 6, D) and read.keys.device == k.device
    assert torch.equal(read.query_positions.cpu(), torch.tensor([[3], [1]]))
    assert torch.equal(cache.keys[0, :, 3], k1[0, :, 0]) and torch.equal(cache.keys[1, :, 1], k1[1, :, 0])
    assert torch.equal(cache.keys[0, :, :3], k[0]) and torch.equal(cache.keys[1, :, 0], k[1, :, 0])
    assert cache.lengths.tolist() == [4, 2] and cache.length == 4
    allowed = read.mask(None, causal=True)  # (B, 1, 1, 6): each row sees its own tokens only
    assert allowed[:, 0, 0].tolist() == [[True] * 4 + [False] * 2, [True] * 2 + [False] * 4]
    assert cache.nbytes == B * HKV * 6 * (D + DV) * 8 + B * 8


@pytest.mark.parametrize("device", DEVICES)
def test_sliding_cache_keeps_the_last_window_plus_one_tokens_in_a_ring(device):
    cache = _sliding(window=2, device=device)  # capacity 3
    k, v = _kv(7, device=device)
    for t in range(7):
        read = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert cache.positions.tolist() == [6, 4, 5]  # slot p % 3
    assert torch.equal(read.keys[:, :, 0], k[:, :, 6]) and read.window == 2
    window = mh.sliding_window(2)  # the mask the ring serves (a wider one is refused)
    # positions 4, 5, 6 for the query at 6: every slot, so no mask at all (decided on the host)
    assert read.held == range(4, 7) and read.mask(window, causal=True) is None
    chunk_k, chunk_v = _kv(4, seed=3, device=device)  # a step of 4 tokens straddling the wrap: the ring, then them
    read = cache.update(chunk_k, chunk_v)
    assert read.keys.shape[2] == 3 + 4 and read.key_positions.tolist() == [6, 4, 5, 7, 8, 9, 10]
    assert cache.positions.tolist() == [9, 10, 8] and cache.length == 11
    visible = read.mask(window, causal=True)[0, 0]  # query 7 sees 5, 6, 7; query 10 sees 8, 9, 10
    assert visible[0].tolist() == [True, False, True, True, False, False, False]
    assert visible[3].tolist() == [False, False, False, False, True, True, True]


def test_every_cache_is_a_kv_cache_and_the_interface_is_abstract():
    assert all(isinstance(make(), KVCache) for make in MAKERS.values())
    with pytest.raises(TypeError, match="abstract"):
        KVCache()


# ---------------------------------------------------------------------------- crop, reorder, reset, rollback
@pytest.mark.parametrize("kind", MAKERS)
def test_rollback_undoes_the_last_update_once(kind):
    cache = MAKERS[kind]()
    cache.update(*_kv(3))
    before = _state(cache)
    cache.update(*_kv(2, seed=1))
    cache.rollback()
    assert cache.length == 3
    if kind != "static":  # a static cache keeps what was written past the lengths: hidden, overwritten next
        assert _same(_state(cache), before)
    with pytest.raises(RuntimeError, match=r"rollback: no update to undo \(once per update\)"):
        cache.rollback()


@pytest.mark.parametrize("kind", MAKERS)
def test_reset_empties_the_cache(kind):
    cache = MAKERS[kind]()
    cache.update(*_kv(3))
    cache.reset()
    assert cache.length == 0
    read = cache.update(*_kv(1, seed=2))
    assert read.query_positions.reshape(-1).tolist()[0] == 0 and cache.length == 1


def test_sliding_crop_goes_back_as_far_as_the_ring_allows():
    cache = _sliding(window=2, extra=2)  # capacity 5
    k, v = _kv(8)
    for t in range(8):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    with pytest.raises(
        ValueError,
        match=r"going back to 4 tokens needs positions 2..3, but the ring \(capacity 5\) only "
        r"holds 3..7; crop at most 3 tokens back",
    ):
        cache.crop(4)
    assert cache.length == 8
    cache.crop(5)
    assert cache.length == 5 and sorted(p for p in cache.positions.tolist() if p != EMPTY_POSITION) == [3, 4]


BAD_CROPS = [  # (a crop past what a row holds keeps the row: tests/caches/test_contract.py)
    ("dynamic", DynamicKVCache, torch.tensor([1, 2]), TypeError, r"same length here, so length must be an int"),
    ("dynamic", DynamicKVCache, -1, ValueError, r"crop: length must be >= 0, got -1"),
    ("dynamic", DynamicKVCache, 1.5, TypeError, r"crop: length must be an int, got float"),
    ("static", _static, torch.tensor([1.0, 2.0]), TypeError, r"must be integers of shape \(B,\) = \(2,\)"),
    (
        "static",
        _static,
        torch.tensor([1, 2, 3]),
        TypeError,
        r"shape \(B,\) = \(2,\), got dtype torch.int64, shape \(3,\)",
    ),
]


@pytest.mark.parametrize(
    "kind, make, length, error, pattern", BAD_CROPS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CROPS)]
)
def test_a_refused_crop_changes_nothing(kind, make, length, error, pattern):
    cache = make()
    cache.update(*_kv(3))
    before = _state(cache)
    with pytest.raises(error, match=pattern):
        cache.crop(length)
    assert _same(_state(cache), before)


@pytest.mark.parametrize("kind", MAKERS)
def test_reorder_moves_rows_and_refuses_bad_indices(kind):
    cache = MAKERS[kind]()
    k, v = _kv(3)
    cache.update(k, v)
    before = _state(cache)
    for bad, error, pattern in [
        (torch.tensor([0, 2]), ValueError, r"indices must be rows in \[0, 2\), got values in \[0, 2\]"),
        (torch.tensor([[0, 1]]), TypeError, r"indices must be a 1-D integer tensor"),
        (torch.tensor([0.0, 1.0]), TypeError, r"indices must be a 1-D integer tensor of batch rows .*float32"),
        ([True, False], TypeError, r"indices must be ints"),
    ]:
        with pytest.raises(error, match=f"{type(cache).__name__}.reorder: " + pattern):
            cache.reorder(bad)
        assert _same(_state(cache), before)
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.keys[:, :, :3], k[[1, 1]])


# ---------------------------------------------------------------------------- refused updates
k1, v1 = _kv(1, seed=1)
BAD_UPDATES = [  # (name, k, v, positions, error, message after "<Cache>.update: ")
    ("k not a tensor", [[0.0]], v1, None, TypeError, r"k must be a torch.Tensor \(B, Hkv, Lnew, D\), got list"),
    (
        "v sparse",
        k1,
        v1.to_sparse(),
        None,
        TypeError,
        r"v must be a dense \(strided\) tensor \(B, Hkv, Lnew, Dv\), got layout torch.sparse_coo",
    ),
    (
        "k 3-D",
        k1[0],
        v1,
        None,
        ValueError,
        r"k must have 4 dims \(B, Hkv, Lnew, D\), got shape \(3, 1, 5\); hint: split",
    ),
    ("k, v lengths", k1, _kv(2, seed=1)[1], None, ValueError, r"k and v must agree on \(B, Hkv, Lnew\)"),
    (
        "k, v dtypes",
        k1,
        v1.float(),
        None,
        TypeError,
        r"k and v must share a dtype, got torch.float64 and torch.float32",
    ),
    ("k, v devices", k1, v1.to("meta"), None, ValueError, r"k and v must be on one device, got cpu and meta"),
    ("batch", *_kv(1, B=1), None, ValueError, r"new keys/values have B=1 but the cache holds B=2"),
    ("kv heads", *_kv(1, Hkv=1), None, ValueError, r"new keys/values have Hkv=1 but the cache holds Hkv=3"),
    ("head dim", *_kv(1, D=6), None, ValueError, r"new keys/values have D=6 but the cache holds D=5"),
    ("value dim", *_kv(1, Dv=5), None, ValueError, r"new keys/values have Dv=5 but the cache holds Dv=7"),
    (
        "dtype",
        k1.float(),
        v1.float(),
        None,
        TypeError,
        r"new keys/values have dtype torch.float32 but the cache holds torch.float64",
    ),
    ("device", k1.to("meta"), v1.to("meta"), None, ValueError, r"new keys/values are on meta but the cache is on cpu"),
]
POSITION_UPDATES = [  # every cache checks that positions continue the sequence
    ("positions backwards", k1, v1, torch.tensor([2]), ValueError, r"positions must continue"),
    ("positions with a gap", k1, v1, torch.tensor([4]), ValueError, r"positions must continue"),
    ("positions shape", k1, v1, torch.tensor([3, 4]), ValueError, r"positions must have shape \(1,\) or \(2, 1\)"),
    ("positions float", k1, v1, torch.tensor([3.0]), TypeError, r"positions must be an integer tensor"),
]


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize(
    "name, k, v, positions, error, pattern",
    BAD_UPDATES + POSITION_UPDATES,
    ids=[c[0] for c in BAD_UPDATES + POSITION_UPDATES],
)
def test_a_refused_update_changes_nothing(kind, name, k, v, positions, error, pattern):
    cache = MAKERS[kind]()
    cache.update(*_kv(3))
    before = _state(cache)
    with pytest.raises(error, match=rf"^{type(cache).__name__}\.update: " + pattern):
        cache.update(k, v, positions)
    assert _same(_state(cache), before)
    cache.update(k1, v1)  # and it still works
    assert cache.length == 4


def test_static_cache_refuses_to_write_past_max_len():
    cache = _static(max_len=4)
    cache.update(*_kv(3))
    before = _state(cache)
    with pytest.raises(
        ValueError,
        match=r"StaticKVCache.update: writing 2 tokens after the 3 stored in the longest row "
        r"would pass max_len=4",
    ):
        cache.update(*_kv(2))
    assert _same(_state(cache), before)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: StaticKVCache(0, 4, 1, 8), r"StaticKVCache: batch_size must be a positive int, got 0"),
        (lambda: StaticKVCache(1, 4, 1, 8, dtype=torch.int64), r"StaticKVCache: dtype must be a floating-point"),
        (lambda: SlidingWindowKVCache(-1, 1, 1, 8), r"SlidingWindowKVCache: window must be an int >= 0, got -1"),
        (lambda: DynamicKVCache(capacity=0), r"DynamicKVCache: capacity must be a positive int, got 0"),
    ],
)
def test_constructors_refuse_bad_sizes(make, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        make()


def test_gqa_and_mqa_caches_hold_only_the_kv_heads():
    """Cache bytes scale with Hkv: MQA (1 head) stores 1/8 of MHA's (8 heads)."""
    mha, gqa, mqa = (StaticKVCache(1, 64, h, 16) for h in (8, 2, 1))
    payload = [c.keys.nbytes + c.values.nbytes for c in (mha, gqa, mqa)]
    assert payload == [2 * 64 * 16 * 4 * h for h in (8, 2, 1)]


# ---------------------------------------------------------------------------- issue 28
C_LATENT = 4  # LatentKVCache rows: DV = C_LATENT + 3 features, values the first C_LATENT of them


def _latent_kv(L, seed=0):
    rows = torch.randn(B, 1, L, C_LATENT + 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return rows, rows[..., :C_LATENT]


EVERY_CACHE = {  # name: (make, kv(L, seed))
    "dynamic": (DynamicKVCache, _kv),
    "latent": (LatentKVCache, _latent_kv),
    "static": (_static, _kv),
    "sliding": (_sliding, _kv),
    "paged": (lambda: PagedKVCache(8, 2, HKV, D, value_dim=DV, batch_size=B, dtype=torch.float64), _kv),
}
BAD_POSITIONS = [  # after 3 tokens, one new token: (name, positions, error, message after "<Cache>.update: ")
    (
        "skips",
        torch.tensor([5]),
        ValueError,
        r"positions must continue each row: expected \[3\] in every row .*got \[5\]",
    ),
    ("goes back", torch.tensor([1]), ValueError, r"positions must continue each row: expected \[3\] .*got \[1\]"),
    (
        "one row skips",
        torch.tensor([[3], [4]]),
        ValueError,
        r"positions must continue each row: expected \[3\] in every row .*got row 0: \[3\]; row 1: \[4\]",
    ),
    ("shape", torch.tensor([3, 4]), ValueError, r"positions must have shape \(1,\) or \(2, 1\) .*got \(2,\)"),
    ("3-D", torch.tensor([[[3]]]), ValueError, r"positions must have shape \(1,\) or \(2, 1\) .*got \(1, 1, 1\)"),
    ("float", torch.tensor([3.0]), TypeError, r"positions must be an integer tensor \(1,\) or \(2, 1\) .*float32"),
    ("bool", torch.tensor([True]), TypeError, r"positions must be an integer tensor .*got dtype torch.bool"),
    ("list", [3], TypeError, r"positions must be an integer tensor .*got list"),
]


@pytest.mark.parametrize("name, positions, error, pattern", BAD_POSITIONS, ids=[c[0] for c in BAD_POSITIONS])
@pytest.mark.parametrize("kind", EVERY_CACHE)
def test_every_cache_refuses_positions_that_do_not_continue_it(kind, name, positions, error, pattern):
    """Issue 28: DynamicKVCache and LatentKVCache took any positions (skipping, going back, of any
    shape, floats) and handed them back as query_positions. Every cache now refuses them with the
    same check and message, and stays bit-identical; the right positions still work."""
    make, kv = EVERY_CACHE[kind]
    cache = make()
    cache.update(*kv(3))
    before = everything(cache)
    k, v = kv(1, seed=1)
    with pytest.raises(error, match=rf"^{type(cache).__name__}\.update: " + pattern):
        cache.update(k, v, positions)
    assert identical(everything(cache), before)
    read = cache.update(k, v, torch.tensor([3]))
    assert read.query_positions.reshape(-1, 1).unique().tolist() == [3] and cache.length == 4


def test_a_latent_cache_refuses_bad_positions_on_its_first_update_and_stays_empty():
    """The first update fixes the latent width: bad positions must not fix it (nor anything else)."""
    cache = LatentKVCache()
    before = everything(cache)
    with pytest.raises(
        ValueError, match=r"^LatentKVCache\.update: positions must continue each row: expected \[0..2\]"
    ):
        cache.update(*_latent_kv(3), torch.tensor([1, 2, 3]))
    assert identical(everything(cache), before) and cache.latent_dim is None and cache.keys is None
    rows, latent = _latent_kv(3)
    read = cache.update(rows, latent, torch.tensor([0, 1, 2]))
    assert read.query_positions.tolist() == [0, 1, 2] and cache.latent_dim == C_LATENT


def _visible(read, window):
    """{position: key of row 0, head 0} the query of a one-token read sees under sliding_window(window)."""
    allowed = read.mask(mh.sliding_window(window), causal=True)
    # (S,); None: a full ring whose window reaches every slot (no mask needed)
    allowed = torch.ones(read.keys.shape[2], dtype=torch.bool) if allowed is None else allowed[0, 0, 0]
    positions = read.key_positions.reshape(-1, read.keys.shape[2])[0]
    return {int(p): read.keys[0, 0, j] for j, p in enumerate(positions.tolist()) if allowed[j]}


@pytest.mark.parametrize("extra", [0, 1, 2])
@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_a_sliding_crop_is_honoured_or_refused_with_the_range_it_lacks(window, extra):
    """Issue 28: SlidingWindowKVCache(window=0).crop(n) refused crops further back than extra + 1
    tokens with an empty range ("needs positions 3..2"), though a query of a window-0 attention sees
    no earlier token. Every crop of a ring of 9 tokens is now honoured exactly when the positions the
    next query sees are held (and decoding goes on as from a fresh cache), or refused naming the
    non-empty range it lacks, changing nothing."""
    L, capacity = 9, window + 1 + extra
    k, v = _kv(L + 1)
    for n in range(L + 1):
        cache = _sliding(window, extra)
        for t in range(L):
            cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        honourable = window == 0 or n == 0 or max(0, n - window) >= max(0, L - capacity)
        before = everything(cache)
        if not honourable:
            with pytest.raises(ValueError, match=r"crop: going back to \d+ tokens needs positions") as refused:
                cache.crop(n)
            first, last = map(int, re.search(r"needs positions (\d+)\.\.(\d+)", str(refused.value)).groups())
            held = {p for p in cache.positions.tolist() if p != EMPTY_POSITION}
            assert first <= last == n - 1 and not set(range(first, last + 1)) <= held, str(refused.value)
            assert identical(everything(cache), before)
            continue
        cache.crop(n)
        assert cache.length == n
        fresh = _sliding(window, extra)
        for t in range(n):
            fresh.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        got = _visible(cache.update(k[:, :, L : L + 1], v[:, :, L : L + 1]), window)
        want = _visible(fresh.update(k[:, :, L : L + 1], v[:, :, L : L + 1]), window)
        assert got.keys() == want.keys() == set(range(max(0, n - window), n + 1)), (n, got.keys())
        assert all(torch.equal(got[p], want[p]) for p in got)


def test_a_window_0_sliding_cache_crops_any_number_of_tokens_back():
    """Issue 28's case: window=0, extra=0 (one slot), 8 tokens, crop(3): honoured."""
    cache = _sliding(window=0)
    k, v = _kv(8)
    for t in range(8):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    cache.crop(3)
    assert cache.length == 3 and cache.positions.tolist() == [EMPTY_POSITION]
    read = cache.update(*_kv(1, seed=4))
    assert read.query_positions.tolist() == [3] and cache.positions.tolist() == [3]
