"""Block-selection attention by gathering: each (batch, KV head, query block) reads only the key
blocks its :func:`~multihead.masks.block_select` row names; cost follows the selected blocks.

``blocksparse``'s plan is one for every batch row and head: it can skip a key block only when no
row and no head selects it, so a selection that differs per row (MoBA, NSA) costs dense. Here a
selection mask ``block_select(idx, bs, ...) & rest`` runs as a few fused-kernel calls over
*gathered* keys: the query blocks are folded into the batch, and each gets a copy of its selected
key blocks (``k`` of them, ``k·bs`` keys)::

    q  (B, Hq, Lq, D)  -> (B·He·nQ, Gp, qbs, D)        He units of Gp query heads sharing one
                                                         row of idx and one KV head
    K  (B, Hkv, Lk, D) -> (B·He·nQ, 1, k·bs, D)        K[b, kv(e), idx[b, e, n, :]·bs + t]
    mask (B·He·nQ, Gp|1, qbs, k·bs)                     the selection's unused slots (-1), keys
                                                         past Lk, and ``rest`` (e.g. causal())
                                                         evaluated at the gathered positions

A unit is the query heads that share a row of ``idx`` and a KV head: a KV group (``Gp = Hq/Hkv``)
when the rows are per KV group or one for all heads, else one query head (``Gp = 1``). The output
and LSE of each row are those of the whole attention (the row sees no key outside its gathered
blocks), so the backward is the flash kernel's given that output and LSE
(:mod:`multihead.backends.flash_pieces`), the keys' gradients summed back to their positions
(``index_add``; a block gathered by many query blocks gets each one's share). Work is done in
chunks of query blocks of at most :data:`CHUNK_SCORES` scores, so memory stays bounded.

A block named twice in a row counts once (the duplicate is dropped before the gather, as the
mask's meaning says). Rows that see no key get output 0 and LSE ``-inf``; keys no row of a unit
sees are zeroed in the gathered copy (they may hold NaN beyond a length: ``0 · NaN = NaN``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.backends.flash_pieces import flash, flash_backward, padded
from multihead.conventions import lse_dtype, softmax_dtype
from multihead.masks import And, BlockSelect, Mask
from multihead.merge import merge_partials

__all__ = ["Selection", "selection_of", "gathered_attention", "CHUNK_SCORES"]

#: The most scores (``B·Hq·qbs·k·bs`` per chunk of query blocks) one chunk of kernel calls holds:
#: 16 MiB of fp32 scores, with the gathered keys and values of the same order.
CHUNK_SCORES = 1 << 22


@dataclass(frozen=True)
class Selection:
    """A call's mask read as ``select & rest`` (``rest`` ``None`` when the selection is alone)."""

    select: BlockSelect
    rest: Mask | None

    def units(self, Hq: int, Hkv: int) -> tuple[int, int, Tensor, Tensor]:
        """``(He, Gp, row, kv)``: ``He`` units of ``Gp`` query heads; ``row (He,)`` the row of
        ``idx`` of each unit, ``kv (He,)`` its KV head. Unit ``e``'s heads are ``e·Gp .. e·Gp+Gp-1``."""
        Hs = self.select.indices.shape[1]
        G = Hq // Hkv
        if Hs == 1 or (Hs < Hq and Hkv % Hs == 0):  # every head of a KV group reads one row
            units = torch.arange(Hkv)
            return Hkv, G, units // (Hkv // Hs), units
        heads = torch.arange(Hq)  # one query head per unit
        return Hq, 1, heads // (Hq // Hs), heads // G

    def density(self, Lq: int, Lk: int) -> tuple[float, int]:
        """The mean number of distinct key blocks a query block reads, and the key blocks of ``Lk``."""
        sel = self.select
        nQ = math.ceil(Lq / sel.query_block_size)
        table = sel._host_table()[:, :, :nQ]
        return float(table.sum()) / max(1, table.shape[0] * table.shape[1] * table.shape[2]), math.ceil(
            Lk / sel.block_size
        )


