"""Decoding from keys and values held in another form than one dense tensor: pages of a pool, int8
or fp8 with scales, a ring. :class:`KVBlocks` hands the decode path its slots a piece at a time,
each piece dense in the compute dtype, small enough to stay in cache; :func:`decode_blocks` attends
over every piece and joins them by their log-sum-exp (:func:`multihead.merge_partials`)::

    slots [lo, hi) a query may see            the mask's key range (decode._visible_keys)
    for (where, k, v) in blocks.pieces(lo, hi, size):      k (B, Hkv, n, D), v (B, Hkv, n, Dv)
        out_i, lse_i = one chunk of the decode path     (decode._attend: folded query heads)
    out = merge_partials(outs, lses)                    (B, Hq, Lq, Dv)

A piece's keys are slots ``where ..`` in order, or carry their slot numbers (``where`` a tensor: a
run of pages that lie in a different order in the pool than in the block table), so the mask
follows each key. So a paged cache is read through its block table in pool order (runs of pages
as views, short runs copied into a buffer that stays in cache, never the whole cache:
:mod:`multihead.caches.paged_blocks`), and a quantized cache is dequantized a piece at a time
(never a dequantized copy of the whole cache). Where multihead's CPU decode kernel runs
(:mod:`multihead.backends.cpu_kernels`), a cache gives its partials itself
(:meth:`KVBlocks.partials`): pages read through the block table, int8 slots with their scales, in
one call, no piece made; without the kernel, int8 slots go through integer GEMMs
(:mod:`multihead.backends.decode_int8`). A cache returns such an object in
``CacheRead.blocks``; a layer reads it through :func:`decode_blocks` when the call is a plain decode
step (:func:`multihead.layers.attend.reads_blocks` says when), and through the dense ``keys`` and
``values`` (:meth:`KVBlocks.dense`, built once on demand) otherwise.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch
from torch import Tensor

from multihead.backends.decode import MAX_QUERIES, _attend, _visible_keys
from multihead.blocks import Extent
from multihead.conventions import default_scale, fold_query_heads, group_query_heads, softmax_dtype, unfold_query_heads
from multihead.masks import Mask, as_mask
from multihead.merge import merge_partials

__all__ = ["KVBlocks", "decode_blocks", "PIECE_BYTES"]

#: Bytes of K and V per piece made by a copy (gathered pages, dequantized slots): a piece is written
#: and read back at once, so it should stay in cache, yet each piece costs a handful of ops, each a
#: parallel region that waits for every thread on a loaded machine; views (pages in one run) are
#: not cut at all (measured: docs/inference.md, "Decoding through every cache").
PIECE_BYTES = 8 << 20


class KVBlocks(abc.ABC):
    """Keys ``(B, Hkv, S, D)`` and values ``(B, Hkv, S, Dv)`` of a cache read, handed out in pieces.

    Slot ``j`` is the cache read's slot ``j`` (its ``key_positions``, if any, still apply, through
    the mask over the slots). Subclasses say how a piece is made (:meth:`pieces`) and how the whole
    read is made dense for the paths that need it (:meth:`dense`)."""

    #: ``(B, Hkv, S, D, Dv)``
    shape: tuple[int, int, int, int, int]
    #: the dtype of the pieces (the cache's compute dtype)
    dtype: torch.dtype
    device: torch.device

    @abc.abstractmethod
    def pieces(self, lo: int, hi: int, size: int) -> Iterator[tuple[int | Tensor, Tensor, Tensor]]:
        """``(where, k (B, Hkv, n, D), v (B, Hkv, n, Dv))`` covering each slot of ``[lo, hi)`` once.
        ``where``: an ``int``, the piece holds the slots ``where .. where + n`` in order, within
        ``[lo, hi)`` and at most ``size`` of them (made by a copy) or any number (a view); or a
        host ``int64`` tensor ``(n,)``, the slot of each key, in any order (attention over a set of
        keys does not depend on their order): slots outside ``[lo, hi)`` may appear only where they
        hold no token and finite values (they are masked). A piece may be a buffer that the next
        piece overwrites: use it before asking for the next."""

    @abc.abstractmethod
    def dense(self) -> tuple[Tensor, Tensor]:
        """Every slot as ``(keys (B, Hkv, S, D), values (B, Hkv, S, Dv))``: what the slow paths read."""

    def partials(
        self, qg: Tensor, lo: int, hi: int, blocked: Tensor | None, scale: float, G: int, Lq: int
    ) -> list[tuple[Tensor, Tensor]] | None:
        """The partial attentions ``(out (B, Hkv, G·Lq, Dv), lse (B, Hkv, G·Lq))`` over slots
        ``[lo, hi)``, fp32 for fp16/bf16 (as :func:`decode_blocks` makes them from :meth:`pieces`),
        for a cache that attends over its own storage without making dense pieces (int8 slots
        multiplied as they are); ``None``: read :meth:`pieces`. ``qg (B, Hkv, G·Lq, D)``: the folded
        query rows (times ``scale`` unless ``scale != 1``); ``blocked``: as ``decode._attend`` takes it."""
        return None

    def describe(self, rows: int) -> str | None:
        """What the CPU decode kernel does with these slots for ``rows`` query rows per KV head, where it
        differs from a dense call of the compute dtype (``explain()`` adds it), or ``None``."""
        return None

    def piece_size(self) -> int:
        """Slots per piece: :data:`PIECE_BYTES` of K and V, at least 64 slots."""
        B, Hkv, S, D, Dv = self.shape
        per_slot = B * Hkv * (D + Dv) * torch.empty((), dtype=self.dtype).element_size()
        return max(64, PIECE_BYTES // per_slot)


def decode_blocks(q: Tensor, blocks: KVBlocks, mask: Mask | Tensor | None = None, scale: float | None = None) -> Tensor:
    """Attention of ``q (B, Hq, Lq, D)`` over the slots of ``blocks``, a piece at a time: ``(B, Hq, Lq, Dv)``.

    ``mask``: ``None``, a mask object or a bool tensor ``(B|1, Hq|1, Lq, S)`` over the slots (``True``
    = visible), as :meth:`multihead.caches.CacheRead.mask` returns. Softmax in fp32 for fp16/bf16,
    matmuls in the input dtype, fully masked rows give 0 (:mod:`multihead.conventions`). No autograd,
    score modifiers, dropout or weights: :func:`multihead.layers.attend.reads_blocks` sends such calls
    to :func:`multihead.attention` over :meth:`KVBlocks.dense`.
    """
    B, Hkv, S, D, Dv = blocks.shape
    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D or q.shape[1] % Hkv:
        raise ValueError(
            f"decode_blocks: q must be (B, Hq, Lq, D) = ({B}, a multiple of {Hkv}, Lq, {D}) for these "
            f"blocks, got {tuple(q.shape)}"
        )
    if q.dtype != blocks.dtype:
        raise TypeError(f"decode_blocks: q has dtype {q.dtype} but the blocks hold {blocks.dtype}")
    Hq, Lq = q.shape[1], q.shape[2]
    if Lq > MAX_QUERIES:
        raise ValueError(f"decode_blocks: Lq={Lq} > {MAX_QUERIES} query tokens; a prefill reads blocks.dense()")
    mask = as_mask(mask)  # a bool tensor over the slots: a TensorMask, evaluated on these rows only
    scale = default_scale(D) if scale is None else scale
    lo, hi, visible, _ = _visible_keys(mask, Extent(B, Hq, Lq, S), q.device)
    acc = softmax_dtype(q.dtype)
    half = acc != q.dtype
    G = Hq // Hkv
    qg = fold_query_heads(q, Hkv, Hq)  # (B, Hkv, G·Lq, D)
    if not half:
        qg, scale = qg * scale, 1.0
    if hi <= lo:  # no row sees any key
        return q.new_zeros(B, Hq, Lq, Dv)
    blocked = None if visible is None else group_query_heads(~visible, Hkv)  # (B|1, Hkv|1, G|1, Lq, n)
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    with torch.no_grad():
        own = blocks.partials(qg, lo, hi, blocked, scale, G, Lq)
        for where, k, v in blocks.pieces(lo, hi, blocks.piece_size()) if own is None else ():
            n = k.shape[2]
            if isinstance(where, int):  # slots where .. where + n
                bc = None if blocked is None else blocked[..., where - lo : where - lo + n]
            else:
                bc = _blocked_at(blocked, where, lo, hi, q.device)
            # a view whose heads lie apart (a run of pages in a head-major pool): oneDNN's batched
            # half GEMM copied such an operand whole first, so its GEMMs run one head at a time
            # (MKL's fp32 batched GEMM reads it as it lies)
            apart = half and Hkv > 1 and (k.stride(1) != n * k.stride(2) or v.stride(1) != n * v.stride(2))
            out, maybe = _attend(qg, k, v, bc, scale, acc, G, Lq, half, True, _per_head if apart else torch.matmul)
            assert maybe is not None  # (asked for)
            lse = maybe
            outs.append(out)
            lses.append(lse)
        if own is not None:
            outs, lses = [out for out, _ in own], [lse for _, lse in own]
        out = outs[0] if len(outs) == 1 else merge_partials(outs, lses)[0]
    return unfold_query_heads(out.to(q.dtype), Hq)  # (B, Hq, Lq, Dv)


def _blocked_at(blocked: Tensor | None, slots: Tensor, lo: int, hi: int, device: torch.device) -> Tensor | None:
    """The row mask ``(B|1, Hkv|1, G|1, Lq, n)`` of a piece whose keys are the slots ``slots`` (``(n,)``,
    any order, on the host): ``blocked``'s columns at those slots, and blocked outside ``[lo, hi)``."""
    outside = (slots < lo) | (slots >= hi)
    if blocked is None:
        return outside.view(1, 1, 1, 1, -1).to(device) if bool(outside.any()) else None
    cols = torch.where(outside, 0, slots - lo).to(device)
    return blocked.index_select(-1, cols) | outside.to(device)


def _per_head(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``(B, H, m, k) @ (B, H, k, n)``, one 2-D GEMM per batch row and head into
    ``out[i, h]`` (``torch.mm``: a 3-D ``matmul`` per head went through the batched path, each call
    dearer: docs/inference.md#decoding-through-every-cache)."""
    out = torch.empty(a.shape[0], a.shape[1], a.shape[2], b.shape[3], dtype=a.dtype, device=a.device)
    for a_i, b_i, out_i in zip(a.unbind(0), b.unbind(0), out.unbind(0)):  # one op per operand, not B·H
        for a_h, b_h, out_h in zip(a_i.unbind(0), b_i.unbind(0), out_i.unbind(0)):
            torch.mm(a_h, b_h, out=out_h)
    return out
