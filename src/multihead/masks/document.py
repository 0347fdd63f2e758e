"""Document masks for packed sequences: a query sees only keys of its own document.

``document(torch.tensor([0, 0, 0, 1, 1, 2]))``::

    ███···
    ███···
    ███···
    ···██·
    ···██·
    ·····█

Combine with ``causal()`` for packed causal training: ``document(ids) & causal()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks.base import UNBOUNDED, BlockState, Mask

__all__ = ["document", "document_causal", "Document", "DocumentCausal"]


def document(q_ids: Tensor, kv_ids: Tensor | None = None) -> Document:
    """Query ``i`` may see key ``j`` iff ``q_ids[b, i] == kv_ids[b, j]``.

    ``q_ids``: integer tensor ``(Lq,)`` or ``(B, Lq)``; ``kv_ids`` likewise with ``Lk``
    (defaults to ``q_ids``, self-attention). Sorted ids (packed documents) let backends skip
    whole blocks without looking at the ids element by element.
    """
    q_ids = _check_ids("q_ids", q_ids).clone()  # copied: the mask is immutable
    kv_ids = q_ids if kv_ids is None else _check_ids("kv_ids", kv_ids).clone()
    if q_ids.shape[0] != kv_ids.shape[0] and 1 not in (q_ids.shape[0], kv_ids.shape[0]):
        raise ValueError(
            f"document: q_ids has {q_ids.shape[0]} batch rows and kv_ids {kv_ids.shape[0]}; "
            "expected equal counts or one of them 1"
        )
    return Document(q_ids, kv_ids)


class Document(Mask):
    """Query ``i`` sees key ``j`` iff their document ids are equal; ids ``(B|1, Lq)`` and
    ``(B|1, Lk)``. Built by :func:`document`."""

    kind = "document"
    q_ids: Tensor  # (B|1, Lq)
    kv_ids: Tensor  # (B|1, Lk)

    def __init__(self, q_ids: Tensor, kv_ids: Tensor):
        self._set(q_ids=q_ids, kv_ids=kv_ids)

    def document_ids(self) -> tuple[Tensor, Tensor]:
        """``(q_ids, kv_ids)``, each ``(B|1, L)``: the document of every query and key."""
        return self.q_ids, self.kv_ids

    # Host copies for structural questions, made on first use (never when the mask is built).
    @property
    def _q_cpu(self) -> Tensor:
        return self._cached("_q_cache", lambda: self.q_ids.detach().cpu())

    @property
    def _kv_cpu(self) -> Tensor:
        return self._cached("_kv_cache", lambda: self.kv_ids.detach().cpu())

    @property
    def _sorted(self) -> bool:
        return self._cached(
            "_sorted_cache",
            lambda: bool((self._q_cpu.diff(dim=-1) >= 0).all()) and bool((self._kv_cpu.diff(dim=-1) >= 0).all()),
        )

    def check(self, extent: Extent) -> None:
        batch, _, q_len, kv_len = extent
        for name, ids, length, what in (("q_ids", self.q_ids, q_len, "Lq"), ("kv_ids", self.kv_ids, kv_len, "Lk")):
            # (not `in (1, B)`: dynamo, torch 2.13, answers it False for a symbolic B)
            if ids.shape[0] != 1 and ids.shape[0] != batch:
                raise ValueError(f"document: {name} has {ids.shape[0]} batch rows but B={batch}")
            if length is not None and ids.shape[1] != length:
                raise ValueError(f"document: {name} has length {ids.shape[1]} but {what}={length}")

    def extent(self) -> tuple[int | None, int | None]:
        return self.q_ids.shape[1], self.kv_ids.shape[1]

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        qi, ki = self.q_ids.to(q.device), self.kv_ids.to(kv.device)
        q_doc = qi[b * 0 if qi.shape[0] == 1 else b, q]
        kv_doc = ki[b * 0 if ki.shape[0] == 1 else b, kv]
        return q_doc == kv_doc

    def _describe(self) -> str:
        shown = self._q_cpu[0].tolist()
        text = str(shown) if len(shown) <= 16 else f"<{len(shown)} ids>"
        return f"document(q_ids={text}{'' if self.kv_ids is self.q_ids else ', kv_ids=...'})"

    def _id_span(self, ids: Tensor, i0: int, i1: int) -> tuple[Tensor, Tensor] | None:
        """Smallest and largest id in positions ``[i0, i1)`` per batch row (ids sorted)."""
        i0, i1 = max(i0, 0), min(i1, ids.shape[1])
        if i0 >= i1:
            return None
        return ids[:, i0], ids[:, i1 - 1]

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        if not self._sorted:
            return -UNBOUNDED, UNBOUNDED
        span = self._id_span(self._q_cpu, block.q0, block.q1)
        if span is None:
            return 0, 0
        lo_id, hi_id = span
        kv = self._kv_cpu.expand(lo_id.shape[0], -1) if self._kv_cpu.shape[0] == 1 else self._kv_cpu
        lo_id, hi_id = lo_id.expand(kv.shape[0]), hi_id.expand(kv.shape[0])
        lo = torch.searchsorted(kv, lo_id.unsqueeze(-1).contiguous(), right=False)
        hi = torch.searchsorted(kv, hi_id.unsqueeze(-1).contiguous(), right=True)
        return int(lo.min()), int(hi.max())

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        if not self._sorted:
            return super().block_state(extent, block)
        qs, ks = self._id_span(self._q_cpu, block.q0, block.q1), self._id_span(self._kv_cpu, block.k0, block.k1)
        if qs is None or ks is None:
            return BlockState.EMPTY
        (qlo, qhi), (klo, khi) = qs, ks
        if bool(((qhi < klo) | (khi < qlo)).all()):
            return BlockState.EMPTY
        if bool(((qlo == qhi) & (klo == khi) & (qlo == klo)).all()):
            return BlockState.FULL
        return BlockState.PARTIAL

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        q, kv = self._q_cpu, self._kv_cpu
        rows = max(q.shape[0], kv.shape[0])
        empty = torch.stack(
            [~torch.isin(q[0 if q.shape[0] == 1 else r], kv[0 if kv.shape[0] == 1 else r]) for r in range(rows)]
        )
        return empty.view(rows, 1, -1).to(device)


def _check_ids(name: str, ids: object) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"document: {name} must be an integer tensor, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"document: {name} must be an integer tensor, got dtype {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"document: {name} must have shape (L,) or (B, L), got {tuple(ids.shape)}")
    return ids.reshape(1, -1) if ids.dim() == 1 else ids


def document_causal(q_ids: Tensor, kv_ids: Tensor | None = None) -> DocumentCausal:
    """Causal within each document, aligned bottom-right *per document* (packed varlen training
    and decoding): in a document with ``m`` queries and ``n`` keys, its query ``i`` (counted from
    the document's first query) sees its keys ``0 .. i + n - m``. A document is a contiguous run of
    equal ids. ``document(ids) & causal()`` instead aligns to the whole attention, which differs
    as soon as documents have different query and key counts::

        q_ids [0 0 1]   kv_ids [0 0 0 1 1]     document_causal     document & causal()
                                               ██···               ███··   <- aligned to Lk - Lq = 2
                                               ███··               ███··
                                               ···██               ···██
    """
    mask = document(q_ids, kv_ids)
    return DocumentCausal(mask.q_ids, mask.kv_ids)


class DocumentCausal(Document):
    """:func:`document_causal`. Position-in-document tables are computed on the ids' device."""

    def _runs(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Per position: its index in its run of equal ids, and the run's length; ``(B|1, L)``."""
        L = ids.shape[1]
        idx = torch.arange(L, device=ids.device).expand_as(ids)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
        ends = torch.ones_like(ids, dtype=torch.bool)
        ends[:, :-1] = ids[:, 1:] != ids[:, :-1]
        last = torch.where(ends, idx, torch.full_like(idx, L - 1)).flip(1).cummin(dim=1).values.flip(1)
        return idx - first, last - first + 1

    def _tables(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self._cached("_tables_cache", lambda: (*self._runs(self.q_ids), *self._runs(self.kv_ids)))

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        same = super()._mod(b, h, q, kv, q_len, kv_len)
        q_pos, q_count, kv_pos, kv_count = (t.to(q.device) for t in self._tables())
        qb = b * 0 if q_pos.shape[0] == 1 else b
        kb = b * 0 if kv_pos.shape[0] == 1 else b
        # Key j of the same run is visible iff its place <= the query's place + (keys - queries).
        return same & (kv_pos[kb, kv] <= q_pos[qb, q] + kv_count[kb, kv] - q_count[qb, q])

    def _describe(self) -> str:
        return "document_causal" + super()._describe()[len("document") :]

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        documents = super().block_state(extent, block)
        if documents is BlockState.EMPTY:
            return BlockState.EMPTY  # other documents: skipped without looking at the positions
        if self._same_ids():
            # Queries and keys share their runs (m = n in every document), so each document's
            # bottom-right diagonal is the whole attention's top-left one: this mask is
            # document(ids) & causal("top_left"), answered from the block's corners in O(1),
            # not from a rows x keys block (a ring's blocks are a shard wide).
            if block.k0 > block.q1 - 1:
                return BlockState.EMPTY  # every key after every query
            if documents is BlockState.FULL and block.k1 - 1 <= block.q0:
                return BlockState.FULL
            return BlockState.PARTIAL
        return Mask.block_state(self, extent, block)

    def _same_ids(self) -> bool:
        """Whether the query and key ids are the same tensor values (self-attention over one packing)."""

        def same() -> bool:
            q, kv = self._q_cpu, self._kv_cpu
            return q.shape == kv.shape and bool(torch.equal(q, kv))

        return self._cached("_same_ids_cache", same)

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        if torch.compiler.is_compiling():
            return Mask._empty_rows(self, extent, device)
        # O(L) from the tables, on the host: query ``p`` of a run of ``m`` sees a key iff some run
        # of keys with its id is at least ``m - p`` long (the key at place 0 of a run of ``n`` is
        # visible iff ``0 <= p + n - m``).
        q, kv = self._q_cpu, self._kv_cpu
        q_pos, q_count = self._runs(q)
        kv_count = self._runs(kv)[1]
        rows = max(q.shape[0], kv.shape[0])
        empty = []
        for r in range(rows):
            qi, ki = q[0 if q.shape[0] == 1 else r], kv[0 if kv.shape[0] == 1 else r]
            ids, where = torch.unique(ki, return_inverse=True)
            longest = torch.zeros(len(ids), dtype=kv_count.dtype).scatter_reduce(
                0, where, kv_count[0 if kv.shape[0] == 1 else r], "amax"
            )
            at = torch.searchsorted(ids, qi).clamp(max=max(len(ids) - 1, 0))
            n = torch.where(ids[at] == qi, longest[at], 0) if len(ids) else torch.zeros_like(qi)
            p, m = q_pos[0 if q.shape[0] == 1 else r], q_count[0 if q.shape[0] == 1 else r]
            empty.append(n < (m - p).clamp(min=1))
        return torch.stack(empty).view(rows, 1, -1).to(device)