def selection_of(mask: Mask | None) -> Selection | None:
    """The call's mask as ``block_select(...) & rest``, or ``None`` when it holds no selection (or
    more than one, or under ``|``/``~``)."""
    if mask is None:
        return None
    parts = mask.parts if isinstance(mask, And) else (mask,)
    found = [p for p in parts if isinstance(p, BlockSelect)]
    if len(found) != 1:
        return None
    rest = [p for p in parts if p is not found[0]]
    return Selection(found[0], None if not rest else rest[0] if len(rest) == 1 else And(*rest))


def gathered_attention(q: Tensor, k: Tensor, v: Tensor, selection: Selection, scale: float) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hq, Lq, E)`` and LSE ``(B, Hq, Lq)`` of ``q (B, Hq, Lq, E)``, ``k``, ``v (B, Hkv,
    Lk, E)`` (one head size ``E``: the caller pads) under the selection's mask; differentiable in
    ``q, k, v``."""
    out, lse = _GatheredAttention.apply(q, k, v, selection, scale)
    return out, lse


# ----------------------------------------------------------------------------------- the plan
@dataclass
class _Layout:
    """The gather of one call: the units, the table of key blocks per unit and query block."""

    B: int
    Hq: int
    Lq: int
    Lk: int
    He: int
    Gp: int
    qbs: int
    bs: int
    nQ: int
    kv: Tensor  # (He,) the KV head of each unit
    idx: Tensor  # (B, He, nQ, ksel) key blocks, -1 for none, no duplicate in a row
    chunk: int  # query blocks per chunk


def _layout(q: Tensor, k: Tensor, selection: Selection) -> _Layout:
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    sel = selection.select
    He, Gp, row, kv = selection.units(Hq, Hkv)
    qbs, bs = sel.query_block_size, sel.block_size
    nQ = math.ceil(Lq / qbs)
    idx = sel.indices[:, row.to(sel.indices.device), :nQ].to(q.device)  # (B|1, He, nQ, ksel)
    idx = idx.expand(B, -1, -1, -1)
    # A block named twice counts once: sorted, a repeat of its left neighbour becomes -1.
    idx, _ = idx.sort(dim=-1, descending=True)
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = idx.masked_fill(repeat, -1)
    ksel = idx.shape[-1]
    chunk = max(1, CHUNK_SCORES // max(1, B * Hq * qbs * ksel * bs))
    return _Layout(B, Hq, Lq, Lk, He, Gp, qbs, bs, nQ, kv.to(q.device), idx, chunk)


@dataclass
class _Piece:
    """One kernel call of a chunk: ``n`` gathered key blocks per unit and query block."""

    blocks: Tensor  # (B, He, nc, n) key-block numbers (0 where unused)
    additive: Tensor | None  # (N, 1, 1|qbs, n·bs) in the softmax dtype; None: every key visible
    empty: Tensor | None  # (N, 1, 1|qbs) rows that see no key of the piece; None: none
    unseen: Tensor | None  # (N, 1, n·bs, 1) keys no row of the unit sees; None: none
    causal: bool = False  # the kernel's own is_causal (square, top-left), with no mask


def _pieces(lay: _Layout, selection: Selection, q: Tensor, n0: int, n1: int, dtype: torch.dtype) -> list[_Piece]:
    """The kernel calls of query blocks ``[n0, n1)``. With no other mask or a causal diagonal, the
    gathered blocks are sorted by their state against the query block: FULL ones in one call with
    a mask of one row (the unused slots), PARTIAL ones (the diagonal) in a second with a mask of
    every row; both merged by their LSE. Another mask is evaluated at every gathered score."""
    idx = lay.idx[:, :, n0:n1]  # (B, He, nc, ksel)
    rest = selection.rest
    d = None if rest is None else rest.causal_offset(lay.Lq, lay.Lk)
    if rest is not None and d is None:
        return [_piece(lay, selection, q, idx, idx >= 0, n0, dtype, rest)]
    dev = q.device
    bs, qbs = lay.bs, lay.qbs
    n = torch.arange(n0, n1, device=dev).view(1, 1, -1, 1)
    first_row, last_row = n * qbs, torch.clamp((n + 1) * qbs, max=lay.Lq) - 1
    valid = idx >= 0
    first_key, end_key = idx * bs, (idx + 1) * bs
    full = valid & (end_key <= lay.Lk)  # a whole block (the last may be short)
    if d is not None:
        full &= end_key - 1 <= first_row + d  # every row sees every key of the block
        valid &= first_key <= last_row + d  # some row sees some key of it
    pieces = [_full_piece(lay, idx, full, dtype)]
    partial = valid & ~full
    if bool(partial.any()):
        diagonal = _diagonal_piece(lay, idx, partial, n, d, dtype) if d is not None else None
        pieces.append(diagonal or _piece(lay, selection, q, idx, partial, n0, dtype, rest))
    return pieces


def _packed(idx: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """The slots ``keep`` of ``idx (B, He, nc, ksel)`` packed to the left, ``n`` = the most any
    row keeps: block numbers (0 where unused) and which are kept, both ``(B, He, nc, n)``."""
    count = int(keep.sum(-1).max()) if keep.numel() else 0
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., : max(count, 1)]
    return idx.gather(-1, order).clamp(min=0), keep.gather(-1, order)


def _full_piece(lay: _Layout, idx: Tensor, full: Tensor, dtype: torch.dtype) -> _Piece:
    """The blocks every row of the query block sees whole: a mask of one row, for unused slots."""
    blocks, kept = _packed(idx, full)
    N = kept.shape[0] * kept.shape[1] * kept.shape[2]
    kept = kept.reshape(N, -1)
    if bool(kept.all()):
        return _Piece(blocks, None, None, None)
    keys = kept.repeat_interleave(lay.bs, dim=-1)  # (N, n·bs)
    additive = torch.zeros(keys.shape, dtype=softmax_dtype(dtype), device=keys.device).masked_fill_(
        ~keys, float("-inf")
    )
    empty = ~kept.any(-1)
    return _Piece(
        blocks,
        additive.view(N, 1, 1, -1),
        empty.view(N, 1, 1) if bool(empty.any()) else None,
        (~keys).view(N, 1, -1, 1),
    )


def _diagonal_piece(lay: _Layout, idx: Tensor, partial: Tensor, n: Tensor, d: int, dtype: torch.dtype) -> _Piece | None:
    """The causal diagonal as one block per unit and query block, when it sits at the same place
    relative to the query block everywhere (blocks of queries and keys on one grid): one shared
    triangle, ``is_causal`` itself when it is the kernel's. ``None`` when it is not so."""
    bs, qbs = lay.bs, lay.qbs
    if bool((partial.sum(-1) > 1).any()):
        return None
    block = torch.where(partial, idx, -1).amax(-1)  # (B, He, nc): -1 where the query block has none
    has = block >= 0
    shift = d - (block * bs - n[..., 0] * qbs)  # key t of the block is visible to row r iff t <= r + shift
    if not bool((shift[has] == shift[has][0]).all()) or bool(((block + 1) * bs > lay.Lk)[has].any()):
        return None
    shift0 = int(shift[has][0])
    N = has.numel()
    missing = ~has.reshape(N, 1, 1)
    r = torch.arange(qbs, device=idx.device).view(qbs, 1)
    t = torch.arange(bs, device=idx.device).view(1, bs)
    visible = t <= r + shift0  # (qbs, bs)
    no_key = ~visible.any(-1).view(1, 1, qbs)
    empty = missing | no_key
    causal = shift0 == 0 and qbs == bs
    additive = None
    if not causal:
        additive = torch.zeros((1, 1, qbs, bs), dtype=softmax_dtype(dtype), device=idx.device)
        additive.masked_fill_(~visible.view(1, 1, qbs, bs), float("-inf"))
    return _Piece(
        block.clamp(min=0)[..., None],
        additive,
        empty if bool(empty.any()) else None,
        None,
        causal=causal,
    )


