"""A mask as a *program* a kernel evaluates element by element: its leaves, each a small formula
over per-position tables, and the truth table of the ``& | ~`` that joins them.

The ``triton_blocks`` kernels (:mod:`multihead.backends.triton_kernels`) evaluate a tile's mask
from this, never from an ``Lq x Lk`` tensor::

    causal() & (document(ids) | key_padding(n))       leaves: 0 band, 1 document, 2 key lengths
    table bit i = the expression at leaf j = bit j of i:  i = 0b101 (band, lengths) -> visible

The leaves and the parameters each reads (8 int32 per leaf; the first two are the offsets the leaf
is read at, so ``Mask.shifted`` costs nothing; table offsets point into one int32 ``data``):

==========  ==================  ==============================================================
kind        mask                parameters 2..7
==========  ==================  ==============================================================
1 band      ``Band``            left, has left, right, has right, offsets[B] (``Lk - Lq`` or
                                per sequence), -
2 lengths   ``KeyPadding``      lengths[B]
3 valid     ``KeyPadding``      table (B, Lk) of 0/1, its row stride
4 document  ``Document``        q ids (B, Lq), row stride, kv ids (B, Lk), row stride
5 doc.      ``DocumentCausal``  as 4, and per position ``place - count`` of its run (q, kv)
==========  ==================  ==============================================================

What is not one of these (tensor masks, custom functions, masks read at position tensors, more
than :data:`MAX_LEAVES` leaves) has no program: :func:`mask_program` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from multihead.conventions import resolve_alignment_offset
from multihead.masks import And, Band, Document, DocumentCausal, KeyPadding, Mask, Not, Or, Positioned

__all__ = ["MaskProgram", "mask_program", "MAX_LEAVES", "BAND", "LENGTHS", "VALID", "DOCUMENT", "DOCUMENT_CAUSAL"]

#: Leaves a kernel evaluates at most (its truth table has ``2**MAX_LEAVES`` bits, in an int64).
MAX_LEAVES = 5
BAND, LENGTHS, VALID, DOCUMENT, DOCUMENT_CAUSAL = 1, 2, 3, 4, 5
_NO_LIMIT = 1 << 30  # an unbounded band side (never read: its "has" flag is 0)


@dataclass(frozen=True)
class MaskProgram:
    """``kinds`` per leaf, ``table`` (the truth table), ``params (n, 8)`` and ``data`` int32 on the
    host; :meth:`to` puts the tensors on the kernel's device."""

    kinds: tuple[int, ...]
    table: int
    params: Tensor
    data: Tensor

    def to(self, device: torch.device) -> MaskProgram:
        return MaskProgram(self.kinds, self.table, self.params.to(device), self.data.to(device))


class _Builder:
    def __init__(self, batch: int):
        self.batch = batch
        self.kinds: list[int] = []
        self.params: list[list[int]] = []
        self.chunks: list[Tensor] = []
        self.size = 0

    def table(self, t: Tensor) -> int:
        """Append an integer table to ``data``; its offset."""
        at = self.size
        flat = t.detach().reshape(-1).to("cpu", torch.int32)  # built on the host, moved once (MaskProgram.to)
        self.chunks.append(flat)
        self.size += flat.numel()
        return at

    def per_row(self, t: Tensor) -> Tensor:
        """``(B|1, ...)`` -> ``(B, ...)``: one row per batch element."""
        return t.expand(self.batch, *t.shape[1:]) if t.shape[0] == 1 else t

    def leaf(self, kind: int, q_shift: int, kv_shift: int, *params: int) -> int:
        self.kinds.append(kind)
        self.params.append([q_shift, kv_shift, *params, *[0] * (6 - len(params))])
        return len(self.kinds) - 1


def mask_program(mask: Mask | None, batch: int, q_len: int, kv_len: int) -> MaskProgram | str:
    """The program of ``mask`` for calls of ``(B, ·, Lq, Lk)``, or the reason there is none."""
    b = _Builder(batch)
    if mask is None:
        expr: object = True
    else:
        try:
            expr = _walk(mask, b, 0, 0, q_len, kv_len)
        except _NoProgram as why:
            return str(why)
    n = len(b.kinds)
    if n > MAX_LEAVES:
        return f"the mask has {n} leaves; the kernel evaluates at most {MAX_LEAVES}"
    table = sum(1 << i for i in range(1 << n) if _evaluate(expr, i))
    params = torch.tensor(b.params, dtype=torch.int32).reshape(n, 8)
    data = torch.cat(b.chunks) if b.chunks else torch.zeros(1, dtype=torch.int32)
    return MaskProgram(tuple(b.kinds), table, params, data)


