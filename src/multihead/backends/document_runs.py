"""Document runs: packed documents as one fused-kernel call per document.

Packed documents (``document(ids)``, alone or ``& causal()``, or ``document_causal(ids)``) split
the attention into independent squares on the diagonal: the queries of a document see only the
keys of the same document, all of them or causally. So each document is a whole attention of its
own, and the CPU flash kernel runs it in one call: no mask, ``is_causal=True`` for the causal
kinds (top-left *within* the document, which is what these masks mean there)::

    ids      0 0 0 1 1 2 2 2          one call per document:
    0        █ · · · · · · ·            rows 0-2, keys 0-2, is_causal
    0        █ █ · · · · · ·            rows 3-4, keys 3-4, is_causal
    0        █ █ █ · · · · ·            rows 5-7, keys 5-7, is_causal
    1        · · · █ · · · ·
    1        · · · █ █ · · ·
    2        · · · · · █ · ·
    2        · · · · · █ █ ·
    2        · · · · · █ █ █

The block grid instead cuts the documents into query blocks of 256 rows, each with a few pieces
(the keys of its document before the block, the causal diagonal, a small mask where a document
starts mid-block) merged by log-sum-exp: a few dozen kernel calls and operations per 256 rows,
each an OpenMP parallel region. On an idle machine that costs little; when other processes share
the cores each region waits for a descheduled thread, and packed documents fell behind the
padded dense-mask SDPA baseline (measured: docs/performance.md#packed-documents). One call per
document is one region per document, and the kernel itself skips what is above a causal diagonal.

The ``blocksparse`` backend runs the documents as its query blocks (one piece each), so its
forward, backward and LSE handling serve them unchanged. :func:`document_segments` answers only
for the masks above, ids shared by every batch row, and at most ``max_segments`` documents (many
tiny documents would make more calls than the block grid); ``None`` otherwise. Imports only torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from multihead.masks import And, Band, Document, DocumentCausal, Mask

__all__ = ["Segment", "document_segments"]


class Segment(NamedTuple):
    """Queries ``[q0, q1)`` see keys ``[k0, k1)`` (no other key), all of them or, with ``causal``,
    causally aligned top-left (query ``q0 + r`` sees keys ``k0 .. k0 + r``). ``k0 == k1``: the
    queries see no key (their output is 0, their LSE ``-inf``)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def document_segments(mask: Mask | None, q_len: int, kv_len: int, max_segments: int) -> tuple[Segment, ...] | None:
    """The documents of ``mask`` as segments covering every query row in order, or ``None`` when
    ``mask`` is not one of: ``document(ids)``; ``document(ids) & causal()`` (or a band whose window
    is exactly "keys up to the query") and ``document_causal(ids)`` with the same ids for queries
    and keys, ``Lq == Lk``. The ids must be sorted and the same for every batch row, and there
    must be at most ``max_segments`` documents."""
    if mask is None:
        return None
    parts = mask.parts if isinstance(mask, And) else (mask,)
    docs = [p for p in parts if isinstance(p, Document)]
    bands = [p for p in parts if isinstance(p, Band)]
    if len(docs) != 1 or len(docs) + len(bands) != len(parts) or len(bands) > 1:
        return None
    doc = docs[0]
    causal = isinstance(doc, DocumentCausal) or bool(bands)
    if bands and (isinstance(doc, DocumentCausal) or bands[0].window(q_len, kv_len) != (None, 0)):
        return None  # only "key j <= query i" within the document
    q_runs, kv_runs = _runs(doc.q_ids), _runs(doc.kv_ids)
    if q_runs is None or kv_runs is None or len(q_runs) > max_segments:
        return None
    if causal and (q_len != kv_len or q_runs != kv_runs):
        return None  # a document with other query and key counts: aligned otherwise (masks/document.py)
    where = {doc_id: (s, e) for doc_id, s, e in kv_runs}
    segments = []
    for doc_id, q0, q1 in q_runs:
        k0, k1 = where.get(doc_id, (0, 0))
        segments.append(Segment(q0, q1, k0, k1, causal))
    return tuple(segments)


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """``(id, start, end)`` of each run of equal ids ``(B|1, L)`` (host), or ``None`` unless the
    ids are sorted, each id one run, and every batch row the same."""
    ids = ids.detach().cpu()
    if ids.shape[1] == 0 or (ids.shape[0] > 1 and not bool((ids == ids[:1]).all())):
        return None
    row = ids[0]
    if not bool((row.diff() >= 0).all()):
        return None  # unsorted: a document may come back later
    values, counts = torch.unique_consecutive(row, return_counts=True)
    ends = counts.cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return list(zip(values.tolist(), starts, ends))
