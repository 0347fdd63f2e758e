"""Attention heatmaps as PNG with matplotlib: a layer x head grid, and one head with its tokens.

matplotlib is imported inside the functions (it is an optional dependency) and figures are
drawn on an Agg canvas directly, so no global backend is switched and no window opens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

__all__ = ["plot_attention_grid", "plot_attention"]


def plot_attention_grid(weights: Tensor | list[Tensor], path: str | Path, *, tokens: list[str] | None = None,
                        title: str = "", layer_names: list[str] | None = None) -> Path:
    """Write a PNG grid: one heatmap per layer (rows) and head (columns).

    ``weights``: ``(layers, H, Lq, Lk)`` or per-layer ``(H, Lq, Lk)`` / ``(1, H, Lq, Lk)``.
    ``tokens`` label the axes of the first column and the last row when there are few enough.
    """
    from matplotlib.figure import Figure

    w = _stack(weights)
    layers, heads, lq, lk = w.shape
    cell = 1.3
    fig = Figure(figsize=(1.2 + cell * heads, 0.8 + cell * layers), dpi=110)
    axes = fig.subplots(layers, heads, squeeze=False)
    label_ticks = tokens is not None and max(lq, lk) <= 24
    for l in range(layers):
        for h in range(heads):
            ax = axes[l][h]
            ax.imshow(w[l, h].numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            if l == 0:
                ax.set_title(f"head {h}", fontsize=7)
            if h == 0:
                name = layer_names[l] if layer_names else f"layer {l}"
                ax.set_ylabel(name, fontsize=6)
            if label_ticks and l == layers - 1 and h == 0:
                ax.set_xticks(range(lk), tokens[:lk], rotation=90, fontsize=4)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_attention(weights: Tensor, path: str | Path, *, q_tokens: list[str], k_tokens: list[str],
                   title: str = "", marks: list[tuple[int, int]] | None = None) -> Path:
    """Write a PNG of one head ``(Lq, Lk)`` with its tokens on both axes; ``marks`` circles
    ``(query, key)`` cells (e.g. where a lookup should land)."""
    from matplotlib.figure import Figure

    w = weights.detach().float().cpu()
    if w.dim() != 2 or w.shape != (len(q_tokens), len(k_tokens)):
        raise ValueError(f"plot_attention: weights must be (Lq, Lk) = ({len(q_tokens)}, {len(k_tokens)}), "
                         f"got shape {tuple(w.shape)}")
    lq, lk = w.shape
    fig = Figure(figsize=(2 + 0.22 * lk, 1.5 + 0.22 * lq), dpi=120)
    ax = fig.subplots()
    im = ax.imshow(w.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks(range(lk), k_tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(lq), q_tokens, fontsize=7)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    for q, k in marks or []:
        ax.scatter([k], [q], s=60, facecolors="none", edgecolors="#e0892b", linewidths=1.2)
    fig.colorbar(im, ax=ax, fraction=0.03)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _stack(weights) -> Tensor:
    if isinstance(weights, Tensor):
        w = weights
    else:
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
