"""The int8 decode path (:mod:`multihead.backends.decode_int8`): a step over an int8
``QuantizedKVCache`` multiplies the stored bytes with integer GEMMs. Its oracle is the fp64
attention over exactly what the cache stores (``K8 · kc · kt`` and ``V8 · vt`` in fp64, sinks and
window as they are), its baseline the same attention done naively in the compute dtype over the
cache's dense read; the relative rule (TESTING.md) holds across GQA shapes, query counts, spans
crossed mid-read, masks (windows that start inside a span, key padding, rows that see nothing),
``Dv != D``, a batch and a non-contiguous query, and on long reads whose weights span many
orders of magnitude (one key near 1, thousands near 1e-5: the weights' second int8 digit).
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.backends import decode_int8
from multihead.backends.decode_blocks import decode_blocks
from multihead.caches import QuantizedKVCache

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FACTOR = {torch.float32: 10, torch.bfloat16: 2, torch.float16: 2}


def _stored(cache: QuantizedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot as the cache stores it, in fp64, without rounding to the compute dtype."""
    s, nq, L = min(cache.sinks, cache.length), cache._quantized, cache.length
    t = L - s - nq
    kc = cache._channel_scales(0, nq).double() * cache.k_token[:, :, :nq].double()
    keys = torch.cat(
        [cache.sink_k[:, :, :s].double(), cache.q_k[:, :, :nq].double() * kc, cache.tail_k[:, :, :t].double()], 2
    )
    vq = cache.q_v[:, :, :nq].double() * cache.v_scale[:, :, :nq].double()
    values = torch.cat([cache.sink_v[:, :, :s].double(), vq, cache.tail_v[:, :, :t].double()], 2)
    return keys, values


def _filled(B, Hkv, L, D, Dv, dtype, span, seed=0, outliers=True):
    gen = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.2, 6.0, D) if outliers else torch.ones(D)
    k = (torch.randn(B, Hkv, L, D, generator=gen) * spread).to(dtype)
    v = torch.randn(B, Hkv, L, Dv, generator=gen).to(dtype)
    cache = QuantizedKVCache(B, L + 8, Hkv, D, value_dim=Dv, residual=6, sinks=3, group=4, span=span, dtype=dtype)
    for a, b in ((0, L // 3), (L // 3, L // 3 + 1), (L // 3 + 1, L)):  # a prefill, a step, the rest
        cache.update(k[:, :, a:b], v[:, :, a:b])
    return cache, gen


def _check(cache, q, mask, dtype, what):
    read = cache.update(torch.zeros_like(cache.tail_k[:, :, :0]), torch.zeros_like(cache.tail_v[:, :, :0]))
    over = read.mask(mask, True, q.shape[1])
    got = decode_blocks(q, read.blocks, over)
    keys, values = _stored(cache)
    ref = mh.reference_attention(q.double(), keys, values, mask=over).output
    base = naive_attention(q, read.keys, read.values, over)
    cache.rollback()
    assert_relative(got, ref, base, factor=FACTOR[dtype], what=what)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "B, Hq, Hkv, Lq, L, D, Dv, span",
    [
        (1, 4, 4, 1, 203, 16, 16, 8),
        (2, 8, 2, 3, 113, 40, 24, 12),
        (3, 6, 3, 2, 127, 16, 16, 32),
        (1, 8, 1, 1, 300, 59, 59, 64),
        (2, 32, 8, 1, 257, 64, 64, 4096),
    ],
    ids=lambda x: str(x),
)
@pytest.mark.parametrize("mask", ["none", "window", "padding"])
def test_int8_steps_follow_the_relative_rule_over_what_the_cache_stores(dtype, B, Hq, Hkv, Lq, L, D, Dv, span, mask):
    cache, gen = _filled(B, Hkv, L, D, Dv, dtype, span)
    assert cache._quantized > span or span == 4096  # reads cross spans (the small ones)
    q = (torch.randn(B, Lq, Hq, D, generator=gen) / 2).to(dtype).transpose(1, 2)  # non-contiguous
    masks = {
        "none": None,
        "window": mh.sliding_window(L // 2 + 5),  # starts inside a span of the 8-bit region
        "padding": mh.key_padding(torch.tensor([L - 1, 17, L][:B])),  # rows of different lengths
    }
    _check(cache, q, masks[mask], dtype, f"int8 {dtype} {mask}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_that_see_nothing_give_zero_and_the_others_are_unchanged(dtype):
    B, Hq, Hkv, L, D = 2, 4, 2, 90, 16
    cache, gen = _filled(B, Hkv, L, D, D, dtype, span=16)
    q = torch.randn(B, Hq, 2, D, generator=gen).to(dtype)
    visible = torch.ones(B, 1, 2, L, dtype=torch.bool)
    visible[1, :, 0] = False  # batch row 1, query 0: no key
    visible[0, :, 1, 20:70] = False  # a hole over the 8-bit region
    got = _check(cache, q, visible, dtype, f"int8 {dtype} holes")
    assert torch.equal(got[1, :, 0], torch.zeros_like(got[1, :, 0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_across_many_orders_of_magnitude_keep_their_tail(dtype):
    """One key gets half of the weight, 6000 others share the rest (each near 1e-4 of the peak): a
    single int8 digit per weight rounds the tail of the peak's span to 0 and moves the output by
    about half the tail's mean value (the values carry a common offset so that the tail's sum
    matters); two digits (fp16/bf16) and three (fp32) stay within the relative rule."""
    B, Hq, Hkv, L, D = 1, 4, 1, 6000, 32
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(B, Hkv, L, D, generator=gen) * 0.05
    v = (torch.randn(B, Hkv, L, D, generator=gen) + 3.0).to(dtype)
    q = torch.randn(B, Hq, 1, D, generator=gen)
    # one key whose score for head 0 is log(L) above the others': about half of that head's weight
    k[:, :, 1000] = q[0, 0] / q[0, 0].norm() * (math.log(L) * D**0.5 / q[0, 0].norm())
    cache = QuantizedKVCache(B, L, Hkv, D, residual=8, sinks=0, group=8, span=2048, dtype=dtype)
    cache.update(k.to(dtype), v)
    _check(cache, q.to(dtype), None, dtype, f"int8 {dtype} peaked")


def test_fp64_and_fp8_dequantize_instead():
    """No int8 digits hold fp64 precision, and fp8 is not an integer format: both read pieces."""
    assert decode_int8.digits_for(torch.float64) is None
    for fmt, dtype in (("fp8", torch.float32), ("int8", torch.float64)):
        cache = QuantizedKVCache(1, 64, 2, 8, format=fmt, residual=4, sinks=1, group=4, dtype=dtype)
        read = cache.update(torch.randn(1, 2, 40, 8, dtype=dtype), torch.randn(1, 2, 40, 8, dtype=dtype))
        assert read.blocks.partials(torch.zeros(1, 2, 1, 8, dtype=dtype), 0, 40, None, 1.0, 1, 1) is None
