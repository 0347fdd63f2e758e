"""The PNG heatmaps and the HTML viewer's contents (the browser test is in test_browser.py)."""

from __future__ import annotations

import base64
import html
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
    page = render_viewer(
        [ViewerSource("m", tokens, tokens, w, ["first", "second"], highlight=(1, 2, "lookup"))], title="<title>"
    )
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


@pytest.mark.parametrize(
    "source, regex",
    [
        (lambda: ViewerSource("m", ["a"], ["a", "b"], _weights(lq=1, lk=3)), r"got 1 query tokens and 2 key tokens"),
        (lambda: ViewerSource("m", ["a"], ["a"], torch.ones(1, 1, 1)), r"must be \(layers, H, Lq, Lk\)"),
        (
            lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), ["only one"]),
            r"1 layer names for 2 layers",
        ),
        (
            lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), highlight=(5, 0, "x")),
            r"outside 2 layers x 3 heads",
        ),
        (
            lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), highlight=(1, 0)),
            r"highlight must be \(layer, head, label\), got \(1, 0\)",
        ),
        (lambda: ViewerSource("m", [], [], []), r"weights is an empty list; expected one \(H, Lq, Lk\) per layer"),
        (
            lambda: ViewerSource("m", ["a", "b"], ["a", "b"], torch.tensor([[[[2.0, -1.0], [0.5, 0.5]]]])),
            r"weights must be attention probabilities in \[0, 1\], got values in \[-1, 2\]; pass the softmax",
        ),
        (lambda: ViewerSource("m", ["a"], ["a"], torch.full((1, 1, 1, 1), float("nan"))), r"\[0, 0\] with NaN or inf"),
    ],
)
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


# ------------------------------------------------------------------ neuron view, generation, Jupyter
def _floats(b64: str, *shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.float32).view(*shape)


