"""Log-sum-exp and attention weights recomputed from ``q``, ``k``, the mask and the score
modifier, a block of query rows at a time.

When a kernel returns no log-sum-exp, or a caller wants the weights, these recompute them a
block of query rows at a time, so memory stays at one ``rows x Lk`` block per head instead of
the full ``Lq x Lk`` square; LSE and weights come from the same block of scores (one pass):

.. math::  \\mathrm{lse}_i = \\log \\sum_{j \\text{ visible}} e^{S_{ij}}
           \\qquad P_{ij} = e^{S_{ij} - \\mathrm{lse}_i}

with ``S`` the scaled, modified scores (:func:`multihead.scoring.score_block`). Fully masked
rows give ``lse = -inf`` and a weights row of 0 (never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from multihead.blocks import Block
from multihead.masks import Mask
from multihead.scores import ScoreMod
from multihead.scoring import score_block

__all__ = ["lse_by_blocks", "weights_by_blocks", "zero_anchor"]

# Elements of one score block (rows x Lk x heads x batch) computed at a time.
_BLOCK_ELEMENTS = 1 << 23


def _row_step(q: Tensor, k: Tensor, heads: int) -> int:
    return max(1, _BLOCK_ELEMENTS // max(1, q.shape[0] * heads * k.shape[2]))


def lse_by_blocks(q: Tensor, k: Tensor, mask: Mask | None, score_mod: ScoreMod | None, scale: float) -> Tensor:
    """Log-sum-exp of the scores: ``(B, Hq, Lq)``, ``-inf`` on fully masked rows."""
    Lq, Lk = q.shape[2], k.shape[2]
    step = _row_step(q, k, q.shape[1])
    # Under autograd (an LSE that is differentiated: sinks, a merge) each block is checkpointed:
    # its scores are recomputed in the backward instead of kept, so memory stays at one block.
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or (score_mod is not None and score_mod.requires_grad)
    )
    parts = []
    for q0 in range(0, Lq, step):
        args = (q, k, mask, score_mod, scale, Block(q0, min(q0 + step, Lq), 0, Lk))
        parts.append(checkpoint(_block_lse, *args, use_reentrant=False) if grad else _block_lse(*args))
    return torch.cat(parts, dim=-1)


def _block_lse(
    q: Tensor, k: Tensor, mask: Mask | None, score_mod: ScoreMod | None, scale: float, block: Block
) -> Tensor:
    scores, _ = score_block(q, k, mask, score_mod, scale, block)
    return safe_logsumexp(scores)


def weights_by_blocks(
    q: Tensor,
    k: Tensor,
    mask: Mask | None,
    score_mod: ScoreMod | None,
    scale: float,
    lse: Tensor | None,
    heads: Tensor | None = None,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention probabilities ``exp(S - lse)`` for the requested query heads and rows.

    Returns ``(weights, lse)``: weights ``(B, len(heads), len(rows), Lk)`` (all heads / rows by
    default), holding no more than that slice plus one block of scores, and the LSE of those
    heads and rows. ``lse`` is the kernel's ``(B, Hq, Lq)``; ``None`` computes it from the same
    blocks of scores as the weights (one pass, no second ``Q Kᵀ``).
    """
    Lq = q.shape[2]
    n_heads = q.shape[1] if heads is None else len(heads)
    row_ids = torch.arange(Lq, device=q.device) if rows is None else rows
    step = _row_step(q, k, n_heads)
    # Written into preallocated results: a list plus torch.cat would hold the slice twice.
    weights: Tensor | None = None
    lses: Tensor | None = None
    done = 0
    chunks: list[tuple[int, int, Tensor | None]]
    if rows is None:  # every row, in ranges: no value read back from a tensor (compiles in one graph)
        chunks = [(q0, min(q0 + step, Lq), None) for q0 in range(0, Lq, step)]
    else:
        pieces = [row_ids[start : start + step] for start in range(0, len(row_ids), step)]
        # Scattered rows (e.g. [0, 8000]) would make a chunk's row span, and its scores, large:
        # such chunks are taken one row at a time, so memory stays at the slice plus one block.
        chunks = [
            (int(c.min()), int(c.max()) + 1, c)
            for chunk in pieces
            for c in ((chunk,) if int(chunk.max()) - int(chunk.min()) < 2 * len(chunk) + 64 else chunk.split(1))
        ]
    for q0, q1, chunk in chunks:
        scores, _ = score_block(q, k, mask, score_mod, scale, Block(q0, q1, 0, k.shape[2]), heads=heads)
        n = q1 - q0 if chunk is None else len(chunk)
        picked = slice(q0, q1) if chunk is None else chunk
        if chunk is not None:
            scores = scores[:, :, chunk - q0]
        if lse is None:
            block_lse = safe_logsumexp(scores).unsqueeze(-1)
        else:
            block_lse = (lse if heads is None else lse[:, heads])[:, :, picked].unsqueeze(-1).to(scores.dtype)
        # exp(-inf - (-inf)) would be NaN: fully masked rows are set to 0 explicitly.
        empty = torch.isneginf(block_lse)
        probs = torch.exp(scores - torch.where(empty, torch.zeros_like(block_lse), block_lse))
        probs = torch.where(empty, torch.zeros_like(probs), probs)
        if weights is None or lses is None:
            weights = probs.new_empty(probs.shape[0], probs.shape[1], len(row_ids), probs.shape[3])
            lses = block_lse.new_empty(probs.shape[0], probs.shape[1], len(row_ids))
        weights[:, :, done : done + n] = probs
        lses[:, :, done : done + n] = block_lse.squeeze(-1)
        done += n
    assert weights is not None and lses is not None  # Lq >= 1 (empty calls return earlier): one chunk at least
    return weights, lses


def safe_logsumexp(scores: Tensor) -> Tensor:
    """``logsumexp`` over the last dim: ``-inf`` for an all ``-inf`` row, with a zero (never
    NaN) gradient there."""
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    finite_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    total = torch.exp(scores - finite_max).sum(dim=-1)
    # A fully masked row sums to 0; log(0)'s gradient (inf * 0) would be NaN, so it is taken of 1
    # and the row set to -inf afterwards (masked_fill passes no gradient to it).
    empty = torch.isneginf(row_max).squeeze(-1)
    total = torch.where(empty, torch.ones_like(total), total)
    return (torch.log(total) + finite_max.squeeze(-1)).masked_fill(empty, float("-inf"))


def zero_anchor(*tensors: Tensor) -> Tensor:
    """A scalar ``0`` that carries the graph of ``tensors`` (each gets an exact zero gradient),
    finite whatever they hold. Added to results that no key contributes to (rows that see no key,
    an empty call), so that such a result is connected to every input, as a computed one is: with
    only ``k`` and ``v`` requiring grad, ``backward()`` then works and gives zeros instead of
    failing on a result with no graph. Non-finite entries are replaced before the sum: a key no
    row may see can hold anything (NaN beyond a length), and ``0 * NaN`` would be NaN."""
    total: Tensor | None = None
    for t in tensors:
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        part = torch.where(torch.isfinite(t), t, zero).sum() * 0
        total = part if total is None else total + part.to(total.dtype)
    assert total is not None  # at least one tensor
    return total
