"""``QuantizedKVCache``: what it stores and what it gives back.

* the sinks and the residual window read back exactly; quantized slots within half a step of
  their scale (int8) or the format's rounding (fp8), keys scaled per channel per span (set by the
  span's first group) and then per token, values per token;
* ``crop`` into the quantized region, ``rollback`` and ``reorder`` keep what reads return
  consistent (same slots, same values, same scales);
* refused constructor arguments; bytes held.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.caches import QuantizedKVCache, StaticKVCache

B, HKV, D = 2, 3, 16
SINKS, RESIDUAL, GROUP, SPAN = 2, 5, 4, 12


def _cache(fmt="int8", dtype=torch.float32, **kw):
    return QuantizedKVCache(
        B, 200, HKV, D, format=fmt, residual=RESIDUAL, sinks=SINKS, group=GROUP, span=SPAN, dtype=dtype, **kw
    )


def _kv(L, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, L, D, generator=g) * torch.linspace(0.1, 8, D)  # channels of different ranges
    return k.to(dtype), torch.randn(B, HKV, L, D, generator=g).to(dtype)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("steps", [[60], [1] * 40, [7, 1, 1, 13, 1, 2, 1]], ids=["prefill", "steps", "mixed"])
def test_sinks_and_residual_window_are_exact_and_quantized_slots_within_their_step(fmt, steps):
    cache = _cache(fmt)
    k, v = _kv(sum(steps))
    t = 0
    for n in steps:
        read = cache.update(k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
        keys, values = read.keys, read.values  # (B, Hkv, t, D): what the cache holds
        assert keys.shape[2] == t and read.contiguous
        exact = list(range(min(SINKS, t))) + list(range(max(SINKS, t - RESIDUAL), t))
        assert torch.equal(keys[:, :, exact], k[:, :, exact]) and torch.equal(values[:, :, exact], v[:, :, exact])
        lo, hi = SINKS, SINKS + cache._quantized
        assert hi <= max(SINKS, t - RESIDUAL) and (hi - lo) % GROUP == 0
        if hi > lo:
            top = 127.0 if fmt == "int8" else 448.0
            kq = k[:, :, lo:hi]
            k_step = _key_steps(cache, kq, top)  # per channel per span, then per token
            v_step = v[:, :, lo:hi].abs().amax(dim=3, keepdim=True) / top  # per token
            k_err = (keys[:, :, lo:hi] - kq).abs()
            v_err = (values[:, :, lo:hi] - v[:, :, lo:hi]).abs()
            if fmt == "int8":  # round to nearest: half a step, plus the scale's own rounding
                assert bool((k_err <= 0.5001 * k_step + 1e-6).all()) and bool((v_err <= 0.5001 * v_step + 1e-6).all())
            else:  # e4m3: 3 mantissa bits, relative 2^-4 of the value (or a subnormal step)
                assert bool((k_err <= kq.abs() / 16 + k_step * 2**-6).all())
                assert bool((v_err <= v[:, :, lo:hi].abs() / 16 + v_step * 2**-6).all())


def _key_steps(cache, k, top):
    """The step of each quantized key element ``(B, Hkv, n, D)``: the span's channel scale times
    the token's scale, the token's recomputed from the keys (its amax after dividing by the channel
    scales, over ``top``). The channel scales are the cache's; what makes them right is checked
    here too: each is at least the channel's amax over the span's first group (no key that set it
    is clipped) and at least 1/32 of the span's largest."""
    steps = torch.empty_like(k)
    for a in range(0, k.shape[2], cache.span):
        channel = cache.k_channel[:, :, a // cache.span].unsqueeze(2).float()  # (B, Hkv, 1, D)
        first = k[:, :, a : a + GROUP].abs().amax(dim=2, keepdim=True)
        assert bool((channel >= first).all()) and bool((channel >= channel.amax(dim=3, keepdim=True) / 32.001).all())
        token = (k[:, :, a : a + cache.span] / channel).abs().amax(dim=3, keepdim=True) / top
        steps[:, :, a : a + cache.span] = channel * token
    return steps


def test_a_step_reads_what_the_cache_holds():
    """Prefill and steps through a layer equal the fp64 attention over the dequantized slots."""
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(4 * D, 4, num_kv_heads=2, causal=True, dtype=torch.float64).eval()
    x = torch.randn(1, 40, 4 * D, dtype=torch.float64)
    cache = QuantizedKVCache(1, 64, 2, D, residual=3, sinks=1, group=4, dtype=torch.float64)
    with torch.no_grad():
        layer(x[:, :30], kv_cache=cache)
        for t in range(30, 40):
            out = layer(x[:, t : t + 1], kv_cache=cache)
            read = _peek(cache)  # the t + 1 slots the step read
            q = layer.q_proj(x[:, t : t + 1]).view(1, 1, 4, D).transpose(1, 2)
            heads = mh.reference_attention(q, read[0], read[1]).output  # (1, 4, 1, D): the last token sees all
            want = layer.out_proj(heads.transpose(1, 2).reshape(1, 1, 4 * D))
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def _peek(cache):
    """``(keys, values)`` the cache holds now (a read of zero new tokens, then undone)."""
    read = cache.update(
        torch.zeros(cache.batch_size, cache.tail_k.shape[1], 0, D, dtype=cache.dtype), cache.tail_v[:, :, :0]
    )
    keys, values = read.keys, read.values
    cache.rollback()
    return keys, values


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("n", [0, 1, SINKS, SINKS + 1, SINKS + GROUP, SINKS + GROUP + 3, 25, 31, 34])
def test_crop_keeps_what_reads_returned(fmt, n):
    """Cropping anywhere (sinks, inside a group, a group's edge, the tail) keeps the first ``n``
    slots exactly as reads returned them; decoding goes on from there, the new tokens' residual
    window exact. A cut group's kept tokens wait in the tail and are quantized again with the
    next group: within that group's step of what they read before."""
    cache = _cache(fmt)
    k, v = _kv(34)
    before = cache.update(k, v)
    held_k, held_v = before.keys.clone(), before.values.clone()
    cache.crop(n)
    assert cache.length == n
    now_k, now_v = _peek(cache)
    assert torch.equal(now_k, held_k[:, :, :n]) and torch.equal(now_v, held_v[:, :, :n])
    k1, v1 = _kv(9, seed=1)
    read = cache.update(k1, v1)
    step = 2 * float(torch.cat([k, k1], 2).abs().max()) / (127 if fmt == "int8" else 16)
    torch.testing.assert_close(read.keys[:, :, :n], held_k[:, :, :n], rtol=0, atol=step)
    recent = list(range(max(n, n + 9 - RESIDUAL), n + 9))  # the residual window of the new tokens
    assert torch.equal(read.keys[:, :, recent], k1[:, :, [p - n for p in recent]])
    quantized = SINKS + 24  # 34 tokens: 24 quantized after the sinks, 8 in the tail
    kept = n if n <= SINKS else SINKS + (min(n, quantized) - SINKS) // GROUP * GROUP  # sinks and whole groups
    assert torch.equal(read.keys[:, :, :kept], held_k[:, :, :kept])  # never quantized again


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_rollback_and_reorder_keep_slots_and_scales_together(fmt):
    cache = _cache(fmt)
    k, v = _kv(30)
    cache.update(k[:, :, :20], v[:, :, :20])
    held = _peek(cache)
    cache.update(k[:, :, 20:], v[:, :, 20:])  # quantizes more groups
    cache.rollback()
    assert cache.length == 20
    after = _peek(cache)
    assert torch.equal(after[0], held[0]) and torch.equal(after[1], held[1])
    cache.reorder(torch.tensor([1, 0, 1]))
    swapped = _peek(cache)
    assert torch.equal(swapped[0], held[0][[1, 0, 1]]) and torch.equal(swapped[1], held[1][[1, 0, 1]])


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(bits=4),
            ValueError,
            r"QuantizedKVCache: bits must be 8 \(int8 and fp8 e4m3fn are 8-bit formats\), got 4",
        ),
        (dict(format="int4"), ValueError, r"QuantizedKVCache: format must be one of \['fp8', 'int8'\], got 'int4'"),
        (dict(residual=-1), ValueError, r"QuantizedKVCache: residual must be an int >= 0, got -1"),
        (dict(group=0), ValueError, r"QuantizedKVCache: group must be an int >= 1, got 0"),
        (dict(span=0), ValueError, r"QuantizedKVCache: span must be an int >= 1, got 0"),
        (dict(dtype=torch.int8), TypeError, r"QuantizedKVCache: dtype must be a floating-point torch.dtype"),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        QuantizedKVCache(1, 16, 1, 8, **kwargs)


