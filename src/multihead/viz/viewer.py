"""A self-contained HTML attention viewer: one file, inline CSS and JS, no network.

    source = ViewerSource("MiniLM", tokens, tokens, weights, layer_names)  # weights (layers, H, Lq, Lk)
    write_viewer("attention.html", [source], title="Attention")
    Viewer([source])                     # in Jupyter: shown inline (``_repr_html_``), or .save(path)

The page has three views (``docs/demo.md``, "The viewer"):

* **head view**: query tokens on the left, key tokens on the right, a line per weight in the
  colour of its head; a legend with one toggle per head (click: show or hide, double-click: only
  this one); hover a token to focus it in any mode, click it to pin it. Beside it the shown heads'
  matrix as a heatmap with its tokens on the axes (hover a cell for its weight).
* **model view**: a thumbnail per layer x head, enlargeable (size slider, full-resolution preview
  on hover); click one to open it in the head view.
* **neuron view** (sources with ``queries`` and ``keys``): one query against every key of the
  focused head, each score split into its ``D`` elementwise terms ``q_d · k_d · scale``.
* **text view**: the tokens as text, each coloured by the chosen token's weight on it (its row) or
  its weight on the chosen token (its column), for the shown heads' mean or one line per head.
* **logit lens** (sources with ``logit_lens``, :func:`multihead.viz.logit_lens`): per layer and
  position, the top next token through the model's final norm and unembedding.

Sources of one ``name`` with ``kind`` ``"encoder"``, ``"decoder"`` and ``"cross"`` are one model
with a switch between them; ``segments`` (a sentence pair) adds an A→B filter; a button switches
to a dark theme.

Under the heatmap a colour bar gives the scale (0 to 1, or to the largest weight shown, with a
contrast slider) and the shown minimum and maximum. A ``signed`` source (scores, attributions,
differences) is drawn with a diverging palette around 0. Batched weights need ``batch=``.

A source with ``prompt_len`` is a generation: row ``prompt_len - 1 + s`` is decode step ``s``, one
query against the keys up to it, and the page shows a step slider.

Weights are stored as base64 ``uint8`` (``round(255 * w)``: 1/255 resolution, which a line's
opacity cannot show anyway) and decoded in the browser per head on demand; thumbnails are
average-pooled here to at most 48 x 48; query and key vectors as base64 float32. Everything is
drawn on canvases and the head view draws only the rows in its scroll window, so 1024 tokens stay
responsive (a 6-layer, 12-head model at 512 tokens is a ~25 MB file).
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

from multihead.conventions import default_scale, repeat_kv
from multihead.viz.lens import LogitLens

__all__ = ["ViewerSource", "Viewer", "render_viewer", "write_viewer"]

THUMB = 48  # max thumbnail side, in cells
#: The page's script, one concept a file, joined in this order: each uses what the ones before declare.
SCRIPTS = ("viewer.js", "viewer_text.js", "viewer_lens.js", "viewer_main.js")
KINDS = ("encoder", "decoder", "cross")  # a seq2seq model's attentions, in the page's order


@dataclass
class ViewerSource:
    """The attention of one model on one input.

    Args:
        name: shown in the model selector.
        q_tokens, k_tokens: ``Lq`` and ``Lk`` strings.
        weights: ``(layers, H, Lq, Lk)`` or a list of per-layer ``(H, Lq, Lk)`` / ``(1, H, Lq, Lk)``
            tensors (what :func:`multihead.capture_attention` records for one sequence): probabilities
            in ``[0, 1]``, not scores. Batched weights (``(layers, B, H, Lq, Lk)``, per-layer
            ``(B, H, Lq, Lk)`` with ``B > 1``: a capture of a batch, HF's ``attentions`` of a padded
            batch) need ``batch``.
        layer_names: one per layer; default ``layer 0``, ``layer 1``, ...
        caption: a line shown above the views.
        highlight: ``(layer, head, label)`` of a head to open first and mark in the model view.
        queries, keys: for the neuron view, the query and key vectors each score was computed
            from, after positions (rotary) and scaling aside: ``(layers, H, Lq, D)`` and
            ``(layers, H or Hkv, Lk, D)``, or per-layer lists like ``weights``. Keys of ``Hkv``
            heads are read by query heads as :func:`multihead.conventions.kv_head_of` maps them.
            :func:`multihead.viz.record_attention` records them with the weights.
        scale: the softmax scale of the scores (default ``1 / sqrt(D)``): score = ``sum_d q_d k_d scale``
            (plus what a mask or score modifier adds, which the neuron view does not split).
        prompt_len: makes the source a generation: ``q_tokens`` and ``k_tokens`` are the same
            sequence, rows before ``prompt_len - 1`` are the prompt's, and row ``prompt_len - 1 + s``
            is decode step ``s`` (the token fed in, attending to the keys up to it).
        generated: the token each decode step produced, one per step (``Lq - prompt_len + 1``);
            default: the next token of ``q_tokens``, and ``""`` for the last step.
        batch: which sequence of batched ``weights`` (and ``queries``, ``keys``) the tokens belong
            to; batched tensors without it are refused (the page would otherwise pair one
            sequence's weights with another's tokens). A batch of one needs none.
        signed: ``weights`` are any finite values, not probabilities: scores, attributions, the
            difference between two heads or two runs. Drawn with a diverging palette (red
            negative, white 0, blue positive) around 0, lines of negative values dashed; stored
            as 8 bits of ``value / max|value|`` (one scale for the whole source, so heads
            compare). Masked scores (``-inf``) must be replaced first (by 0, or with
            ``torch.where``); the neuron view (``queries``, ``keys``) is for probabilities only.
        kind: ``"encoder"``, ``"decoder"`` or ``"cross"``: one attention of a model with several
            (a seq2seq model). Sources of one ``name`` and different kinds are one model on the
            page, with a switch between them (bertviz's encoder / decoder / cross views).
        segments: the sentence (0 = A, 1 = B) of each query token, e.g. BERT's ``token_type_ids``
            of a sentence pair; the page then filters the attention to A→A, A→B, B→A or B→B.
        k_segments: the sentence of each key token; default ``segments`` when the keys are the
            query tokens.
        logit_lens: a :class:`multihead.viz.LogitLens` of the same tokens (decoders): per layer,
            the top next tokens, shown in the page's "Logit lens" tab.
    """

    name: str
    q_tokens: list[str]
    k_tokens: list[str]
    weights: Tensor | list[Tensor]
    layer_names: list[str] | None = None
    caption: str = ""
    highlight: tuple[int, int, str] | None = None
    queries: Tensor | list[Tensor] | None = None
    keys: Tensor | list[Tensor] | None = None
    scale: float | None = None
    prompt_len: int | None = None
    generated: list[str] | None = None
    batch: int | None = None
    signed: bool = False
    kind: str | None = None
    segments: list[int] | None = None
    k_segments: list[int] | None = None
    logit_lens: LogitLens | None = None

    def to_json(self) -> dict:
        """The source as the viewer's JSON: tokens, weights ``(layers, H, Lq, Lk)`` rounded, names."""
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int)):
            raise TypeError(f"ViewerSource {self.name!r}: batch must be None or an int, got {self.batch!r}")
        w = _stack(self.weights, self.name, "weights", self.batch)  # (layers, H, Lq, Lk)
        layers, heads, lq, lk = w.shape
        if len(self.q_tokens) != lq or len(self.k_tokens) != lk:
            raise ValueError(
                f"ViewerSource {self.name!r}: weights are (layers, H, Lq, Lk) = {tuple(w.shape)} but "
                f"got {len(self.q_tokens)} query tokens and {len(self.k_tokens)} key tokens"
            )
        if not isinstance(self.signed, bool):
            raise TypeError(f"ViewerSource {self.name!r}: signed must be a bool, got {self.signed!r}")
        extras = self._extras_json(lq, lk)
        if self.signed:
            return {**self._signed_json(w), **extras}
        if w.numel() and not (bool(torch.isfinite(w).all()) and w.min() >= 0 and w.max() <= 1 + 1e-3):
            # stored as round(255 * w) clamped to [0, 1]: scores or NaN would be drawn as something else
            raise ValueError(
                f"ViewerSource {self.name!r}: weights must be attention probabilities in [0, 1], got "
                f"values in [{float(w.nan_to_num().min()):.3g}, {float(w.nan_to_num().max()):.3g}]"
                f"{' with NaN or inf' if not bool(torch.isfinite(w).all()) else ''}; pass the softmax "
                "of the scores (need_weights=True or capture_attention record it), or "
                "ViewerSource(..., signed=True) for scores, attributions or differences"
            )
        q8 = _to_uint8(w)
        tq, tk = min(lq, THUMB), min(lk, THUMB)
        thumbs = F.adaptive_avg_pool2d(w.reshape(layers * heads, 1, lq, lk), (tq, tk)).reshape(layers, heads, tq, tk)
        # Each thumbnail scaled to its own maximum: a head's pattern matters there, not its scale.
        thumbs = thumbs / thumbs.amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12)
        t8 = _to_uint8(thumbs)
        data = self._common_json(w, q8, t8)
        data.update(self._vectors_json(layers, heads, lq, lk))
        data.update(self._generation_json(lq, lk))
        data.update(extras)
        return data

    def _signed_json(self, w: Tensor) -> dict:
        """The JSON of a ``signed`` source: int8 of ``w / max|w|``, thumbnails likewise each to its own."""
        layers, heads, lq, lk = w.shape
        if w.numel() and not bool(torch.isfinite(w).all()):
            raise ValueError(
                f"ViewerSource {self.name!r}: signed values must be finite, got NaN or inf (masked "
                "scores are -inf: replace them, e.g. torch.where(torch.isinf(s), 0.0, s), or show "
                "the probabilities instead)"
            )
        if self.queries is not None or self.keys is not None:
            raise ValueError(
                f"ViewerSource {self.name!r}: the neuron view splits the scores of probabilities; "
                "a signed source takes no queries= or keys= (show them in a second, unsigned source)"
            )
        scale = float(w.abs().max()) if w.numel() else 0.0
        scale = scale if scale > 0 else 1.0
        tq, tk = min(lq, THUMB), min(lk, THUMB)
        thumbs = F.adaptive_avg_pool2d(w.reshape(layers * heads, 1, lq, lk), (tq, tk)).reshape(layers, heads, tq, tk)
        thumbs = thumbs / thumbs.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12)
        data = self._common_json(w, _to_int8(w / scale), _to_int8(thumbs))
        data.update({"signed": True, "value_scale": scale})
        data.update(self._generation_json(lq, lk))
        return data

    def _common_json(self, w: Tensor, q8: Tensor, t8: Tensor) -> dict:
        """Names, tokens, the encoded weights ``q8`` and thumbnails ``t8``, the highlight."""
        layers, heads, lq, lk = w.shape
        tq, tk = t8.shape[-2:]
        names = list(self.layer_names) if self.layer_names is not None else [f"layer {i}" for i in range(layers)]
        if len(names) != layers:
            raise ValueError(f"ViewerSource {self.name!r}: {len(names)} layer names for {layers} layers")
        data = {
            "name": self.name,
            "caption": self.caption,
            "q_tokens": [str(t) for t in self.q_tokens],
            "k_tokens": [str(t) for t in self.k_tokens],
            "layers": names,
            "heads": heads,
            "lq": lq,
            "lk": lk,
            "thumb_q": tq,
            "thumb_k": tk,
            "weights": [[_b64(q8[l, h]) for h in range(heads)] for l in range(layers)],
            "thumbs": [[_b64(t8[l, h]) for h in range(heads)] for l in range(layers)],
        }
        if self.highlight is not None:
            if not isinstance(self.highlight, (tuple, list)) or len(self.highlight) != 3:
                raise ValueError(
                    f"ViewerSource {self.name!r}: highlight must be (layer, head, label), got {self.highlight!r}"
                )
            layer, head, label = self.highlight
            if not (0 <= layer < layers and 0 <= head < heads):
                raise ValueError(
                    f"ViewerSource {self.name!r}: highlight (layer={layer}, head={head}) is outside "
                    f"{layers} layers x {heads} heads"
                )
            data["highlight"] = {"layer": int(layer), "head": int(head), "label": str(label)}
        return data

    def _extras_json(self, lq: int, lk: int) -> dict:
        """The attention kind, the sentences of a pair and the logit lens, checked against the shape."""
        out: dict = {}
        if self.kind is not None:
            if self.kind not in KINDS:
                raise ValueError(f"ViewerSource {self.name!r}: kind must be None or one of {KINDS}, got {self.kind!r}")
            out["kind"] = self.kind
        if self.segments is not None or self.k_segments is not None:
            same = lq == lk and list(self.q_tokens) == list(self.k_tokens)
            if self.segments is None or (self.k_segments is None and not same):
                raise ValueError(
                    f"ViewerSource {self.name!r}: a sentence pair needs segments= (one per query token) and, "
                    "when the keys are other tokens, k_segments= (one per key token)"
                )
            q_seg = _segments(self.segments, lq, self.name, "segments")
            k_seg = q_seg if self.k_segments is None else _segments(self.k_segments, lk, self.name, "k_segments")
            out.update({"segments": q_seg, "k_segments": k_seg})
        if self.logit_lens is not None:
            lens = self.logit_lens
            if not isinstance(lens, LogitLens):
                raise TypeError(
                    f"ViewerSource {self.name!r}: logit_lens must be a multihead.viz.LogitLens "
                    f"(multihead.viz.logit_lens(model, ids, ...)), got {type(lens).__name__}"
                )
            if len(lens.tokens) != lq:
                raise ValueError(
                    f"ViewerSource {self.name!r}: the logit lens has {len(lens.tokens)} positions for "
                    f"{lq} query tokens; record it on the same ids"
                )
            out["lens"] = lens.to_json()
        return out

    def _vectors_json(self, layers: int, heads: int, lq: int, lk: int) -> dict:
        if self.queries is None and self.keys is None:
            return {}
        if self.queries is None or self.keys is None:
            raise ValueError(
                f"ViewerSource {self.name!r}: the neuron view needs both queries and keys, got only "
                f"{'queries' if self.keys is None else 'keys'}"
            )
        q = _stack(self.queries, self.name, "queries", self.batch)  # (layers, H, Lq, D)
        k = _stack(_keys_per_query_head(self.keys, heads, self.name, self.batch), self.name, "keys", self.batch)
        D = q.shape[-1]
        if q.shape != (layers, heads, lq, D):
            raise ValueError(
                f"ViewerSource {self.name!r}: queries must be (layers, H, Lq, D) = "
                f"({layers}, {heads}, {lq}, D) like the weights, got {tuple(q.shape)}"
            )
        if k.shape[0] != layers or k.shape[2:] != (lk, D) or k.shape[1] < 1 or heads % k.shape[1]:
            raise ValueError(
                f"ViewerSource {self.name!r}: keys must be (layers, Hkv, Lk, D) = ({layers}, Hkv, {lk}, "
                f"{D}) with Hkv dividing H={heads}, got {tuple(k.shape)}"
            )
        k = repeat_kv(k, heads)  # (layers, H, Lk, D): query head h reads KV head kv_head_of(h)
        scale = default_scale(D) if self.scale is None else float(self.scale)
        return {
            "dim": D,
            "scale": scale,
            "queries": [[_b64(q[l, h].contiguous()) for h in range(heads)] for l in range(layers)],
            "keys": [[_b64(k[l, h].contiguous()) for h in range(heads)] for l in range(layers)],
        }

    def _generation_json(self, lq: int, lk: int) -> dict:
        if self.prompt_len is None:
            if self.generated is not None:
                raise ValueError(f"ViewerSource {self.name!r}: generated tokens need prompt_len (where decoding began)")
            return {}
        P = self.prompt_len
        if lq != lk or list(self.q_tokens) != list(self.k_tokens):
            raise ValueError(
                f"ViewerSource {self.name!r}: a generation (prompt_len={P}) attends a sequence to itself; "
                f"got {lq} query tokens and {lk} different key tokens"
            )
        if isinstance(P, bool) or not isinstance(P, int) or not 1 <= P <= lq:
            raise ValueError(f"ViewerSource {self.name!r}: prompt_len must be an int in [1, {lq}], got {P!r}")
        steps = lq - P + 1
        generated = (
            ([str(t) for t in self.q_tokens[P:]] + [""]) if self.generated is None else [str(t) for t in self.generated]
        )
        if len(generated) != steps:
            raise ValueError(
                f"ViewerSource {self.name!r}: {len(generated)} generated tokens for {steps} decode steps "
                f"(rows {P - 1}..{lq - 1}); expected one per step"
            )
        return {"prompt_len": P, "generated": generated}


