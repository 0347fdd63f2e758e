"""Attention heatmaps as PNG with matplotlib: a layer x head grid, one head, and heads side by side.

Every figure reads at a glance: tokens on both axes at :data:`FONT` points (queries down the
left, keys along the bottom), the axis titles "query" and "key", a colour bar of the weight
(0 to 1), and a title naming the model, layer and head. Layers are named ``layer i`` everywhere,
with the module's name under it when one is given (``layer 0`` / ``layers.0.attention``), as the
HTML viewer names them.

matplotlib is imported inside the functions (it is an optional dependency) and figures are
drawn on an Agg canvas directly, so no global backend is switched and no window opens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

__all__ = ["plot_attention_grid", "plot_attention", "plot_attention_panels", "layer_label", "FONT"]

FONT = 8  # points, for token labels: at the 100 dpi of these figures, 11 pixels
DPI = 100
MAX_LABELS = 48  # more tokens than this: every k-th is labelled
QUERY, KEY = "query (attending)", "key (attended to)"


def layer_label(index: int, name: str | None = None) -> str:
    """``layer i``, with the module's name on a second line when given: the one naming rule."""
    return f"layer {index}" + (f"\n{name}" if name and name != f"layer {index}" else "")


def plot_attention_grid(
    weights: Tensor | list[Tensor],
    path: str | Path,
    *,
    tokens: list[str] | None = None,
    title: str = "",
    layer_names: list[str] | None = None,
) -> Path:
    """Write a PNG grid: one heatmap per layer (rows) and head (columns).

    ``weights``: ``(layers, H, Lq, Lk)`` or per-layer ``(H, Lq, Lk)`` / ``(1, H, Lq, Lk)``.
    ``tokens`` (``Lq == Lk``) label the query axis of every row and the key axis of every column;
    without them positions are labelled. ``title`` should name the model (rows name the layer,
    columns the head).
    """
    return _save(grid_figure(weights, tokens=tokens, title=title, layer_names=layer_names), path)