def _piece(lay, selection, q, idx, keep, n0, dtype, rest) -> _Piece:
    """The slots ``keep`` of ``idx (B, He, nc, ksel)``, packed, with ``rest`` and the key count
    evaluated at every score (the general case)."""
    B, He, nc = idx.shape[:3]
    N, bs, qbs, Gp = B * He * nc, lay.bs, lay.qbs, lay.Gp
    blocks, kept = _packed(idx, keep)  # (B, He, nc, n)
    kpos = (blocks[..., None] * bs + torch.arange(bs, device=q.device)).flatten(-2)  # (B, He, nc, kb)
    qpos = torch.arange(n0 * qbs, (n0 + nc) * qbs, device=q.device).view(1, 1, nc, 1, qbs, 1)
    visible = (kept.repeat_interleave(bs, dim=-1) & (kpos < lay.Lk)).view(B, He, nc, 1, 1, -1)
    if rest is not None:
        b = torch.arange(B, device=q.device).view(B, 1, 1, 1, 1, 1)
        h = (torch.arange(He, device=q.device)[:, None] * Gp + torch.arange(Gp, device=q.device)).view(
            1, He, 1, Gp, 1, 1
        )
        # padded rows (past Lq) are read at the last query: a mask's tables end at Lq
        at = qpos.clamp(max=lay.Lq - 1)
        visible = visible & rest.mask_mod(
            b, h, at, kpos.view(B, He, nc, 1, 1, -1).clamp(max=lay.Lk - 1), lay.Lq, lay.Lk
        )
    heads, rows = visible.shape[3], visible.shape[4]
    visible = visible.expand(B, He, nc, heads, rows, -1).reshape(N, heads, rows, -1)
    seen = visible.any(-1)
    empty = None if bool(seen.all()) else ~seen
    unseen = ~visible.any(-2).any(1).view(N, 1, -1, 1)
    additive = None
    if not bool(visible.all()):
        additive = torch.zeros(visible.shape, dtype=softmax_dtype(dtype), device=q.device)
        additive.masked_fill_(~visible, float("-inf"))
    return _Piece(blocks, additive, empty, unseen if bool(unseen.any()) else None)


