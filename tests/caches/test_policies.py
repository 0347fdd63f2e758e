"""Eviction policies (``multihead.caches.policies``) against independent fp64 oracles.

Each oracle below recomputes, from dense full-attention weights over the whole sequence, which
positions the paper's rule keeps (StreamingLLM: sinks + window; SnapKV: the observation window's
pooled votes; H2O: accumulated attention, heavy + recent), and what attention over the kept
tokens must give: full attention with every dropped key masked. The cache computes its scores a
block of rows at a time from the queries; the tests never hand it the oracle's weights.
"""

from __future__ import annotations

import pytest
import torch
from cache_state import everything, identical

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.caches.policies import H2O, PolicyKVCache, SinksAndWindow, SnapKV
from multihead.positions import RotaryEmbedding

DT = torch.float64


def _draw(B, H, L, D, seed, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, L, D, generator=g, dtype=DT).to(dtype)


def dense_attention(q, k, v, allowed):
    """fp64 ``softmax(q kᵀ / sqrt(D))`` with ``allowed (B|1, Hq|1, Lq, Lk)``; grouped KV heads
    repeated; returns ``(out, weights)``."""
    B, Hq, Lq, D = q.shape
    G = Hq // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ k.transpose(-1, -2)) / D**0.5
    s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v, w


def _step(cache, q, k, v):
    """One update of ``cache`` with queries ``q`` observed, and the attention over its read."""
    cache.observe(q)
    read = cache.update(k, v)
    mask = read.mask(None, True, q.shape[1])
    return mh.attention(q, read.keys, read.values, mask=mask), read


def _kept(cache) -> list[list[set[int]]]:
    kp = cache.kept_positions
    return [[{p for p in kp[b, h].tolist() if p >= 0} for h in range(kp.shape[1])] for b in range(kp.shape[0])]


# ---------------------------------------------------------------------------- sinks + window
def streaming_allowed(L, sinks, window):
    """``causal() & (sliding_window(w) | first s keys)``, built from the rule, ``(L, L)``."""
    i = torch.arange(L).view(-1, 1)
    j = torch.arange(L).view(1, -1)
    return (j <= i) & ((i - j <= window) | (j < sinks))


@pytest.mark.parametrize("Hq, Hkv", [(1, 1), (4, 2), (6, 3)])
@pytest.mark.parametrize("sinks, window", [(0, 3), (2, 5), (4, 1), (3, 0)])
@pytest.mark.parametrize("prefill, chunk", [(1, 1), (9, 1), (13, 3), (4, 5)])
def test_sinks_and_window_equals_the_masked_full_attention_and_keeps_sinks_plus_window(
    Hq, Hkv, sinks, window, prefill, chunk
):
    B, L, D = 2, 29, 8
    q, k, v = _draw(B, Hq, L, D, 1), _draw(B, Hkv, L, D, 2), _draw(B, Hkv, L, D, 3)
    full, _ = dense_attention(q, k, v, streaming_allowed(L, sinks, window))
    cache = mh.DynamicKVCache(policy=SinksAndWindow(sinks, window))
    assert isinstance(cache, PolicyKVCache)
    t = 0
    while t < L:
        n = prefill if t == 0 else min(chunk, L - t)
        out, _ = _step(cache, q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n])
        torch.testing.assert_close(out, full[:, :, t : t + n])
        t += n
        expected = {p for p in range(t) if p < sinks or p >= t - window}
        assert all(heads == [expected] * Hkv for heads in _kept(cache)), (t, _kept(cache)[0][0], expected)
        assert cache.held == len(expected) and cache.length == t


def test_sinks_and_window_through_the_layer_equals_the_layer_with_the_mask():
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=RotaryEmbedding(8)).double().eval()
    x = torch.randn(2, 40, 32, dtype=DT)
    sinks, window = 3, 6
    with torch.no_grad():
        full = layer(x, mask=mh.sliding_window(window) | mh.key_padding(sinks))
        cache = mh.DynamicKVCache(policy=SinksAndWindow(sinks, window))
        outs = [layer(x[:, :11], kv_cache=cache)] + [layer(x[:, t : t + 1], kv_cache=cache) for t in range(11, 40)]
    torch.testing.assert_close(torch.cat(outs, 1), full)
    assert cache.held == sinks + window  # memory flat


def _rank_positions(kept: list[int]) -> dict[int, int]:
    return {p: i for i, p in enumerate(sorted(kept))}


