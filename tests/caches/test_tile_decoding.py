"""bf16 MQA decoding through each cache on the CPU decode kernel, whose AMX tile path takes calls of
at least 8 query rows per KV head over bf16 (``backends/cpu_decode_amx.h``): 16 query heads over one
KV head of 32 features, prefill then one-token and three-token steps, against the fp64 forward of
the same rounded weights, no further from it than the bf16 full forward (times 2). ``explain()``
on a one-token step says whether the tiles ran (they do where the CPU has them and the read has no
row mask: a static, dynamic or paged cache; a partly filled ring has a row mask)."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import assert_relative
from multihead.backends import cpu_kernels
from multihead.caches import DynamicKVCache, PagedKVCache, QuantizedKVCache, SlidingWindowKVCache, StaticKVCache

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel() is None, reason=f"the CPU decode kernel is unavailable: {cpu_kernels.unavailable()}"
)

E, HQ, B, T, PREFILL = 512, 16, 2, 70, 41
SCHEDULE = [PREFILL] + [1] * 20 + [3, 3, 1, 1, 1]
TILES = cpu_kernels.tiles(torch.bfloat16, HQ, E // HQ, E // HQ, False)


def _layer(dtype):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(E, HQ, num_kv_heads=1, causal=True, dtype=dtype).eval()


def _cache(kind):
    if kind == "static":
        return StaticKVCache(B, 96, 1, E // HQ, dtype=torch.bfloat16)
    if kind == "dynamic":
        return DynamicKVCache(capacity=8)
    if kind == "paged":
        return PagedKVCache(24, 8, 1, E // HQ, batch_size=B, dtype=torch.bfloat16)
    return SlidingWindowKVCache(40, B, 1, E // HQ, dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["static", "dynamic", "paged", "sliding"])
def test_bf16_mqa_steps_through_each_cache_equal_the_full_forward(kind):
    mask = mh.sliding_window(40) if kind == "sliding" else None
    layer, layer64 = _layer(torch.bfloat16), _layer(torch.float64)
    layer64.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})  # the same rounded weights
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(1)).bfloat16()
    cache = _cache(kind)
    outs, t = [], 0
    with torch.no_grad():
        want, full = layer64(x.double(), mask=mask), layer(x, mask=mask)
        for n in SCHEDULE:
            if t == PREFILL:  # the steps on the decode backend (auto leaves calls this small to sdpa)
                layer.backend = "decode"
                report = str(layer.explain(x[:, t : t + 1], kv_cache=cache, mask=mask))
            outs.append(layer(x[:, t : t + n], kv_cache=cache, mask=mask))
            t += n
    assert t == T
    out = torch.cat(outs, 1)
    assert "cpu_decode.c" in report, report
    assert ("AMX tiles" in report) == TILES, report
    assert_relative(out[:, PREFILL:], want[:, PREFILL:], full[:, PREFILL:], 2, f"{kind} steps")


def test_an_int8_cache_under_sixteen_query_heads_reads_its_slots_in_place_within_its_rounding():
    """The same layer over a ``QuantizedKVCache`` (int8, bf16 compute): its steps read the cache as
    blocks (``explain()`` says so), the 8-bit slots through the kernel (on the tiles from 16 query
    rows per KV head, where the CPU has them), within the int8 rounding of the static cache's steps."""
    layer = _layer(torch.bfloat16)
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(1)).bfloat16()
    outs = {}
    with torch.no_grad():
        for kind in ("static", "int8"):
            layer.backend = "auto"
            cache = (
                _cache(kind)
                if kind != "int8"
                else QuantizedKVCache(B, 96, 1, E // HQ, residual=8, sinks=2, dtype=torch.bfloat16)
            )
            parts, t = [], 0
            for n in SCHEDULE:
                if t == PREFILL:
                    layer.backend = "decode"
                    report = str(layer.explain(x[:, t : t + 1], kv_cache=cache))
                parts.append(layer(x[:, t : t + n], kv_cache=cache))
                t += n
            outs[kind] = torch.cat(parts, 1)[:, PREFILL:].float()
    assert "read as blocks" in report, report
    scale = float(outs["static"].abs().max())
    assert float((outs["int8"] - outs["static"]).abs().max()) <= 2e-2 * scale
    assert float((outs["int8"] - outs["static"]).abs().mean()) <= 2e-3 * scale


def test_a_gqa_layer_over_an_int8_cache_takes_the_int8_tiles_within_its_rounding():
    """GQA's step (4 query heads per KV head, one token: 4 rows) over an int8 ``QuantizedKVCache``:
    its scores and ``P V`` run on the AMX int8 tiles where the CPU has them (``explain()`` names them,
    and the FMA path elsewhere), and its steps stay within the int8 rounding of a bf16 static cache's
    (long enough for several spans of channel scales and a 256-slot round of tile products)."""
    torch.manual_seed(0)
    heads, kv_heads, D, T, prefill = 16, 4, 64, 700, 600
    layer = mh.MultiHeadAttention(heads * D, heads, num_kv_heads=kv_heads, causal=True, dtype=torch.bfloat16).eval()
    x = torch.randn(B, T, heads * D, generator=torch.Generator().manual_seed(2)).bfloat16()
    caches = {
        "static": StaticKVCache(B, T, kv_heads, D, dtype=torch.bfloat16),
        "int8": QuantizedKVCache(B, T, kv_heads, D, residual=16, sinks=4, span=128, dtype=torch.bfloat16),
    }
    outs = {}
    with torch.no_grad():
        for kind, cache in caches.items():
            layer.backend = "auto"
            layer(x[:, :prefill], kv_cache=cache)
            layer.backend = "decode"
            report = str(layer.explain(x[:, prefill : prefill + 1], kv_cache=cache))
            outs[kind] = torch.cat([layer(x[:, t : t + 1], kv_cache=cache) for t in range(prefill, T)], 1).float()
    assert "read as blocks" in report, report
    assert ("AMX int8 tiles" in report) == cpu_kernels.int8_tiles(heads // kv_heads, D), report
    assert ("on the FMA path" in report) != cpu_kernels.int8_tiles(heads // kv_heads, D), report
    scale = float(outs["static"].abs().max())
    assert float((outs["int8"] - outs["static"]).abs().max()) <= 2e-2 * scale
    assert float((outs["int8"] - outs["static"]).abs().mean()) <= 2e-3 * scale