def test_a_write_past_max_len_is_refused_with_the_cache_unchanged():
    cache = QuantizedKVCache(1, 10, 1, 8, residual=2, sinks=1, group=2)
    cache.update(torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8))
    held = _peek_any(cache)
    with pytest.raises(
        ValueError, match=r"QuantizedKVCache.update: writing 3 tokens after the 8 stored would pass max_len=10"
    ):
        cache.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
    assert cache.length == 8 and torch.equal(_peek_any(cache), held)


def _peek_any(cache):
    read = cache.update(cache.tail_k[:, :, :0], cache.tail_v[:, :, :0])
    keys = read.keys
    cache.rollback()
    return keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_held_are_about_half_a_bf16_cache_and_a_quarter_of_fp32(dtype):
    big = QuantizedKVCache(1, 4096, 8, 128, dtype=dtype)
    full = StaticKVCache(1, 4096, 8, 128, dtype=dtype)
    ratio = big.nbytes / full.nbytes
    per_element = torch.empty((), dtype=dtype).element_size()
    # 8 bits, plus scales (one per group of 32 keys per channel, one per value token), sinks and window
    assert ratio < 1.25 / per_element


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_an_all_zero_channel_or_token_reads_back_as_zero_in_every_dtype(fmt, dtype):
    """A key channel (or a value token) that is zero over a group had its scale clamped to 1e-30,
    which fp16 rounds to 0: the cache stored 0 / 0 = NaN (fp8 keeps it) and every read of the
    group was NaN. Scales now stay at or above the dtype's smallest normal."""
    cache = _cache(fmt, dtype=dtype)
    k, v = _kv(SINKS + RESIDUAL + 2 * GROUP, dtype=dtype)
    k[..., 3] = 0  # a dead channel
    v[:, :, SINKS + 1] = 0  # a zero value token inside the first quantized group
    read = cache.update(k, v)
    assert cache._quantized == 2 * GROUP
    keys, values = read.keys, read.values
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert not keys[..., 3].any() and not values[:, :, SINKS + 1].any()
    torch.testing.assert_close(keys.float(), k.float(), rtol=0.07, atol=0.1)  # within the format's rounding
