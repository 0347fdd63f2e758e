"""``token_selected_attention``: attention over each query's own list of keys (the top-k indexer's
choice), a chunk of queries at a time against the keys its queries chose together.

Run as a ``block_select`` of one-key blocks, each query token gets a copy of its ``top_k`` keys
and values (``top_k · D`` per token and KV head: many times the plain layer's time, measured in
docs/variants.md "The top-k indexer's cost"). Here the queries are cut into chunks of
:data:`QUERY_CHUNK` tokens; a chunk reads the union ``U`` of its queries' choices once, with a
boolean mask saying which query chose which key::

    chunk c: queries [c0, c1)          U = the keys any of them chose (sorted), within [0, r)
    keys    k[:, :, :r]  (a view)      when U is dense in [0, r): no copy at all
            k[:, :, U]   (a copy)      when U is sparse (|U| < GATHER_BELOW · r: local choices, decoding)
    mask    (B, 1, C, |U| or r)        True where query i chose the key

so the chunk is one fused kernel call of :func:`multihead.attention` (its backward, dtypes, GQA
and fully masked rows as every call), exact: a key no query of the row chose is masked out, a key
chosen is read once. Choices spread over the whole past (an untrained indexer) make ``U`` the
whole causal range, and the cost that of dense attention with a mask; choices that cluster make
it follow ``|U|``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from multihead.attention import attention

__all__ = ["token_selected_attention", "QUERY_CHUNK", "GATHER_BELOW"]

#: Query tokens per chunk: the kernel's matmuls want a few hundred rows; a larger chunk widens
#: the union of choices (measured: docs/variants.md "The top-k indexer's cost").
QUERY_CHUNK = 512

#: Copy the chosen keys when they are fewer than this share of the causal range; otherwise read
#: the range as a view and mask the keys nobody chose (a copy costs about as much as the kernel
#: reading a key).
GATHER_BELOW = 0.5


def token_selected_attention(q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, **options: Any) -> Tensor:
    """Attention of each query over exactly the keys it chose.

    Args:
        q: ``(B, Hq, Lq, D)``, query ``i`` at position ``Lk - Lq + i`` (bottom-right causal).
        k, v: ``(B, Hkv, Lk, D)``, ``(B, Hkv, Lk, Dv)``.
        chosen: ``(B, 1, Lq, n)`` int64, the key positions each query reads (every head the
            same), ``-1`` for none; each at most the query's position (the caller's choice is causal).
        **options: passed to :func:`multihead.attention` for each chunk (``dropout_p``,
            ``sinks``, ``backend``); not a mask or a position-dependent ``score_mod``.

    Returns:
        ``(B, Hq, Lq, Dv)``; a query that chose nothing gives zeros (the core's fully masked rule).
    """
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    if chosen.dim() != 4 or chosen.shape[0] != B or chosen.shape[1] != 1 or chosen.shape[2] != Lq:
        raise ValueError(f"token_selected_attention: chosen must be (B={B}, 1, Lq={Lq}, n), got {tuple(chosen.shape)}")
    outs = []
    for c0 in range(0, Lq, QUERY_CHUNK):
        c1 = min(Lq, c0 + QUERY_CHUNK)
        r = Lk - Lq + c1  # keys up to the chunk's last query: no choice lies beyond
        idx = chosen[:, :, c0:c1]  # (B, 1, C, n)
        valid = idx >= 0
        present = torch.zeros(r + 1, dtype=torch.bool, device=q.device)
        present[torch.where(valid, idx, r)] = True  # a scatter: no sort of the chunk's choices
        count = int(present[:r].sum())
        if count == 0:  # no query of the chunk chose a key: the fully masked rule, zeros
            outs.append(q.new_zeros(*q.shape[:2], c1 - c0, v.shape[-1]))
            continue
        if count < GATHER_BELOW * r:
            keys = present[:r].nonzero().squeeze(1)  # (|U|,) sorted
            kc, vc = k.index_select(2, keys), v.index_select(2, keys)  # (B, Hkv, |U|, D)
            column = torch.searchsorted(keys, idx.clamp(min=0))
            width = count
        else:
            kc, vc = k[:, :, :r], v[:, :, :r]  # a view: the chunk's causal range
            column, width = idx.clamp(min=0), r
        # one extra column takes the -1s, then is cut off
        column = torch.where(valid, column, width)
        mask = torch.zeros(*idx.shape[:3], width + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(-1, column, True)
        outs.append(attention(q[:, :, c0:c1], kc, vc, mask=mask[..., :width], **options))
    return torch.cat(outs, dim=2)  # (B, Hq, Lq, Dv)
