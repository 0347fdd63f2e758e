"""Incremental decoding through ``MultiHeadAttention(..., kv_cache=)`` equals the full forward, for
every cache: prefill of any length, one-token and multi-token steps, MHA/GQA/MQA, sliding windows
around and far past the window, RoPE at cache positions, rows of different lengths, mask objects
at absolute positions, crop and reorder, and a failed call that rolls the cache back."""

from __future__ import annotations

import pytest
import torch
from cache_state import everything, identical

import multihead as mh
from helpers import DEVICES
from multihead.caches import (
    DynamicKVCache,
    PagedKVCache,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from multihead.positions import RotaryEmbedding

DT = torch.float64
E, HQ = 32, 4


def _layer(Hkv=2, dtype=DT, rope=False, seed=0, device="cpu", **options):
    torch.manual_seed(seed)  # the weights are drawn on CPU, then moved
    return (
        mh.MultiHeadAttention(
            E,
            HQ,
            num_kv_heads=Hkv,
            causal=True,
            dtype=dtype,
            rope=RotaryEmbedding(E // HQ) if rope else None,
            **options,
        )
        .to(device)
        .eval()
    )


def _x(B, L, dtype=DT, seed=1, device="cpu"):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)


def _cache(kind, layer, B, max_len=64, window=None, dtype=DT, device="cpu"):
    if kind == "dynamic":
        return DynamicKVCache(capacity=4)  # small: the decoding below grows it several times
    if kind == "static":
        return StaticKVCache(B, max_len, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
    return SlidingWindowKVCache(window, B, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)


def _decode(layer, x, cache, schedule, **kwargs):
    outs, t = [], 0
    for n in schedule:
        outs.append(layer(x[:, t : t + n], kv_cache=cache, **kwargs))
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, dim=1)


SCHEDULES = {"prefill+steps": [6] + [1] * 10, "chunked": [3, 4, 1, 5, 1, 2], "steps-only": [1] * 16}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [DT, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_cached_decoding_equals_the_full_causal_forward(kind, Hkv, schedule, dtype, device):
    """Cached and full forward on ``device``; the fp64 truth on CPU."""
    layer = _layer(Hkv, dtype, device=device)
    x = _x(2, 16, dtype, device=device)
    with torch.no_grad():
        full = layer(x).cpu()
        cached = _decode(layer, x, _cache(kind, layer, 2, dtype=dtype, device=device), SCHEDULES[schedule]).cpu()
        full64 = _layer(Hkv, DT)(x.double().cpu())
    if dtype == DT:
        torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)
    else:  # the relative rule: no further from the fp64 truth than the full fp32 forward, times 2
        err, base = (cached.double() - full64).abs().max(), (full.double() - full64).abs().max()
        assert err <= 2 * base + 4 * torch.finfo(dtype).eps, (err, base)


@pytest.mark.parametrize(
    "schedule",
    [[1] * 20, [5] + [1] * 15, [2, 3, 4, 1, 6, 4], [9, 11], [20]],
    ids=["steps", "prefill5+steps", "chunks-straddling-wraps", "two-chunks", "one-prefill"],
)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 3, 4, 5, 19])
@pytest.mark.parametrize("kind", ["sliding", "dynamic", "static"])
def test_windowed_decoding_equals_the_full_windowed_forward(kind, window, schedule, device):
    """Lengths around and far past the window (window-1, window, window+1, many wraps), steps of
    several tokens that straddle the wrap. The sliding cache holds what the window sees, no more;
    the mask says which window (a causal layer without it is refused, never narrowed)."""
    layer = _layer(2, device=device)
    x = _x(2, 20, device=device)
    band = mh.sliding_window(window)
    with torch.no_grad():
        full = layer(x, mask=band)
        cache = _cache(kind, layer, 2, window=window, device=device)
        cached = _decode(layer, x, cache, schedule, mask=band)
        if kind == "sliding":
            assert cache.keys.shape[2] == window + 1  # it holds what the window sees, no more
            with pytest.raises(ValueError, match=rf"no mask with causal=True .* window={window} keys"):
                _decode(layer, x, _cache(kind, layer, 2, window=window, device=device), schedule)
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_rope_positions_come_from_the_cache(kind, device):
    layer = _layer(2, rope=True, device=device)
    x = _x(2, 16, device=device)
    with torch.no_grad():
        full = layer(x)
        cached = _decode(layer, x, _cache(kind, layer, 2, device=device), SCHEDULES["chunked"])
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_different_lengths_each_decode_as_their_own_sequence(device):
    """A right-padded prefill cropped to each row's length, then steps: row b's outputs equal
    the full forward of row b alone (causal and window masks align to each row's own length)."""
    lengths = [5, 2, 7]
    for mask in (None, mh.sliding_window(2)):
        layer = _layer(2, rope=True, device=device)
        x = _x(3, 7 + 6, device=device)
        cache = StaticKVCache(3, 16, 2, E // HQ, dtype=DT, device=device)
        with torch.no_grad():
            layer(x[:, :7], kv_cache=cache, mask=mask)  # pads after each row's prompt: no real token sees them
            cache.crop(torch.tensor(lengths))
            steps = []
            for t in range(6):  # row b's step t is its token lengths[b] + t
                token = torch.stack([x[b, lengths[b] + t] for b in range(3)])[:, None]  # (3, 1, E)
                steps.append(layer(token, kv_cache=cache, mask=mask))
            steps = torch.cat(steps, dim=1)  # (3, 6, E)
            for b, n in enumerate(lengths):
                alone = layer(x[b : b + 1, : n + 6], mask=mask)  # (1, n + 6, E)
                torch.testing.assert_close(steps[b], alone[0, n:], rtol=1e-12, atol=1e-12)
        assert cache.lengths.tolist() == [n + 6 for n in lengths]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_mask_objects_are_read_at_absolute_positions(kind, device):
    """Documents and key padding mean with a cache what they mean without: ids and lengths index
    the whole sequence (the mask's tensors stay on CPU, as a caller builds them)."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]] * 2)
    mask = mh.document(ids) & mh.key_padding(torch.tensor([12, 9]))
    if kind == "sliding":
        mask = mask & mh.sliding_window(3)
    layer = _layer(2, device=device)
    x = _x(2, 12, device=device)
    with torch.no_grad():
        full = layer(x, mask=mask)
        cached = _decode(layer, x, _cache(kind, layer, 2, window=3, device=device), [4, 1, 1, 3, 1, 1, 1], mask=mask)
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_crop_then_decode_equals_decoding_the_cropped_sequence(kind):
    """Speculative decoding: 3 drafted tokens verified in one step and rejected, then the real continuation."""
    layer = _layer(2)
    x, draft = _x(2, 12), _x(2, 3, seed=7)
    window = 4
    mask = mh.sliding_window(window) if kind == "sliding" else None
    with torch.no_grad():
        full = layer(x, mask=mask)
        cache = _cache(kind, layer, 2, window=window)
        if kind == "sliding":
            cache = SlidingWindowKVCache(window, 2, 2, E // HQ, extra=2, dtype=DT)
        first = layer(x[:, :6], kv_cache=cache, mask=mask)
        layer(draft, kv_cache=cache, mask=mask)  # verify 3 drafted tokens at once
        cache.crop(6 if kind != "static" else torch.tensor([6, 6]))  # back to before the draft
        rest = _decode(layer, x[:, 6:], cache, [1, 2, 3], mask=mask)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_reorder_then_decode_equals_decoding_the_reordered_batch(kind):
    """Beam search: rows 0, 1, 2 become rows 2, 2, 0."""
    layer = _layer(2)
    x = _x(3, 10)
    order = torch.tensor([2, 2, 0])
    mask = mh.sliding_window(3) if kind == "sliding" else None
    with torch.no_grad():
        cache = _cache(kind, layer, 3, window=3)
        layer(x[:, :6], kv_cache=cache, mask=mask)
        cache.reorder(order)
        rest = _decode(layer, x[order, 6:], cache, [1, 3], mask=mask)
        full = layer(torch.cat([x[order, :6], x[order, 6:]], 1), mask=mask)
    torch.testing.assert_close(rest, full[:, 6:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_a_call_that_fails_after_the_update_rolls_the_cache_back(kind, monkeypatch):
    """A forced backend that refuses the call raises after the keys were stored: the cache is as
    it was, and decoding goes on exactly. (The same layer: a cache serves one layer.)"""
    layer = _layer(2, softcap=2.0)
    x = _x(2, 8)
    with torch.no_grad():
        cache = _cache(kind, layer, 2, window=3)
        mask = mh.sliding_window(3) if kind == "sliding" else None
        layer(x[:, :5], kv_cache=cache, mask=mask)
        with monkeypatch.context() as patch, pytest.raises(ValueError, match="sdpa"):
            patch.setattr(layer, "backend", "sdpa")  # refuses softcap
            layer(x[:, 5:6], kv_cache=cache, mask=mask)
        assert cache.length == 5
        rest = _decode(layer, x[:, 5:], cache, [1, 2], mask=mask)
        full = layer(x, mask=mask)
    torch.testing.assert_close(rest, full[:, 5:], rtol=1e-12, atol=1e-12)


def test_a_distance_score_mod_needs_slots_in_position_order():
    """ALiBi decodes exactly through a static cache while its rows share one length (slots read in
    order); once rows differ, the layer refuses it with the reason, and the cache is unchanged."""
    layer = _layer(2, score_mod=mh.positions.ALiBi(HQ))
    x = _x(2, 7)
    cache = StaticKVCache(2, 8, 2, E // HQ, dtype=DT)
    with torch.no_grad():
        out = _decode(layer, x, cache, [4, 1, 2])
        torch.testing.assert_close(out, layer(x), rtol=1e-12, atol=1e-12)
        cache.crop(torch.tensor([7, 5]))
        with pytest.raises(
            ValueError,
            match=r"reads query and key indices, which this cache's slots .* use "
            r"DynamicKVCache",
        ):
            layer(_x(2, 1), kv_cache=cache)
    assert cache.lengths.tolist() == [7, 5]


def test_need_weights_over_a_static_cache_hides_the_empty_slots():
    """Rows of one length: weights over the filled slots. Rows that differ: weights over all
    max_len slots, zero on the empty ones."""
    layer = _layer(2)
    x = _x(2, 5)
    cache = StaticKVCache(2, 9, 2, E // HQ, dtype=DT)
    with torch.no_grad():
        layer(x[:, :4], kv_cache=cache)
        _, weights = layer(x[:, 4:], kv_cache=cache, need_weights=True)
        _, full = layer(x, need_weights=True)
        assert weights.shape == (2, HQ, 1, 5)
        torch.testing.assert_close(weights, full[:, :, 4:], rtol=1e-12, atol=1e-12)
        cache.crop(torch.tensor([5, 3]))  # row 1 goes back to 3 tokens: its next token is x[1, 3]
        _, weights = layer(torch.stack([_x(1, 1, seed=5)[0], x[1, 3:4]]), kv_cache=cache, need_weights=True)
    assert weights.shape == (2, HQ, 1, 9)
    torch.testing.assert_close(weights[1:, :, :, :4], full[1:, :, 3:4, :4], rtol=1e-12, atol=1e-12)
    assert torch.all(weights[0, ..., 6:] == 0) and torch.all(weights[1, ..., 4:] == 0)


@pytest.mark.parametrize("given", [False, True], ids=["cache-positions", "given-positions"])
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("lengths", [[4, 4], [5, 3]], ids=["equal-lengths", "different-lengths"])
def test_a_mask_over_a_static_caches_slots_fits_the_next_step(lengths, new, given):
    """``cache.slots(n)`` is the number of slots the next eager update of ``n`` tokens returns: the
    ``T + n`` filled ones while every row holds ``T`` tokens (the speed-up), all ``max_len`` when
    rows differ, positions given or not. So a bool mask over ``slots(n)`` columns (the documented
    recipe) goes through the layer either way, weights have that width, and hiding slot 0
    (position 0 in every row) computes what each row's full forward with position 0 hidden does."""
    max_len, D = 9, E // HQ
    equal = lengths[0] == lengths[1]
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 5 + new, D, generator=g, dtype=DT), torch.randn(2, 2, 5 + new, D, generator=g, dtype=DT)
    cache = StaticKVCache(2, max_len, 2, D, dtype=DT)
    cache.update(k[:, :, :5], v[:, :, :5])
    cache.crop(torch.tensor(lengths))
    S = cache.slots(new)
    read = cache.update(k[:, :, 5:], v[:, :, 5:], cache.next_positions(new) if given else None)
    assert read.keys.shape[2] == S == (lengths[0] + new if equal else max_len)

    layer = _layer(2)
    x = _x(2, 5 + new)
    cache = StaticKVCache(2, max_len, 2, D, dtype=DT)
    with torch.no_grad():
        layer(x[:, :5], kv_cache=cache)
        cache.crop(torch.tensor(lengths))
        tokens = torch.stack([x[b, n : n + new] for b, n in enumerate(lengths)])  # (2, new, E): after each row
        S = cache.slots(new)
        mask = torch.ones(2, 1, new, S, dtype=torch.bool)  # (B, 1, Lq, S)
        mask[..., 0] = False  # slot 0 holds position 0, whichever slots the step reads
        positions = {"positions": cache.next_positions(new)} if given else {}
        out, weights = layer(tokens, kv_cache=cache, mask=mask, need_weights=True, **positions)
        assert weights.shape == (2, HQ, new, S)
        for b, n in enumerate(lengths):
            hidden = torch.ones(n + new, n + new, dtype=torch.bool)  # (Lq, Lk)
            hidden[:, 0] = False
            alone = layer(x[b : b + 1, : n + new], mask=hidden)  # (1, n + new, E)
            torch.testing.assert_close(out[b], alone[0, n:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Hkv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_gradients_through_cached_steps_equal_the_full_forward(kind, Hkv, device):
    """Backpropagating through prefill and steps (under autograd no cache writes into keys an
    earlier step saved) gives the full forward's gradients; a static cache used to fail with
    PyTorch's "modified by an inplace operation"."""
    layer = _layer(Hkv, device=device)
    x = _x(2, 9, device=device).requires_grad_()
    mask = mh.sliding_window(4) if kind == "sliding" else None
    cache = DynamicKVCache(capacity=2) if kind == "dynamic" else _cache(kind, layer, 2, window=4, device=device)
    out = _decode(layer, x, cache, [4, 1, 3, 1], mask=mask)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    want = torch.autograd.grad(layer(x, mask=mask).square().sum(), [x, *layer.parameters()])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- issue 28
@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_a_layer_refuses_positions_that_skip_or_go_back_with_any_cache(kind):
    """Issue 28: a cache whose slots follow positions refuses, through a layer, positions that
    skip or go back, before storing anything; the right positions then decode exactly. (A
    call-order cache takes them as rotary positions only: the next test.)"""
    layer = _layer(2, rope=True)
    x = _x(2, 8)
    mask = mh.sliding_window(3) if kind == "sliding" else None
    with torch.no_grad():
        full = layer(x, mask=mask)
        cache = _cache(kind, layer, 2, window=3)
        layer(x[:, :5], kv_cache=cache, mask=mask)
        before = everything(cache)
        for bad in (torch.tensor([7]), torch.tensor([4]), torch.tensor([[5], [6]])):
            with pytest.raises(ValueError, match=rf"{type(cache).__name__}\.update: positions must continue each row"):
                layer(x[:, 5:6], kv_cache=cache, mask=mask, positions=bad)
            assert identical(everything(cache), before)
        rest = _decode(layer, x[:, 5:], cache, [1, 2], mask=mask)
    torch.testing.assert_close(rest, full[:, 5:], rtol=1e-12, atol=1e-12)


def test_call_order_caches_take_a_layers_positions_as_rotary_positions_only():
    """DynamicKVCache and LatentKVCache keep call order (``places_by_position`` is False): a layer
    given positions that start at 300 (an offset) rotates by them and stores in order, equal to
    the forward without a cache at the same positions, for both layers; the caches, asked
    directly, still refuse positions that do not continue them (tests/caches/test_caches.py)."""
    torch.manual_seed(0)
    mla = mh.MultiHeadLatentAttention(
        E, HQ, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, dtype=DT
    ).eval()
    layer = _layer(2, rope=True)
    x = _x(2, 7)
    positions = torch.arange(7) + 300
    assert not DynamicKVCache.places_by_position and not mh.LatentKVCache.places_by_position
    with torch.no_grad():
        for module, cache in [(mla, mh.LatentKVCache()), (layer, DynamicKVCache())]:
            full = module(x, positions=positions)
            first = module(x[:, :5], kv_cache=cache, positions=positions[:5])
            rest = module(x[:, 5:], kv_cache=cache, positions=positions[5:])
            torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-10, atol=1e-10)
            assert cache.length == 7


def _layer_causal(causal: bool):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(E, HQ, num_kv_heads=2, causal=causal, dtype=DT).eval()


WIDE_MASKS = [  # (name, layer options, mask, message): a SlidingWindowKVCache(3) cannot honour these
    ("a wider window", {}, mh.sliding_window(8), r"mask sliding_window\(left=8.* the 8 keys before it.* window=3"),
    ("a causal layer, no mask", {}, None, r"no mask with causal=True lets a query see every earlier key.*window=3"),
    ("causal()", {}, mh.causal(), r"mask causal\(.*every earlier key \(no window\).*window=3"),
    ("no mask, causal=False", {"causal": False}, None, r"no mask with causal=False .*every earlier key.*window=3"),
    ("a tensor mask", {}, torch.ones(1, 5, dtype=torch.bool), r"a tensor mask .*every earlier key.*window=3"),
    (
        "a window wider than the layer's",
        {},
        mh.sliding_window(4) & mh.causal(),
        r"mask sliding_window\(left=4.*the 4 keys before it",
    ),
]


@pytest.mark.parametrize("name, options, mask, message", WIDE_MASKS, ids=[c[0] for c in WIDE_MASKS])
def test_a_sliding_cache_refuses_a_mask_reaching_further_back_than_its_window(name, options, mask, message):
    """Issue 28: with a SlidingWindowKVCache(3), a sliding_window(8) mask (or a causal layer with no
    window) computed window-3 attention, off by 0.4-0.5, with no error. The call is now refused
    before anything is written (the undo record of the last update is still there, so nothing was
    written and rolled back), naming both widths; a fresh cache is refused at its first call."""
    layer = _layer_causal(options.get("causal", True))
    x = _x(2, 6)
    with torch.no_grad():
        cache = _cache("sliding", layer, 2, window=3)
        layer(x[:, :4], kv_cache=cache, mask=mh.sliding_window(3))
        before = everything(cache)
        with pytest.raises(ValueError, match=r"^SlidingWindowKVCache: " + message + r".*hint: pass a mask that fits"):
            layer(x[:, 4:5], kv_cache=cache, mask=mask)
        assert identical(everything(cache), before)
        fresh = _cache("sliding", layer, 2, window=3)
        empty = everything(fresh)
        with pytest.raises(ValueError, match=message):
            layer(x[:, :4], kv_cache=fresh, mask=mask if not isinstance(mask, torch.Tensor) else mask[:, :4])
        assert identical(everything(fresh), empty)


def test_cache_read_mask_refuses_a_mask_wider_than_the_ring():
    """CacheRead.mask, the one place a ring's window meets the mask, refuses it too (for code that
    reads a cache without a layer)."""
    cache = SlidingWindowKVCache(3, 1, 1, 4, dtype=DT)
    read = cache.update(torch.randn(1, 1, 5, 4, dtype=DT), torch.randn(1, 1, 5, 4, dtype=DT))
    with pytest.raises(ValueError, match=r"^CacheRead\.mask: mask sliding_window\(left=8.*the 8 keys.*window=3"):
        read.mask(mh.sliding_window(8), causal=True)
    with pytest.raises(ValueError, match=r"^CacheRead\.mask: no mask with causal=True"):
        read.mask(None, causal=True)
    assert read.mask(mh.sliding_window(3), causal=True).shape[-1] == 3 + 1 + 5


@pytest.mark.parametrize(
    "mask",
    [
        mh.sliding_window(0),
        mh.sliding_window(2),
        mh.sliding_window(3),
        mh.sliding_window(1) & mh.causal(),
        mh.document(torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1])) & mh.sliding_window(2),
    ],
    ids=["window0", "window2", "window3", "window1&causal", "documents&window2"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not-causal"])
def test_a_mask_that_fits_the_sliding_cache_decodes_exactly(mask, causal):
    """Windows up to the cache's (alone or combined), causal layer or not: unchanged, exact."""
    layer = _layer_causal(causal)
    x = _x(2, 12)
    with torch.no_grad():
        full = layer(x, mask=mask)
        cached = _decode(layer, x, _cache("sliding", layer, 2, window=3), [4, 1, 3, 1, 1, 2], mask=mask)
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)


