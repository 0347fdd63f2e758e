"""``PrefixCache``: shared pages, copy-on-write, the token index, LRU eviction; cascade and
ragged attention over it.

The property test drives random interleavings of requests whose prompts share prefixes and
diverge, forks, crops, appends of any length, releases and evictions (a small pool), and after
every step compares each live request with an independent contiguous cache: the keys and values
of a token are a function of the token ids up to it (as in a causal model), so a request must
read exactly the K/V of its own token sequence, however its pages were shared. A page that is
shared or indexed before a step and still held or indexed after it is never written.
"""

from __future__ import annotations

import random

import pytest
import torch

import multihead as mh
from multihead.caches import PrefixCache, prefix_attention, ragged_attention

HKV, D, DV = 2, 4, 3
DT = torch.float64


def token_kv(prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``(HKV, D)`` and V ``(HKV, DV)`` of the last token of ``prefix``: a function of every id up to it."""
    g = torch.Generator().manual_seed(hash(prefix) % (1 << 31))
    return torch.randn(HKV, D, generator=g, dtype=DT), torch.randn(HKV, DV, generator=g, dtype=DT)


def contiguous(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent cache: ``(1, HKV, L, ·)`` built token by token."""
    pairs = [token_kv(tuple(ids[: t + 1])) for t in range(len(ids))]
    k = torch.stack([p[0] for p in pairs], 1).unsqueeze(0) if pairs else torch.zeros(1, HKV, 0, D, dtype=DT)
    v = torch.stack([p[1] for p in pairs], 1).unsqueeze(0) if pairs else torch.zeros(1, HKV, 0, DV, dtype=DT)
    return k, v


def packed_kv(cache: PrefixCache, rids: list[int], new: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of each request's new tokens, packed in the order of ``rids``."""
    ks, vs = [], []
    for r, ids in zip(rids, new):
        have = cache.tokens(r)
        for i in range(len(ids)):
            k, v = token_kv(tuple(have + ids[: i + 1]))
            ks.append(k)
            vs.append(v)
    if not ks:
        return torch.zeros(1, HKV, 0, D, dtype=DT), torch.zeros(1, HKV, 0, DV, dtype=DT)
    return torch.stack(ks, 1).unsqueeze(0), torch.stack(vs, 1).unsqueeze(0)


def append(cache, rids, new):
    k, v = packed_kv(cache, rids, new)
    cache.append(rids, k, v, new)


def holders(cache: PrefixCache, page: int) -> set[tuple[int, int]]:
    """``(request, page number in its table)`` of every hold of ``page``."""
    return {(r, i) for r in cache.requests() for i, p in enumerate(cache.table(r)) if p == page}


def check_invariants(cache: PrefixCache) -> None:
    counts = [0] * cache.pool.num_pages
    for r in cache.requests():
        assert len(cache.table(r)) == -(-cache.length(r) // cache.page_size)
        for p in cache.table(r):
            counts[p] += 1
    assert counts == cache.refs
    free = set(cache.pool.free)
    assert len(free) == len(cache.pool.free)
    assert not free & {p for p, c in enumerate(counts) if c}
    idle = {p for p in range(cache.pool.num_pages) if p in cache.index and not counts[p]}
    assert not free & idle and cache.index.idle == len(idle)
    assert len(free) + len(idle) + sum(1 for c in counts if c) == cache.pool.num_pages


@pytest.mark.parametrize("seed", range(12))
def test_random_interleavings_equal_independent_contiguous_caches(seed):
    rng = random.Random(seed)
    ps = rng.choice([2, 3, 4])
    cache = PrefixCache(rng.choice([12, 20, 40]), ps, HKV, D, value_dim=DV, dtype=DT)
    prompts = [[rng.randrange(5) for _ in range(rng.randint(1, 14))] for _ in range(3)]  # few ids: shared runs
    live: dict[int, list[int]] = {}
    refused = 0
    for step in range(120):
        shared = {p for p in range(cache.pool.num_pages) if cache.refs[p] > 1 or p in cache.index}
        before = {p: (cache.pool.key_pages[:, p].clone(), cache.pool.value_pages[:, p].clone()) for p in shared}
        identity = {p: (cache.index.key_of(p), holders(cache, p)) for p in shared}
        action = rng.random()
        try:
            if action < 0.3 or not live:
                base = rng.choice(prompts)
                prompt = base[: rng.randint(1, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 5))]
                if not prompt:
                    prompt = [0]
                rid, cached = cache.admit(prompt)
                assert cached % ps == 0 and cached < len(prompt) and cache.tokens(rid) == prompt[:cached]
                live[rid] = prompt[:cached]
                try:
                    append(cache, [rid], [prompt[cached:]])
                    live[rid] = prompt
                except ValueError as exc:  # out of pages: the request holds its cached pages only
                    assert "more pages" in str(exc)
                    refused += 1
            elif action < 0.6:
                rids = rng.sample(sorted(live), rng.randint(1, len(live)))
                new = [[rng.randrange(5) for _ in range(rng.choice([0, 1, 1, 2, 5]))] for _ in rids]
                try:
                    append(cache, rids, new)
                    for r, ids in zip(rids, new):
                        live[r] = live[r] + ids
                except ValueError as exc:
                    assert "more pages" in str(exc)
                    refused += 1
            elif action < 0.7:
                r = rng.choice(sorted(live))
                live[cache.fork(r)] = list(live[r])
            elif action < 0.8:
                r = rng.choice(sorted(live))
                n = rng.randint(0, len(live[r]))
                cache.crop(r, n)
                live[r] = live[r][:n]
            else:
                r = rng.choice(sorted(live))
                cache.release(r)
                del live[r]
        finally:
            check_invariants(cache)
        for p, (k, v) in before.items():  # shared before and still the same page's content: never written
            key, held = identity[p]
            if (key is not None and cache.index.key_of(p) == key) or held & holders(cache, p):
                same = torch.equal(cache.pool.key_pages[:, p], k) and torch.equal(cache.pool.value_pages[:, p], v)
                assert same, (step, p)
        assert sorted(live) == sorted(cache.requests())
        for r, ids in live.items():
            assert cache.tokens(r) == ids
            k, v = cache.read(r)
            want_k, want_v = contiguous(ids)
            assert torch.equal(k, want_k) and torch.equal(v, want_v), (step, r)
            start = rng.randint(0, len(ids))
            assert torch.equal(cache.read(r, start)[1], want_v[:, :, start:]), (step, r, start)
    assert refused < 120


def test_a_second_request_reuses_the_pages_of_a_finished_prompt_and_evicts_lru():
    ps = 4
    cache = PrefixCache(6, ps, HKV, D, value_dim=DV, dtype=DT)
    a, cached = cache.admit(list(range(10)))
    assert cached == 0
    append(cache, [a], [list(range(10))])
    first_pages = cache.table(a)[:2]
    cache.release(a)
    assert cache.free_pages == 4 and cache.index.idle == 2  # two full pages stay cached
    b, cached = cache.admit(list(range(8)) + [99, 98])
    assert cached == 8 and cache.table(b) == first_pages
    append(cache, [b], [[99, 98]])
    k, _ = cache.read(b)
    assert torch.equal(k, contiguous(list(range(8)) + [99, 98])[0])
    cache.release(b)
    c, cached = cache.admit([7] * 25)  # needs every page: the cached ones are evicted, LRU first
    append(cache, [c], [[7] * 24])
    assert cache.index.idle == 0 and cache.length(c) == 24
    # a prompt that equals what is cached still computes its last token
    cache.release(c)
    d, cached = cache.admit([7] * 8)
    assert cached == 4


def test_fork_copies_the_shared_last_page_on_the_first_write():
    cache = PrefixCache(10, 4, HKV, D, value_dim=DV, dtype=DT)
    a, _ = cache.admit([1, 2, 3, 4, 5, 6])
    append(cache, [a], [[1, 2, 3, 4, 5, 6]])
    b = cache.fork(a)
    assert cache.table(a) == cache.table(b) and cache.refs[cache.table(a)[1]] == 2
    last = cache.table(a)[1]
    before = cache.pool.key_pages[:, last].clone()
    append(cache, [b], [[7]])
    assert cache.table(b)[1] != last and cache.table(b)[0] == cache.table(a)[0]
    assert torch.equal(cache.pool.key_pages[:, last], before)  # the shared page was not written
    append(cache, [a], [[8]])  # a holds it alone now: written in place
    assert cache.table(a)[1] == last
    for r, ids in ((a, [1, 2, 3, 4, 5, 6, 8]), (b, [1, 2, 3, 4, 5, 6, 7])):
        assert torch.equal(cache.read(r)[0], contiguous(ids)[0])


BAD = [
    ("admit empty", lambda c, r: c.admit([]), ValueError, r"prompt must hold at least one token id"),
    ("admit floats", lambda c, r: c.admit([1.0]), TypeError, r"prompt must be a list of int token ids"),
    ("unknown request", lambda c, r: c.release(99), ValueError, r"PrefixCache.release: no live request 99"),
    ("crop negative", lambda c, r: c.crop(r, -1), ValueError, r"length must be an int >= 0, got -1"),
    (
        "k shape",
        lambda c, r: c.append([r], torch.zeros(1, HKV, 2, D, dtype=DT), torch.zeros(1, HKV, 1, DV, dtype=DT), [[1]]),
        ValueError,
        r"k must be \(1, Hkv, T, ·\) = \(1, 2, 1, 4\)",
    ),
    (
        "dtype",
        lambda c, r: c.append([r], torch.zeros(1, HKV, 1, D), torch.zeros(1, HKV, 1, DV), [[1]]),
        TypeError,
        r"k must be torch.float64",
    ),
    ("twice", lambda c, r: append(c, [r, r], [[1], [2]]), ValueError, r"each request appears once per call"),
    ("out of pages", lambda c, r: append(c, [r], [[1] * 40]), ValueError, r"need 10 more pages .* 2 are free"),
]


@pytest.mark.parametrize("name, call, error, pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_refused_with_nothing_half_done(name, call, error, pattern):
    cache = PrefixCache(4, 4, HKV, D, value_dim=DV, dtype=DT)
    r, _ = cache.admit([1, 2, 3, 4, 5])
    append(cache, [r], [[1, 2, 3, 4, 5]])
    state = (list(cache.refs), list(cache.pool.free), cache.table(r), cache.tokens(r), cache.pool.key_pages.clone())
    with pytest.raises(error, match=pattern):
        call(cache, r)
    after = (list(cache.refs), list(cache.pool.free), cache.table(r), cache.tokens(r), cache.pool.key_pages)
    assert state[:4] == after[:4] and torch.equal(state[4], after[4])


# ---------------------------------------------------------------------------- attention over it
def dense(q, k, v, L):
    """fp64 bottom-right causal attention of ``q (1, Hq, n, D)`` over ``k (1, Hkv, L, D)``."""
    Hq, n = q.shape[1], q.shape[2]
    G = Hq // k.shape[1]
    s = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
    i = torch.arange(L - n, L).view(-1, 1)
    s = s.masked_fill(torch.arange(L).view(1, -1) > i, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(G, 1)


@pytest.mark.parametrize("Hq", [2, 4])
@pytest.mark.parametrize("lq", [1, 3])
def test_prefix_attention_reads_the_shared_pages_once_and_equals_each_request_alone(Hq, lq):
    cache = PrefixCache(64, 4, HKV, D, value_dim=DV, dtype=DT)
    prompt = list(range(1, 18))
    base, _ = cache.admit(prompt)
    append(cache, [base], [prompt])
    rids = [base]
    for tail in ([50, 51], [52], [53, 54, 55, 56, 57]):
        r, cached = cache.admit(prompt + tail)
        assert cached == 16
        append(cache, [r], [(prompt + tail)[cached:]])
        rids.append(r)
    rids.append(cache.fork(rids[1]))  # shares rids[1]'s partial last page until it writes
    append(cache, rids, [[9 + i] * lq for i, _ in enumerate(rids)])
    assert cache.shared_prefix(rids) == 16
    assert cache.shared_prefix([rids[1], rids[-1]]) == 16  # the fork copied its last page on writing
    q = torch.randn(len(rids), Hq, lq, D, dtype=DT)
    out = prefix_attention(cache, q, rids)
    for b, r in enumerate(rids):
        k, v = cache.read(r)
        torch.testing.assert_close(out[b : b + 1], dense(q[b : b + 1], k, v, k.shape[2]))


@pytest.mark.parametrize("query_lengths", [[1, 1, 1], [5, 1, 3], [0, 4, 1], [7]])
def test_ragged_attention_equals_each_request_run_alone(query_lengths):
    Hq = 4
    cache = PrefixCache(64, 4, HKV, D, value_dim=DV, dtype=DT)
    rids = []
    for n, prompt in zip(query_lengths, ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [3] * 11)):
        r, cached = cache.admit(prompt)
        append(cache, [r], [prompt[cached:]])
        append(cache, [r], [[7] * n])  # the step's new tokens: a chunk, one token, or none
        rids.append(r)
    T = sum(query_lengths)
    q = torch.randn(1, Hq, T, D, dtype=DT)
    out = ragged_attention(cache, q, rids, query_lengths)
    assert out.shape == (1, Hq, T, DV)
    start = 0
    for r, n in zip(rids, query_lengths):
        k, v = cache.read(r)
        want = dense(q[:, :, start : start + n], k, v, k.shape[2])
        torch.testing.assert_close(out[:, :, start : start + n], want)
        start += n


def test_ragged_attention_reads_a_mask_object_at_each_requests_positions():
    Hq = 2
    cache = PrefixCache(64, 4, HKV, D, value_dim=DV, dtype=DT)
    rids = []
    for prompt in ([1] * 9, [2] * 13):
        r, _ = cache.admit(prompt)
        append(cache, [r], [prompt])
        rids.append(r)
    lengths = [3, 2]
    q = torch.randn(1, Hq, 5, D, dtype=DT)
    out = ragged_attention(cache, q, rids, lengths, mask=mh.sliding_window(4))
    start = 0
    for r, n in zip(rids, lengths):
        k, v = cache.read(r)
        want = mh.attention(
            q[:, :, start : start + n], k, v, mask=mh.sliding_window(4) & mh.causal(), backend="reference"
        )
        torch.testing.assert_close(out[:, :, start : start + n], want)
        start += n


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "blocksparse"])
def test_ragged_attention_takes_a_mask_per_request(backend):
    """One call: a prefill chunk under a window, a decode token, and a draft tree being verified,
    each equal to its request attended alone (packed queries, no padding)."""
    Hq = 4
    cache = PrefixCache(64, 4, HKV, D, value_dim=DV, dtype=DT)
    parents = torch.tensor([-1, 0, 0, 1])
    rids = []
    for prompt, new in (([1] * 6, [5] * 5), ([2] * 10, [6]), ([3] * 7, [7, 8, 9, 10])):
        r, _ = cache.admit(prompt)
        append(cache, [r], [prompt])
        append(cache, [r], [new])  # this step's tokens: a chunk, one token, the tree's 4 drafts
        rids.append(r)
    lengths = [5, 1, 4]
    masks = [mh.sliding_window(3), None, mh.tree(parents)]
    q = torch.randn(1, Hq, sum(lengths), D, dtype=DT)
    out = ragged_attention(cache, q, rids, lengths, mask=masks, backend=backend)
    start = 0
    for r, n, own in zip(rids, lengths, masks, strict=True):
        k, v = cache.read(r)
        alone = mh.causal() if own is None else own & mh.causal()
        want = mh.attention(q[:, :, start : start + n], k, v, mask=alone, backend="reference")
        torch.testing.assert_close(out[:, :, start : start + n], want)
        start += n


def test_ragged_attention_reads_a_bottom_right_tree_in_each_request():
    """One tree for every request (each verifying its own 3 drafts after prefixes of different
    lengths): read on each request's own sequence, so it is each request's last 3 tokens."""
    cache = PrefixCache(64, 4, HKV, D, value_dim=DV, dtype=DT)
    draft = mh.tree(torch.tensor([-1, 0, 0]))
    rids = []
    for prompt in ([1] * 5, [2] * 12):
        r, _ = cache.admit(prompt)
        append(cache, [r], [prompt + [4, 5, 6]])
        rids.append(r)
    q = torch.randn(1, 2, 6, D, dtype=DT)
    out = ragged_attention(cache, q, rids, [3, 3], mask=draft)
    for i, r in enumerate(rids):
        k, v = cache.read(r)
        want = mh.attention(q[:, :, 3 * i : 3 * i + 3], k, v, mask=draft, backend="reference")
        torch.testing.assert_close(out[:, :, 3 * i : 3 * i + 3], want)
    with pytest.raises(TypeError, match=r"one per request \(2: mask objects or None\), got \['Band'\]"):
        ragged_attention(cache, q, rids, [3, 3], mask=[mh.causal()])


def test_ragged_attention_refuses_queries_the_cache_does_not_hold():
    cache = PrefixCache(8, 4, HKV, D, value_dim=DV, dtype=DT)
    r, _ = cache.admit([1, 2])
    append(cache, [r], [[1, 2]])
    with pytest.raises(ValueError, match=r"request 0 has 3 queries but holds 2 tokens"):
        ragged_attention(cache, torch.zeros(1, 2, 3, D, dtype=DT), [r], [3])
    with pytest.raises(ValueError, match=r"q must be \(1, Hq, T, D\) with T = sum\(query_lengths\) = 2"):
        ragged_attention(cache, torch.zeros(1, 2, 3, D, dtype=DT), [r], [2])
