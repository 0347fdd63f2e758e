"""Attention a block of queries at a time in plain PyTorch, for what the fused CPU kernel cannot
do: dropout, and elementwise score modifiers (softcap, a user's ``score_mod``). Used by the
``blocksparse`` backend.

PyTorch's CPU flash kernel takes only an additive mask and has no dropout; SDPA with dropout
falls back to its math kernel with a dense ``Lq x Lk`` mask. Here each query block attends to
the key range its mask lets it see (``mask.key_range``: the window of a band, the prefix of a
causal row, the document of a packed sequence)::

    S = score_mod(scale · Q_b K_rᵀ) , -inf where blocked     (multihead.scoring.score_block)
    lse = logsumexp(S)               P = exp(S - lse)        (the probabilities, before dropout)
    O_b = dropout(P) V_r             keep ~ Bernoulli(1 - p) (torch's dropout, the global generator)

Each block runs under activation checkpointing: nothing of the block is kept for the backward,
which recomputes it (with the same random draw: the generator state is saved and restored), so
memory stays at one block whatever ``L`` is and a fixed seed gives the same result twice. The
backward is autograd's, so tensors a modifier reads, even through a closure, get their gradient.
Cost follows the visible area of the mask. Fully masked rows give output 0 and LSE ``-inf``
(their probabilities are 0, never NaN).

A band's interior blocks (``run``, :mod:`multihead.backends.band_runs`; no score modifier) all
see the same relative window, so they are folded into the batch of the same ops and run together
(:func:`band_chunks` of at most ``RUN_CHUNK_SCORES`` scores, each checkpointed as a block is):
each op is one OpenMP parallel region, and a few dozen per block made dropout with a window lose to
SDPA's dense math kernel when other processes share the cores (docs/performance.md, "Dropout")::

    q rows (B, Hq, n*block, D) -> (n, B*Hq, block, D)      K, V windows (n, B*Hkv, span, D)
    S = scale · Q Kᵀ + window mask (block, span)           one draw for the n blocks
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from multihead.backends.band_runs import BandRun, fold_rows, fold_windows, unfold_rows, window_mask
from multihead.blocks import Block, Extent
from multihead.blockwise import safe_logsumexp, zero_anchor
from multihead.conventions import lse_dtype, softmax_dtype
from multihead.scoring import score_block, unseen_keys

__all__ = ["attention_by_blocks", "band_chunks", "RUN_CHUNK_SCORES"]

#: The most scores (``B·Hq·block·span`` per folded block) one batched chunk of a band run holds:
#: 64 MiB of fp32 scores, so memory stays bounded whatever ``L`` is (docs/performance.md, "Dropout").
RUN_CHUNK_SCORES = 1 << 24


def attention_by_blocks(
    q: Tensor, k: Tensor, v: Tensor, mask, mods, scale: float, dropout_p: float, block: int, run: BandRun | None = None
) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hq, Lq, Dv)`` and LSE ``(B, Hq, Lq)``, one query block of ``block`` rows at a
    time, with any score modifier and dropout ``dropout_p`` on the probabilities; differentiable.
    ``run``: the interior of a band on the same block grid, run in batched chunks (no modifier)."""
    B, Hq, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    extent = Extent(B, Hq, Lq, Lk)
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (mods is not None and mods.requires_grad)
    )
    # A block that sees no key is 0 (LSE -inf) plus a zero carrying the graph of q, k, v and the
    # modifier's tensors, as the fused path's blocks are: with only k, v requiring grad, a call
    # where no block sees a key must still backpropagate (exact zeros), not be a constant.
    anchor: Tensor | None = None
    outs, lses = [], []
    if run is not None and (mods is not None or run.block != block):
        raise ValueError(f"a band run needs no score modifier and block={block}, got {run} with {mods}")
    for q0 in range(0, Lq, block):
        q1 = min(q0 + block, Lq)
        if run is not None and run.q0 <= q0 < run.q1:
            if q0 == run.q0:  # the whole run, in chunks, in row order
                for part in band_chunks(run, B, Hq):
                    chunk = (q, k, v, part, scale, dropout_p)
                    out, lse = (
                        checkpoint(_band, *chunk, use_reentrant=False, preserve_rng_state=True)
                        if grad
                        else _band(*chunk)
                    )
                    outs.append(out)
                    lses.append(lse)
            continue
        k0, k1 = (0, Lk) if mask is None else mask.key_range(extent, extent.rows(q0, q1))
        if k0 >= k1:  # the block sees no key: output 0, LSE -inf
            out = q.new_zeros((B, Hq, q1 - q0, Dv))
            lse = torch.full((B, Hq, q1 - q0), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
            if grad:
                if anchor is None:
                    anchor = zero_anchor(q, k, v, *(mods.tensors() if mods is not None else ()))
                out, lse = out + anchor.to(out.dtype), lse + anchor.to(lse.dtype)
            outs.append(out)
            lses.append(lse)
            continue
        args = (q, k, v, mask, mods, scale, dropout_p, Block(q0, q1, k0, k1))
        out, lse = checkpoint(_block, *args, use_reentrant=False, preserve_rng_state=True) if grad else _block(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block(
    q: Tensor, k: Tensor, v: Tensor, mask, mods, scale: float, dropout_p: float, block: Block
) -> tuple[Tensor, Tensor]:
    """The block's queries ``[q0, q1)`` against its keys ``[k0, k1)``: ``(B, Hq, rows, Dv)`` and the
    LSE ``(B, Hq, rows)``."""
    B, Hq, Lq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    q0, q1, k0, k1 = block
    rows, keys = block.rows, block.cols
    s, visible = score_block(q, k, mask, mods, scale, block)  # (B, Hq, rows, keys), softmax dtype
    lse = safe_logsumexp(s)  # (B, Hq, rows); -inf for a row that sees no key of the range
    # exp(-inf - (-inf)) would be NaN: rows that see no key get a finite LSE here, then probability 0.
    empty = torch.isneginf(lse).unsqueeze(-1)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse.unsqueeze(-1)), lse.unsqueeze(-1)))
    p = p.masked_fill(empty, 0.0)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)  # keep ~ Bernoulli(1 - p), kept ones scaled by 1 / (1 - p)
    vb = v[:, :, k0:k1].to(p.dtype)
    if visible is not None:  # a key no row of the block sees may hold anything: its 0 weight times NaN is NaN
        unseen = unseen_keys(visible, Hkv)  # (B|1, Hkv|1, keys, 1)
        vb = torch.where(unseen, torch.zeros((), dtype=vb.dtype, device=vb.device), vb)
    # Query head h = kv * G + g reads KV head kv: the G heads of a group fold into one matmul.
    out = _DenseGrad.apply(torch.matmul(p.reshape(B, Hkv, (Hq // Hkv) * rows, keys), vb)).view(B, Hq, rows, Dv)
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


def band_chunks(run: BandRun, batch: int, heads: int) -> list[BandRun]:
    """``run`` cut into consecutive runs of at most :data:`RUN_CHUNK_SCORES` scores each
    (``batch·heads·block·span`` per block; at least one block per chunk)."""
    per_chunk = max(1, RUN_CHUNK_SCORES // (batch * heads * run.block * run.span))
    step = per_chunk * run.block
    return [dataclasses.replace(run, q0=r, q1=min(r + step, run.q1)) for r in range(run.q0, run.q1, step)]


def _band(q: Tensor, k: Tensor, v: Tensor, run: BandRun, scale: float, dropout_p: float) -> tuple[Tensor, Tensor]:
    """The rows of ``run`` (interior: every row sees ``hi - lo + 1`` keys): ``(B, Hq, rows, Dv)`` and
    the LSE ``(B, Hq, rows)``, the blocks folded into the batch of each op (module docstring)."""
    B, Hq, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G, n, rows, span, dtype = Hq // Hkv, run.blocks, run.block, run.span, softmax_dtype(q.dtype)
    # Folded query head b*Hq + kv*G + g reads KV head b*Hkv + kv: its G heads fold into the rows.
    qf = (fold_rows(q, run).to(dtype) * scale).reshape(n * B * Hkv, G * rows, D)  # scaled: fewer elements than S
    kf = fold_windows(k, run).to(dtype).reshape(n * B * Hkv, span, D)  # the overlapping windows, copied
    vf = fold_windows(v, run).to(dtype).reshape(n * B * Hkv, span, Dv)
    mask = window_mask(run, dtype, q.device).view(1, rows, span).repeat(1, G, 1)  # 0 or -inf, each head's rows
    s = torch.baddbmm(mask, qf, kf.transpose(1, 2))  # (n*B*Hkv, G*rows, span): scale·Q Kᵀ + mask in one op
    lse = torch.logsumexp(s, dim=-1)  # finite: every row sees keys
    p = torch.exp(s - lse.unsqueeze(-1))
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)  # one draw for the whole chunk
    out = _DenseGrad.apply(torch.bmm(p, vf)).view(n, B * Hq, rows, Dv)
    lse = lse.view(n, B * Hq, rows)
    return unfold_rows(out, B, Hq).to(q.dtype), unfold_rows(lse, B, Hq).to(lse_dtype(q.dtype))


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient. ``loss = out.sum()`` makes the
    gradient of ``out`` an expanded scalar (stride 0), and CPU ``bmm`` on such an operand leaves
    the BLAS path: the backward's products ran many times slower than on a dense gradient
    (measured: docs/performance.md#dropout)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()
