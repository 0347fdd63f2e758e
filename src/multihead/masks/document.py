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

from multihead.masks.base import UNBOUNDED, BlockState, Mask

__all__ = ["document", "Document"]


def document(q_ids: Tensor, kv_ids: Tensor | None = None) -> "Document":
    """Query ``i`` may see key ``j`` iff ``q_ids[b, i] == kv_ids[b, j]``.

    ``q_ids``: integer tensor ``(Lq,)`` or ``(B, Lq)``; ``kv_ids`` likewise with ``Lk``
    (defaults to ``q_ids``, self-attention). Sorted ids (packed documents) let backends skip
    whole blocks without looking at the ids element by element.
    """
    q_ids = _check_ids("q_ids", q_ids)
    kv_ids = q_ids if kv_ids is None else _check_ids("kv_ids", kv_ids)
    if q_ids.shape[0] != kv_ids.shape[0] and 1 not in (q_ids.shape[0], kv_ids.shape[0]):
        raise ValueError(f"document: q_ids has {q_ids.shape[0]} batch rows and kv_ids {kv_ids.shape[0]}; "
                         "expected equal counts or one of them 1")
    return Document(q_ids, kv_ids)


class Document(Mask):
    kind = "document"

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
        return self._cached("_sorted_cache", lambda: bool((self._q_cpu.diff(dim=-1) >= 0).all())
                            and bool((self._kv_cpu.diff(dim=-1) >= 0).all()))

    def check(self, batch, heads, q_len, kv_len):
        for name, ids, length, what in (("q_ids", self.q_ids, q_len, "Lq"), ("kv_ids", self.kv_ids, kv_len, "Lk")):
            if ids.shape[0] not in (1, batch):
                raise ValueError(f"document: {name} has {ids.shape[0]} batch rows but B={batch}")
            if ids.shape[1] != length:
                raise ValueError(f"document: {name} has length {ids.shape[1]} but {what}={length}")

    def _mod(self, b, h, q, kv, q_len, kv_len):
        qi, ki = self.q_ids.to(q.device), self.kv_ids.to(kv.device)
        q_doc = qi[b * 0 if qi.shape[0] == 1 else b, q]
        kv_doc = ki[b * 0 if ki.shape[0] == 1 else b, kv]
        return q_doc == kv_doc

    def _describe(self):
        shown = self._q_cpu[0].tolist()
        text = str(shown) if len(shown) <= 16 else f"<{len(shown)} ids>"
        return f"document(q_ids={text}{'' if self.kv_ids is self.q_ids else ', kv_ids=...'})"

    def to_string(self, q_len=None, kv_len=None, b=0, h=0):
        q_len = self._q_cpu.shape[1] if q_len is None else q_len
        kv_len = self._kv_cpu.shape[1] if kv_len is None else kv_len
        return super().to_string(q_len, kv_len, b, h)

    def _id_span(self, ids: Tensor, i0: int, i1: int):
        """Smallest and largest id in positions ``[i0, i1)`` per batch row (ids sorted)."""
        i0, i1 = max(i0, 0), min(i1, ids.shape[1])
        if i0 >= i1:
            return None
        return ids[:, i0], ids[:, i1 - 1]

    def _key_range(self, q0, q1, q_len, kv_len):
        if not self._sorted:
            return -UNBOUNDED, UNBOUNDED
        span = self._id_span(self._q_cpu, q0, q1)
        if span is None:
            return 0, 0
        lo_id, hi_id = span
        kv = self._kv_cpu.expand(lo_id.shape[0], -1) if self._kv_cpu.shape[0] == 1 else self._kv_cpu
        lo_id, hi_id = lo_id.expand(kv.shape[0]), hi_id.expand(kv.shape[0])
        lo = torch.searchsorted(kv, lo_id.unsqueeze(-1).contiguous(), right=False)
        hi = torch.searchsorted(kv, hi_id.unsqueeze(-1).contiguous(), right=True)
        return int(lo.min()), int(hi.max())

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        if not self._sorted:
            return super().block_state(q0, q1, k0, k1, q_len, kv_len, batch, heads)
        qs, ks = self._id_span(self._q_cpu, q0, q1), self._id_span(self._kv_cpu, k0, k1)
        if qs is None or ks is None:
            return BlockState.EMPTY
        (qlo, qhi), (klo, khi) = qs, ks
        if bool(((qhi < klo) | (khi < qlo)).all()):
            return BlockState.EMPTY
        if bool(((qlo == qhi) & (klo == khi) & (qlo == klo)).all()):
            return BlockState.FULL
        return BlockState.PARTIAL

    def _empty_rows(self, batch, heads, q_len, kv_len, device=None):
        q, kv = self._q_cpu, self._kv_cpu
        rows = max(q.shape[0], kv.shape[0])
        empty = torch.stack([
            ~torch.isin(q[0 if q.shape[0] == 1 else r], kv[0 if kv.shape[0] == 1 else r]) for r in range(rows)
        ])
        return empty.view(rows, 1, -1).to(device)


def _check_ids(name: str, ids) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"document: {name} must be an integer tensor, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"document: {name} must be an integer tensor, got dtype {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"document: {name} must have shape (L,) or (B, L), got {tuple(ids.shape)}")
    return ids.reshape(1, -1) if ids.dim() == 1 else ids
