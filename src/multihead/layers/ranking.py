"""``best_first``: the ``n`` best of each row of scores, ties to the lower index, as one ``topk``.

The sparse layers (MoBA, NSA, the top-k indexer) choose blocks or keys per query token: ``L``
rows of up to ``L`` scores. A stable descending sort gives the rule they document (best first,
equal scores to the lower index, ``-inf`` never chosen) but sorts every row whole; ``topk`` finds
the ``n`` best in one pass and does not say how it orders ties. Here ties cannot happen: each
fp32 score becomes an int64 key that orders as the score does, with the index inverted in the
low bits, so ``topk`` of the keys is exactly the stable sort's first ``n``::

    key = ordered_bits(score) · m + (m − 1 − index)          m = the row's length
    ordered_bits: the fp32 bits as int32, negative ones with the magnitude bits flipped

fp64 scores (the fp64 layers the tests compare with the papers' equations) keep every bit and
take the stable sort: a key of 64 bits has no room for the index.

Rows whose ``n + 1`` best fp32 scores are all different (most rows of real scores) have one
order only: those take a ``topk`` of the scores themselves, and only rows with a tie (or a NaN)
build the keys. fp32 scores on the CPU take multihead's kernel (:mod:`multihead.backends.cpu_topk`:
each row read once against the ``n`` best so far, the rule itself), rows with a NaN the keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.backends import cpu_topk

__all__ = ["best_first"]

_NONE = torch.iinfo(torch.int64).min  # the key of a score that is never chosen (-inf)


def best_first(scores: Tensor, n: int) -> Tensor:
    """``(..., min(n, m))`` int64: the indices of the ``n`` largest of ``scores (..., m)`` along
    the last dimension, best first, equal scores to the lower index; ``-1`` in place of a
    ``-inf`` (fewer than ``n`` to choose from). Not differentiated."""
    m = scores.shape[-1]
    n = min(n, m)
    with torch.no_grad():
        if scores.dtype == torch.float64:
            ranked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
            return torch.where(torch.isneginf(ranked[..., :n]), -1, order[..., :n])
        if cpu_topk.supports(scores, n):  # fp32 on the CPU: one pass per row in C (-0.0 equals 0.0 there)
            fast, nan = cpu_topk.best_first_rows(scores, n)
            if bool(nan.any()):
                fast[nan] = _keyed(scores[nan] + 0.0, n)
            return fast
        s = scores.float() + 0.0  # -0.0 -> 0.0: one key for equal scores
        if torch.compiler.is_compiling():  # the rows with a tie are a host decision: keys, no graph break
            return _keyed(s, n)
        # most rows of real scores hold no tie among their n + 1 best: there the fp32 topk's
        # order is the only one, and it runs faster than a topk of int64 keys (measured:
        # docs/variants.md "The top-k indexer's cost"); rows with a tie (or a NaN) take the keys
        vals, order = s.topk(min(n + 1, m), dim=-1)  # sorted, largest first
        tied = ((vals[..., 1:] == vals[..., :-1]) & ~torch.isneginf(vals[..., 1:])).any(-1) | vals.isnan().any(-1)
        fast = torch.where(torch.isneginf(vals[..., :n]), -1, order[..., :n])
        if bool(tied.any()):
            fast[tied] = _keyed(s[tied], n)
        return fast


def _keyed(s: Tensor, n: int) -> Tensor:
    """``best_first`` of fp32 rows ``s (R, m)`` through one ``topk`` of int64 keys (ties exact)."""
    m = s.shape[-1]
    with torch.no_grad():
        bits = s.view(torch.int32)
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # int order = float order
        inverted = (m - 1) - torch.arange(m, device=s.device)
        key = (ordered * m + inverted).masked_fill_(torch.isneginf(s), _NONE)
        top = key.topk(n, dim=-1).values  # sorted, largest first
        return torch.where(top == _NONE, -1, (m - 1) - torch.remainder(top, m))
