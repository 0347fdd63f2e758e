"""Every ```python block of docs/positions.md runs, and what the page claims holds.

How blocks run: **cumulatively per section**. The page is split at its ``## `` headings; each
section gets a fresh namespace and its blocks are executed in order in it, so a block may use
what an earlier block *of the same section* defined (as a reader of that section would), never
another section's. A section therefore starts with its own imports. Blocks nested in list items
(indented fences) are dedented first. Blocks assert their own claims (``assert``,
``torch.testing.assert_close``); the tests below re-check the main ones outside the page, so
they hold under ``python -O`` too.

The RoPE section's blocks are excerpts that use ``x``, ``L``, ``prompt`` and ``next_token`` without
defining them; ``PREAMBLES`` gives them values that fit every block of that section.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead import scores
from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "positions.md"
IMG = ROOT / "docs" / "img"

#: The sections this page must have, in order, after the RoPE ones.
ADDED = [
    "ALiBi",
    "Learned relative position bias (T5)",
    "Softcap",
    "Attention sinks",
    "Your own score_mod",
    "How backends run them",
    "The labml hook, kept",
    "Measured",
]
#: Sections whose blocks must exist (a section that loses its examples fails here).
WITH_CODE = ADDED[:-1]


def _rope_preamble() -> dict:
    L = 12  # the packed-documents block's lengths add up to 12
    x = torch.randn(1, L, 512, generator=torch.Generator().manual_seed(0))
    return {"torch": torch, "x": x, "L": L, "prompt": x[:, :8], "next_token": x[:, 8:9]}


PREAMBLES = {"Rotary embeddings (RoPE)": _rope_preamble}

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def sections(text: str) -> dict[str, list[str]]:
    """``{heading: [python block source, ...]}`` for every ``## `` section, in page order."""
    found: dict[str, list[str]] = {}
    current, block, indent, lang = None, None, "", ""
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if block is not None:  # inside a fence
            if fence and fence.group(1) == indent and not fence.group(2):
                if lang == "python":
                    found[current].append(textwrap.dedent("\n".join(block)))
                block = None
            else:
                block.append(line)
            continue
        if fence:
            indent, lang, block = fence.group(1), fence.group(2), []
        elif line.startswith("## "):
            current = line[3:].strip()
            found[current] = []
    assert block is None, "docs/positions.md: an unclosed ``` fence"
    return found


SECTIONS = sections(DOC.read_text(encoding="utf-8"))


def run_section(title: str) -> dict:
    namespace = PREAMBLES[title]() if title in PREAMBLES else {}
    namespace["__name__"] = "docs_positions"
    for i, source in enumerate(SECTIONS[title]):
        code = compile(source, f"docs/positions.md [{title}, block {i + 1}]", "exec")
        exec(code, namespace)  # noqa: S102 - the page's own examples
    return namespace


def test_the_page_has_its_sections_in_order():
    titles = list(SECTIONS)
    assert "Rotary embeddings (RoPE)" in titles
    assert [t for t in titles if t in ADDED] == ADDED, titles
    assert titles.index(ADDED[0]) > titles.index("Rotary embeddings (RoPE)")
    for title in WITH_CODE:
        assert SECTIONS[title], f"section {title!r} has no ```python block"


@pytest.mark.parametrize("title", [t for t, blocks in SECTIONS.items() if blocks])
def test_every_python_block_runs(title):
    torch.manual_seed(0)
    run_section(title)


