"""The PNG figures read at a glance (issue 15): tokens on both axes at a readable size, the
"query" and "key" axis titles, a colour bar, a title, and one naming rule for layers."""

from __future__ import annotations

import pytest
import torch

from multihead.viz.heatmap import FONT, grid_figure, layer_label, panels_figure, plot_attention

TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]


def _weights(layers=2, heads=3, n=5):
    g = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(layers, heads, n, n, generator=g), dim=-1)


def _labels(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels() if t.get_visible()]


def _colorbars(fig) -> list:
    return [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]


def _all_text(fig) -> str:
    parts = [t.get_text() for t in fig.texts]
    if fig._suptitle is not None:
        parts.append(fig._suptitle.get_text())
    for ax in fig.axes:
        parts += [ax.get_xlabel(), ax.get_ylabel(), ax.get_title()]
    return "\n".join(parts)


@pytest.mark.parametrize(
    "names",
    [["layers.0.attention", "layers.1.attention"], ["blocks.0.attn", "blocks.1.attn"], None],
    ids=["encoder", "decoder", "no-names"],
)
def test_grid_labels_both_axes_with_titles_and_a_colour_bar(names):
    fig = grid_figure(_weights(), tokens=TOKENS, title="all-MiniLM-L6-v2: every layer and head", layer_names=names)
    heat = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(heat) == 2 * 3
    grid = [heat[i * 3 : (i + 1) * 3] for i in range(2)]
    for l, row in enumerate(grid):
        assert _labels(row[0].yaxis) == TOKENS, "every row of heatmaps has the query tokens on its left"
        # One naming rule in every figure: "layer i", the module's name under it.
        assert row[0].get_ylabel() == layer_label(l, names[l] if names else None)
        assert row[0].get_ylabel().startswith(f"layer {l}")
    for h, ax in enumerate(grid[-1]):
        assert _labels(ax.xaxis) == TOKENS, "every column of heatmaps has the key tokens under it"
        assert grid[0][h].get_title() == f"head {h}"
    for ax in grid[0][0], grid[-1][-1]:
        for label in ax.get_xticklabels() + ax.get_yticklabels():
            assert label.get_fontsize() >= FONT >= 8
    text = _all_text(fig)
    assert "query" in text and "key" in text and "all-MiniLM-L6-v2" in text
    assert len(_colorbars(fig)) == 1


def test_single_head_and_panels_have_tokens_titles_and_colour_bar(tmp_path):
    w = _weights()
    path = plot_attention(
        w[0, 0], tmp_path / "one.png", q_tokens=TOKENS, k_tokens=TOKENS, title="recall decoder: layer 1, head 0"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = panels_figure(
        [
            dict(weights=w[0, 0], tokens=TOKENS, title="layer 0, head 2", row=2),
            dict(weights=w[1, 1], tokens=TOKENS, title="layer 1, head 1"),
        ],
        title="MiniLM",
    )
    heat = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(heat) == 2 and len(_colorbars(fig)) == 1
    for ax in heat:
        assert _labels(ax.xaxis) == TOKENS and _labels(ax.yaxis) == TOKENS
        assert "query" in ax.get_ylabel() and "key" in ax.get_xlabel() and "layer" in ax.get_title()
    with pytest.raises(ValueError, match=r"weights must be \(L, L\) = \(4, 4\)"):
        panels_figure([dict(weights=w[0, 0], tokens=TOKENS[:4], title="x")])


def test_grid_refuses_tokens_that_do_not_fit_the_axes():
    with pytest.raises(ValueError, match=r"4 tokens for a query axis of 5"):
        grid_figure(_weights(), tokens=TOKENS[:4])


def test_long_inputs_label_every_kth_token():
    tokens = [f"t{i}" for i in range(100)]
    fig = grid_figure(_weights(layers=1, heads=1, n=100), tokens=tokens)
    labels = _labels(fig.axes[0].yaxis)
    assert 20 <= len(labels) <= 50 and labels[0] == "t0" and labels[1] == "t3"
