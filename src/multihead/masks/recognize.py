"""Recognising a dense mask tensor as the mask object it spells out: :func:`from_dense`, the one
recogniser (``explain()``'s advice, a Hugging Face 4-D mask, ``compat``'s ``attn_mask``).

A bool ``(Lq, Lk)`` ... ``(B, H, Lq, Lk)`` tensor (``True`` = may attend), or a float one read as
an additive mask (:func:`multihead.masks.tensor.additive_blocked` says what it blocks), is often
a structure written out in full: a causal triangle (``torch.tril``,
``nn.Transformer.generate_square_subsequent_mask``), a band, padded keys, packed documents.
:func:`from_dense` finds the object that means exactly the same (candidates from the tensor's
rows, each checked against the whole tensor, never guessed)::

    from_dense(torch.ones(4, 4, dtype=torch.bool).tril())
    Recognized(mask=causal(align='bottom_right'), expression='causal()', bias=False, where='')

    x  x  ·  ·     first and last visible key of each row, relative to the row's aligned key,
    x  x  x  ·     give the band's left and right extents in each alignment (bottom-right
    ·  x  x  x     offset Lk - Lq, top-left 0); a key no row sees on the right of a batch element
    ·  ·  x  x     is padding; a row whose first visible key is itself starts a document.

Objects let backends skip blocked blocks and pass causal diagonals as ``is_causal`` instead of
reading a tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks.band import Band, causal, sliding_window
from multihead.masks.base import Mask
from multihead.masks.document import document, document_causal
from multihead.masks.padding import key_padding
from multihead.masks.tensor import additive_blocked

__all__ = ["from_dense", "recognize", "Recognized", "MAX_ELEMENTS"]

#: Patterns larger than this (``B · Lq · Lk`` after dropping equal heads) are not analysed:
#: each candidate is checked against the whole tensor.
MAX_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Recognized:
    """A dense mask recognised: ``mask`` means exactly what the tensor's pattern means (``None``:
    every query sees every key), ``expression`` is how to write it (``where`` says what the names
    in it hold: the ids of documents, a padding table), and ``bias`` says whether a float tensor
    also adds something other than 0 to the scores it lets through."""

    mask: Mask | None
    expression: str
    bias: bool = False
    where: str = ""


def from_dense(mask: Tensor) -> Recognized | None:
    """The mask object equal to the dense ``mask`` (module docstring), or ``None`` when it has
    no structure the objects express (per-head patterns, random masks) or is too large to check
    (over :data:`MAX_ELEMENTS`). Integer tensors are not read (their polarity is unknown).

    The work and the objects' tensors (lengths, ids, tables) are on the host: every candidate is
    a host read anyway, and a mask holding small host tensors compares by value (plan caches)."""
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return None
    if not 2 <= mask.dim() <= 4:
        return None
    pattern = mask if mask.dtype == torch.bool else ~additive_blocked(mask)
    bias = mask.dtype != torch.bool and bool(torch.where(pattern, mask, torch.zeros((), dtype=mask.dtype)).any())
    p = pattern.detach().reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).cpu()  # (B|1, H|1, Lq, Lk)
    if p.shape[1] > 1:  # heads that agree are one (a (B, H, Lq, Lk) mask written for every head)
        if not bool((p == p[:, :1]).all()):
            return None  # a pattern per head: no mask object is one
        p = p[:, :1]
    if p.shape[0] > 1 and bool((p == p[:1]).all()):
        p = p[:1]
    B, _, Lq, Lk = p.shape
    if B * Lq * Lk > MAX_ELEMENTS or Lq == 0 or Lk == 0:
        return None
    if bool(p.all()):
        return Recognized(None, "None", bias)
    padding = _padding(p[:, 0])  # (mask, expression, where) or None
    for structure, text, where in _structures(p[:, 0]):
        for extra, extra_text, extra_where in [(None, "", "")] + ([padding] if padding else []):
            candidate = structure if extra is None else (extra if structure is None else structure & extra)
            if candidate is None:
                continue
            if _agrees(candidate, p):
                expression = " & ".join(t for t in (text, extra_text) if t)
                return Recognized(candidate, expression, bias, "; ".join(w for w in (where, extra_where) if w))
    return None


def recognize(mask: Tensor) -> Recognized | None:
    """Renamed :func:`from_dense` (the same function); this name warns."""
    warnings.warn("masks.recognize.recognize is now masks.recognize.from_dense", DeprecationWarning, stacklevel=2)
    return from_dense(mask)


def _agrees(candidate: Mask, p: Tensor) -> bool:
    """``candidate`` materialised equals ``p (B, 1, Lq, Lk)``: a few rows at each end first (most
    wrong candidates differ there, cheaply), then the whole square."""
    B, _, Lq, Lk = p.shape
    for q0, q1 in ((0, min(Lq, 16)), (max(0, Lq - 16), Lq), (0, Lq)):
        block = candidate.materialize_block(Extent(B, 1, Lq, Lk), Block(q0, q1, 0, Lk), "cpu").expand(B, 1, q1 - q0, Lk)
        if not torch.equal(block, p[:, :, q0:q1]):
            return False
    return True


def _padding(p: Tensor) -> tuple[Mask, str, str] | None:
    """``key_padding`` of the keys no query of a batch element sees, when some are."""
    valid = p.any(dim=1)  # (B, Lk)
    if bool(valid.all()):
        return None
    lengths = valid.sum(dim=1)  # (B,)
    prefix = torch.arange(p.shape[-1]).unsqueeze(0) < lengths.unsqueeze(1)
    if torch.equal(prefix, valid):
        return key_padding(lengths), f"key_padding(torch.tensor({lengths.tolist()}))", ""
    return key_padding(valid), "key_padding(valid)", "valid: (B, Lk) bool, True = a key some query sees"


def _structures(p: Tensor) -> Iterator[tuple[Mask | None, str, str]]:
    """Candidate ``(mask, expression, where)`` for ``p (B, Lq, Lk)``, simplest first; ``None`` is
    "no structure" (padding alone)."""
    B, Lq, Lk = p.shape
    yield None, "", ""
    rows = p.any(dim=2)  # (B, Lq): rows that see a key
    if not bool(rows.any()):
        return
    bytes_ = p.to(torch.uint8)
    first = bytes_.argmax(dim=2)  # (B, Lq) first visible key of each row (argmax: the first maximum)
    last = Lk - 1 - bytes_.flip(2).argmax(dim=2)  # (B, Lq) last visible key
    i = torch.arange(Lq).unsqueeze(0)
    lo_rel, hi_rel = (first - i)[rows], (last - i)[rows]
    a, b = int(lo_rel.min()), int(hi_rel.max())  # the rows the edges of the square clip least
    starts_at_zero = bool((first[rows] == 0).all())
    seen = set()
    unbounded_left = []  # Band(None, right): no constructor names it, so tried after those that have one
    for align in ("bottom_right", "top_left"):
        offset = Lk - Lq if align == "bottom_right" else 0
        lefts = [None] + ([offset - a] if not starts_at_zero and offset - a >= 0 else [])
        rights = [0] + ([b - offset] if b - offset > 0 else []) + [None]
        for left in lefts:
            for right in rights:
                found = _band(left, right, align)
                if found is None or found[0] in seen:
                    continue
                seen.add(found[0])
                if left is None and right != 0:
                    unbounded_left.append(found)
                else:
                    yield found[0], found[1], ""
    for band, text in unbounded_left:
        yield band, text, ""
    # documents: each row's visible keys are one run, shared by the rows of its document
    union = p.any(dim=0)  # (Lq, Lk)
    yield from _documents(union, document, "document(ids)")
    if Lq == Lk:
        yield from _documents(union | union.T, document_causal, "document_causal(ids)")
        # documents of each sequence in a band (a packed batch, a window inside documents): a row
        # whose first visible key is itself starts a document; the band is the tightest one
        tight = _tightest_band(a, b, Lq, Lk)
        if tight is not None:
            starts = torch.where(rows, first, i) == i  # (B, L)
            ids = starts.long().cumsum(dim=1)  # (B, L): the document of each token
            docs: Mask = document(ids[0] if B == 1 else ids)
            outer, outer_text = tight
            if outer is None:
                mask, text = docs, "document(ids)"
            else:
                mask, text = outer & docs, f"{outer_text} & document(ids)"
            shape = "(L,)" if B == 1 else "(B, L)"
            yield mask, text, f"ids: {shape} int, the document of each token"


def _band(left: int | None, right: int | None, align: str) -> tuple[Mask, str] | None:
    """The band object of ``left`` keys before the aligned one and ``right`` after (``None``:
    unbounded) and how to write it; ``None`` when both are unbounded (nothing blocked)."""
    if left is None and right is None:
        return None
    suffix = [] if align == "bottom_right" else ["align='top_left'"]
    if left is None:
        if right == 0:
            return causal(align), f"causal({'' if align == 'bottom_right' else repr(align)})"
        return Band(None, right, align), f"Band(None, {right}, {align!r})"
    args = [str(left)] + ([] if right == 0 else [f"right={right}"]) + suffix
    return sliding_window(left, right, align), f"sliding_window({', '.join(args)})"


def _tightest_band(a: int, b: int, Lq: int, Lk: int) -> tuple[Mask | None, str] | None:
    """The narrowest band holding the diagonals ``j - i`` from ``a`` to ``b`` and its aligned
    diagonal, in the first alignment that has one: ``(None, "")`` for every diagonal, ``None``
    when no band holds its aligned diagonal there."""
    for align, offset in (("bottom_right", Lk - Lq), ("top_left", 0)):
        if a <= offset <= b:
            left = None if a <= -(Lq - 1) else offset - a
            right = None if b >= Lk - 1 else b - offset
            band = _band(left, right, align)
            return (None, "") if band is None else band
    return None


def _documents(p: Tensor, build: Callable[..., Mask], text: str) -> Iterator[tuple[Mask | None, str, str]]:
    """``build(q_ids, kv_ids)`` with ids read from ``p (Lq, Lk)``: a query's id is the first key
    it sees, a key's the id of the first query that sees it (-1 / -2 where none)."""
    Lq, Lk = p.shape
    bytes_ = p.to(torch.uint8)
    q_ids = torch.where(p.any(dim=1), bytes_.argmax(dim=1), -1)  # (Lq,): first key each query sees
    first_query = bytes_.argmax(dim=0)  # (Lk,): first query that sees each key
    kv_ids = torch.where(p.any(dim=0), q_ids[first_query], -2)
    if Lq == Lk and torch.equal(q_ids, kv_ids):
        yield build(q_ids), text, "ids: (L,) int, the document of each token"
    else:
        yield (
            build(q_ids, kv_ids),
            text.replace("(ids)", "(q_ids, kv_ids)"),
            "q_ids (Lq,), kv_ids (Lk,): the document of each query and key",
        )
