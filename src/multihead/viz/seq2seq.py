"""A seq2seq model's three attentions as one model of the viewer: the encoder's self-attention,
the decoder's self-attention and the decoder's cross-attention to the encoder (bertviz's three
views), from one forward.

    sources = record_seq2seq(bart, input_ids=src, decoder_input_ids=tgt,
                             src_tokens=src_names, tgt_tokens=tgt_names, name="bart")
    write_viewer("bart.html", sources)   # one model in the menu, a switch between the three

Each attention layer is sorted by its module path, by the first ``encoder`` or ``decoder``
module on it: under an encoder it is the encoder's; under a decoder it is the decoder's, and its
cross-attention when a module below says so (``encoder_attn``: BART, Marian, Whisper;
``EncDecAttention``: T5; ``crossattention``: BERT as the decoder of an ``EncoderDecoderModel``).
Its weights' shape must agree: ``(Ls, Ls)``, ``(Lt, Lt)``, ``(Lt, Ls)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from multihead.capture import capture_attention, layers_of
from multihead.viz.record import record_vectors
from multihead.viz.viewer import ViewerSource

__all__ = ["record_seq2seq", "attention_kind"]

_CROSS = re.compile(r"encoder_?attn|encdec|cross", re.IGNORECASE)


def attention_kind(path: str) -> str | None:
    """``"encoder"``, ``"decoder"`` or ``"cross"`` for an attention module's path, or ``None``."""
    parts = path.lower().split(".")
    for n, part in enumerate(parts[:-1]):
        if part.endswith("decoder"):  # the decoder's: cross when a module below it says so
            return "cross" if any(_CROSS.search(p) for p in parts[n + 1 :]) else "decoder"
        if part.endswith("encoder"):
            return "encoder"
    return None


@torch.no_grad()
def record_seq2seq(
    model: nn.Module,
    *inputs,
    src_tokens: list[str],
    tgt_tokens: list[str],
    name: str = "seq2seq",
    batch: int | None = None,
    kind_of: Callable[[str], str | None] = attention_kind,
    **kwargs,
) -> list[ViewerSource]:
    """One forward ``model(*inputs, **kwargs)`` of a seq2seq model on the `multihead` backend (or
    built of `multihead` layers) as three :class:`ViewerSource` of one ``name``, with their query
    and key vectors: ``kind="encoder"`` over ``src_tokens``, ``"decoder"`` over ``tgt_tokens``,
    ``"cross"`` from ``tgt_tokens`` to ``src_tokens``. ``batch`` picks the sequence of a batch;
    ``kind_of`` maps a module path to its kind when :func:`attention_kind` cannot."""
    with capture_attention(model) as cap, record_vectors(model) as vec:
        model(*inputs, **kwargs)
    if not cap.weights or len(vec.queries) != len(cap.weights):
        raise ValueError(
            f"record_seq2seq: {type(model).__name__} recorded {len(cap.weights)} attention calls with "
            f"weights and {len(vec.queries)} with vectors; run it on the multihead backend "
            "(multihead.integrations.hf.register(), attn_implementation='multihead')"
        )
    B = cap.weights[0].shape[0]
    if batch is None and B != 1:
        raise ValueError(f"record_seq2seq: the inputs hold B={B} sequences; pass batch=i (0 <= i < {B})")
    i = 0 if batch is None else batch
    Ls, Lt = len(src_tokens), len(tgt_tokens)
    expected = {"encoder": (Ls, Ls), "decoder": (Lt, Lt), "cross": (Lt, Ls)}
    groups: dict[str, list[int]] = {kind: [] for kind in expected}
    for n, (path, w) in enumerate(zip(cap.names, cap.weights)):
        kind = kind_of(path)
        if kind not in expected:
            raise ValueError(
                f"record_seq2seq: cannot tell which attention {path!r} is (got kind {kind!r}); pass "
                "kind_of=lambda path: 'encoder' | 'decoder' | 'cross'"
            )
        if tuple(w.shape[-2:]) != expected[kind]:
            raise ValueError(
                f"record_seq2seq: {path!r} looks like {kind} attention, (Lq, Lk) = {expected[kind]} for "
                f"{Ls} source and {Lt} target tokens, but its weights are {tuple(w.shape[-2:])}; check "
                "src_tokens and tgt_tokens, or pass kind_of="
            )
        groups[kind].append(n)
    missing = [kind for kind, calls in groups.items() if not calls]
    if missing:
        raise ValueError(f"record_seq2seq: no {' or '.join(missing)} attention found in {cap.names}")
    tokens = {  # (query tokens, key tokens) of each kind
        "encoder": (src_tokens, src_tokens),
        "decoder": (tgt_tokens, tgt_tokens),
        "cross": (tgt_tokens, src_tokens),
    }
    # A Hugging Face module's own scale (``scaling``), for the neuron view's terms q_d k_d scale.
    scales = {getattr(m, "scaling", None) for m in layers_of(model, "record_seq2seq").values()}
    return [
        ViewerSource(
            name,
            *tokens[kind],
            [cap.weights[n][i] for n in calls],
            [cap.names[n] for n in calls],
            queries=[vec.queries[n][i] for n in calls],
            keys=[vec.keys[n][i] for n in calls],
            kind=kind,
            scale=next(iter(scales)) if len(scales) == 1 else None,
        )
        for kind, calls in groups.items()
    ]
