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

# every test twice: multihead's CPU decode kernel and PyTorch's GEMMs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("decode_kernel")

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
    here too: relative to the span's largest channel (which is 1), each at least 1/32 (a
    key of a channel quiet in the span's first store is not blown up); the magnitude is the
    token's. No key is clipped whatever kc is: the token's scale is its own amax."""
    steps = torch.empty_like(k)
    for a in range(0, k.shape[2], cache.span):
        channel = cache.k_channel[:, :, a // cache.span].unsqueeze(2).float()  # (B, Hkv, 1, D)
        assert bool((channel.amax(dim=3) == 1).all()) and bool((channel >= 1 / 32).all())
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


@pytest.mark.parametrize("seed", range(6))
def test_rolled_back_updates_leave_no_trace(seed):
    """Updates of random sizes (into the sinks, the window, stores of whole groups across spans),
    each followed by a rolled-back update of another random size: every read equals a twin cache's
    that never saw the rolled-back writes, bit for bit (a rollback restores the counts, and the
    tail's tokens only when a store moved them)."""
    rng = torch.Generator().manual_seed(seed)
    cache, twin = _cache(), _cache()
    k, v = _kv(200, seed=seed)
    junk_k, junk_v = _kv(200, seed=seed + 100)
    t = 0
    while t < 180:
        n = int(torch.randint(1, 20, (1,), generator=rng))
        n = min(n, 180 - t)
        j = int(torch.randint(0, 40, (1,), generator=rng))
        j = min(j, cache.max_len - cache.length)
        cache.update(junk_k[:, :, :j], junk_v[:, :, :j])
        cache.rollback()
        for c in (cache, twin):
            c.update(k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
        got, want = _peek(cache), _peek(twin)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, t)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(bits=4),
            ValueError,
            r"QuantizedKVCache: bits must be 8 \(int8 and fp8 e4m3fn are 8-bit formats\), got 4",
        ),
        (dict(bits=8.0), ValueError, r"QuantizedKVCache: bits must be 8 .*, got 8\.0"),
        (dict(format=["int8"]), ValueError, r"QuantizedKVCache: format must be one of .*, got \['int8'\]"),
        (dict(format="int4"), ValueError, r"QuantizedKVCache: format must be one of \['fp8', 'int8'\], got 'int4'"),
        (dict(residual=-1), ValueError, r"QuantizedKVCache: residual must be an int >= 0, got -1"),
        (dict(group=0), ValueError, r"QuantizedKVCache: group must be an int >= 1, got 0"),
        (dict(span=0), ValueError, r"QuantizedKVCache: span must be an int >= 1, got 0"),
        (dict(dtype=torch.int8), TypeError, r"QuantizedKVCache: dtype must be a floating-point torch.dtype"),
        (dict(values_in_keys=1), TypeError, r"QuantizedKVCache: values_in_keys must be a bool, got 1"),
        (
            dict(values_in_keys=True, value_dim=9),
            ValueError,
            r"QuantizedKVCache: with values_in_keys .* value_dim <= head_dim; got value_dim=9, head_dim=8",
        ),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        QuantizedKVCache(1, 16, 1, 8, **kwargs)