def test_viewer_stores_queries_and_keys_with_gqa_keys_read_by_their_query_heads():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)  # Hq=4, Hkv=2
    tokens = list("abcde")
    data = _data(render_viewer([ViewerSource("m", tokens, tokens, _weights(heads=4), queries=q, keys=k)]))["sources"][0]
    assert (data["dim"], data["scale"]) == (8, pytest.approx(8**-0.5))
    torch.testing.assert_close(_floats(data["queries"][1][3], 5, 8), q[1, 3], rtol=0, atol=0)
    for h in range(4):  # query heads 0, 1 read KV head 0; 2, 3 read KV head 1
        torch.testing.assert_close(_floats(data["keys"][1][h], 5, 8), k[1, h // 2], rtol=0, atol=0)
    data = _data(render_viewer([ViewerSource("m", tokens, tokens, _weights(heads=4), queries=q, keys=k, scale=0.5)]))
    assert data["sources"][0]["scale"] == 0.5


def test_record_attention_takes_a_model_mixing_mha_and_gqa_layers():
    import multihead as mh
    from multihead.viz import Viewer, record_attention

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        mh.MultiHeadAttention(32, 4, causal=True), mh.MultiHeadAttention(32, 4, num_kv_heads=2)
    ).eval()  # Hkv 4, then 2
    source = record_attention(model, torch.randn(1, 5, 32), tokens=list("abcde"))
    data = _data(Viewer(source).html)["sources"][0]
    for h in range(4):  # layer 1: query heads 0, 1 read KV head 0; 2, 3 read KV head 1
        torch.testing.assert_close(_floats(data["keys"][1][h], 5, 8), source.keys[1][h // 2], rtol=0, atol=0)
        torch.testing.assert_close(_floats(data["keys"][0][h], 5, 8), source.keys[0][h], rtol=0, atol=0)


def test_record_attention_vectors_reproduce_the_weights_with_rotary_positions():
    import multihead as mh
    from multihead.positions import RotaryEmbedding
    from multihead.viz import record_attention

    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=RotaryEmbedding(8), causal=True).eval()
    src = record_attention(layer, torch.randn(1, 7, 32), tokens=list("abcdefg"))
    q, k = src.queries[0], src.keys[0].repeat_interleave(2, dim=0)  # (H, L, D)
    scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(scores.softmax(-1), src.weights[0], atol=1e-6, rtol=1e-5)


def test_record_vectors_reads_the_drop_in_layer_through_its_hook_points():
    from multihead.layers.compat import MultiheadAttention
    from multihead.viz import record_attention

    torch.manual_seed(0)
    layer = MultiheadAttention(24, 3, batch_first=True).eval()
    x = torch.randn(1, 5, 24)
    src = record_attention(layer, x, x, x, tokens=list("abcde"))
    q, k = src.queries[0], src.keys[0]  # (H, L, D)
    torch.testing.assert_close((q @ k.transpose(-1, -2) / 8**0.5).softmax(-1), src.weights[0], atol=1e-6, rtol=1e-5)


def test_record_generation_rows_equal_the_uncached_forward_and_the_tokens_generate_returns():
    from multihead.capture import capture_attention
    from multihead.models import CausalDecoder, DecoderConfig
    from multihead.viz import record_generation

    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(20, 32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2)).eval()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    src = record_generation(model, prompt, 6, token_names=lambda ids: [f"t{i}" for i in ids])
    expected = model.generate(prompt, 6, cache="dynamic")[0].tolist()
    assert src.generated == [f"t{i}" for i in expected] and src.prompt_len == 5
    assert src.q_tokens == [f"t{i}" for i in [1, 2, 3, 4, 5] + expected[:-1]]  # the last token is never fed in
    with capture_attention(model) as cap:
        model(torch.tensor([[1, 2, 3, 4, 5] + expected[:-1]]))
    torch.testing.assert_close(src.weights, torch.stack([w[0] for w in cap.weights]), atol=1e-6, rtol=1e-5)
    data = _data(render_viewer([src]))["sources"][0]
    assert (data["prompt_len"], data["generated"], data["lq"]) == (5, src.generated, 10)
    q, k = torch.stack(src.queries), torch.stack(src.keys).repeat_interleave(2, dim=1)  # (layers, H, L, D)
    scores = (q @ k.transpose(-1, -2) * data["scale"]).masked_fill(
        torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf")
    )
    torch.testing.assert_close(scores.softmax(-1), src.weights, atol=1e-6, rtol=1e-5)


def test_generation_source_names_each_steps_token():
    tokens = list("abcdef")
    w = torch.tril(torch.ones(1, 1, 6, 6))
    w = w / w.sum(-1, keepdim=True)
    data = _data(render_viewer([ViewerSource("g", tokens, tokens, w, prompt_len=3)]))["sources"][0]
    assert data["generated"] == ["d", "e", "f", ""]  # steps read rows 2..5; the last step's token is unknown
    data = _data(render_viewer([ViewerSource("g", tokens, tokens, w, prompt_len=3, generated=list("defg"))]))
    assert data["sources"][0]["generated"] == list("defg")


def test_viewer_repr_html_is_the_page_in_an_isolated_frame(tmp_path):
    from multihead.viz import Viewer

    tokens = ['"quoted" & <b>', "b", "c", "d", "e"]
    viewer = Viewer([ViewerSource("m", tokens, tokens, _weights())], title='a "title"', height=500)
    frame = viewer._repr_html_()
    assert frame.startswith('<iframe class="multihead-viewer"') and 'sandbox="allow-scripts"' in frame
    assert "height: 500px" in frame
    srcdoc = re.search(r'srcdoc="([^"]*)"', frame).group(1)  # escaped: no raw quote ends the attribute early
    assert html.unescape(srcdoc) == viewer.html
    assert not re.search(r"https?://", frame)
    assert (
        viewer.save(tmp_path / "v.html").read_text(encoding="utf-8")
        == viewer.html
        == render_viewer([ViewerSource("m", tokens, tokens, _weights())], title='a "title"')
    )


@pytest.mark.parametrize(
    "make, regex",
    [
        (
            lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), queries=torch.ones(2, 3, 5, 4)),
            r"needs both queries and keys, got only queries",
        ),
        (
            lambda: ViewerSource(
                "m",
                list("abcde"),
                list("abcde"),
                _weights(),
                queries=torch.ones(2, 3, 4, 4),
                keys=torch.ones(2, 3, 5, 4),
            ),
            r"queries must be \(layers, H, Lq, D\) = \(2, 3, 5, D\)",
        ),
        (
            lambda: ViewerSource(
                "m",
                list("abcde"),
                list("abcde"),
                _weights(),
                queries=torch.ones(2, 3, 5, 4),
                keys=torch.ones(2, 2, 5, 4),
            ),
            r"Hkv dividing H=3, got \(2, 2, 5, 4\)",
        ),
        (
            lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), prompt_len=0),
            r"prompt_len must be an int in \[1, 5\]",
        ),
        (
            lambda: ViewerSource("m", list("abcde"), list("abcdx"), _weights(), prompt_len=2),
            r"attends a sequence to itself",
        ),
        (
            lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), prompt_len=2, generated=["x"]),
            r"1 generated tokens for 4 decode steps",
        ),
        (lambda: ViewerSource("m", list("abcde"), list("abcde"), _weights(), generated=["x"]), r"need prompt_len"),
    ],
)
def test_viewer_rejects_bad_vectors_and_generations(make, regex):
    with pytest.raises(ValueError, match=regex):
        render_viewer([make()])