class _NoProgram(Exception):
    pass


def _walk(mask: Mask, b: _Builder, qs: int, ks: int, q_len: int, kv_len: int) -> object:
    """The expression of ``mask`` read at offsets ``qs, ks`` of a whole attention of ``q_len x
    kv_len``: a leaf index, or ``("and" | "or", parts)``, ``("not", part)``."""
    if isinstance(mask, (And, Or)):
        return ("and" if isinstance(mask, And) else "or", [_walk(p, b, qs, ks, q_len, kv_len) for p in mask.parts])
    if isinstance(mask, Not):
        return ("not", _walk(mask.inner, b, qs, ks, q_len, kv_len))
    if isinstance(mask, Positioned):
        q_pos, kv_pos = mask.q_pos, mask.kv_pos
        if not isinstance(q_pos, int) or not isinstance(kv_pos, int):
            raise _NoProgram("a mask read at position tensors (Mask.at) has no per-element formula here")
        whole = (q_len, kv_len) if mask.q_len is None or mask.kv_len is None else (mask.q_len, mask.kv_len)
        return _walk(mask.inner, b, qs + q_pos, ks + kv_pos, *whole)
    if type(mask) is Band:
        if mask.per_sequence:
            q_lengths = torch.tensor([q_len]) if mask.q_lengths is None else mask.q_lengths
            kv_lengths = torch.tensor([kv_len]) if mask.kv_lengths is None else mask.kv_lengths
            offsets = b.per_row((kv_lengths - q_lengths).view(-1))
        else:
            offsets = torch.full((b.batch,), resolve_alignment_offset(mask.align, q_len, kv_len))
        left, right = mask.left, mask.right
        return b.leaf(
            BAND,
            qs,
            ks,
            _NO_LIMIT if left is None else left,
            int(left is not None),
            _NO_LIMIT if right is None else right,
            int(right is not None),
            b.table(offsets),
        )
    if type(mask) is KeyPadding:
        lengths = mask.key_lengths()
        if lengths is not None:
            return b.leaf(LENGTHS, qs, ks, b.table(b.per_row(lengths.detach().cpu().view(-1))))
        assert mask.valid is not None  # a KeyPadding holds lengths or a table (masks/padding.py)
        valid = b.per_row(mask.valid.detach().cpu())
        return b.leaf(VALID, qs, ks, b.table(valid), valid.shape[1])
    if isinstance(mask, Document) and type(mask) in (Document, DocumentCausal):
        q_ids, kv_ids = (b.per_row(t.detach().cpu()) for t in mask.document_ids())
        # Ids renumbered 0.. (int32 in the kernel, whatever the caller's ids are).
        _, inverse = torch.unique(torch.cat([q_ids.reshape(-1), kv_ids.reshape(-1)]), return_inverse=True)
        q_num, kv_num = inverse[: q_ids.numel()].view_as(q_ids), inverse[q_ids.numel() :].view_as(kv_ids)
        params = [b.table(q_num), q_ids.shape[1], b.table(kv_num), kv_ids.shape[1]]
        if not isinstance(mask, DocumentCausal):
            return b.leaf(DOCUMENT, qs, ks, *params)
        # Key j of a run is visible iff its place - count <= the query's (masks/document.py).
        q_place, q_count, kv_place, kv_count = mask._tables()
        q_at, kv_at = b.per_row((q_place - q_count).cpu()), b.per_row((kv_place - kv_count).cpu())
        return b.leaf(DOCUMENT_CAUSAL, qs, ks, *params, b.table(q_at), b.table(kv_at))
    raise _NoProgram(f"{mask._describe()} ({type(mask).__name__}) has no per-element formula in the kernel")


def _evaluate(expr: Any, bits: int) -> bool:
    """The expression's value when leaf ``j`` is bit ``j`` of ``bits``."""
    if expr is True:
        return True
    if isinstance(expr, int):
        return bool(bits >> expr & 1)
    op, arg = expr
    if op == "not":
        return not _evaluate(arg, bits)
    values = [_evaluate(e, bits) for e in arg]
    return all(values) if op == "and" else any(values)