@pytest.mark.parametrize("span,expected", [(5, 4), (12, 12), (10**9, 72), (8 * 4096, 72)])
def test_span_is_whole_groups_within_the_8_bit_region(span, expected):
    """``span`` is rounded down to whole groups and capped at the 8-bit region, the whole groups
    that can ever leave the window (``max_len - sinks - residual = 75`` tokens: 18 groups of 4, 72
    slots): an int8 step pads its slots to
    whole spans, so a span past ``max_len`` made every step allocate span-sized buffers (out of
    memory at ``10**9``) for slots that cannot exist. The step equals the one with the capped span."""
    cache = QuantizedKVCache(1, 80, 2, 8, residual=3, sinks=2, group=4, span=span)
    assert cache.span == expected and cache.k_channel.shape[2] == -(-72 // expected) and cache.q_k.shape[2] == 72
    k, v = torch.randn(1, 2, 60, 8, dtype=torch.float32), torch.randn(1, 2, 60, 8, dtype=torch.float32)
    same = QuantizedKVCache(1, 80, 2, 8, residual=3, sinks=2, group=4, span=expected)
    q = torch.randn(1, 4, 1, 8)
    outs = []
    for c in (cache, same):
        c.update(k, v)
        read = c.update(k[:, :, :1], v[:, :, :1])
        outs.append(mh.backends.decode_blocks.decode_blocks(q, read.blocks, read.mask(None, True, 4)))
    assert torch.equal(outs[0], outs[1])


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


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("bad", ["nan key", "inf key", "nan value", "-inf value"])
def test_a_non_finite_token_reaches_only_the_rows_that_read_it(fmt, bad):
    """One token of a group holds a NaN or an infinity. The other slots of its group keep scales
    of the finite entries (they read back within their step), the bad token's value reads back as
    NaN (its key finite), and a decode step whose window leaves that token out, in another row or
    head, or in the same one, gives what the fp64 reference gives over what the cache holds:
    finite, except where a row reads the token."""
    L, p = SINKS + 2 * GROUP + RESIDUAL, SINKS + GROUP  # p: the first token of the second group
    k, v = _kv(L, seed=3)
    bad_k, bad_v = k.clone(), v.clone()
    where = (0, 1, p, 5)  # batch 0, KV head 1, channel 5
    {"nan key": bad_k, "inf key": bad_k, "nan value": bad_v, "-inf value": bad_v}[bad][where] = {
        "nan key": float("nan"),
        "inf key": float("inf"),
        "nan value": float("nan"),
        "-inf value": float("-inf"),
    }[bad]
    clean, poisoned = _cache(fmt), _cache(fmt)
    clean.update(k, v)
    poisoned.update(bad_k, bad_v)
    assert poisoned._quantized == 2 * GROUP  # the bad token is in the 8-bit region
    ck, cv = _peek(clean)
    pk, pv = _peek(poisoned)
    assert torch.isfinite(pk).all(), "a non-finite key entry reached other slots' keys"
    assert torch.isnan(pv[0, 1, p]).all()
    assert torch.isfinite(pv[0, 1, :p]).all() and torch.isfinite(pv[0, 1, p + 1 :]).all()
    assert torch.isfinite(pv[1]).all() and torch.isfinite(pv[0, [0, 2]]).all()
    # every other slot of the bad token's group: within a step of the scales of the finite entries
    others = [j for j in range(p, p + GROUP) if j != p]
    top = 127.0 if fmt == "int8" else 448.0
    region = bad_k[:, :, SINKS : SINKS + poisoned._quantized]
    steps = _key_steps(poisoned, region.where(torch.isfinite(region), 0.0), top)  # the bad entry as 0
    step = steps[0, 1, [j - SINKS for j in others]]  # (GROUP - 1, D)
    kq = k[0, 1, others]  # (GROUP - 1, D)
    tol = 0.5001 * step + 1e-6 if fmt == "int8" else kq.abs() / 16 + step * 2**-6
    assert bool(((pk[0, 1, others] - kq).abs() <= tol).all())
    assert torch.equal(pk[:, :, :p], ck[:, :, :p]) and torch.equal(pv[:, :, :p], cv[:, :, :p])
    # a decode step: 2 query heads per KV head, with masks leaving the bad token out of every row of
    # its batch row: a window (bottom-right) ending after it, and padding at it in batch row 0 only
    # (batch row 1 reads that slot: inside the keys the decode path reads, weighed 0 in row 0)
    q = torch.randn(B, 2 * HKV, 1, D, generator=torch.Generator().manual_seed(4))
    step_k, step_v = torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D)
    for mask in (mh.sliding_window(L - p - 1), mh.key_padding(torch.tensor([p, L + 1]))):
        outs = {}
        for name, cache in (("clean", clean), ("poisoned", poisoned)):
            read = cache.update(step_k, step_v)
            keys, values, over_slots = read.keys, read.values, read.mask(mask, True, 2 * HKV)
            outs[name] = mh.attention(q, keys, values, mask=over_slots)
            want = mh.reference_attention(q.double(), keys.double(), values.double(), mask=over_slots)
            torch.testing.assert_close(outs[name].double(), want.output, rtol=1e-5, atol=1e-5)
            # the cache's own decode read (pieces dequantized one at a time)
            assert read.blocks is not None
            from_blocks = mh.backends.decode_blocks.decode_blocks(q, read.blocks, over_slots)
            torch.testing.assert_close(from_blocks.double(), want.output, rtol=1e-5, atol=1e-5)
            cache.rollback()
        assert torch.isfinite(outs["poisoned"]).all(), mask
    # the full causal step reads the token: NaN in exactly the rows of batch 0's KV head 1
    read = poisoned.update(step_k, step_v)
    out = mh.attention(q, read.keys, read.values, mask=read.mask(None, True, 2 * HKV))
    nan_rows = torch.isnan(out).any(-1)[..., 0]  # (B, Hq)
    expected = torch.zeros(B, 2 * HKV, dtype=torch.bool)
    expected[0, 2:4] = True  # query heads 2 and 3 read KV head 1
    assert torch.equal(nan_rows, expected)
    from_blocks = mh.backends.decode_blocks.decode_blocks(q, read.blocks, read.mask(None, True, 2 * HKV))
    assert torch.equal(torch.isnan(from_blocks).any(-1)[..., 0], expected)  # the int8 step: the same rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("first", [0.0, 1e-3], ids=["zero-first-group", "quiet-first-group"])