def test_viewer_and_recorders_reject_bad_arguments():
    from multihead.models import CausalDecoder, DecoderConfig
    from multihead.viz import Viewer, record_generation, record_vectors

    source = ViewerSource("m", list("abcde"), list("abcde"), _weights())
    with pytest.raises(ValueError, match=r"height must be an int >= 200 .* got 50"):
        Viewer(source, height=50)
    with pytest.raises(TypeError, match=r"sources must be a ViewerSource or a list of them, got Tensor"):
        Viewer([_weights()])
    assert render_viewer(source) == render_viewer([source])  # one source need not be a list
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got str"):
        with record_vectors("model"):
            pass
    model = CausalDecoder(DecoderConfig(10, 16, d_model=16, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"one prompt \(1, P\), got \(2, 3\)"):
        record_generation(model, torch.ones(2, 3, dtype=torch.long), 2, token_names=str)
    # Regression: a sliding window's ring buffer holds slots, not positions: its weights were wrong (by 1.0).
    windowed = CausalDecoder(DecoderConfig(10, 16, d_model=16, num_layers=1, num_heads=2, window=2)).eval()
    with pytest.raises(
        ValueError,
        match=r"read \d+ cached keys for \d+ tokens so far; .* cache='dynamic' "
        r"\(the default\) or 'static', got cache='sliding'",
    ):
        record_generation(windowed, torch.ones(1, 3, dtype=torch.long), 6, token_names=str, cache="sliding")


@pytest.mark.parametrize("missing", ["chromium", "chromedriver", "both", "neither"])
def test_make_test_says_why_browser_tests_were_skipped(tmp_path, missing):
    """Without Chromium or its driver (either one, or both) the browser tests are skipped and the
    run ends with each missing binary and how to install it; with both they run."""
    import subprocess
    import sys
    from pathlib import Path

    conftest = (Path(__file__).parent / "conftest.py").read_text(encoding="utf-8")
    present = tmp_path / "bin"
    present.mkdir()
    paths = {}
    for name, constant in [("chromium", "CHROMIUM"), ("chromedriver", "CHROMEDRIVER")]:
        line = f'{constant} = Path("/usr/bin/{name}")'
        assert line in conftest
        gone = missing in (name, "both")
        paths[name] = Path(f"/nonexistent/{name}") if gone else present / name
        if not gone:
            paths[name].write_text("")  # exists; never run: the marked test below uses no browser
        conftest = conftest.replace(line, f'{constant} = Path("{paths[name]}")')
    (tmp_path / "conftest.py").write_text(conftest, encoding="utf-8")
    (tmp_path / "test_page.py").write_text(
        "import pytest\n\n@pytest.mark.browser\ndef test_page():\n    pass\n\ndef test_other():\n    pass\n",
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if missing == "neither":
        assert "2 passed" in done.stdout and "browser tests skipped" not in done.stdout, done.stdout
        return
    assert "1 passed, 1 skipped" in done.stdout, done.stdout
    tail = done.stdout[done.stdout.index("browser tests skipped") :]
    assert "1 browser test(s) of the attention viewer did not run" in tail
    for name, install in [
        ("chromium", "apt-get install chromium ("),
        ("chromedriver", "apt-get install chromium-driver"),
    ]:
        said = f"{paths[name]} not found: {install}" in tail
        assert said == (missing in (name, "both")), tail
