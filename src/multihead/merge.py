"""``merge_partials``: attention over a split of the keys, put back together by log-sum-exp.

Attention over keys ``K = K_1 ∪ ... ∪ K_n`` (disjoint) is a weighted mean of the attentions
over each part, weighted by how much softmax mass each part holds::

    lse = log Σ_i exp(lse_i)          out = Σ_i exp(lse_i - lse) · out_i

This is how the ``blocksparse`` backend joins the pieces of one query block, and how ring
attention (one part per rank), cascade attention (a shared prefix and a per-request suffix)
and chunked prefill (cached keys and new keys) join theirs. Parts a row cannot see
(``lse_i = -inf``) weigh exactly 0; a row that sees no part gets output 0 and LSE ``-inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.conventions import lse_dtype

__all__ = ["merge_partials"]


def merge_partials(outputs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge partial attentions over disjoint key sets.

    Args:
        outputs: partial outputs ``(B, H, Lq, Dv)``, each normalised over its own keys (rows that
            see none of its keys hold anything finite, usually 0).
        lses: the matching log-sum-exps ``(B, H, Lq)`` (``-inf`` where a row sees none of the keys).

    Returns:
        ``(output, lse)``: ``(B, H, Lq, Dv)`` in the dtype of ``outputs[0]``, and ``(B, H, Lq)``
        in the LSE dtype (:func:`multihead.conventions.lse_dtype`). Differentiable with respect to
        every output and LSE; no NaN in forward or backward, whatever rows are fully masked.
    """
    _check(outputs, lses)
    acc = lse_dtype(outputs[0].dtype)
    stacked = torch.stack([l.to(acc) for l in lses])  # (n, B, H, Lq)
    peak = stacked.amax(dim=0).detach()  # the largest part, for a stable exp
    empty = torch.isneginf(peak)  # rows that see no part at all
    peak = torch.where(empty, torch.zeros_like(peak), peak)
    # exp(-inf - peak) = 0 with gradient 0: a part a row cannot see weighs nothing.
    mass = torch.exp(stacked - peak)  # (n, B, H, Lq)
    total = mass.sum(dim=0)
    total = torch.where(empty, torch.ones_like(total), total)  # log(1) = 0: no inf * 0 in backward
    lse = (torch.log(total) + peak).masked_fill(empty, float("-inf"))
    weights = mass / total  # (n, B, H, Lq); rows that see nothing: all 0
    output = sum(w.unsqueeze(-1) * o.to(acc) for w, o in zip(weights, outputs))
    return output.to(outputs[0].dtype), lse


def _check(outputs: object, lses: object) -> None:
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(
            f"merge_partials: outputs and lses must be sequences of tensors, got "
            f"{type(outputs).__name__} and {type(lses).__name__}"
        )
    if len(outputs) == 0 or len(outputs) != len(lses):
        raise ValueError(
            f"merge_partials: expected as many outputs as lses (at least one), got "
            f"{len(outputs)} outputs and {len(lses)} lses"
        )
    shape = tuple(outputs[0].shape)
    for i, (o, l) in enumerate(zip(outputs, lses)):
        if not isinstance(o, Tensor) or not isinstance(l, Tensor):
            raise TypeError(f"merge_partials: outputs[{i}] and lses[{i}] must be tensors")
        if o.dim() != 4 or tuple(o.shape) != shape:
            raise ValueError(
                f"merge_partials: outputs[{i}] has shape {tuple(o.shape)}; expected (B, H, Lq, Dv) "
                f"= {shape} like outputs[0]"
            )
        if tuple(l.shape) != shape[:3]:
            raise ValueError(f"merge_partials: lses[{i}] has shape {tuple(l.shape)}; expected (B, H, Lq) = {shape[:3]}")
        if o.dtype != outputs[0].dtype or o.device != outputs[0].device:
            raise TypeError(
                f"merge_partials: outputs[{i}] is {o.dtype} on {o.device} but outputs[0] is "
                f"{outputs[0].dtype} on {outputs[0].device}; partial outputs share a dtype and device"
            )
