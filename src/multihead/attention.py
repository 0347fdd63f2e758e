"""``multihead.attention``: the functional entry point of the core.

Conventions (layout, mask polarity, causal alignment, GQA mapping, fully masked rows, scale,
precision) are in :mod:`multihead.conventions`.
"""

from __future__ import annotations

from torch import Tensor

from multihead.backends.registry import check_backend_name, select_backend
from multihead.masks import Mask
from multihead.reference import AttentionResult
from multihead.blockwise import weights_by_blocks
from multihead.validation import validate_call, validate_weights_selection

__all__ = ["attention"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads=None,
    weights_rows=None,
) -> Tensor | AttentionResult:
    """Scaled dot-product attention.

    Args:
        q: ``(B, Hq, Lq, D)`` queries.
        k: ``(B, Hkv, Lk, D)`` keys; ``Hkv`` divides ``Hq``; query head ``h`` reads KV head
            ``h // (Hq // Hkv)``.
        v: ``(B, Hkv, Lk, Dv)`` values.
        mask: a mask object from :mod:`multihead.masks` (``causal()``, ``sliding_window(w)``,
            ``key_padding(lengths)``, ``document(ids)``, ``prefix_lm(n)``, ``custom(fn)`` and
            their ``& | ~`` combinations), or a tensor broadcastable to ``(B, Hq, Lq, Lk)``:
            bool (``True`` = may attend) or float (additive).
        scale: multiplies ``q k^T``; default ``1 / sqrt(D)``.
        dropout_p: dropout on the attention probabilities. Applied whenever ``> 0`` (layers pass
            0 in eval mode); reproducible under ``torch.manual_seed``.
        return_weights: also return the probabilities ``(B, Hq, Lq, Lk)`` (before dropout).
        return_lse: also return the log-sum-exp ``(B, Hq, Lq)`` (``-inf`` on fully masked rows).
        backend: ``"auto"`` (the fastest backend that can serve the call) or a registered name
            (``"sdpa"``, ``"reference"``, ...); a forced backend that cannot serve the call
            raises an error listing its reasons.
        dropout_mask: bool ``(B, Hq, Lq, Lk)``, ``True`` = kept; replaces the random dropout draw
            (for testing; reference backend only).
        weights_heads, weights_rows: with ``return_weights=True``, return only these query heads
            and query rows (an int, a sequence of ints, a slice or an integer tensor): weights
            ``(B, len(heads), len(rows), Lk)``. The output then runs on the fast path and the
            probabilities are recomputed from ``q``, ``k`` and its log-sum-exp, one block at a
            time, never holding more than the slice plus one block.

    Returns:
        ``(B, Hq, Lq, Dv)`` in the dtype of ``q``; or, when weights or LSE are asked for, an
        :class:`~multihead.reference.AttentionResult` ``(output, weights, lse)`` with ``None``
        for what was not asked.
    """
    check_backend_name(backend)
    call = validate_call(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, dropout_mask=dropout_mask,
                         return_weights=return_weights, return_lse=return_lse)
    heads, rows = validate_weights_selection(weights_heads, weights_rows, q=q, return_weights=return_weights)
    chosen, _ = select_backend(call, backend)
    result = chosen.forward(call)  # the output, and the LSE when asked for (or for the weights)
    if return_weights:
        # Weights on demand: recomputed from q, k and the fast path's LSE, a block at a time, for
        # the requested heads/rows only (all by default). No backend runs a slow path for them.
        weights = weights_by_blocks(q, k, call.mask, call.scale, result.lse, heads, rows).to(q.dtype)
        return AttentionResult(result.output, weights, result.lse if return_lse else None)
    if return_lse:
        return result
    return result.output