@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("sinks, window, prefill", [(2, 4, 3), (4, 3, 10), (1, 6, 1)])
def test_sinks_and_window_with_positions_in_the_cache_equals_streamingllm(Hq, Hkv, sinks, window, prefill):
    """Positions re-assigned in the cache: at each decode step the query and each kept key sit at
    their rank among the kept tokens (StreamingLLM), each rotated there from scratch in fp64."""
    B, L, D = 2, 24, 8
    rope = RotaryEmbedding(D).double()
    q, k, v = _draw(B, Hq, L, D, 4), _draw(B, Hkv, L, D, 5), _draw(B, Hkv, L, D, 6)
    cache = mh.DynamicKVCache(policy=SinksAndWindow(sinks, window, positions="cache", rotary=rope))
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]:
        slots = cache.next_positions(t1 - t0)
        out, _ = _step(cache, rope(q[:, :, t0:t1], slots), rope(k[:, :, t0:t1], slots), v[:, :, t0:t1])
        for i, p in enumerate(range(t0, t1)):
            seen = [j for j in range(p + 1) if j < sinks or j >= p - window]
            if t0 == 0:  # the prefill: slots are positions, the window as in the sequence
                rank = {j: j for j in seen}
            else:
                rank = _rank_positions(seen)
            at = torch.tensor([rank[j] for j in seen])
            ks = rope(k[:, :, seen], at)
            qs = rope(q[:, :, p : p + 1], torch.tensor([rank[p]]))
            want, _ = dense_attention(qs, ks, v[:, :, seen], torch.ones(1, 1, 1, len(seen), dtype=torch.bool))
            torch.testing.assert_close(out[:, :, i : i + 1], want, msg=f"position {p}")
    assert cache.held == min(L, sinks + window) and cache.next_positions(1).tolist() == [sinks + window]