def _gather(t: Tensor, lay: _Layout, piece: _Piece, buffer: Tensor) -> Tensor:
    """The key blocks of ``t (B, Hkv, nK·bs, E)`` (padded to whole blocks) a piece names, of each
    unit's KV head: ``(B·He·nc, 1, n·bs, E)``, keys no row sees zeroed; written into ``buffer``
    (1-D, reused by every chunk: a fresh allocation of this size pays its page faults again, which
    cost more than the copy; measured: docs/variants.md#block-selection-cost)."""
    B, Hkv, E = t.shape[0], t.shape[1], t.shape[-1]
    nK = t.shape[2] // lay.bs
    flat = _flat_blocks(lay, piece.blocks, Hkv, nK).reshape(-1)
    g = buffer[: flat.numel() * lay.bs * E].view(flat.numel(), lay.bs * E)
    torch.index_select(t.reshape(B * Hkv * nK, lay.bs * E), 0, flat, out=g)
    g = g.view(B * lay.He * piece.blocks.shape[2], 1, -1, E)
    return g if piece.unseen is None else g.masked_fill_(piece.unseen, 0.0)


def _buffers(lay: _Layout, t: Tensor) -> Tensor:
    """One gather buffer for ``t``'s blocks: a chunk's every slot."""
    return t.new_empty(lay.B * lay.He * lay.chunk * lay.idx.shape[-1] * lay.bs * t.shape[-1])


def _flat_blocks(lay: _Layout, blocks: Tensor, Hkv: int, nK: int) -> Tensor:
    """``blocks (B, He, nc, n)`` as rows of the ``(B·Hkv·nK, bs·E)`` view of a padded K or V."""
    B = blocks.shape[0]
    unit = torch.arange(B, device=blocks.device).view(B, 1, 1, 1) * Hkv + lay.kv.view(1, -1, 1, 1)
    return unit * nK + blocks


def _whole_blocks(t: Tensor, bs: int) -> Tensor:
    """``t (B, H, L, E)`` with zero rows up to a multiple of ``bs``."""
    extra = -t.shape[2] % bs
    return t if extra == 0 else torch.cat([t, t.new_zeros(t.shape[:2] + (extra, t.shape[3]))], dim=2)


def _rows(t: Tensor, lay: _Layout, n0: int, n1: int) -> Tensor:
    """Query rows ``t (B, Hq, nQ·qbs, ...)`` of blocks ``[n0, n1)`` as ``(B·He·nc, Gp, qbs, ...)``."""
    B, He, Gp, qbs = lay.B, lay.He, lay.Gp, lay.qbs
    rest = t.shape[3:]
    x = t[:, :, n0 * qbs : n1 * qbs].reshape(B, He, Gp, n1 - n0, qbs, *rest)
    return x.transpose(2, 3).reshape(B * He * (n1 - n0), Gp, qbs, *rest)