# ---------------------------------------------------------------------- the claims, re-checked
def test_user_score_mods_equal_the_built_ins():
    """The three-line functions of "Your own score_mod" equal the built-ins: forward on every CPU
    backend that runs them, and the T5 table's gradient. Call indices are not aligned, so with
    ``Lq != Lk`` the functions equal the built-ins aligned ``top_left``."""
    ns = run_section("Your own score_mod")
    my_alibi, my_t5, my_softcap, rel = ns["my_alibi"], ns["my_t5"], ns["my_softcap"], ns["rel"]
    t5 = rel()
    pairs = [(my_alibi, ALiBi(8)), (my_t5, t5), (my_softcap, scores.softcap(30.0))]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 8, 37, 16, generator=g) for _ in range(3))
    for mine, builtin in pairs:
        for mask in (None, mh.causal()):
            expected = mh.attention(q, k, v, mask=mask, score_mod=builtin, backend="reference")
            for backend in ("reference", "torch_blocks"):  # a function is elementwise: blocksparse refuses it
                got = mh.attention(q, k, v, mask=mask, score_mod=mine, backend=backend)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Lq != Lk: the function's indices are the call's, i.e. top-left alignment.
    q_short = q[:, :, :5]
    for mine, builtin in [(my_alibi, ALiBi(8, align="top_left")), (my_t5, RelativePositionBias(8, align="top_left")())]:
        if isinstance(builtin, type(t5)):  # the same table (a modifier is immutable: a copy that reads it)
            builtin = builtin._replace(weight=rel.weight)
        torch.testing.assert_close(
            mh.attention(q_short, k, v, score_mod=mine, backend="reference"),
            mh.attention(q_short, k, v, score_mod=builtin, backend="reference"),
        )
    # and not bottom-right: the doc's warning is real
    assert not torch.allclose(
        mh.attention(q_short, k, v, score_mod=my_alibi), mh.attention(q_short, k, v, score_mod=ALiBi(8))
    )
    # gradients reach the closed-over table exactly as the built-in's
    w = torch.randn(2, 8, 37, 16, generator=g)
    grads = []
    for mod in (my_t5, t5):
        rel.weight.grad = None
        (mh.attention(q, k, v, mask=mh.causal(), score_mod=mod, backend="torch_blocks") * w).sum().backward()
        grads.append(rel.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])


def test_alibi_slopes_as_the_page_states():
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0**-n for n in range(1, 9)], dtype=torch.float64))
    expected_12 = [2.0**-n for n in range(1, 9)] + [2.0**-n for n in (0.5, 1.5, 2.5, 3.5)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected_12, dtype=torch.float64))
    assert torch.equal(alibi_slopes(4), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256], dtype=torch.float64))


def test_sink_formula_as_the_page_states():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.0, 1.5, float("-inf")], dtype=torch.float64)
    plain = mh.attention(q, k, v, mask=mh.causal(), return_lse=True)
    r = mh.attention(q, k, v, mask=mh.causal(), sinks=sinks, return_lse=True, return_weights=True)
    s = sinks.view(1, -1, 1)
    torch.testing.assert_close(r.output, plain.output * torch.sigmoid(plain.lse - s).unsqueeze(-1))
    torch.testing.assert_close(r.lse, torch.logaddexp(plain.lse, s))
    torch.testing.assert_close(r.weights.sum(-1), torch.sigmoid(plain.lse - s))
    torch.testing.assert_close(r.output[:, 2], plain.output[:, 2])  # a sink of -inf is no sink


# ---------------------------------------------------------------------- the pictures
def _figures_module():
    path = ROOT / "docs" / "figures" / "positions_figures.py"
    spec = importlib.util.spec_from_file_location("positions_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_embeds_every_figure_the_script_draws_and_they_are_committed_small():
    figures = _figures_module().FIGURES
    embedded = set(re.findall(r"\]\(img/(positions_[\w.]+\.png)\)", DOC.read_text(encoding="utf-8")))
    assert embedded == set(figures)
    for name in figures:
        path = IMG / name
        assert path.is_file(), f"{path} missing: run .venv/bin/python docs/figures/positions_figures.py"
        assert path.stat().st_size < 150 * 1024, f"{name} is {path.stat().st_size} bytes"


def test_the_figures_data_is_what_the_captions_say():
    fig = _figures_module()
    # ALiBi(4): slopes 1/4 ... 1/256, m_h·(j - i) below the diagonal, -m_h·|j - i| symmetric
    bias = fig.alibi_bias(4, 32, symmetric=False)
    assert bias.shape == (4, 32, 32)
    assert float(bias[0, 31, 0]) == -31 / 4 and float(bias[3, 31, 0]) == -31 / 256 and float(bias[0, 5, 5]) == 0
    sym = fig.alibi_bias(4, 32, symmetric=True)
    assert torch.equal(sym, sym.transpose(-1, -2)) and float(sym[1, 0, 31]) == -31 / 16
    # the T5 picture: the table from seed 0, read at bucket(j - i)
    t5 = fig.t5_bias(4, 48)
    table = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    assert float(t5[2, 10, 10]) == float(table[0, 2])  # the diagonal is bucket 0
    assert float(t5[1, 40, 0]) == float(table[12, 1])  # d = -40: bucket 12 (-32 ... -45)
    assert float(t5[1, 0, 40]) == float(table[28, 1])  # d = +40: bucket 16 + 12
    # the sink picture: the sink's logit is the row's LSE, so it takes half the mass
    p, p_sink, sink = fig.sink_row()
    torch.testing.assert_close(p.sum(), torch.tensor(1.0, dtype=p.dtype))
    torch.testing.assert_close(p_sink, p / 2)
