"""Block-selection attention key-major: for selections made per query token (NSA, MoBA, a top-k
indexer), each selected key block is read once for the queries that chose it.

:mod:`multihead.backends.block_gather` copies each query block's selected key blocks: with one
query per block that is ``k · bs`` keys copied per token, more memory traffic than dense attention
computes. Here the (unit, query block, key block) pairs are sorted by key block, and the queries
that chose one block are gathered into tiles of about :data:`TILE_ROWS` rows against that block::

    pairs (b, e, n, j)  sorted by (b, e, j)        e: a unit of Gp query heads (block_gather)
    tile  = up to T query blocks that chose block j of unit (b, e)     T = TILE_ROWS / (Gp · qbs)
    Q rows (tiles, 1, T·Gp·qbs, D)  gathered     K, V block (tiles, 1, bs, D)  gathered once per tile

Each tile gives a partial output and LSE per row; a row's partials (one per block it chose) are
joined by log-sum-exp, online over chunks of tiles (a reference, sum and weighted output per
row, as :func:`multihead.merge_partials` computes them at once; the reference is the row's first
LSE, moved to a new maximum only when a partial exceeds it by more than ``RESCALE_ABOVE``).
Tiles whose every row sees every key of the block run with no mask; the others (the causal
diagonal, a short last block, another mask) with one evaluated at their positions. The backward
is the flash kernel's per tile, given the merged output and LSE of its rows
(:mod:`multihead.backends.flash_pieces`), gradients summed back with ``index_add``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.backends.block_gather import (
    Selection,
    _backward_inputs,
    _input_gradients,
    _Layout,
    _layout,
    _pad_rows,
    _save_for_backward,
    _whole_blocks,
)
from multihead.backends.flash_pieces import flash, flash_backward
from multihead.conventions import lse_dtype, softmax_dtype

__all__ = ["key_major_attention", "TILE_ROWS"]

#: Query rows per tile: enough for the kernel's matmuls and to read each key block few times, few enough
#: that a block chosen by few queries wastes little (measured: docs/variants.md#measured-cost).
TILE_ROWS = 256

#: Most scores per chunk of tiles (as block_gather.CHUNK_SCORES).
CHUNK_SCORES = 1 << 22

#: How far a partial's LSE may exceed its row's reference before the row's sums are rescaled
#: to it (the forward's join of partials; the exponent of a weight, far below fp32's 88).
RESCALE_ABOVE = 40.0


def key_major_attention(q: Tensor, k: Tensor, v: Tensor, selection: Selection, scale: float) -> tuple[Tensor, Tensor]:
    """As :func:`multihead.backends.block_gather.gathered_attention` (one head size ``E``)."""
    out, lse = _KeyMajor.apply(q, k, v, selection, scale)
    return out, lse


@dataclass
class _Tiles:
    """One kind of tile (masked or not): for each tile its key block row in the ``(B·Hkv·nK, bs·E)``
    view of K and V, its query rows in the ``(B·Hq·Lqp, E)`` view of q, and their positions."""

    block_rows: Tensor  # (T,) rows of the blocked K/V view
    key0: Tensor  # (T,) the block's first key position
    rows: Tensor  # (T, R) rows of the flat q view (0 where unused)
    used: Tensor  # (T, R) bool
    qpos: Tensor  # (T, R) query positions
    heads: Tensor  # (T, R) query heads
    batch: Tensor  # (T,)
    masked: bool


def _tiles(lay: _Layout, selection: Selection, Lqp: int, Hkv: int, device) -> list[_Tiles]:
    """The tiles of the call: pairs (unit, query block, key block) sorted by key block, cut into
    tiles of ``T`` query blocks, separately for blocks seen whole and the others."""
    He, Gp, qbs, bs, nQ = lay.He, lay.Gp, lay.qbs, lay.bs, lay.nQ
    nK = -(-lay.Lk // bs)
    idx = lay.idx  # (B, He, nQ, ksel)
    rest = selection.rest
    d = None if rest is None else rest.causal_offset(lay.Lq, lay.Lk)
    n = torch.arange(nQ, device=device).view(1, 1, nQ, 1)
    first_row, last_row = n * qbs, torch.clamp((n + 1) * qbs, max=lay.Lq) - 1
    valid = idx >= 0
    whole = valid & ((idx + 1) * bs <= lay.Lk)
    if rest is not None and d is None:
        whole = torch.zeros_like(valid)  # another mask: evaluated at every score
    elif d is not None:
        whole &= (idx + 1) * bs - 1 <= first_row + d
        valid &= idx * bs <= last_row + d
    out = []
    for keep, masked in ((whole, False), (valid & ~whole, True)):
        T = max(1, TILE_ROWS // (Gp * qbs))
        b, e, nq, slot = keep.nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        j = idx[b, e, nq, slot]
        group = (b * He + e) * nK + j
        group, order = torch.sort(group, stable=True)
        b, e, nq, j = b[order], e[order], nq[order], j[order]
        _, counts = torch.unique_consecutive(group, return_counts=True)
        T = min(T, int(counts.max()))  # no tile longer than the most any block is chosen (the diagonal: qbs)
        tiles_per = (counts + T - 1) // T
        starts = torch.cumsum(counts, 0) - counts  # first pair of each group
        tile_start = torch.cumsum(tiles_per, 0) - tiles_per  # first tile of each group
        gid = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
        rank = torch.arange(group.numel(), device=device) - starts[gid]
        tile = tile_start[gid] + rank // T  # (P,)
        nT = int(tiles_per.sum())
        slots = torch.full((nT, T), -1, dtype=torch.long, device=device)
        slots[tile, rank % T] = nq
        first = torch.zeros(nT, dtype=torch.long, device=device)
        first[tile] = torch.arange(group.numel(), device=device)  # any pair of the tile names its block
        tb, te, tj = b[first], e[first], j[first]
        # rows of a tile: slot s, head g of the unit, token t of the query block
        gp = torch.arange(Gp, device=device).view(1, 1, Gp, 1)
        tt = torch.arange(qbs, device=device).view(1, 1, 1, qbs)
        qpos = (slots.clamp(min=0) * qbs).view(nT, T, 1, 1) + tt  # (nT, T, 1, qbs)
        heads = (te * Gp).view(nT, 1, 1, 1) + gp  # (nT, 1, Gp, 1)
        rows = ((tb.view(nT, 1, 1, 1) * lay.Hq + heads) * Lqp + qpos).reshape(nT, -1)
        used = ((slots >= 0).view(nT, T, 1, 1) & (qpos < lay.Lq)).expand(nT, T, Gp, qbs).reshape(nT, -1)
        out.append(
            _Tiles(
                block_rows=(tb * Hkv + lay.kv[te]) * nK + tj,
                key0=tj * bs,
                rows=rows.masked_fill(~used, 0),
                used=used,
                qpos=qpos.expand(nT, T, Gp, qbs).reshape(nT, -1),
                heads=heads.expand(nT, T, Gp, qbs).reshape(nT, -1),
                batch=tb,
                masked=masked,
            )
        )
    return out


def _mask(tiles: _Tiles, t0: int, t1: int, lay: _Layout, selection: Selection, bs: int, dtype: torch.dtype):
    """The additive mask ``(n, 1, R, bs)`` of tiles ``[t0, t1)`` (``None`` for tiles seen whole),
    the rows that see no key ``(n, 1, R)`` and the keys no row sees ``(n, 1, bs, 1)`` (``None``:
    none; they may hold NaN beyond a length, and the kernel computes ``0 · NaN = NaN``)."""
    used = tiles.used[t0:t1]
    if not tiles.masked:
        return None, ~used.unsqueeze(1), None
    kpos = tiles.key0[t0:t1, None, None] + torch.arange(bs, device=used.device)  # (n, 1, bs)
    visible = (kpos < lay.Lk) & used.unsqueeze(-1)  # (n, R, bs)
    if selection.rest is not None:
        qpos = tiles.qpos[t0:t1].unsqueeze(-1).clamp(max=lay.Lq - 1)
        b = tiles.batch[t0:t1].view(-1, 1, 1)
        visible &= selection.rest.mask_mod(
            b, tiles.heads[t0:t1].unsqueeze(-1), qpos, kpos.clamp(max=lay.Lk - 1), lay.Lq, lay.Lk
        )
    additive = torch.zeros(visible.shape, dtype=softmax_dtype(dtype), device=used.device)
    additive.masked_fill_(~visible, float("-inf"))
    unseen = ~visible.any(1).view(visible.shape[0], 1, bs, 1)
    return additive.unsqueeze(1), ~visible.any(-1).unsqueeze(1), unseen if bool(unseen.any()) else None


def _chunks(tiles: _Tiles, R: int, bs: int):
    per = max(1, CHUNK_SCORES // (R * bs))
    n = tiles.rows.shape[0]
    return [(t0, min(n, t0 + per)) for t0 in range(0, n, per)]


class _KeyMajor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, selection, scale):
        lay = _layout(q, k, selection)
        Lqp = lay.nQ * lay.qbs
        B, Hq, E, Ev = lay.B, lay.Hq, q.shape[-1], v.shape[-1]
        Hkv, bs = k.shape[1], lay.bs
        qf = _pad_rows(q, Lqp).reshape(B * Hq * Lqp, E)
        kb, vb = (_whole_blocks(t, bs) for t in (k, v))
        kb, vb = kb.reshape(-1, bs * E), vb.reshape(-1, bs * Ev)
        acc = lse_dtype(q.dtype)
        rows_total = B * Hq * Lqp
        peak = torch.full((rows_total,), float("-inf"), dtype=acc, device=q.device)
        total = torch.zeros(rows_total, dtype=acc, device=q.device)
        out = torch.zeros(rows_total, Ev, dtype=acc, device=q.device)
        for tiles in _tiles(lay, selection, Lqp, Hkv, q.device):
            R = tiles.rows.shape[1]
            for t0, t1 in _chunks(tiles, R, bs):
                n = t1 - t0
                qt = qf.index_select(0, tiles.rows[t0:t1].reshape(-1)).view(n, 1, R, E)
                kt = kb.index_select(0, tiles.block_rows[t0:t1]).view(n, 1, bs, E)
                vt = vb.index_select(0, tiles.block_rows[t0:t1]).view(n, 1, bs, Ev)
                additive, empty, unseen = _mask(tiles, t0, t1, lay, selection, bs, q.dtype)
                if unseen is not None:
                    kt, vt = kt.masked_fill(unseen, 0.0), vt.masked_fill(unseen, 0.0)
                o, l = flash(qt, kt, vt, 0.0, False, attn_mask=additive, scale=scale)
                l = l.masked_fill(empty, float("-inf")).reshape(-1).to(acc)
                o = o.reshape(-1, Ev).to(acc)
                rid = tiles.rows[t0:t1].reshape(-1)
                # a row's sums are kept relative to a reference, its first partial's LSE: later
                # partials add exp(l - reference) (no pass over what the row holds) while none
                # exceeds it by more than RESCALE_ABOVE (exp(40) ~ 2e17: far from fp32's range)
                first = torch.isneginf(peak[rid]) & torch.isfinite(l)
                if bool(first.any()):
                    peak.scatter_reduce_(0, rid[first], l[first], reduce="amax")
                here = peak[rid]
                ahead = torch.where(torch.isfinite(l), l - here, 0.0)
                if not bool((ahead > RESCALE_ABOVE).any()):
                    w = torch.exp(l - here.where(torch.isfinite(here), 0.0)).where(torch.isfinite(l), 0.0)
                    total.index_add_(0, rid, w)
                    out.index_add_(0, rid, w[:, None] * o)
                    continue
                # online log-sum-exp join of the rows this chunk touches (only those: a pass over
                # every row per chunk would grow as L²): rescale what they hold to the new peak, add
                touched = torch.unique(rid)
                before = peak[touched]
                peak.scatter_reduce_(0, rid, l, reduce="amax")
                after = peak[touched]
                finite = torch.isfinite(after)
                rescale = torch.where(finite, torch.exp(before - after.where(finite, 0.0)), 0.0)
                total[touched] = total[touched] * rescale
                out[touched] = out[touched] * rescale[:, None]
                here = peak[rid]
                w = torch.exp(l - here.where(torch.isfinite(here), 0.0)).where(torch.isfinite(l), 0.0)
                total.index_add_(0, rid, w)
                out.index_add_(0, rid, w[:, None] * o)
        seen = total > 0
        out = torch.where(seen[:, None], out / total.where(seen, 1.0)[:, None], 0.0)
        lse = torch.where(seen, peak + torch.log(total.where(seen, 1.0)), float("-inf"))
        out = out.view(B, Hq, Lqp, Ev)[:, :, : lay.Lq].to(q.dtype)
        lse = lse.view(B, Hq, Lqp)[:, :, : lay.Lq]
        _save_for_backward(ctx, q, k, v, out, lse, selection, scale)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        bw = _backward_inputs(ctx, grad_out, grad_lse)
        lay, dev = bw.lay, bw.q.device
        B, Hq, E, Ev = lay.B, lay.Hq, bw.q.shape[-1], bw.v.shape[-1]
        Hkv, bs = bw.k.shape[1], lay.bs
        Lqp = lay.nQ * lay.qbs
        qf, of, gf = (t.reshape(B * Hq * Lqp, -1) for t in (bw.q, bw.out, bw.grad))
        lf = bw.lse.reshape(-1)
        kb, vb = bw.k.reshape(-1, bs * E), bw.v.reshape(-1, bs * Ev)
        dq = torch.zeros(qf.shape, dtype=bw.acc, device=dev)
        dk = torch.zeros(kb.shape, dtype=bw.acc, device=dev)
        dv = torch.zeros(vb.shape, dtype=bw.acc, device=dev)
        for tiles in _tiles(lay, ctx.selection, Lqp, Hkv, dev):
            R = tiles.rows.shape[1]
            for t0, t1 in _chunks(tiles, R, bs):
                n = t1 - t0
                rid = tiles.rows[t0:t1].reshape(-1)
                qt, ot, gt = (t.index_select(0, rid).view(n, 1, R, -1) for t in (qf, of, gf))
                lt = lf[rid].view(n, 1, R)
                kt = kb.index_select(0, tiles.block_rows[t0:t1]).view(n, 1, bs, E)
                vt = vb.index_select(0, tiles.block_rows[t0:t1]).view(n, 1, bs, Ev)
                additive, empty, unseen = _mask(tiles, t0, t1, lay, ctx.selection, bs, bw.q.dtype)
                if unseen is not None:
                    kt, vt = kt.masked_fill(unseen, 0.0), vt.masked_fill(unseen, 0.0)
                lt = lt.masked_fill(empty, float("inf"))  # unused rows and rows that see no key: P = 0
                gq, gk, gv = flash_backward(gt, qt, kt, vt, ot, lt, 0.0, False, attn_mask=additive, scale=ctx.scale)
                dq.index_add_(0, rid, gq.reshape(-1, E).to(bw.acc))
                dk.index_add_(0, tiles.block_rows[t0:t1], gk.reshape(n, -1).to(bw.acc))
                dv.index_add_(0, tiles.block_rows[t0:t1], gv.reshape(n, -1).to(bw.acc))
        return _input_gradients(bw, dq.view(B, Hq, Lqp, E), dk.view(bw.k.shape), dv.view(bw.v.shape))
