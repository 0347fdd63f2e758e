"""The viewer's controls of issue 32, item 2, in headless Chromium (the ``browser`` fixture of
conftest.py): the text view, the encoder / decoder / cross switch, the sentence-pair filter, the
logit lens, dark mode and labels at any length. Each test changes a control and checks what the
page drew against values computed here in Python: the DOM (a token's weight and background), the
numbers the page says it drew (``window.__viewerStats``), or pixels of a canvas.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_browser import TOKENS, _click, _errors, _frame, _hover_token, _load, _peaked, _q, _select, _stats, _status

from multihead.models import CausalDecoder, DecoderConfig
from multihead.viz import ViewerSource, logit_lens, record_attention, write_viewer

pytestmark = pytest.mark.browser


def _rgb(css: str) -> tuple[float, ...]:
    """``rgb(r, g, b)`` / ``rgba(...)`` / ``color(srgb r g b / a)`` as numbers (0-255; alpha 0-1 last)."""
    numbers = [float(x) for x in re.findall(r"[\d.]+", css)]
    if css.startswith("color(srgb"):  # color-mix() computes to color(srgb r g b / a) with r, g, b in [0, 1]
        return tuple(255 * x for x in numbers[:3]) + tuple(numbers[3:])
    return tuple(numbers)


def _tokens(driver, row: str) -> list[dict]:
    """The spans of one line of the text view: index, text, weight (or None), background."""
    return driver.execute_script(
        """return [...document.querySelectorAll(`.text-line[data-row="${arguments[0]}"] .tok`)].map((e) => ({
             index: Number(e.dataset.index), text: e.textContent, off: e.classList.contains('off'),
             chosen: e.classList.contains('chosen'),
             value: e.dataset.value === undefined ? null : Number(e.dataset.value),
             background: getComputedStyle(e).backgroundColor}))""",
        row,
    )


def _darkest(spans: list[dict]) -> int:
    """The index of the span with the darkest (most saturated) background."""
    return min((s for s in spans if s["value"] is not None), key=lambda s: sum(_rgb(s["background"])[:3]))["index"]


# ------------------------------------------------------------------------------------ text view
def test_text_view_colours_each_token_by_the_chosen_tokens_attention(browser, tmp_path):
    w = _peaked(1, 2, 6)  # head h's row i peaks at key (i + h + 1) % 6
    _load(browser, write_viewer(tmp_path / "v.html", [ViewerSource("m", TOKENS, TOKENS, w)]))
    _click(browser, "#tab-text")
    assert browser.find_element("id", "text-panel").is_displayed()
    # Opens on the last token's row, the mean of both heads (both are shown).
    spans = _tokens(browser, "mean")
    assert [s["text"] for s in spans] == TOKENS and [s["chosen"] for s in spans] == [False] * 5 + [True]
    mean = [(_q(w[0, 0, 5, j]) + _q(w[0, 1, 5, j])) / 2 for j in range(6)]
    assert [s["value"] for s in spans] == pytest.approx(mean, abs=1e-4)
    assert _darkest(spans) == max(range(6), key=lambda j: mean[j])
    assert "mean of heads 0, 1" in _status(browser)

    _click(browser, '.text-line[data-row="mean"] .tok[data-index="2"]')  # choose "sat"
    spans = _tokens(browser, "mean")
    assert [s["chosen"] for s in spans].index(True) == 2
    mean = [(_q(w[0, 0, 2, j]) + _q(w[0, 1, 2, j])) / 2 for j in range(6)]
    assert [s["value"] for s in spans] == pytest.approx(mean, abs=1e-4)
    assert _darkest(spans) == max(range(6), key=lambda j: mean[j])
    best = max(range(6), key=lambda j: mean[j])
    assert f'query 2 "sat" reads "{TOKENS[best]}" most' in _status(browser)
    # The colour scale applies: at "the largest shown" the strongest token is full blue, below it lighter.
    before = _rgb(spans[best]["background"])
    _click(browser, "#tab-head")  # the colour scale is set beside the heatmap
    _select(browser, "scale", "max")
    _click(browser, "#tab-text")
    after = _rgb(_tokens(browser, "mean")[best]["background"])
    assert max(abs(a - b) for a, b in zip(after[:3], (45.9, 109.65, 221.85))) < 1.5, after
    assert sum(after[:3]) < sum(before[:3])
    _click(browser, "#tab-head")
    _select(browser, "scale", "one")
    _click(browser, "#tab-text")

    # One line per head, each in its colour, each head's own row.
    _select(browser, "text-mode", "heads")
    assert _tokens(browser, "mean") == []
    for h, hue in ((0, (31, 119, 180)), (1, (255, 127, 14))):  # #1f77b4, #ff7f0e
        spans = _tokens(browser, str(h))
        assert [s["value"] for s in spans] == pytest.approx([_q(w[0, h, 2, j]) for j in range(6)], abs=1e-4)
        peak = (2 + h + 1) % 6
        rgb = _rgb(spans[peak]["background"])
        assert max(abs(a - b) for a, b in zip(rgb[:3], hue)) < 2 and rgb[3] > 0.4, rgb  # the head's colour, strong
    _click(browser, ".head-toggle[data-head='1']", double=True)  # only head 1: one line
    assert _tokens(browser, "0") == [] and len(_tokens(browser, "1")) == 6

    # Its column: the weight each query gives the chosen key.
    _select(browser, "text-dir", "to")
    _select(browser, "text-mode", "mean")
    _click(browser, '.text-line[data-row="mean"] .tok[data-index="4"]')
    spans = _tokens(browser, "mean")
    assert [s["value"] for s in spans] == pytest.approx([_q(w[0, 1, i, 4]) for i in range(6)], abs=1e-4)
    assert _stats(browser)["text"]["chosen"] == 4 and _stats(browser)["text"]["dir"] == "to"
    assert _errors(browser) == []


def test_text_view_of_cross_attention_picks_a_query_and_colours_the_keys(browser, tmp_path):
    q_tokens, k_tokens = ["le", "chat", "dort"], ["the", "cat", "is", "sleeping"]
    w = torch.softmax(3 * torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(7)), -1)
    _load(browser, write_viewer(tmp_path / "v.html", [ViewerSource("mt", q_tokens, k_tokens, w)]))
    _click(browser, "#tab-text")
    assert [s["text"] for s in _tokens(browser, "pick")] == q_tokens  # the queries, to pick from
    _click(browser, '.text-line[data-row="pick"] .tok[data-index="1"]')
    spans = _tokens(browser, "mean")
    assert [s["text"] for s in spans] == k_tokens
    assert [s["value"] for s in spans] == pytest.approx([_q(x) for x in w[0, 0, 1]], abs=1e-4)
    assert _darkest(spans) == int(w[0, 0, 1].argmax())
    assert _errors(browser) == []


# -------------------------------------------------------------- attention kinds and sentence pairs
ENC = ["[CLS]", "the", "cat", "[SEP]", "it", "slept", "[SEP]"]
SEG = [0, 0, 0, 0, 1, 1, 1]
DEC = ["<s>", "le", "chat"]


def _seq2seq() -> list[ViewerSource]:
    g = torch.Generator().manual_seed(11)
    soft = lambda *shape: torch.softmax(2 * torch.randn(*shape, generator=g), -1)  # noqa: E731
    return [
        ViewerSource("t5", ENC, ENC, soft(2, 3, 7, 7), kind="encoder", segments=SEG),
        ViewerSource("t5", DEC, DEC, soft(2, 3, 3, 3), kind="decoder"),
        ViewerSource("t5", DEC, ENC, soft(2, 3, 3, 7), kind="cross"),
        ViewerSource("plain", TOKENS, TOKENS, _peaked(1, 2, 6)),
    ]


def test_the_kind_switch_moves_between_encoder_decoder_and_cross_attention(browser, tmp_path):
    _load(browser, write_viewer(tmp_path / "v.html", _seq2seq()))
    options = browser.execute_script("return [...document.getElementById('source').options].map((o) => o.text)")
    assert options == ["t5", "plain"]  # the three kinds are one model
    buttons = browser.find_elements("css selector", "#kinds button")
    assert [b.text for b in buttons] == ["Encoder (self)", "Decoder (self)", "Cross (decoder → encoder)"]
    assert browser.find_element("css selector", "#kinds button.active").get_attribute("data-kind") == "encoder"
    assert _stats(browser)["heatmapLabels"] == {"q": ENC, "k": ENC}
    _select(browser, "layer", "1")
    _click(browser, ".head-toggle[data-head='2']", double=True)

    _click(browser, "#kinds button[data-kind='cross']")
    assert browser.find_element("css selector", "#kinds button.active").get_attribute("data-kind") == "cross"
    assert _stats(browser)["heatmapLabels"] == {"q": DEC, "k": ENC}  # decoder queries, encoder keys
    assert _status(browser).startswith("layer 1, head 2: 3 queries x 7 keys")  # layer and head kept
    _click(browser, "#kinds button[data-kind='decoder']")
    assert _stats(browser)["heatmapLabels"] == {"q": DEC, "k": DEC}
    assert not browser.find_element("id", "pairbar").is_displayed()  # the decoder has no sentence pair

    _select(browser, "source", "3")  # another model: no kinds to switch
    assert not browser.find_element("id", "kindbar").is_displayed()
    _select(browser, "source", "0")
    assert browser.find_element("id", "kindbar").is_displayed()
    assert _errors(browser) == []


def test_the_sentence_pair_filter_keeps_only_the_chosen_direction(browser, tmp_path):
    sources = _seq2seq()
    w = sources[0].weights  # (2, 3, 7, 7)
    _load(browser, write_viewer(tmp_path / "v.html", sources))
    assert browser.find_element("id", "pairbar").is_displayed()
    _click(browser, ".head-toggle[data-head='0']", double=True)
    every = _stats(browser)["lines"]
    A = [i for i, s in enumerate(SEG) if s == 0]
    B = [i for i, s in enumerate(SEG) if s == 1]

    _select(browser, "pair-filter", "AB")  # queries of sentence A, keys of sentence B
    block = torch.tensor([[_q(w[0, 0, i, j]) for j in B] for i in A])
    scale = _stats(browser)["colorScale"]
    assert abs(scale["min"] - float(block.min())) < 1e-6 and abs(scale["max"] - float(block.max())) < 1e-6
    assert 0 < _stats(browser)["lines"] <= len(A) * len(B) < every
    _hover_token(browser, "q", 1)  # "the" (sentence A): its strongest key in sentence B
    j = B[int(block[1].argmax())]
    assert f'attends most to key {j} "{ENC[j]}"' in _status(browser), _status(browser)
    # A cell outside the filter (A -> A) is drawn in the "off" grey, one inside it in blue.
    off, inside = browser.execute_script(
        """const g = heatGeometry(), c = document.getElementById('heatmap'), r = window.devicePixelRatio || 1;
        const at = (i, j) => Array.from(c.getContext('2d').getImageData(Math.round((g.left + (j + 0.5) * g.cw) * r),
                                         Math.round((g.top + (i + 0.5) * g.ch) * r), 1, 1).data);
        return [at(1, 1), at(1, 5)];"""
    )
    assert off[:3] == [234, 234, 238], off
    assert inside[:3] != [234, 234, 238] and inside[2] >= inside[0], inside  # white to blue: never the grey
    # The text view hides the other sentence's tokens.
    _click(browser, "#tab-text")
    _click(browser, '.text-line[data-row="mean"] .tok[data-index="2"]')  # "cat", in sentence A
    spans = _tokens(browser, "mean")
    assert [s["off"] for s in spans] == [j not in B for j in range(7)]
    assert [s["value"] for s in spans if not s["off"]] == pytest.approx([_q(w[0, 0, 2, j]) for j in B], abs=1e-4)
    _click(browser, "#tab-head")

    # The other three directions: each block's range, and lines only inside it.
    for pair, rows, cols in (("AA", A, A), ("BA", B, A), ("BB", B, B)):
        _select(browser, "pair-filter", pair)
        block = torch.tensor([[_q(w[0, 0, i, j]) for j in cols] for i in rows])
        scale = _stats(browser)["colorScale"]
        assert abs(scale["min"] - float(block.min())) < 1e-6 and abs(scale["max"] - float(block.max())) < 1e-6, pair
        assert 0 < _stats(browser)["lines"] <= len(rows) * len(cols), pair

    _select(browser, "pair-filter", "all")
    assert _stats(browser)["lines"] == every
    assert _errors(browser) == []


# ------------------------------------------------------------------------------------ logit lens
def test_the_logit_lens_panel_shows_each_layers_top_tokens_as_recorded(browser, tmp_path):
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(24, 32, d_model=32, num_layers=3, num_heads=2)).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5]])
    names = lambda ids: [f"w{i}" for i in ids]  # noqa: E731
    lens = logit_lens(model, ids, token_names=names, top_k=3)
    source = record_attention(model, ids, tokens=names(ids[0].tolist()), name="decoder")
    source.logit_lens = lens
    plain = ViewerSource("no lens", TOKENS, TOKENS, _peaked(1, 2, 6))
    _load(browser, write_viewer(tmp_path / "v.html", [source, plain]))
    _click(browser, "#tab-lens")
    grid = browser.execute_script(
        """return [...document.querySelectorAll('#lens-grid tr')].slice(1).map((r) =>
             [...r.querySelectorAll('td')].map((c) => c.textContent))"""
    )
    assert grid == [[names([t])[0] for t in layer[:, 0].tolist()] for layer in lens.top_ids]  # 3 layers x 9
    # Opens on the last position (what the model predicts next); a click picks another.
    n = _stats(browser)["lens"]
    assert n["pos"] == 8 and n["top1"] == [lens.top_names[layer][8][0] for layer in range(3)]
    browser.find_element("css selector", "#lens-grid th[data-pos='2']").click()
    _frame(browser)
    n = _stats(browser)["lens"]
    assert n["pos"] == 2
    for layer in range(3):
        assert [t for t, _ in n["detail"][layer]] == lens.top_names[layer][2]
        assert [p for _, p in n["detail"][layer]] == pytest.approx(lens.top_probs[layer, 2].tolist(), abs=1e-3)
    assert 'position 2 "w4"' in browser.find_element("id", "lens-detail").text
    browser.find_element("css selector", "#lens-grid td[data-layer='1'][data-pos='5']").click()  # a cell: its column
    _frame(browser)
    assert _stats(browser)["lens"]["pos"] == 5
    assert 'position 5 "w9"' in browser.find_element("id", "lens-detail").text
    # A cell whose top token is the text's next one is outlined.
    hits = browser.execute_script(
        "return [...document.querySelectorAll('#lens-grid td.hit')].map((c) => [c.dataset.layer, c.dataset.pos])"
    )
    expected = [
        [str(layer), str(i)] for layer in range(3) for i in range(8) if lens.top_ids[layer, i, 0] == ids[0, i + 1]
    ]
    assert sorted(hits) == sorted(expected)

    _select(browser, "source", "1")
    assert browser.find_element("id", "lens-empty").is_displayed()
    assert "logit_lens(model, ids" in browser.find_element("id", "lens-empty").text
    assert _stats(browser)["lens"] is None
    assert _errors(browser) == []


# ------------------------------------------------------------------------------------- dark mode
def _pixel(driver, canvas: str, x: float, y: float) -> list[int]:
    return driver.execute_script(
        """const c = document.getElementById(arguments[0]), r = window.devicePixelRatio || 1;
        const x = Math.round(arguments[1] * r), y = Math.round(arguments[2] * r);
        return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data);""",
        canvas,
        x,
        y,
    )


def _bright_pixels(driver, canvas: str) -> int:
    """Pixels of ``canvas`` brighter than light grey (text drawn light on dark)."""
    return driver.execute_script(
        """const c = document.getElementById(arguments[0]);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let p = 0; p < d.length; p += 4) if (d[p + 3] > 200 && d[p] > 180 && d[p + 1] > 180 && d[p + 2] > 180) n++;
        return n;""",
        canvas,
    )


def test_dark_mode_redraws_the_page_and_its_canvases_dark_and_back(browser, tmp_path):
    w = torch.zeros(1, 1, 6, 6)
    w[0, 0, :, 0] = 1  # every query on key 0: the other cells are weight 0, the background
    _load(browser, write_viewer(tmp_path / "v.html", [ViewerSource("m", TOKENS, TOKENS, w)]))
    background = "return getComputedStyle(document.body).backgroundColor"
    assert browser.execute_script(background) == "rgb(251, 251, 250)"
    g = browser.execute_script("return heatGeometry()")
    zero = (g["left"] + 3.5 * g["cw"], g["top"] + 2.5 * g["ch"])
    assert _pixel(browser, "heatmap", *zero)[:3] == [255, 255, 255]
    assert _bright_pixels(browser, "lines") == 0  # dark text on a transparent canvas

    _click(browser, "#theme")
    assert browser.find_element("id", "theme").get_attribute("aria-pressed") == "true"
    assert browser.find_element("id", "theme").text == "Light mode"
    assert browser.execute_script(background) == "rgb(27, 27, 31)"
    assert _pixel(browser, "heatmap", *zero)[:3] == [30, 30, 34]  # weight 0 is the dark background
    full = _pixel(browser, "heatmap", g["left"] + 0.5 * g["cw"], g["top"] + 2.5 * g["ch"])
    assert full[:3] == [110, 175, 255], full  # weight 1: the dark theme's blue
    assert _bright_pixels(browser, "lines") > 100  # the token labels, light on dark
    assert _bright_pixels(browser, "heatmap") > 50  # the heatmap's labels too
    _click(browser, "#tab-model")
    thumb = browser.execute_script(
        "const c = document.querySelector('#grid canvas');"
        "return Array.from(c.getContext('2d').getImageData(3, 2, 1, 1).data)"
    )
    assert thumb[:3] == [30, 30, 34], thumb  # thumbnails repainted
    _click(browser, "#tab-text")
    assert (
        browser.execute_script("return getComputedStyle(document.getElementById('text-body')).backgroundColor")
        == "rgb(30, 30, 34)"
    )

    _click(browser, "#theme")
    _click(browser, "#tab-head")
    assert browser.execute_script(background) == "rgb(251, 251, 250)"
    assert _pixel(browser, "heatmap", *zero)[:3] == [255, 255, 255]
    assert _bright_pixels(browser, "lines") == 0
    assert _errors(browser) == []


# ------------------------------------------------------------------------------ labels at any length
def _overlaps(boxes: list[list[float]]) -> list[tuple[int, int]]:
    """Pairs of boxes ``[x0, y0, x1, y1]`` that overlap (sharing an edge is fine)."""
    return [
        (a, b)
        for a in range(len(boxes))
        for b in range(a + 1, len(boxes))
        if boxes[a][0] < boxes[b][2] - 0.01
        and boxes[b][0] < boxes[a][2] - 0.01
        and boxes[a][1] < boxes[b][3] - 0.01
        and boxes[b][1] < boxes[a][3] - 0.01
    ]


@pytest.mark.parametrize("lq, lk", [(6, 6), (32, 32), (54, 54), (200, 200), (7, 300), (300, 7), (1024, 1024)])
def test_heatmap_labels_never_overlap_each_other_or_the_matrix(browser, tmp_path, lq, lk):
    q = [f"query_token_{i}" for i in range(lq)]  # long labels: cut at 12 characters
    k = [f"k{i}" if i % 3 else f"a_long_key_{i}" for i in range(lk)]
    w = torch.full((1, 1, lq, lk), 1.0 / lk)
    _load(browser, write_viewer(tmp_path / "v.html", [ViewerSource("m", q, k, w)]))
    boxes = _stats(browser)["heatmapBoxes"]
    labels = boxes["q"] + boxes["k"]
    assert len(boxes["q"]) >= min(lq, 26) and len(boxes["k"]) >= min(lk, 26)  # thinned, never all dropped
    assert _overlaps(labels) == []
    x0, y0, x1, y1 = boxes["matrix"]
    assert [b for b in labels if _overlaps([b, boxes["matrix"]])] == []
    assert all(b[2] <= x0 + 0.01 for b in boxes["q"]) and all(b[3] <= y0 + 0.01 for b in boxes["k"])  # beside, above
    cx0, cy0, cx1, cy1 = boxes["canvas"]
    assert all(b[0] >= cx0 - 0.01 and b[1] >= cy0 - 0.01 and b[2] <= cx1 and b[3] <= cy1 for b in labels)
    assert y1 - y0 >= min(lq * 12, 12 * 4) and x1 - x0 >= min(lk * 12, 12 * 4)  # no axis squashed flat
    assert _errors(browser) == []


def test_logit_lens_column_labels_never_overlap_at_200_positions(browser, tmp_path):
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(50, 256, d_model=16, num_layers=2, num_heads=2)).eval()
    ids = torch.randint(0, 50, (1, 200), generator=torch.Generator().manual_seed(1))
    names = lambda ids: [f"token_number_{i}" for i in ids]  # noqa: E731
    source = ViewerSource(
        "long", names(ids[0].tolist()), names(ids[0].tolist()), torch.full((1, 1, 200, 200), 1 / 200),
        logit_lens=logit_lens(model, ids, token_names=names),
    )  # fmt: skip
    _load(browser, write_viewer(tmp_path / "v.html", [source]))
    _click(browser, "#tab-lens")
    rects = browser.execute_script(
        """return [...document.querySelectorAll('#lens-grid th.lens-pos span, #lens-grid td')].map((e) => {
             const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })"""
    )
    headers, cells = rects[:200], rects[200:]
    assert len(cells) == 2 * 200
    assert _overlaps(headers) == []
    assert all(h[2] - h[0] < 20 for h in headers)  # written vertically: a line's height wide
    assert _overlaps(cells) == []
    assert _errors(browser) == []


def test_text_view_and_logit_lens_respond_in_time_at_1024_tokens(browser, tmp_path):
    L = 1024
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(64, L, d_model=32, num_layers=4, num_heads=4)).eval()
    ids = torch.randint(0, 64, (1, L), generator=torch.Generator().manual_seed(3))
    names = lambda ids: [f"t{i}" for i in ids]  # noqa: E731
    source = record_attention(model, ids, tokens=names(ids[0].tolist()), name="long")
    source.logit_lens = logit_lens(model, ids, token_names=names)
    _load(browser, write_viewer(tmp_path / "long.html", [source]))
    timed = """const [what, done] = [arguments[0], arguments[arguments.length - 1]];
        const t0 = performance.now();
        if (what === 'text') document.getElementById('tab-text').click();
        if (what === 'pick') document.querySelector('.text-line .tok[data-index="500"]').click();
        if (what === 'heads') { const s = document.getElementById('text-mode'); s.value = 'heads';
                                s.dispatchEvent(new Event('change')); }
        if (what === 'lens') document.getElementById('tab-lens').click();
        if (what === 'column') document.querySelector('#lens-grid th[data-pos="700"]').click();
        requestAnimationFrame(() => requestAnimationFrame(() => done(performance.now() - t0)));"""
    for what in ("text", "pick", "heads", "lens", "column"):
        ms = browser.execute_async_script(timed, what)
        print(f"{what}: {ms:.0f} ms")
        assert ms < 3000, f"{what} took {ms:.0f} ms at {L} tokens"
    assert _stats(browser)["lens"]["pos"] == 700 and len(_stats(browser)["lens"]["top1"]) == 4
    _click(browser, "#tab-text")
    assert _stats(browser)["text"]["chosen"] == 500 and len(_stats(browser)["text"]["rows"]) == 4
    assert _errors(browser) == []


def test_a_recorded_bart_switches_between_its_three_attentions(browser, tmp_path):
    from test_seq2seq import SRC, TGT, names, transformers  # noqa: F401 (skips without transformers)

    from multihead.integrations import hf as mh_hf
    from multihead.viz import record_seq2seq

    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    bart = transformers.BartForConditionalGeneration(config).eval()
    bart.set_attn_implementation(mh_hf.register())
    sources = record_seq2seq(
        bart, input_ids=SRC, decoder_input_ids=TGT, src_tokens=names(SRC), tgt_tokens=names(TGT), name="bart"
    )
    _load(browser, write_viewer(tmp_path / "bart.html", sources))
    assert [b.get_attribute("data-kind") for b in browser.find_elements("css selector", "#kinds button")] == [
        "encoder",
        "decoder",
        "cross",
    ]
    assert _status(browser).startswith("layer 0 (model.encoder.layers.0.self_attn), all 4 heads: 7 queries x 7 keys")
    _click(browser, "#kinds button[data-kind='cross']")
    assert _stats(browser)["heatmapLabels"] == {"q": names(TGT), "k": names(SRC)}
    assert _status(browser).startswith("layer 0 (model.decoder.layers.0.encoder_attn), all 4 heads: 5 queries x 7 keys")
    _click(browser, "#tab-neuron")  # the cross-attention's own q and k: each target token against 7 source keys
    n = _stats(browser)["neuron"]
    assert (n["keys"], n["dim"]) == (7, 8)
    assert n["weight"] == pytest.approx(float(sources[2].weights[0][n["head"], n["query"], n["key"]]), abs=1 / 255)
    assert _errors(browser) == []
