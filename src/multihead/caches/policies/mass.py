"""``attention_mass``: how much attention each key receives from a range of query rows, summed
over those rows, recomputed a block of rows at a time.

SnapKV ranks the prompt's keys by the attention its last queries (the observation window) give
them; H2O by the attention every query has given them so far. Both need column sums of the
softmax weights, not the weights themselves, so each block of rows is scored
(:func:`multihead.scoring.score_block`), normalised by its own log-sum-exp and summed over its rows
before the next block: memory stays at one ``rows x S`` block per head, as in
:mod:`multihead.blockwise`, whatever the prompt's length::

    mass[b, h, j] = sum over rows i in [r0, r1) of  exp(S[b, h, i, j] - lse[b, h, i])
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Block
from multihead.blockwise import safe_logsumexp
from multihead.conventions import default_scale
from multihead.masks import Mask, as_mask
from multihead.scoring import score_block

__all__ = ["attention_mass"]

# Elements of one block of scores (rows x S x heads x batch) computed at a time: as blockwise.py.
_BLOCK_ELEMENTS = 1 << 23


def attention_mass(
    q: Tensor,
    k: Tensor,
    mask: Mask | Tensor | None,
    r0: int,
    r1: int,
    scale: float | None = None,
) -> Tensor:
    """The attention mass each key receives from query rows ``[r0, r1)``: ``(B, Hq, S)``.

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, S, D)`` (grouped query heads, :mod:`multihead.conventions`),
    ``mask`` the read's mask over ``(Lq, S)`` (a mask object, or a bool tensor broadcastable to
    ``(B, Hq, Lq, S)``), ``scale`` default ``1/sqrt(D)``. Float32 (float64 for float64 inputs);
    a row that sees no key adds nothing.
    """
    B, Hq, Lq, D = q.shape
    S = k.shape[2]
    scale = default_scale(D) if scale is None else scale
    block_mask = as_mask(mask) if isinstance(mask, Tensor) else mask
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    total = torch.zeros(B, Hq, S, dtype=dtype, device=q.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, B * Hq * S))
    with torch.no_grad():  # a ranking, not part of any graph
        for q0 in range(r0, r1, step):
            q1 = min(q0 + step, r1)
            scores, _ = score_block(q, k, block_mask, None, scale, Block(q0, q1, 0, S), dtype=dtype)  # (B, Hq, rows, S)
            lse = safe_logsumexp(scores).unsqueeze(-1)  # (B, Hq, rows, 1)
            seen = torch.isfinite(lse)
            weights = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse)))
            total += torch.where(seen, weights, torch.zeros_like(weights)).sum(dim=2)
    return total