def _unrows(x: Tensor, lay: _Layout, nc: int) -> Tensor:
    """The inverse of :func:`_rows`: ``(B·He·nc, Gp, qbs, ...)`` -> ``(B, Hq, nc·qbs, ...)``."""
    B, He, Gp, qbs = lay.B, lay.He, lay.Gp, lay.qbs
    rest = x.shape[3:]
    return x.reshape(B, He, nc, Gp, qbs, *rest).transpose(2, 3).reshape(B, He * Gp, nc * qbs, *rest)


def _pad_rows(t: Tensor, length: int, value: float = 0.0) -> Tensor:
    """``t (B, H, L, ...)`` with rows of ``value`` up to ``length`` (the last query block may be short)."""
    if t.shape[2] == length:
        return t
    pad = t.new_full(t.shape[:2] + (length - t.shape[2],) + t.shape[3:], value)
    return torch.cat([t, pad], dim=2)


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, selection, scale):
        lay = _layout(q, k, selection)
        L = lay.nQ * lay.qbs
        qp = _pad_rows(q, L)
        kp, vp = _whole_blocks(k, lay.bs), _whole_blocks(v, lay.bs)
        kbuf, vbuf = _buffers(lay, kp), _buffers(lay, vp)
        out = q.new_zeros((lay.B, lay.Hq, L, v.shape[-1]))
        lse = torch.full((lay.B, lay.Hq, L), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        for n0 in range(0, lay.nQ, lay.chunk):
            n1 = min(lay.nQ, n0 + lay.chunk)
            qg = _rows(qp, lay, n0, n1)
            N = qg.shape[0]
            parts = []
            for piece in _pieces(lay, selection, q, n0, n1, q.dtype):
                kg, vg = _gather(kp, lay, piece, kbuf), _gather(vp, lay, piece, vbuf)
                o, l = flash(
                    qg,
                    kg.expand(N, lay.Gp, -1, -1),
                    vg.expand(N, lay.Gp, -1, -1),
                    0.0,
                    piece.causal,
                    attn_mask=piece.additive,
                    scale=scale,
                )
                if piece.empty is not None:  # the kernel gives a row with no key LSE 0: it weighs nothing
                    l = l.masked_fill(piece.empty, float("-inf"))
                    o = o.masked_fill(piece.empty.unsqueeze(-1), 0.0)
                parts.append((o, l))
            if len(parts) == 1:
                o, l = parts[0]
            else:
                o, l = merge_partials([p[0] for p in parts], [p[1] for p in parts])
            out[:, :, n0 * lay.qbs : n1 * lay.qbs] = _unrows(o, lay, n1 - n0)
            lse[:, :, n0 * lay.qbs : n1 * lay.qbs] = _unrows(l, lay, n1 - n0)
        out, lse = out[:, :, : lay.Lq], lse[:, :, : lay.Lq]
        _save_for_backward(ctx, q, k, v, out, lse, selection, scale)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        bw = _backward_inputs(ctx, grad_out, grad_lse)
        lay, qp, kp, vp = bw.lay, bw.q, bw.k, bw.v
        dq = torch.zeros(qp.shape, dtype=bw.acc, device=qp.device)
        B, Hkv = kp.shape[0], kp.shape[1]
        nK = kp.shape[2] // lay.bs
        kbuf, vbuf = _buffers(lay, kp), _buffers(lay, vp)
        dk = torch.zeros((B * Hkv * nK, lay.bs * kp.shape[-1]), dtype=bw.acc, device=qp.device)
        dv = torch.zeros((B * Hkv * nK, lay.bs * vp.shape[-1]), dtype=bw.acc, device=qp.device)
        for n0 in range(0, lay.nQ, lay.chunk):
            n1 = min(lay.nQ, n0 + lay.chunk)
            go, qg, og = (_rows(t, lay, n0, n1) for t in (bw.grad, qp, bw.out))
            lg = _rows(bw.lse, lay, n0, n1)
            N = qg.shape[0]
            for piece in _pieces(lay, ctx.selection, qp, n0, n1, qp.dtype):
                kg, vg = _gather(kp, lay, piece, kbuf), _gather(vp, lay, piece, vbuf)
                kg, vg = kg.expand(N, lay.Gp, -1, -1), vg.expand(N, lay.Gp, -1, -1)
                # rows that see no key of the piece: P = 0 (a unit with no diagonal block reads one
                # under the shared triangle; its rows must weigh nothing)
                lpiece = lg if piece.empty is None else lg.masked_fill(piece.empty, float("inf"))
                gq, gk, gv = flash_backward(
                    go, qg, kg, vg, og, lpiece, 0.0, piece.causal, attn_mask=piece.additive, scale=ctx.scale
                )
                dq[:, :, n0 * lay.qbs : n1 * lay.qbs] += _unrows(gq, lay, n1 - n0)
                # Each gathered block's share, summed back to its place (unused slots and keys no
                # row sees have a zero gradient: their probabilities are 0).
                flat = _flat_blocks(lay, piece.blocks, Hkv, nK).reshape(-1)
                dk.index_add_(0, flat, gk.sum(1).reshape(flat.shape[0], -1).to(bw.acc))
                dv.index_add_(0, flat, gv.sum(1).reshape(flat.shape[0], -1).to(bw.acc))
        return _input_gradients(bw, dq, dk.view(kp.shape), dv.view(vp.shape))


# ------------------------------------------------------------------ the backward of a selection run
@dataclass
class _Backward:
    """What the backward of either selection run (this module's, :mod:`~multihead.backends.key_major`'s)
    reads, from the merged output and LSE the forward saved: ``q``, ``out``, ``grad`` ``(B, Hq,
    nQ·qbs, E)`` padded to whole query blocks (``E`` with the LSE-gradient column of
    :func:`~multihead.backends.flash_pieces.padded` when ``grad_lse`` was given), ``lse``
    ``(B, Hq, nQ·qbs)`` with fully masked and padding rows at ``+inf``, ``k``, ``v`` ``(B, Hkv,
    nK·bs, E)`` padded to whole key blocks."""

    lay: _Layout
    q: Tensor
    out: Tensor
    grad: Tensor
    lse: Tensor
    k: Tensor
    v: Tensor
    acc: torch.dtype  # the gradients' accumulation dtype
    saved: tuple[Tensor, Tensor, Tensor]  # q, k, v as the forward saved them: the gradients' shapes, dtypes
    lse_column: bool  # the column that carried grad_lse, dropped from the gradients


def _save_for_backward(ctx, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, selection, scale) -> None:
    """What :func:`_backward_inputs` reads: the inputs, the merged output and LSE, the selection and scale."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.selection, ctx.scale = selection, scale
    ctx.set_materialize_grads(False)  # an unused output reaches backward as None, not as zeros


def _backward_inputs(ctx, grad_out: Tensor | None, grad_lse: Tensor | None) -> _Backward:
    q, k, v, out, lse = ctx.saved_tensors
    lay = _layout(q, k, ctx.selection)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    # The LSE's gradient through one extra column (flash_pieces.padded), dropped by _input_gradients.
    qe, ke, ve, oe, ge = padded(q, k, v, out, grad_out, lse, grad_lse)
    L = lay.nQ * lay.qbs
    qp, op, gp = (_pad_rows(t.to(q.dtype), L) for t in (qe, oe, ge))
    # Fully masked rows (and the padding rows past Lq): LSE +inf makes every probability
    # exp(s - inf) = 0, so no NaN.
    lp = _pad_rows(lse.masked_fill(torch.isneginf(lse), float("inf")), L, float("inf"))
    kp, vp = _whole_blocks(ke, lay.bs), _whole_blocks(ve, lay.bs)
    return _Backward(lay, qp, op, gp, lp, kp, vp, lse_dtype(q.dtype), (q, k, v), grad_lse is not None)


def _input_gradients(bw: _Backward, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
    """``dq (B, Hq, nQ·qbs, E)``, ``dk``, ``dv`` ``(B, Hkv, nK·bs, E)`` -> the gradients of the
    forward's ``q, k, v, selection, scale``: padding rows and the LSE column dropped, in the inputs' dtypes."""
    q, k, v = bw.saved
    dq, dk, dv = dq[:, :, : bw.lay.Lq], dk[:, :, : k.shape[2]], dv[:, :, : v.shape[2]]
    if bw.lse_column:
        dq, dk, dv = dq[..., : q.shape[-1]], dk[..., : q.shape[-1]], dv[..., : v.shape[-1]]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