def render_viewer(sources: ViewerSource | list[ViewerSource], *, title: str = "multihead attention viewer") -> str:
    """The viewer page as one HTML string."""
    items = [sources] if isinstance(sources, ViewerSource) else list(sources)
    wrong = [type(s).__name__ for s in items if not isinstance(s, ViewerSource)]
    if wrong:
        raise TypeError(
            f"sources must be a ViewerSource or a list of them, got {', '.join(wrong)}; wrap "
            "weights in ViewerSource(name, q_tokens, k_tokens, weights)"
        )
    if not items:
        raise ValueError("render_viewer: sources is empty; expected at least one ViewerSource")
    kinds: dict[tuple[str, str | None], int] = {}
    for s in items:
        kinds[(s.name, s.kind)] = kinds.get((s.name, s.kind), 0) + 1
    for name, kind in kinds:
        if kind is not None and ((name, None) in kinds or kinds[(name, kind)] > 1):
            raise ValueError(
                f"render_viewer: the sources named {name!r} are one model's attention kinds; each needs "
                f"its own kind ({', '.join(KINDS)}), got {kinds[(name, kind)]} of kind {kind!r}"
                f"{' and one without a kind' if (name, None) in kinds else ''}"
            )
    payload = json.dumps({"title": title, "sources": [s.to_json() for s in items]}, separators=(",", ":"))
    # Inside <script> only "</" can end the element early; "<\/" is the same string to JSON.
    payload = payload.replace("</", "<\\/")
    parts = {
        "TITLE": html.escape(title),
        "CSS": _template("viewer.css"),
        "JS": "\n".join(_template(name) for name in SCRIPTS).replace("</", "<\\/"),
        "DATA": payload,
    }
    # One pass, so text inside one part (a token "{{JS}}") is never substituted again.
    return re.sub(r"\{\{(TITLE|CSS|JS|DATA)\}\}", lambda m: parts[m.group(1)], _template("viewer.html"))


