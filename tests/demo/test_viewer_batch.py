"""Batched weights in the viewer and the heatmaps: a batch index, or a refusal naming it, never
sequence 0 in silence (the tokens name one sequence; the page would pair another's weights with them)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import multihead as mh
from multihead.viz import ViewerSource, plot_attention_grid, record_attention, render_viewer


def _batched(layers=2, B=3, H=2, L=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(layers, B, H, L, L, generator=g), dim=-1)  # (layers, B, H, L, L)


def _data(source: ViewerSource) -> dict:
    page = render_viewer([source])
    return json.loads(re.search(r'<script id="attention-data" type="application/json">(.*?)</script>', page, re.S)[1])


TOKENS = list("abcd")


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_batched_weights_without_a_batch_index_are_refused_with_the_fix(form):
    w = _batched()
    weights = list(w) if form == "list" else w  # per-layer (B, H, L, L), or (layers, B, H, L, L)
    with pytest.raises(
        ValueError,
        match=r"weights( of layer 0)? are batched, shape (\(3, 2, 4, 4\)|\(layers, B, H, L, ·\) = "
        r"\(2, 3, 2, 4, 4\)) with B=3.*batch=i",
    ):
        render_viewer([ViewerSource("m", TOKENS, TOKENS, weights)])


@pytest.mark.parametrize("form", ["list", "tensor"])
@pytest.mark.parametrize("batch", [1, 2, -1])
def test_a_batch_index_shows_that_sequence(form, batch):
    w = _batched()
    weights = list(w) if form == "list" else w
    shown = _data(ViewerSource("m", TOKENS, TOKENS, weights, batch=batch))["sources"][0]
    alone = _data(ViewerSource("m", TOKENS, TOKENS, w[:, batch]))["sources"][0]
    assert shown["weights"] == alone["weights"] and shown["thumbs"] == alone["thumbs"]
    other = _data(ViewerSource("m", TOKENS, TOKENS, w[:, (batch + 1) % 3]))["sources"][0]
    assert shown["weights"] != other["weights"]


def test_the_batch_index_selects_queries_and_keys_too():
    w = _batched(B=2)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 2, 4, 8, generator=g), torch.randn(2, 2, 1, 4, 8, generator=g)  # (layers, B, H|Hkv, L, D)
    shown = _data(ViewerSource("m", TOKENS, TOKENS, list(w), queries=list(q), keys=list(k), batch=1))["sources"][0]
    alone = _data(ViewerSource("m", TOKENS, TOKENS, w[:, 1], queries=list(q[:, 1]), keys=list(k[:, 1])))["sources"][0]
    assert shown["queries"] == alone["queries"] and shown["keys"] == alone["keys"]
    with pytest.raises(ValueError, match=r"queries of layer 0 are batched, shape \(2, 2, 4, 8\) with B=2"):
        render_viewer([ViewerSource("m", TOKENS, TOKENS, w[:, 1], queries=list(q), keys=list(k[:, 1]))])


@pytest.mark.parametrize(
    "batch, error, pattern",
    [
        (3, ValueError, r"batch=3 is out of range for weights of layer 0 with B=3"),
        (-4, ValueError, r"batch=-4 is out of range"),
        (True, TypeError, r"batch must be None or an int, got True"),
        ("0", TypeError, r"batch must be None or an int, got '0'"),
    ],
)
def test_a_bad_batch_index_is_refused(batch, error, pattern):
    with pytest.raises(error, match=pattern):
        render_viewer([ViewerSource("m", TOKENS, TOKENS, list(_batched()), batch=batch)])


def test_a_batch_of_one_needs_no_index_and_a_single_sequence_takes_no_other():
    w = _batched(B=1)
    assert _data(ViewerSource("m", TOKENS, TOKENS, list(w)))["sources"][0]["weights"]
    with pytest.raises(ValueError, match=r"batch=1 but weights \(2, 2, 4, 4\) hold one sequence"):
        render_viewer([ViewerSource("m", TOKENS, TOKENS, w[:, 0], batch=1)])


def test_the_heatmap_grid_refuses_batched_weights():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match=r"weights of layer 0 are batched, shape \(3, 2, 4, 4\); pass one sequence"):
        plot_attention_grid(list(_batched()), "unused.png")


def test_record_attention_of_a_batch_needs_the_index_and_shows_that_sequence():
    torch.manual_seed(0)
    model = torch.nn.Sequential(mh.MultiHeadAttention(16, 2, causal=True), mh.MultiHeadAttention(16, 2)).eval()
    x = torch.randn(3, 4, 16)
    with pytest.raises(ValueError, match=r"record_attention: the inputs hold B=3 sequences .* pass batch=i"):
        record_attention(model, x, tokens=TOKENS)
    with pytest.raises(ValueError, match=r"batch must be an int in \[0, 3\)"):
        record_attention(model, x, tokens=TOKENS, batch=3)
    with torch.no_grad(), mh.capture_attention(model) as cap:
        model(x)
    source = record_attention(model, x, tokens=TOKENS, batch=2)
    for recorded, captured in zip(source.weights, cap.weights):
        torch.testing.assert_close(recorded, captured[2])


# ---------------------------------------------------------------------------------- signed values
def test_signed_values_are_stored_against_the_largest_magnitude():
    g = torch.Generator().manual_seed(0)
    w = 5 * torch.randn(2, 3, 4, 4, generator=g)
    data = _data(ViewerSource("m", TOKENS, TOKENS, w, signed=True))["sources"][0]
    scale = float(w.abs().max())
    assert data["signed"] is True and abs(data["value_scale"] - scale) < 1e-6
    import base64

    stored = torch.frombuffer(bytearray(base64.b64decode(data["weights"][1][2])), dtype=torch.int8).float()
    torch.testing.assert_close(stored.view(4, 4) * scale / 127, w[1, 2], rtol=0, atol=scale / 254 + 1e-6)
    zero = torch.zeros(1, 1, 4, 4)
    assert _data(ViewerSource("z", TOKENS, TOKENS, zero, signed=True))["sources"][0]["value_scale"] == 1.0


@pytest.mark.parametrize(
    "source, error, pattern",
    [
        (
            lambda: ViewerSource("m", TOKENS, TOKENS, torch.randn(1, 1, 4, 4)),
            ValueError,
            r"weights must be attention probabilities in \[0, 1\].*signed=True",
        ),
        (
            lambda: ViewerSource("m", TOKENS, TOKENS, torch.full((1, 1, 4, 4), float("-inf")), signed=True),
            ValueError,
            r"signed values must be finite.*masked scores are -inf: replace them",
        ),
        (
            lambda: ViewerSource(
                "m",
                TOKENS,
                TOKENS,
                torch.randn(1, 1, 4, 4),
                queries=torch.randn(1, 1, 4, 8),
                keys=torch.randn(1, 1, 4, 8),
                signed=True,
            ),
            ValueError,
            r"a signed source takes no queries= or keys=",
        ),
        (
            lambda: ViewerSource("m", TOKENS, TOKENS, torch.rand(1, 1, 4, 4), signed=1),
            TypeError,
            r"signed must be a bool",
        ),
    ],
    ids=["unsigned-out-of-range", "signed-inf", "signed-with-vectors", "signed-not-bool"],
)
def test_bad_signed_sources_are_refused_with_the_fix(source, error, pattern):
    with pytest.raises(error, match=pattern):
        render_viewer([source()])
