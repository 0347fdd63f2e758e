"""``max_weights_bytes``: returned weights larger than the limit are refused before any kernel
runs (issue 28, item 10: ``need_weights=True`` at L = 32768 ran 18 s, then failed to allocate
32 GiB), with the size, the limit and the fix; a selection under the limit passes."""

import sys

import pytest
import torch

import multihead as mh
from helpers import LargestAllocation
from multihead.validation import DEFAULT_MAX_WEIGHTS_BYTES

B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 48, 64, 16
FULL = B * Hq * Lq * Lk * 4  # bytes of all the fp32 weights: 98304


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(28)
    return [torch.randn(B, h, L, D, generator=gen).to(dtype) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))]


def _no_kernel(monkeypatch):
    """Make dispatch fail the test: a refusal must come before any backend is chosen or run."""

    def refuse(*args, **kwargs):
        raise AssertionError("a backend was selected: the limit was checked too late")

    monkeypatch.setattr(sys.modules["multihead.attention"], "select_backend", refuse)


@pytest.mark.parametrize("extra", [{}, {"sinks": torch.zeros(Hq)}], ids=["plain", "sinks"])
def test_weights_over_the_limit_are_refused_before_any_kernel_runs(monkeypatch, extra):
    q, k, v = _inputs()
    _no_kernel(monkeypatch)
    with LargestAllocation() as probe:
        with pytest.raises(
            ValueError,
            match=rf"return_weights=True would allocate {FULL} bytes \(96.0 KiB\) for the weights \(B, heads, rows, "
            rf"Lk\) = \({B}, {Hq}, {Lq}, {Lk}\) in torch.float32, over max_weights_bytes=4096 \(4.0 KiB\); refused "
            r"before computing anything. Fix: .*weights_heads= and weights_rows=.*or raise the limit with "
            r"multihead.attention\(\.\.\., max_weights_bytes=\) \(None: no limit\)",
        ):
            mh.attention(q, k, v, return_weights=True, max_weights_bytes=4096, **extra)
    assert probe.largest < B * Hq * Lq * D  # nothing as large as the output, let alone the scores


def test_a_selection_under_the_limit_passes_and_equals_the_full_weights_slice():
    q, k, v = _inputs()
    mask = mh.causal()
    full = mh.attention(q, k, v, mask=mask, return_weights=True, max_weights_bytes=None)
    assert full.weights.shape == (B, Hq, Lq, Lk)
    picked = dict(weights_heads=[0, 3], weights_rows=slice(-4, None))
    nbytes = B * 2 * 4 * Lk * 4  # 4096
    got = mh.attention(q, k, v, mask=mask, return_weights=True, max_weights_bytes=nbytes, **picked)
    torch.testing.assert_close(got.weights, full.weights[:, [0, 3], -4:])
    torch.testing.assert_close(got.output, full.output)
    with pytest.raises(ValueError, match=rf"would allocate {nbytes} bytes .*max_weights_bytes={nbytes - 1} "):
        mh.attention(q, k, v, mask=mask, return_weights=True, max_weights_bytes=nbytes - 1, **picked)


def test_the_limit_counts_the_dtype_of_the_weights_and_the_default_passes_ordinary_calls():
    q, k, v = (t.to(torch.bfloat16) for t in _inputs())
    half = FULL // 2  # bf16 weights take 2 bytes each
    assert mh.attention(q, k, v, return_weights=True, max_weights_bytes=half).weights.shape == (B, Hq, Lq, Lk)
    with pytest.raises(ValueError, match=rf"would allocate {half} bytes .* in torch.bfloat16"):
        mh.attention(q, k, v, return_weights=True, max_weights_bytes=half - 1)
    assert DEFAULT_MAX_WEIGHTS_BYTES == 2 << 30
    assert mh.attention(*_inputs(), return_weights=True).weights.shape == (B, Hq, Lq, Lk)
    # Without weights the limit is not consulted: the output alone is never refused.
    assert mh.attention(*_inputs(), max_weights_bytes=0).shape == (B, Hq, Lq, D)


def test_a_layer_with_need_weights_is_refused_at_once_by_the_default_limit(monkeypatch):
    """(1, 8, 8200, 8200) fp32 weights are 2 GiB + 4 MiB: over the default, refused before
    attention runs (the report: 18 s of compute, then a failed 32 GiB allocation)."""
    layer = mh.MultiHeadAttention(16, 8)
    x = torch.randn(1, 8200, 16)
    _no_kernel(monkeypatch)
    with pytest.raises(ValueError, match=r"would allocate 2151680000 bytes \(2.0 GiB\) .*max_weights_bytes=2147483648"):
        layer(x, need_weights=True)


@pytest.mark.parametrize(
    "limit,exc,pattern",
    [
        ("2GiB", TypeError, r"max_weights_bytes must be an int \(bytes\) or None \(no limit\), got '2GiB'"),
        (True, TypeError, r"max_weights_bytes must be an int .*got True"),
        (1e9, TypeError, r"max_weights_bytes must be an int .*got 1000000000.0"),
        (-1, ValueError, r"max_weights_bytes must be >= 0 or None \(no limit\), got -1"),
    ],
    ids=["str", "bool", "float", "negative"],
)
def test_max_weights_bytes_is_validated(limit, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mh.attention(*_inputs(), return_weights=True, max_weights_bytes=limit)