def test_keys_after_a_quiet_first_group_of_their_span_read_back_finite(first, fmt, dtype):
    """The span's channel scales are set by its first store. They were absolute: after a group of
    zero keys (padding) or of small ones, every later key of the span had a token scale
    ``amax(k / kc) / top`` past the dtype's range (inf: fp16 from keys of 10, every dtype after
    zeros), so its slots read back inf or NaN and every row reading them got NaN. They are now
    relative to the span's largest channel, in [1/32, 1]; the tokens carry the magnitude."""
    cache = QuantizedKVCache(1, 64, 1, 8, format=fmt, residual=0, sinks=0, group=4, span=64, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    quiet = (torch.randn(1, 1, 4, 8, generator=g) * first).to(dtype)
    loud = (torch.randn(1, 1, 4, 8, generator=g) * 1000).to(dtype)
    cache.update(quiet, quiet)
    read = cache.update(loud, loud)
    assert torch.isfinite(read.keys).all() and torch.isfinite(read.values).all()
    rel = 2**-7 if fmt == "int8" else 2**-4  # half a step of 127 levels (with the scales' rounding), e4m3's 3 bits
    torch.testing.assert_close(read.keys[:, :, 4:].float(), loud.float(), rtol=rel, atol=rel * 1000 * 4)
    q = torch.randn(1, 2, 1, 8, generator=g).to(dtype)  # a decode step over those slots (int8: integer GEMMs)
    step = mh.backends.decode_blocks.decode_blocks(q, read.blocks, None)
    want = mh.reference_attention(q.double(), read.keys.double(), read.values.double()).output
    assert torch.isfinite(step).all()
    torch.testing.assert_close(step.double(), want, rtol=0.02, atol=0.02 * 1000)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("magnitude", [1e-3, 1e-4])
def test_small_fp16_tokens_keep_the_precision_of_8_bits(magnitude, fmt):
    """Token scales were floored at fp16's smallest normal (6.1e-5), so every token with
    ``amax < 127 · 6.1e-5`` had that step: 9% relative error at ``amax`` 3e-4 where 8 bits give
    0.4%. Scales may now be subnormal, rounded up so that no value passes ``top``."""
    cache = QuantizedKVCache(1, 64, 2, 16, format=fmt, residual=0, sinks=0, group=32, dtype=torch.float16)
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(1, 2, 32, 16, generator=g) * magnitude).half()
    v = (torch.randn(1, 2, 32, 16, generator=g) * magnitude).half()
    read = cache.update(k, v)
    top = 127.0 if fmt == "int8" else 448.0
    k_step = _key_steps(cache, k.float(), top)  # kc · kt per element, as in the test above
    v_step = v.float().abs().amax(dim=-1, keepdim=True) / top
    for got, want, step in ((read.keys, k, k_step), (read.values, v, v_step)):
        want = want.float()
        # int8: half a step; e4m3: 3 mantissa bits; both: fp16's rounding of the product (and its
        # subnormal spacing, 2^-24, for the smallest entries)
        tol = 0.5001 * step if fmt == "int8" else want.abs() / 16 + step * 2**-6
        assert bool(((got.float() - want).abs() <= tol + want.abs() * 2**-10 + 2**-24).all())
    assert bool((cache.v_scale[:, :, :32].float() < 6.1e-5).all())  # below the floor it had (fp16 smallest normal)