def test_sinks_and_window_refuses_bad_arguments():
    for args, kwargs, error, pattern in [
        ((-1, 3), {}, ValueError, r"sinks must be an int >= 0, got -1"),
        ((1, 2.0), {}, ValueError, r"window must be an int >= 0, got 2.0"),
        ((1, 2), {"positions": "slots"}, ValueError, r"positions must be one of \('sequence', 'cache'\)"),
        ((1, 2), {"rotary": RotaryEmbedding(8)}, ValueError, r"only happens with positions='cache'"),
        ((1, 2), {"positions": "cache", "rotary": lambda x, p: x}, TypeError, r"rotary must be a RotaryEmbedding"),
        (
            (1, 2),
            {
                "positions": "cache",
                "rotary": RotaryEmbedding(8, scaling={"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=64),
            },
            ValueError,
            r"rotations that compose",
        ),
    ]:
        with pytest.raises(error, match=pattern):
            SinksAndWindow(*args, **kwargs)


# ---------------------------------------------------------------------------- SnapKV
def snapkv_oracle(q, k, budget, window, kernel, pooling, per_head):
    """The positions SnapKV keeps per (row, head), from the dense causal weights of the prompt."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    _, w = dense_attention(q, k, k, torch.ones(L, L, dtype=torch.bool).tril())  # (B, Hq, L, L)
    window = min(window, L, budget)
    prefix = L - window
    votes = w[:, :, L - window :, :prefix].sum(2)  # (B, Hq, prefix)
    r = kernel // 2
    pooled = torch.empty_like(votes)
    for j in range(prefix):
        lo, hi = j - r, j + r + 1
        part = votes[..., max(0, lo) : min(prefix, hi)]
        pooled[..., j] = part.sum(-1) / kernel if pooling == "avg" else part.amax(-1)
    heads = Hq if per_head else Hkv
    scores = pooled if per_head else pooled.view(B, Hkv, Hq // Hkv, prefix).mean(2)
    kept = []
    for b in range(B):
        row = []
        for h in range(heads):
            s = scores[b, h].tolist()
            order = sorted(range(prefix), key=lambda j: (-s[j], j))[: budget - window]
            row.append(set(order) | set(range(prefix, L)))
        kept.append(row)
    return kept


@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 2), (6, 1)])
@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("selection", ["kv_group", "head"])
@pytest.mark.parametrize("L, budget, window, kernel", [(40, 12, 4, 5), (33, 20, 8, 3), (17, 9, 32, 7), (25, 6, 2, 1)])
def test_snapkv_keeps_the_window_and_the_top_pooled_votes(Hq, Hkv, pooling, selection, L, budget, window, kernel):
    B, D, steps = 2, 8, 5
    q, k, v = _draw(B, Hq, L + steps, D, 7), _draw(B, Hkv, L + steps, D, 8), _draw(B, Hkv, L + steps, D, 9)
    policy = SnapKV(budget, window=window, kernel=kernel, pooling=pooling, selection=selection)
    cache = mh.DynamicKVCache(policy=policy)
    out, _ = _step(cache, q[:, :, :L], k[:, :, :L], v[:, :, :L])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    torch.testing.assert_close(out, dense_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], causal)[0])  # full prefill
    expected = snapkv_oracle(q[:, :, :L], k[:, :, :L], budget, window, kernel, pooling, selection == "head")
    assert _kept(cache) == expected
    # decoding: attention over the kept tokens = full attention with the dropped prompt keys masked
    heads = Hq if selection == "head" else Hkv
    for t in range(L, L + steps):
        out, _ = _step(cache, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        allowed = torch.zeros(B, heads, 1, t + 1, dtype=torch.bool)
        for b in range(B):
            for h in range(heads):
                allowed[b, h, 0, sorted(expected[b][h] | set(range(L, t + 1)))] = True
        allowed = allowed.repeat_interleave(Hq // heads, 1)
        want, _ = dense_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], allowed)
        torch.testing.assert_close(out, want)
    assert cache.held == min(budget, L) + steps  # generated tokens are all kept


def test_snapkv_compression_ratio_is_the_share_removed():
    B, Hq, Hkv, L, D = 1, 4, 2, 64, 8
    cache = mh.DynamicKVCache(policy=SnapKV(compression_ratio=0.75, window=4))
    _step(cache, _draw(B, Hq, L, D, 1), _draw(B, Hkv, L, D, 2), _draw(B, Hkv, L, D, 3))
    assert cache.held == 16 and cache.length == L


def test_snapkv_without_observed_queries_is_refused_and_changes_nothing():
    cache = mh.DynamicKVCache(policy=SnapKV(4))
    k = _draw(1, 2, 5, 8, 0)
    with pytest.raises(ValueError, match=r"no queries were observed for this update; hint: call cache.observe"):
        cache.update(k, k)
    assert cache.length == 0 and cache.held == 0
    cache.observe(_draw(1, 4, 6, 8, 1))
    with pytest.raises(ValueError, match=r"observed queries \(1, 4, 6, 8\) do not match the update's keys"):
        cache.update(k, k)
    assert cache.length == 0


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({}, r"pass exactly one of budget .* and compression_ratio"),
        ({"budget": 4, "compression_ratio": 0.5}, r"pass exactly one of budget"),
        ({"budget": 0}, r"budget must be an int >= 1"),
        ({"compression_ratio": 1.0}, r"compression_ratio must be a float in \[0, 1\)"),
        ({"budget": 4, "kernel": 4}, r"kernel must be an odd int >= 1"),
        ({"budget": 4, "window": 0}, r"window must be an int >= 1"),
        ({"budget": 4, "pooling": "mean"}, r"pooling must be 'avg' or 'max'"),
        ({"budget": 4, "selection": "query"}, r"selection must be one of"),
    ],
)
def test_snapkv_refuses_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SnapKV(**kwargs)


# ---------------------------------------------------------------------------- H2O
def h2o_oracle(q, k, v, prefill, heavy, recent, per_head):
    """Kept sets after the prefill and after each decode step, and each step's output, by the
    paper's rule simulated on dense fp64 weights: every query's weights over the keys held then
    (plus its own and earlier new ones) are added to each key's score (mean over the query heads
    of a KV group); then each head keeps its ``recent`` newest and ``heavy`` best-scored others."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    heads = Hq if per_head else Hkv
    G = Hq // heads
    kept = [[set() for _ in range(heads)] for _ in range(B)]
    score = torch.zeros(B, heads, L, dtype=DT)
    history, outs = [], []
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]:
        allowed = torch.zeros(B, heads, t1 - t0, L, dtype=torch.bool)
        for b in range(B):
            for h in range(heads):
                for i, p in enumerate(range(t0, t1)):
                    allowed[b, h, i, sorted(kept[b][h] | set(range(t0, p + 1)))] = True
        out, w = dense_attention(q[:, :, t0:t1], k, v, allowed.repeat_interleave(G, 1))
        outs.append(out)
        score += w.sum(2).view(B, heads, G, L).mean(2)
        for b in range(B):
            for h in range(heads):
                held = sorted(kept[b][h] | set(range(t0, t1)))
                if len(held) > heavy + recent:
                    newest = set(held[-recent:]) if recent else set()
                    rest = sorted((p for p in held if p not in newest), key=lambda p: (-float(score[b, h, p]), p))
                    held = sorted(newest | set(rest[:heavy]))
                kept[b][h] = set(held)
        history.append([[set(s) for s in row] for row in kept])
    return history, torch.cat(outs, 2)