def write_viewer(
    path: str | Path, sources: ViewerSource | list[ViewerSource], *, title: str = "multihead attention viewer"
) -> Path:
    """Write :func:`render_viewer` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(render_viewer(sources, title=title), encoding="utf-8")
    return path


class Viewer:
    """The viewer as an object: shown inline by Jupyter (``_repr_html_``), saved with :meth:`save`.

    Inline, the page sits in an ``<iframe srcdoc>``: its ids, styles and script are its own, so
    several viewers in one notebook do not interfere, and the notebook needs no extension.
    The sources are rendered once, here, so a bad source raises at construction.
    """

    def __init__(
        self,
        sources: ViewerSource | list[ViewerSource],
        *,
        title: str = "multihead attention viewer",
        height: int = 760,
    ):
        if isinstance(height, bool) or not isinstance(height, int) or height < 200:
            raise ValueError(f"Viewer: height must be an int >= 200 (pixels of the inline frame), got {height!r}")
        self.title, self.height = title, height
        self.html = render_viewer(sources, title=title)  # the standalone page

    def save(self, path: str | Path) -> Path:
        """Write the standalone page to ``path`` and return the path."""
        path = Path(path)
        path.write_text(self.html, encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        # srcdoc is an attribute: escaping & and " (html.escape) is all it needs.
        return (
            f'<iframe class="multihead-viewer" title="{html.escape(self.title)}" srcdoc="{html.escape(self.html)}" '
            f'style="width: 100%; height: {self.height}px; border: 1px solid #d9d9de;" '
            f'sandbox="allow-scripts"></iframe>'
        )

    def show(self) -> None:
        """``IPython.display.display(self)`` (in a notebook, the same as ending a cell with it)."""
        from IPython.display import display

        display(self)


def _template(name: str) -> str:
    return resources.files("multihead.viz").joinpath(name).read_text(encoding="utf-8")


def _stack(tensors, name: str, what: str, batch: int | None = None) -> Tensor:
    """``(layers, H, L, ·)`` from a tensor or a list of per-layer ``(H, L, ·)`` / ``(B, H, L, ·)``,
    the sequence ``batch`` of batched ones (:func:`_one_sequence`)."""
    shape = "(layers, H, Lq, Lk)" if what == "weights" else "(layers, H, L, D)"
    if isinstance(tensors, Tensor):
        w = tensors
        if w.dim() == 5:  # (layers, B, H, L, ·)
            w = _one_sequence(w.transpose(0, 1), batch, name, what, "", f"(layers, B, H, L, ·) = {tuple(w.shape)}")
        elif batch not in (None, 0):
            raise ValueError(
                f"ViewerSource {name!r}: batch={batch} but {what} {tuple(w.shape)} hold one sequence "
                f"{shape}; pass batch=None"
            )
    else:
        layers = [
            _one_sequence(t, batch, name, what, f" of layer {i}") if t.dim() == 4 else t for i, t in enumerate(tensors)
        ]
        if not layers:
            raise ValueError(f"ViewerSource {name!r}: {what} is an empty list; expected one ({shape[9:]} per layer")
        if len({tuple(t.shape) for t in layers}) > 1:
            raise ValueError(
                f"ViewerSource {name!r}: {what} of the layers have different shapes "
                f"{sorted({tuple(t.shape) for t in layers})}; expected one ({shape[9:]}"
            )
        w = torch.stack(layers)
    if w.dim() != 4:
        raise ValueError(f"ViewerSource {name!r}: {what} must be {shape}, got shape {tuple(w.shape)}")
    return w.detach().float().cpu()


def _one_sequence(t: Tensor, batch: int | None, name: str, what: str, where: str, shape: str = "") -> Tensor:
    """Sequence ``batch`` of ``t (B, ...)``; with ``batch=None`` only a batch of one is taken, a
    larger one is refused with the fix (never element 0 in silence)."""
    B = t.shape[0]
    if batch is None:
        if B != 1:
            raise ValueError(
                f"ViewerSource {name!r}: {what}{where} are batched, shape {shape or tuple(t.shape)} with B={B}, and "
                f"the tokens name one sequence; pass batch=i (0 <= i < {B}) to show sequence i, with its tokens"
            )
        return t[0]
    if not -B <= batch < B:
        raise ValueError(f"ViewerSource {name!r}: batch={batch} is out of range for {what}{where} with B={B}")
    return t[batch]


def _keys_per_query_head(keys, heads: int, name: str, batch: int | None):
    """Per-layer keys with each KV head copied to the query heads that read it, so that layers of
    different ``Hkv`` (an MHA layer beside a GQA one) stack; a tensor is returned as it is."""
    if isinstance(keys, Tensor):
        return keys
    out = []
    for i, k in enumerate(keys):
        k = _one_sequence(k, batch, name, "keys", f" of layer {i}") if k.dim() == 4 else k  # (Hkv, Lk, D)
        if k.dim() == 3 and 1 <= k.shape[0] < heads and heads % k.shape[0] == 0:
            k = k.repeat_interleave(heads // k.shape[0], dim=0)  # query head h reads kv_head_of(h)
        out.append(k)
    return out


def _segments(values, n: int, name: str, what: str) -> list[int]:
    """``values`` (a list or a tensor of 0s and 1s, one per token) as a list of ints."""
    seg = values.tolist() if isinstance(values, Tensor) else list(values)
    if len(seg) != n or any(isinstance(v, bool) or v not in (0, 1) for v in seg):
        raise ValueError(
            f"ViewerSource {name!r}: {what} must be {n} values of 0 (sentence A) or 1 (sentence B), one per "
            f"token, got {len(seg)} values {sorted(set(map(repr, seg)))[:4]}"
        )
    return [int(v) for v in seg]


def _to_uint8(w: Tensor) -> Tensor:
    return (w.clamp(0, 1) * 255).round().to(torch.uint8)


def _to_int8(w: Tensor) -> Tensor:
    """``w`` in ``[-1, 1]`` as ``round(127 * w)``: 0 stays exactly 0, signs are symmetric."""
    return (w.clamp(-1, 1) * 127).round().to(torch.int8)


def _b64(t: Tensor) -> str:
    """Raw bytes, little-endian as JavaScript's typed arrays read them on every platform we target."""
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")