def grid_figure(weights, *, tokens=None, title="", layer_names=None):
    """The :func:`plot_attention_grid` figure, unsaved (tests read its labels)."""
    from matplotlib.figure import Figure

    w = _stack(weights)
    layers, heads, lq, lk = w.shape
    q_tokens, k_tokens = _tokens(tokens, lq, "query"), _tokens(tokens, lk, "key")
    if layer_names is not None and len(layer_names) != layers:
        raise ValueError(f"plot_attention_grid: {len(layer_names)} layer names for {layers} layers")
    # Fixed margins in inches (a layout engine over dozens of axes costs seconds): room on the left
    # for the query tokens and the layer names, at the bottom for the key tokens.
    side = max(1.6, 0.14 * max(lq, lk))  # inches per heatmap: one label per row at FONT points
    gap, left, right, bottom, top = 0.12, 1.9, 1.1, 1.0, 0.4 + (0.35 if title else 0)
    width, height = left + heads * side + (heads - 1) * gap + right, bottom + layers * side + (layers - 1) * gap + top
    fig = Figure(figsize=(width, height), dpi=DPI)
    axes = fig.subplots(
        layers,
        heads,
        squeeze=False,
        gridspec_kw=dict(
            left=left / width,
            right=1 - right / width,
            bottom=bottom / height,
            top=1 - top / height,
            wspace=gap / side,
            hspace=gap / side,
        ),
    )
    image = None
    for l in range(layers):
        for h in range(heads):
            ax = axes[l][h]
            image = ax.imshow(w[l, h].numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
            # Tokens on the edges only: every row of heatmaps shares the left column's query labels,
            # every column the bottom row's key labels (ticks on 72 axes would cost seconds).
            _ticks(ax, q_tokens if h == 0 else None, k_tokens if l == layers - 1 else None)
            if l == 0:
                ax.set_title(f"head {h}", fontsize=FONT + 1)
            if h == 0:
                ax.set_ylabel(layer_label(l, layer_names[l] if layer_names else None), fontsize=FONT + 1)
    fig.text(
        0.12 / width,
        (bottom + layers * side / 2) / height,
        QUERY,
        rotation=90,
        va="center",
        ha="left",
        fontsize=FONT + 2,
    )
    fig.text((left + heads * side / 2) / width, 0.08 / height, KEY, ha="center", va="bottom", fontsize=FONT + 2)
    bar_ax = fig.add_axes(
        ((width - right + 0.2) / width, bottom / height, 0.18 / width, min(3.0, layers * side) / height),
        label="<colorbar>",
    )
    assert image is not None  # one image per layer and head was drawn
    bar = fig.colorbar(image, cax=bar_ax)
    bar.set_label("attention weight", fontsize=FONT)
    bar.ax.tick_params(labelsize=FONT)
    if title:
        fig.suptitle(title, fontsize=FONT + 4, y=1 - 0.1 / height, va="top")
    return fig


def plot_attention(
    weights: Tensor,
    path: str | Path,
    *,
    q_tokens: list[str],
    k_tokens: list[str],
    title: str = "",
    marks: list[tuple[int, int]] | None = None,
) -> Path:
    """Write a PNG of one head ``(Lq, Lk)`` with its tokens on both axes and a colour bar;
    ``marks`` circles ``(query, key)`` cells (e.g. where a lookup should land). ``title`` should
    name the model, layer and head."""
    from matplotlib.figure import Figure

    w = weights.detach().float().cpu()
    if w.dim() != 2 or w.shape != (len(q_tokens), len(k_tokens)):
        raise ValueError(
            f"plot_attention: weights must be (Lq, Lk) = ({len(q_tokens)}, {len(k_tokens)}), got shape {tuple(w.shape)}"
        )
    lq, lk = w.shape
    fig = Figure(figsize=(2.6 + 0.17 * lk, 1.8 + 0.17 * lq), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(w.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    _ticks(ax, list(q_tokens), list(k_tokens))
    ax.set_xlabel(KEY, fontsize=FONT + 1)
    ax.set_ylabel(QUERY, fontsize=FONT + 1)
    for q, k in marks or []:
        ax.scatter([k], [q], s=60, facecolors="none", edgecolors="#e0892b", linewidths=1.2)
    bar = fig.colorbar(im, ax=ax, fraction=0.04)
    bar.set_label("attention weight", fontsize=FONT)
    bar.ax.tick_params(labelsize=FONT)
    if title:
        ax.set_title(title, fontsize=FONT + 1)
    return _save(fig, path)


def plot_attention_panels(panels: list[dict], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG of several heads side by side, one colour bar for all.

    Each panel is a dict: ``weights`` ``(L, L)``, ``tokens`` (``L``), ``title`` (name the layer
    and head), and optionally ``row``, a query row to outline (e.g. the pronoun's).
    """
    return _save(panels_figure(panels, title=title), path)


def panels_figure(panels: list[dict], *, title: str = ""):
    """The :func:`plot_attention_panels` figure, unsaved (tests read its labels)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    if not panels:
        raise ValueError("plot_attention_panels: expected at least one panel, got none")
    longest = max(len(p["tokens"]) for p in panels)
    side = max(2.4, 0.19 * longest)
    fig = Figure(
        figsize=(1.2 + (side + 0.9) * len(panels) + 0.8, 1.9 + side + (0.6 if title else 0)),
        dpi=DPI,
        layout="constrained",
    )
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, panel in zip(axes, panels):
        w = panel["weights"].detach().float().cpu()
        tokens = list(panel["tokens"])
        if w.shape != (len(tokens), len(tokens)):
            raise ValueError(
                f"plot_attention_panels: weights must be (L, L) = ({len(tokens)}, {len(tokens)}), "
                f"got shape {tuple(w.shape)}"
            )
        image = ax.imshow(w.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
        _ticks(ax, tokens, tokens)
        ax.set_xlabel(KEY, fontsize=FONT + 1)
        ax.set_ylabel(QUERY, fontsize=FONT + 1)
        ax.set_title(panel.get("title", ""), fontsize=FONT + 1)
        if panel.get("row") is not None:
            ax.add_patch(
                Rectangle((-0.5, panel["row"] - 0.5), len(tokens), 1, fill=False, edgecolor="#e0892b", linewidth=1.6)
            )
    assert image is not None  # one image per panel was drawn (no panel is refused above)
    bar = fig.colorbar(image, ax=list(axes), fraction=0.02, pad=0.01)
    bar.set_label("attention weight", fontsize=FONT)
    bar.ax.tick_params(labelsize=FONT)
    if title:
        fig.suptitle(title, fontsize=FONT + 3)
    return fig


def _ticks(ax, q_tokens: list[str] | None, k_tokens: list[str] | None) -> None:
    """Token labels on both axes (every k-th past MAX_LABELS tokens); ``None``: no ticks on that axis."""
    for tokens, axis in ((q_tokens, ax.yaxis), (k_tokens, ax.xaxis)):
        if tokens is None:
            axis.set_ticks([])
            continue
        step = -(-len(tokens) // MAX_LABELS)
        positions = list(range(0, len(tokens), step))
        axis.set_ticks(positions, [tokens[i] for i in positions])
        axis.set_tick_params(labelsize=FONT, length=2, pad=1)
    ax.tick_params(axis="x", labelrotation=90)


def _tokens(tokens, n: int, axis: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    if len(tokens) != n:
        raise ValueError(
            f"plot_attention_grid: {len(tokens)} tokens for a {axis} axis of {n}; the grid's tokens "
            "label both axes, so Lq == Lk == len(tokens)"
        )
    return list(tokens)


def _stack(weights) -> Tensor:
    if isinstance(weights, Tensor):
        w = weights
    else:
        batched = [i for i, t in enumerate(weights) if t.dim() == 4 and t.shape[0] != 1]
        if batched:  # never element 0 in silence: the tokens name one sequence
            raise ValueError(
                f"plot_attention_grid: weights of layer {batched[0]} are batched, shape "
                f"{tuple(weights[batched[0]].shape)}; pass one sequence: [w[i] for w in weights]"
            )
        w = torch.stack([t[0] if t.dim() == 4 else t for t in weights])
    if w.dim() != 4:
        raise ValueError(f"plot_attention_grid: weights must be (layers, H, Lq, Lk), got shape {tuple(w.shape)}")
    return w.detach().float().cpu()


def _save(fig, path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png")
    return path