@pytest.mark.parametrize(
    "sinks,residual,slots",
    [(4, 4096, (4, 96, 0)), (4096, 64, (100, 0, 0)), (0, 100, (0, 100, 0)), (2, 50, (2, 82, 32)), (4, 64, (4, 96, 32))],
)
def test_buffers_are_what_max_len_can_hold_and_bytes_say_so(sinks, residual, slots):
    """Sinks, tail and 8-bit region sized by what ``max_len`` can hold, not by the sizes asked:
    ``residual >= max_len`` (nothing ever quantized) allocated ``residual + group`` full-precision
    slots and an 8-bit region for every token besides (a 100-token cache with ``residual=4096``
    held 41x a StaticKVCache's bytes). A store keeps ``residual`` tokens in the tail, so the region
    is the whole groups of ``max_len - sinks - residual``. Every token still reads back."""
    cache = QuantizedKVCache(1, 100, 2, 8, sinks=sinks, residual=residual, group=32)
    assert (cache.sink_k.shape[2], cache.tail_k.shape[2], cache.q_k.shape[2]) == slots
    if residual >= 100 - min(sinks, 100):  # nothing is quantized: the bytes of a full-precision cache
        assert cache.nbytes == StaticKVCache(1, 100, 2, 8).nbytes - 8  # (less its int64 lengths)
    k, v = torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    read = None
    for t in range(0, 100, 7):  # fill it to max_len, in steps
        read = cache.update(k[:, :, t : t + 7], v[:, :, t : t + 7])
    assert read is not None and cache.length == 100
    exact = min(sinks, 100) + min(residual, 100)
    if exact >= 100:
        assert torch.equal(read.keys, k) and torch.equal(read.values, v)
    torch.testing.assert_close(read.keys, k, rtol=0.05, atol=0.05)


def test_values_in_keys_refuses_values_that_are_not_the_keys_prefix_and_keeps_the_cache():
    """``values_in_keys=True``: ``update`` wants ``v = k[..., :value_dim]``; other values are refused
    with the cache as it was, and the values read are the keys' first features, bit for bit."""
    cache = QuantizedKVCache(1, 64, 2, 8, value_dim=6, values_in_keys=True, residual=4, sinks=1, group=4)
    k = torch.randn(1, 2, 20, 8)
    read = cache.update(k, k[..., :6])
    keys, values = read.keys, read.values
    assert torch.equal(values, keys[..., :6])
    before = cache.nbytes, cache.length
    with pytest.raises(ValueError, match=r"QuantizedKVCache.update: v must equal k\[\.\.\., :6\]"):
        cache.update(k[:, :, :1], torch.randn(1, 2, 1, 6))
    assert (cache.nbytes, cache.length) == before
    again = cache.update(k[:, :, :1], k[:, :, :1, :6])
    assert again.keys.shape[2] == 21 and torch.equal(again.values, again.keys[..., :6])
