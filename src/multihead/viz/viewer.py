"""A self-contained HTML attention viewer: one file, inline CSS and JS, no network.

    source = ViewerSource("MiniLM", tokens, tokens, weights, layer_names)  # weights (layers, H, Lq, Lk)
    write_viewer("attention.html", [source], title="Attention")

The page has a *head view* (query tokens on the left, key tokens on the right, a line per
weight, layer and head selectors, hover a token to focus it, plus the selected head's heatmap)
and a *model view* (a thumbnail per layer x head; click one to open it). Several sources (e.g.
an encoder and a decoder) share one file with a selector.

Weights are stored as base64 ``uint8`` (``round(255 * w)``: 1/255 resolution, which a line's
opacity cannot show anyway) and decoded in the browser per head on demand; thumbnails are
average-pooled here to at most 48 x 48. The head view draws only the rows in its scroll window,
so 512 tokens stay responsive (a 6-layer, 12-head model at 512 tokens is a ~25 MB file).
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ViewerSource", "render_viewer", "write_viewer"]

THUMB = 48  # max thumbnail side, in cells


@dataclass
class ViewerSource:
    """The attention of one model on one input.

    ``weights``: ``(layers, H, Lq, Lk)`` or a list of per-layer ``(H, Lq, Lk)`` / ``(1, H, Lq, Lk)``
    tensors (what :func:`multihead.capture_attention` records for one sequence). ``highlight``:
    ``(layer, head, label)`` of a head to open first and mark in the model view.
    """

    name: str
    q_tokens: list[str]
    k_tokens: list[str]
    weights: Tensor | list[Tensor]
    layer_names: list[str] | None = None
    caption: str = ""
    highlight: tuple[int, int, str] | None = None

    def to_json(self) -> dict:
        w = _stack(self.weights, self.name)  # (layers, H, Lq, Lk)
        layers, heads, lq, lk = w.shape
        if len(self.q_tokens) != lq or len(self.k_tokens) != lk:
            raise ValueError(f"ViewerSource {self.name!r}: weights are (layers, H, Lq, Lk) = {tuple(w.shape)} but "
                             f"got {len(self.q_tokens)} query tokens and {len(self.k_tokens)} key tokens")
        names = list(self.layer_names) if self.layer_names is not None else [f"layer {i}" for i in range(layers)]
        if len(names) != layers:
            raise ValueError(f"ViewerSource {self.name!r}: {len(names)} layer names for {layers} layers")
        q8 = _to_uint8(w)
        tq, tk = min(lq, THUMB), min(lk, THUMB)
        thumbs = F.adaptive_avg_pool2d(w.reshape(layers * heads, 1, lq, lk), (tq, tk)).reshape(layers, heads, tq, tk)
        # Each thumbnail scaled to its own maximum: a head's pattern matters there, not its scale.
        thumbs = thumbs / thumbs.amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12)
        t8 = _to_uint8(thumbs)
        data = {
            "name": self.name, "caption": self.caption,
            "q_tokens": [str(t) for t in self.q_tokens], "k_tokens": [str(t) for t in self.k_tokens],
            "layers": names, "heads": heads, "lq": lq, "lk": lk, "thumb_q": tq, "thumb_k": tk,
            "weights": [[_b64(q8[l, h]) for h in range(heads)] for l in range(layers)],
            "thumbs": [[_b64(t8[l, h]) for h in range(heads)] for l in range(layers)],
        }
        if self.highlight is not None:
            layer, head, label = self.highlight
            if not (0 <= layer < layers and 0 <= head < heads):
                raise ValueError(f"ViewerSource {self.name!r}: highlight (layer={layer}, head={head}) is outside "
                                 f"{layers} layers x {heads} heads")
            data["highlight"] = {"layer": int(layer), "head": int(head), "label": str(label)}
        return data


def render_viewer(sources: list[ViewerSource], *, title: str = "multihead attention viewer") -> str:
    """The viewer page as one HTML string."""
    if not sources:
        raise ValueError("render_viewer: sources is empty; expected at least one ViewerSource")
    payload = json.dumps({"title": title, "sources": [s.to_json() for s in sources]}, separators=(",", ":"))
    # Inside <script> only "</" can end the element early; "<\/" is the same string to JSON.
    payload = payload.replace("</", "<\\/")
    parts = {
        "TITLE": html.escape(title),
        "CSS": _template("viewer.css"),
        "JS": _template("viewer.js").replace("</", "<\\/"),
        "DATA": payload,
    }
    # One pass, so text inside one part (a token "{{JS}}") is never substituted again.
    return re.sub(r"\{\{(TITLE|CSS|JS|DATA)\}\}", lambda m: parts[m.group(1)], _template("viewer.html"))


def write_viewer(path: str | Path, sources: list[ViewerSource], *, title: str = "multihead attention viewer") -> Path:
    """Write :func:`render_viewer` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(render_viewer(sources, title=title), encoding="utf-8")
    return path


def _template(name: str) -> str:
    return resources.files("multihead.viz").joinpath(name).read_text(encoding="utf-8")


def _stack(weights, name: str) -> Tensor:
    if isinstance(weights, Tensor):
        w = weights
    else:
        layers = [t[0] if t.dim() == 4 else t for t in weights]
        if len({tuple(t.shape) for t in layers}) > 1:
            raise ValueError(f"ViewerSource {name!r}: layers have different shapes "
                             f"{sorted({tuple(t.shape) for t in layers})}; expected one (H, Lq, Lk)")
        w = torch.stack(layers)
    if w.dim() != 4:
        raise ValueError(f"ViewerSource {name!r}: weights must be (layers, H, Lq, Lk), got shape {tuple(w.shape)}")
    return w.detach().float().cpu()


def _to_uint8(w: Tensor) -> Tensor:
    return (w.clamp(0, 1) * 255).round().to(torch.uint8)


def _b64(t: Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")