@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("selection", ["kv_group", "head"])
@pytest.mark.parametrize("prefill, heavy, recent", [(12, 3, 2), (5, 4, 4), (20, 0, 5), (9, 6, 0)])
def test_h2o_keeps_heavy_hitters_and_recent_tokens_step_by_step(Hq, Hkv, selection, prefill, heavy, recent):
    B, L, D = 2, 26, 8
    q, k, v = _draw(B, Hq, L, D, 11), _draw(B, Hkv, L, D, 12), _draw(B, Hkv, L, D, 13)
    history, want = h2o_oracle(q, k, v, prefill, heavy, recent, selection == "head")
    cache = mh.DynamicKVCache(policy=H2O(heavy, recent, selection=selection))
    outs = []
    for n, (t0, t1) in enumerate([(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]):
        out, _ = _step(cache, q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1])
        outs.append(out)
        assert _kept(cache) == history[n], (t1, _kept(cache)[0], history[n][0])
    torch.testing.assert_close(torch.cat(outs, 2), want)
    assert cache.held == heavy + recent


def test_h2o_compression_ratio_fixes_the_budget_at_the_prompt():
    B, Hq, Hkv, L, D = 1, 2, 2, 40, 8
    q, k, v = _draw(B, Hq, L + 3, D, 1), _draw(B, Hkv, L + 3, D, 2), _draw(B, Hkv, L + 3, D, 3)
    cache = mh.DynamicKVCache(policy=H2O(compression_ratio=0.5))
    _step(cache, q[:, :, :L], k[:, :, :L], v[:, :, :L])
    assert cache.held == 20
    for t in range(L, L + 3):
        _step(cache, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert cache.held == 20


# ---------------------------------------------------------------------------- cache behaviour
@pytest.mark.parametrize(
    "policy", [SinksAndWindow(2, 4), SnapKV(6, window=2), H2O(3, 3)], ids=["sinks", "snapkv", "h2o"]
)
def test_rollback_crop_reorder_and_reset(policy):
    B, Hq, Hkv, D = 3, 4, 2, 8
    cache = mh.DynamicKVCache(policy=policy)
    q, k, v = _draw(B, Hq, 20, D, 1), _draw(B, Hkv, 20, D, 2), _draw(B, Hkv, 20, D, 3)
    _step(cache, q[:, :, :12], k[:, :, :12], v[:, :, :12])
    before = (cache.kept_positions.clone(), cache.length)
    _step(cache, q[:, :, 12:13], k[:, :, 12:13], v[:, :, 12:13])
    cache.rollback()
    assert torch.equal(cache.kept_positions, before[0]) and cache.length == before[1]
    with pytest.raises(RuntimeError, match=r"rollback: no update to undo"):
        cache.rollback()
    cache.crop(8)
    assert cache.length == 8 and bool((cache.kept_positions < 8).all())
    assert cache.next_positions(1).tolist() == [8] or policy.reassigns_positions
    cache.reorder(torch.tensor([2, 2]))
    assert cache.lengths.tolist() == [8, 8]
    kept = cache.kept_positions
    assert torch.equal(kept[0], kept[1])
    out, _ = _step(cache, q[:2, :, 8:9], k[:2, :, 8:9], v[:2, :, 8:9])
    assert out.shape == (2, Hq, 1, D) and torch.isfinite(out).all()
    cache.reset()
    assert cache.length == 0 and cache.held == 0 and cache.kept_positions is None


def test_refused_updates_change_nothing():
    cache = mh.DynamicKVCache(policy=SinksAndWindow(1, 3))
    k = _draw(2, 2, 6, 8, 0)
    cache.update(k, k)
    pos = cache.kept_positions.clone()
    for bad_k, bad_v, positions, pattern in [
        (k[:1, :, :1], k[:1, :, :1], None, r"new keys/values have B=1 but the cache holds B=2"),
        (k[:, :, :1].float(), k[:, :, :1].float(), None, r"new keys/values have dtype torch.float32"),
        (k[:, :, :1], k[:, :, :1], torch.tensor([3]), r"positions must continue each row"),
    ]:
        with pytest.raises((ValueError, TypeError), match=pattern):
            cache.update(bad_k, bad_v, positions)
        assert torch.equal(cache.kept_positions, pos) and cache.length == 6


_POLICIES = [SinksAndWindow(1, 3), SnapKV(4, window=2), H2O(2, 2)]
_POLICY_IDS = ["sinks-window", "snapkv", "h2o"]


@pytest.mark.parametrize("policy", _POLICIES, ids=_POLICY_IDS)
def test_refused_observes_and_updates_leave_every_field_as_before(policy):
    """Every attribute (tensors bit for bit, the observed queries and the undo record included) is
    the same after a refused :meth:`observe` or :meth:`update` as before it."""
    B, Hq, Hkv, D = 2, 4, 2, 8
    cache = mh.DynamicKVCache(policy=policy)
    _step(cache, _draw(B, Hq, 6, D, 1), _draw(B, Hkv, 6, D, 2), _draw(B, Hkv, 6, D, 3))
    q, k = _draw(B, Hq, 1, D, 4), _draw(B, Hkv, 1, D, 5)
    for bad_q, scale, error, pattern in [
        ("q", None, TypeError, r"observe: q must be a torch.Tensor \(B, Hq, Lq, D\), got str"),
        (q.long(), None, TypeError, r"observe: q must be a floating-point tensor .*got dtype torch.int64"),
        (q[0], None, ValueError, r"observe: q must be the queries \(B, Hq, Lq, D\), got shape \(4, 1, 8\)"),
        (q[:1], None, ValueError, r"q must be \(B, Hq, Lq, D\) = \(2, a multiple of 2, Lq, 8\) .* got \(1, 4, 1, 8\)"),
        (q[..., :4], None, ValueError, r"= \(2, a multiple of 2, Lq, 8\) for the 6 tokens held, got \(2, 4, 1, 4\)"),
        (q[:, :3], None, ValueError, r"a multiple of 2, Lq, 8\) for the 6 tokens held, got \(2, 3, 1, 8\)"),
        (q.to("meta"), None, ValueError, r"observe: q is on meta but the cache is on cpu"),
        (q, "0.5", TypeError, r"observe: scale must be None \(1/sqrt\(D\)\) or a finite number, got '0.5'"),
        (q, float("nan"), TypeError, r"scale must be None .* or a finite number, got nan"),
    ]:
        before = everything(cache)
        with pytest.raises(error, match=pattern):
            cache.observe(bad_q, scale)
        after = everything(cache)
        assert [n for n in before if not identical(before[n], after[n])] == [], "a refused observe changed"
    cache.observe(q)
    for bad_k, bad_v, positions, error, pattern in [
        (k[:1], k[:1], None, ValueError, r"new keys/values have B=1 but the cache holds B=2"),
        (k.float(), k.float(), None, TypeError, r"dtype torch.float32 but the cache holds torch.float64"),
        (k, k, torch.tensor([3]), ValueError, r"positions must continue each row"),
        (k[:, :, :0], k[:, :, :0], None, ValueError, r"observed queries \(2, 4, 1, 8\) do not match"),
    ]:
        if not policy.needs_queries and "observed" in pattern:
            continue  # a policy that reads no queries does not compare them
        before = everything(cache)
        with pytest.raises(error, match=pattern):
            cache.update(bad_k, bad_v, positions)
        after = everything(cache)
        assert [n for n in before if not identical(before[n], after[n])] == [], "a refused update changed"


@pytest.mark.parametrize("policy", _POLICIES, ids=_POLICY_IDS)
def test_a_refused_layer_call_leaves_the_policy_cache_as_it_was(policy):
    """A layer observes its queries, then updates: when the update is refused, or attention after
    it (a forced backend that cannot serve the call), or the call only explains itself, the queries
    are withdrawn with the update, so no later update reads this call's queries."""
    torch.manual_seed(0)
    Hq, Hkv, E = 4, 2, 32
    layer = mh.MultiHeadAttention(E, Hq, num_kv_heads=Hkv, causal=True).double().eval()
    cache = mh.DynamicKVCache(policy=policy)
    x = torch.randn(2, 9, E, dtype=DT)
    with torch.no_grad():
        layer(x[:, :6], kv_cache=cache)
        before = everything(cache)
        layer.backend = "decode"
        with pytest.raises(mh.BackendRefusedError):  # decode serves at most 64 query tokens
            layer(torch.randn(2, 70, E, dtype=DT), kv_cache=cache)
        layer.backend = "auto"
        after = everything(cache)
        assert [n for n in before if not identical(before[n], after[n])] == []
        layer.explain(x[:, 6:7], kv_cache=cache)
        after = everything(cache)
        assert [n for n in before if not identical(before[n], after[n])] == []
        assert cache._queries is None  # the next update without observe() is refused, not fed stale queries


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_and_non_contiguous_inputs_follow_the_relative_rule(dtype):
    """Decode steps over an evicting cache in a low precision: error against the fp64 oracle at
    most twice a naive same-dtype attention over the same kept keys (TESTING.md's rule)."""
    B, Hq, Hkv, L, D = 2, 4, 2, 30, 16
    q = _draw(B, L, Hq, D, 1, dtype).transpose(1, 2)  # (B, Hq, L, D), non-contiguous
    k, v = (_draw(B, L, Hkv, D, s, dtype).transpose(1, 2) for s in (2, 3))
    cache = mh.DynamicKVCache(policy=H2O(4, 4))
    _step(cache, q[:, :, :10], k[:, :, :10], v[:, :, :10])
    for t in range(10, L):
        qt, kt, vt = q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]
        out, read = _step(cache, qt, kt, vt)
        mask = read.mask(None, True, Hq)
        if isinstance(mask, mh.masks.Mask):  # no hole: causal() over the slots
            mask = mask.materialize(B, Hq, 1, read.keys.shape[2])
        ref, _ = dense_attention(qt, read.keys, read.values, mask)
        baseline = naive_attention(qt, read.keys, read.values, mask)
        assert_relative(out, ref, baseline, 2.0, what=f"{dtype} step {t}")


