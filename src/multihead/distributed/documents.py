"""Document-balanced sharding of packed sequences: :func:`document_layout`.

Zigzag balances one causal sequence. Packed pretraining attends within documents
(``document_causal(ids)``), and a document's work is quadratic in its length, so a few long
documents decide which rank is slowest: with long-tailed lengths zigzag leaves ranks idle (measured:
``docs/distributed.md``, Document-balanced sharding). Llama 3's answer is to cut *every document* into
``2P`` chunks and give rank ``r`` chunks ``r`` and ``2P-1-r`` of each, so that each rank holds an
early and a late part of every document::

    ids      0 0 0 0 0 0 0 0 | 1 1 1 1 | 2 2 2 2 2 2 2 2 2 2 2 2      P = 2 (4 chunks a document)
    rank     0 0 1 1 1 1 0 0 | 0 1 1 0 | 0 0 0 1 1 1 1 1 1 0 0 0

Here a document of ``n = 2P·q + m`` tokens gets chunks of ``q`` tokens, and its ``m`` left-over
tokens go one each to the next ``m`` ranks of a counter that runs on through the whole sequence,
so every rank holds exactly ``L/P`` tokens (the left-overs add up to a multiple of ``P``) and the
ring's shards keep one shape. Documents shorter than ``2P·min_chunk`` are not cut one by one:
consecutive short documents are cut together as one segment (their work is small and spread
evenly along it), which keeps the runs per rank, and so the ring's plan, small. Runs of one rank
that touch are joined.

The layout is an object (:class:`DocumentLayout`, a :class:`~multihead.distributed.layout.Layout`)
holding the ids it was made from: every sharded attention, :func:`shard_sequence`,
:func:`shard_positions` and :class:`ContextParallel` take it as ``layout=``, and the ring's plan
reads its runs and skips every pair of runs the mask hides (different documents).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from multihead.distributed.layout import Layout, Piece

__all__ = ["DocumentLayout", "document_layout"]


def document_layout(ids: Tensor, world: int, *, min_chunk: int = 16) -> DocumentLayout:
    """The document-balanced layout of a packed sequence over ``world`` ranks.

    Args:
        ids: ``(L,)`` or ``(1, L)`` integer document ids of the whole sequence, one document per
            run of equal ids (what ``document(ids)`` / ``document_causal(ids)`` take). ``L`` must be
            a multiple of ``world``.
        world: the number of ranks sharing the sequence.
        min_chunk: documents shorter than ``2·world·min_chunk`` are cut together with their short
            neighbours (fewer, longer runs); ``1`` cuts every document of ``2·world`` tokens or more.
    """
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = f"a {ids.dtype} tensor" if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"document_layout: ids must be an integer tensor (L,) or (1, L), got {got}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"document_layout: ids must have shape (L,) or (1, L), got {tuple(ids.shape)}; one packing of "
            "positions is shared by every row of the batch (a layout places positions, not rows)"
        )
    for name, value in (("world", world), ("min_chunk", min_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"document_layout: {name} must be a positive int, got {value!r}")
    L = ids.shape[0]
    if L == 0 or L % world:
        raise ValueError(
            f"document_layout: the sequence has L={L} positions, not a positive multiple of world={world}; "
            f"expected every rank to hold L/world positions; hint: pad the sequence to a multiple of {world} "
            "(its own document id) and mask the padding"
        )
    return DocumentLayout(ids, world, min_chunk)


class DocumentLayout(Layout):
    """Rank ``r`` holds :meth:`pieces` ``(r)``: runs of positions, chunks ``r`` and ``2P-1-r`` of
    every document or segment of short documents (module docstring). Built by
    :func:`document_layout`; compared and hashed by its runs."""

    def __init__(self, ids: Tensor, world: int, min_chunk: int):
        self.ids = ids.detach().to("cpu").clone()  # (L,): held, so the layout says what it was made of
        self.world, self.length, self.min_chunk = world, int(ids.shape[0]), min_chunk
        self.runs = _balanced_runs(_segments(self.ids, 2 * world * min_chunk), world)
        self._key = (world, self.length, self.runs)
        self.digest = hashlib.sha1(repr(self._key).encode()).hexdigest()[:12]

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """``rank``'s runs: its chunks of every document or segment, touching ones joined."""
        return self.runs[rank]

    def positions(self, rank: int) -> Tensor:
        """``(L/P,)`` int64: the global positions of ``rank``'s tokens, in its shard's order."""
        return torch.cat([torch.arange(p.start, p.start + p.length) for p in self.runs[rank]])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocumentLayout) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        runs = max(len(r) for r in self.runs)
        return f"document_layout(<{self.length} ids>, world={self.world}) [{runs} runs per rank at most, {self.digest}]"


def _segments(ids: Tensor, short: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each document of at least ``short`` tokens, and of each maximal run
    of consecutive shorter documents."""
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), int(ids.shape[0])]
    out: list[tuple[int, int]] = []
    pending = None  # start of the current run of short documents
    for start, end in zip(bounds, bounds[1:]):
        if end - start >= short:
            if pending is not None:
                out.append((pending, start - pending))
                pending = None
            out.append((start, end - start))
        elif pending is None:
            pending = start
    if pending is not None:
        out.append((pending, bounds[-1] - pending))
    return out


def _balanced_runs(segments: list[tuple[int, int]], world: int) -> tuple[tuple[Piece, ...], ...]:
    """Each segment cut into ``2P`` chunks, chunk ``j`` to rank ``j`` (``j < P``) or ``2P-1-j``;
    left-over tokens one each to the ranks of a counter that runs on across segments (first to a
    rank's early chunk, then its late one). Touching runs of a rank are joined."""
    P = world
    held: list[list[list[int]]] = [[] for _ in range(P)]  # rank -> [start, length] runs
    counter = 0
    for start, n in segments:
        q, m = divmod(n, 2 * P)
        extra = [0] * (2 * P)
        for i in range(m):
            r = (counter + i) % P
            # a rank's first extra token lengthens its early chunk, a second (m > P) its late one
            extra[r if i < P else 2 * P - 1 - r] += 1
        counter = (counter + m) % P
        pos = start
        for j in range(2 * P):
            size = q + extra[j]
            if size:
                runs = held[j if j < P else 2 * P - 1 - j]
                if runs and runs[-1][0] + runs[-1][1] == pos:
                    runs[-1][1] += size  # touches the rank's previous run: one run
                else:
                    runs.append([pos, size])
            pos += size
    out = []
    for runs in held:
        local, pieces = 0, []
        for start, length in runs:
            pieces.append(Piece(local, start, length))
            local += length
        out.append(tuple(pieces))
    return tuple(out)