def test_a_window_0_cache_crops_far_back_and_decodes_exactly():
    """Issue 28: SlidingWindowKVCache(window=0).crop(3) after 8 tokens was refused ("needs positions
    3..2"); a window-0 query sees only itself, so the crop holds, and decoding goes on exactly."""
    layer = _layer(2)
    x = _x(2, 10)
    band = mh.sliding_window(0)
    with torch.no_grad():
        full = layer(x, mask=band)
        cache = _cache("sliding", layer, 2, window=0)
        _decode(layer, x[:, :8], cache, [1] * 8, mask=band)
        cache.crop(3)
        rest = _decode(layer, x[:, 3:], cache, [1, 3, 1, 2], mask=band)
    torch.testing.assert_close(rest, full[:, 3:], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- refused before the update
def _every_cache(layer, B):
    """One of each cache kind a MultiHeadAttention decodes through (sliding: window 3)."""
    Hkv, D = layer.num_kv_heads, layer.head_dim
    return {
        "dynamic": DynamicKVCache(capacity=4),
        "static": StaticKVCache(B, 16, Hkv, D, dtype=DT),
        "sliding": SlidingWindowKVCache(3, B, Hkv, D, dtype=DT),
        "paged": PagedKVCache(16, 4, Hkv, D, batch_size=B, dtype=DT),
        "quantized": QuantizedKVCache(B, 16, Hkv, D, residual=2, sinks=1, group=2, dtype=DT),
    }


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged", "quantized"])
def test_a_tensor_mask_that_does_not_fit_the_slots_is_refused_before_the_update(kind):
    """A tensor mask over the wrong number of slots used to be refused only after the keys were
    stored, and the rollback cleared the undo record and left the written slots behind (a cache
    not as it was). It is now refused against ``slots(Lq)`` before the update: bit-identical."""
    layer = _layer(2, rope=True)
    x = _x(2, 8)
    cache = _every_cache(layer, 2)[kind]
    window = mh.sliding_window(3) if kind == "sliding" else None
    with torch.no_grad():
        layer(x[:, :5], kv_cache=cache, mask=window)
        before = everything(cache)
        S = cache.slots(1)
        wrong = torch.ones(1, S + 1, dtype=torch.bool)  # one column too many
        bad = wrong if window is None else window & wrong
        with pytest.raises(ValueError, match=rf"over the \(Lq, S\) = \(1, {S}\) slots the cache returns"):
            layer(x[:, 5:6], kv_cache=cache, mask=bad)
        assert identical(everything(cache), before)
        cache.rollback()  # the prefill's undo record survived the refused call
        assert cache.length == 0


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_query_batch_other_than_the_caches_names_the_cache(kind):
    """A per-row cache hands the rotary embedding ``(B_cache, Lq)`` positions: a query of another
    batch was refused by the rotary embedding, naming positions the user never passed."""
    layer = _layer(2, rope=True)
    cache = _every_cache(layer, 2)[kind]
    with torch.no_grad():
        layer(_x(2, 3), kv_cache=cache)
        before = everything(cache)
        with pytest.raises(ValueError, match=r"the query has B=3 rows but kv_cache holds 2 \(" + type(cache).__name__):
            layer(_x(3, 1), kv_cache=cache)
    assert identical(everything(cache), before)


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged", "quantized"])
def test_explain_and_a_failed_call_keep_the_last_updates_undo_record(kind, monkeypatch):
    """``layer.explain(..., kv_cache=)`` and a call that fails after the update roll the cache back;
    the rollback used to clear the record of the update before, so the user's own
    ``cache.rollback()`` of their last step then raised "no update to undo". The cache now ends
    as it was: that step is still undone, exactly."""
    layer = _layer(2, rope=True)
    x = _x(2, 8)
    cache = _every_cache(layer, 2)[kind]
    window = mh.sliding_window(3) if kind == "sliding" else None
    with torch.no_grad():
        layer(x[:, :5], kv_cache=cache, mask=window)
        layer(x[:, 5:6], kv_cache=cache, mask=window)
        layer.explain(x[:, 6:7], kv_cache=cache, mask=window)
        with monkeypatch.context() as patch:  # the attention fails after the update (a backend's error)
            patch.setattr(layer, "_attend", lambda *args: (_ for _ in ()).throw(RuntimeError("kernel failed")))
            patch.setattr(mh.layers.multihead, "attend_blocks", lambda *args, **kwargs: None)
            with pytest.raises(RuntimeError, match="kernel failed"):
                layer(x[:, 6:7], kv_cache=cache, mask=window)
        assert cache.length == 6
        cache.rollback()  # the user's own last step
        assert cache.length == 5
        rest = _decode(layer, x[:, 5:], cache, [1, 2], mask=window)
        fresh = _every_cache(layer, 2)[kind]  # (a quantized cache is lossy: the same steps, unbroken)
        want = _decode(layer, x[:, :8], fresh, [5, 1, 2], mask=window)
    torch.testing.assert_close(rest, want[:, 5:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_one_cache_handed_to_two_layers_is_refused_before_it_mixes_them(kind):
    """One cache passed to both layers of a model has the same shapes at each, so no check saw it:
    the second layer attended over the first layer's keys as earlier tokens (off by 0.47 on the
    prefill, no error). The second layer is refused, the cache unchanged; after reset() the cache
    serves any layer, and one cache per layer decodes exactly."""
    first, second = _layer(4, seed=0), _layer(4, seed=1)
    x = _x(1, 6)
    cache = _every_cache(first, 1)[kind]
    with torch.no_grad():
        h = first(x[:, :5], kv_cache=cache)
        before = everything(cache)
        with pytest.raises(ValueError, match=r"^MultiHeadAttention: kv_cache holds the keys and values of another"):
            second(h, kv_cache=cache)
        assert identical(everything(cache), before)
        first.explain(x[:, 5:], kv_cache=cache)  # its own layer: taken
        cache.reset()
        second(h, kv_cache=cache)  # an empty cache goes to any layer
        caches = [_every_cache(first, 1)[kind] for _ in range(2)]
        steps = [second(first(x[:, a:b], kv_cache=caches[0]), kv_cache=caches[1]) for a, b in [(0, 5), (5, 6)]]
        torch.testing.assert_close(torch.cat(steps, 1), second(first(x)), rtol=1e-12, atol=1e-12)


def test_explain_of_a_step_over_a_paged_or_quantized_cache_says_it_reads_blocks():
    """A step over a paged or quantized cache attends over the cache's blocks (``attend_blocks``), not
    over one dense tensor: ``explain()`` says so (it reported the dense call before), and says the
    dense call where the blocks are not taken (weights asked for); the cache ends as it was."""
    layer = _layer(2, torch.float32)
    x = _x(1, 40, torch.float32)
    caches = {
        "paged": PagedKVCache(8, 8, 2, E // HQ),
        "quantized": QuantizedKVCache(1, 64, 2, E // HQ, residual=8, sinks=2),
        "static": StaticKVCache(1, 64, 2, E // HQ),
    }
    for name, cache in caches.items():
        with torch.no_grad():
            layer(x[:, :39], kv_cache=cache)
            step = layer.explain(x[:, 39:], kv_cache=cache)
            weights = layer.explain(x[:, 39:], kv_cache=cache, need_weights=True)
        assert ("read as blocks" in str(step)) == (name != "static"), (name, str(step))
        assert "read as blocks" not in str(weights), (name, str(weights))
        assert cache.length == 39, name
