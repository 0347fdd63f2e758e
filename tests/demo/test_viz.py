"""The PNG heatmaps and the HTML viewer's contents (the browser test is in test_browser.py)."""

from __future__ import annotations

import base64
import json
import re

import pytest
import torch

from multihead.viz import ViewerSource, plot_attention, plot_attention_grid, render_viewer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _weights(layers=2, heads=3, lq=5, lk=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(layers, heads, lq, lk, generator=g), dim=-1)


def _data(page: str) -> dict:
    text = re.search(r'<script id="attention-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    return json.loads(text)


def test_viewer_is_self_contained():
    tokens = ["a", "b", "c", "d", "e"]
    page = render_viewer([ViewerSource("m", tokens, tokens, _weights())], title="t")
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", page), "the viewer must not reference the network"
    assert not re.search(r"<(link|img|iframe)\b|<script[^>]*\bsrc=|@import|url\(", page)
    assert "{{" not in page  # every placeholder filled


def test_viewer_data_round_trips_and_escapes_tokens():
    tokens = ["</script><b>x", "{{JS}}", "c", "d", "e"]
    w = _weights()
    page = render_viewer([ViewerSource("m", tokens, tokens, w, ["first", "second"], highlight=(1, 2, "lookup"))],
                         title="<title>")
    assert page.count("</script>") == 2  # the data block and the code block end; a token cannot end one
    assert "&lt;title&gt;" in page
    data = _data(page)["sources"][0]
    assert data["q_tokens"] == tokens and data["layers"] == ["first", "second"]
    assert (data["heads"], data["lq"], data["lk"]) == (3, 5, 5)
    assert data["highlight"] == {"layer": 1, "head": 2, "label": "lookup"}
    decoded = torch.frombuffer(bytearray(base64.b64decode(data["weights"][1][2])), dtype=torch.uint8).view(5, 5)
    torch.testing.assert_close(decoded.float() / 255, w[1, 2], atol=0.5 / 255 + 1e-6, rtol=0)


def test_viewer_takes_per_layer_captures_and_rectangular_maps():
    per_layer = [w.unsqueeze(0) for w in _weights(layers=3, heads=2, lq=2, lk=7)]  # (1, H, Lq, Lk) each
    page = render_viewer([ViewerSource("m", ["q0", "q1"], [f"k{i}" for i in range(7)], per_layer)])
    data = _data(page)["sources"][0]
    assert (len(data["weights"]), data["lq"], data["lk"], data["thumb_q"], data["thumb_k"]) == (3, 2, 7, 2, 7)


def test_viewer_downsamples_thumbnails_for_long_inputs():
    w = _weights(layers=1, heads=1, lq=300, lk=300)
    tokens = [str(i) for i in range(300)]
    data = _data(render_viewer([ViewerSource("m", tokens, tokens, w)]))["sources"][0]
    assert (data["thumb_q"], data["thumb_k"]) == (48, 48)
    assert len(base64.b64decode(data["thumbs"][0][0])) == 48 * 48
    assert len(base64.b64decode(data["weights"][0][0])) == 300 * 300


@pytest.mark.parametrize("source, regex", [
    (lambda: ViewerSource("m", ["a"], ["a", "b"], _weights(lq=1, lk=3)), r"got 1 query tokens and 2 key tokens"),
    (lambda: ViewerSource("m", ["a"], ["a"], torch.ones(1, 1, 1)), r"must be \(layers, H, Lq, Lk\)"),
    (lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), ["only one"]), r"1 layer names for 2 layers"),
    (lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), highlight=(5, 0, "x")), r"outside 2 layers x 3 heads"),
])
def test_viewer_rejects_mismatched_sources(source, regex):
    with pytest.raises(ValueError, match=regex):
        render_viewer([source()])


def test_heatmaps_are_pngs(tmp_path):
    w = _weights(layers=2, heads=3, lq=4, lk=4)
    grid = plot_attention_grid(w, tmp_path / "grid.png", tokens=list("abcd"), title="grid")
    one = plot_attention(w[0, 0], tmp_path / "one.png", q_tokens=list("abcd"), k_tokens=list("abcd"), marks=[(1, 0)])
    for path in (grid, one):
        assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match=r"weights must be \(Lq, Lk\) = \(2, 4\)"):
        plot_attention(w[0, 0], tmp_path / "bad.png", q_tokens=list("ab"), k_tokens=list("abcd"))