@pytest.mark.parametrize(
    "policy",
    [H2O(4, 3), H2O(3, 2, selection="head"), SnapKV(7, window=3), SnapKV(6, window=2, selection="head")],
    ids=["h2o", "h2o-head", "snapkv", "snapkv-head"],
)
def test_through_the_layer_each_step_equals_the_layer_with_the_dropped_keys_masked(policy):
    """A GQA layer with rotary positions decoding through a policy cache: each step equals the
    layer without a cache over the whole sequence, with a mask hiding exactly the keys the cache
    had dropped before that step (per query head, through the grouped mapping)."""
    torch.manual_seed(0)
    Hq, Hkv, E, L, P = 4, 2, 32, 20, 9
    layer = mh.MultiHeadAttention(E, Hq, num_kv_heads=Hkv, causal=True, rope=RotaryEmbedding(E // Hq)).double().eval()
    x = torch.randn(2, L, E, dtype=DT)
    cache = mh.DynamicKVCache(policy=policy)
    with torch.no_grad():
        layer(x[:, :P], kv_cache=cache)
        for t in range(P, L):
            kept = cache.kept_positions  # (B, H, n): H = Hkv, or Hq for per-head selection
            allowed = torch.zeros(2, kept.shape[1], t + 1, t + 1, dtype=torch.bool)
            for b in range(2):
                for h in range(kept.shape[1]):
                    allowed[b, h, t, [p for p in kept[b, h].tolist() if p >= 0] + [t]] = True
            allowed[:, :, :t] = torch.ones(t, t + 1, dtype=torch.bool).tril()  # earlier rows: unused
            allowed = allowed.repeat_interleave(Hq // kept.shape[1], 1)
            step = layer(x[:, t : t + 1], kv_cache=cache)
            want = layer(x[:, : t + 1], mask=allowed)[:, t : t + 1]
            torch.testing.assert_close(step, want)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_caches_a_policy_does_not_fit_refuse_it_with_the_reason(kind):
    for policy in (SinksAndWindow(2, 4), H2O(heavy=2, recent=2)):
        with pytest.raises(TypeError, match=r"policy=\w+ is not supported: a (static cache keeps fixed|row's block)"):
            if kind == "static":
                mh.StaticKVCache(1, 8, 1, 4, policy=policy)
            else:
                mh.PagedKVCache(4, 4, 1, 4, policy=policy)
