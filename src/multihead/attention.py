"""``multihead.attention``: the functional entry point of the core.

Conventions (layout, mask polarity, causal alignment, GQA mapping, fully masked rows, scale,
precision) are in :mod:`multihead.conventions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, cast, overload

import torch
from torch import Tensor

from multihead import plans
from multihead.backends.base import Backend
from multihead.backends.registry import check_backend_name, select_backend
from multihead.blockwise import lse_by_blocks, weights_by_blocks, zero_anchor
from multihead.call import AttentionCall, AttentionResult, Returns, ScoreModArg, Selection
from multihead.conventions import lse_dtype
from multihead.masks import Mask
from multihead.nonfinite import apply_policy, check_finite_flag
from multihead.scores import ScoreMod
from multihead.scores import softcap as softcap_mod
from multihead.sinks import apply_sinks, check_sinks
from multihead.validation import (
    DEFAULT_MAX_WEIGHTS_BYTES,
    check_weights_bytes,
    validate_call,
    validate_weights_selection,
)

__all__ = ["attention", "plan", "prepare", "dispatch", "finish"]

_is_compiling = torch.compiler.is_compiling  # (one global read on every call; dynamo knows the function)


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: Literal[False] = False,
    return_lse: Literal[False] = False,
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    check_finite: bool = False,
    max_weights_bytes: int | None = DEFAULT_MAX_WEIGHTS_BYTES,
) -> Tensor: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: Literal[True],
    return_lse: bool = False,
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    check_finite: bool = False,
    max_weights_bytes: int | None = DEFAULT_MAX_WEIGHTS_BYTES,
) -> AttentionResult: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: Literal[True],
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    check_finite: bool = False,
    max_weights_bytes: int | None = DEFAULT_MAX_WEIGHTS_BYTES,
) -> AttentionResult: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    check_finite: bool = False,
    max_weights_bytes: int | None = DEFAULT_MAX_WEIGHTS_BYTES,
) -> Tensor | AttentionResult: ...


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    dropout_mask: Tensor | None = None,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    check_finite: bool = False,
    max_weights_bytes: int | None = DEFAULT_MAX_WEIGHTS_BYTES,
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
            bool (``True`` = may attend) or float (PyTorch's additive masks: split into the bool
            mask of its ``-inf`` entries and a :func:`multihead.scores.bias`).
        score_mod: a :mod:`multihead.scores` modifier applied to the scaled scores before the
            softmax (``scores.bias(t)``, ``scores.softcap(cap)``, ``positions.ALiBi(Hq)``, ...),
            a function ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature,
            at absolute positions), or a list of them applied in order.
        softcap: ``cap · tanh(s / cap)`` on the scores after ``score_mod`` (Gemma 2, Grok);
            the same as appending ``scores.softcap(cap)`` to ``score_mod``.
        sinks: ``(Hq,)`` per-head sink logits (gpt-oss): each joins its head's softmax
            denominator and contributes no value (:mod:`multihead.sinks`); trainable. The
            returned LSE and weights include the sink (weights then sum to less than 1).
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
        check_finite: apply the rules for NaN and infinite inputs (``docs/conventions.md``,
            "Non-finite inputs"): each reaches exactly the rows that read it, a key no row may
            see can hold anything. It reads the data after the call (one reduction and one host
            synchronisation; a rerun when something is not finite). Off by default, on every
            device: finite inputs are exact and rows that see no key are 0 either way; a NaN or
            an infinity then gives what the kernel gives, as PyTorch's SDPA does.
        max_weights_bytes: with ``return_weights=True``, the most bytes the returned weights may
            take, ``B · len(heads) · len(rows) · Lk`` elements of ``q``'s dtype (the selection
            applied); checked before any kernel runs, so weights too large are refused at once with
            the size, the limit and the fix (``weights_heads=``/``weights_rows=``) instead of failing
            in an allocation after the output was computed. Default 2 GiB
            (:data:`multihead.validation.DEFAULT_MAX_WEIGHTS_BYTES`); ``None``: no limit.

    Returns:
        ``(B, Hq, Lq, Dv)`` in the dtype of ``q``; or, when weights or LSE are asked for, an
        :class:`~multihead.reference.AttentionResult` ``(output, weights, lse)`` with ``None``
        for what was not asked.
    """
    # A plain call whose signature was served before runs its stored plan (multihead.plans): the
    # validation it passed and the dispatch it got depend on nothing the key holds.
    key = growing = None
    if (
        score_mod is None
        and softcap is None
        and sinks is None
        and dropout_mask is None
        and return_weights is False
        and return_lse is False
        and weights_heads is None
        and weights_rows is None
        and dropout_p.__class__ is float
        and dropout_p == 0.0
        and check_finite is False
        and not _is_compiling()
    ):
        plan, key, growing = plans.find(q, k, v, mask, scale, backend)
        if plan is not None:
            return plan(q, k, v)
    call = prepare(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        softcap=softcap,
        sinks=sinks,
        scale=scale,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
        return_weights=return_weights,
        return_lse=return_lse,
        weights_heads=weights_heads,
        weights_rows=weights_rows,
        check_finite=check_finite,
        max_weights_bytes=max_weights_bytes,
        backend=backend,
    )
    if call.empty:  # Lq == 0 or Lk == 0: nothing to compute (every row sees no key: zeros, LSE -inf)
        return finish(call, _empty(call))
    chosen = dispatch(call, backend)
    result = chosen.forward(call)  # the output, and the LSE when asked for and the kernel has one
    poisoned = None
    if call.check_finite:  # NaN/inf reach the rows that read them
        result, poisoned = apply_policy(call, result, chosen.forward, keys=chosen.capabilities.keys_in_pieces)
    if key is not None or growing is not None:
        _keep_plans(call, chosen, backend, (q, k, v), key, growing)
    return finish(call, result, poisoned)


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> plans.Plan:
    """The plan of a plain call, for the caller to hold: ``plan(q, k, v, mask=m)(q2, k2, v2)``
    computes ``attention(q2, k2, v2, mask=m)`` for any ``q2, k2, v2`` of the same signature
    (shapes, strides, dtypes, devices, autograd state), with the validation and dispatch done once,
    here. Inputs of another signature are refused by the plan, with what differs.

    A plain call passes a mask object (or none) and a scale only: what needs more (score modifiers,
    sinks, dropout, weights, LSE) calls :func:`attention`. Refused here, with the reason: inputs
    that validation would copy or change (a strided last dimension, a scale <= 0), q, k, v that
    share their first address, empty calls, and masks holding a tensor by identity."""
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"plan: mask must be a multihead mask object or None, got {type(mask).__name__}")
    call = prepare(q, k, v, mask=mask, scale=scale, backend=backend)  # every argument checked, named
    key = plans.signature(q, k, v, mask, scale, backend)
    why = (
        "a scale that is not a positive float"
        if key is None
        else "q, k or v with a strided last dimension or a scale <= 0 (validation copies or changes them)"
        if call.q is not q or call.k is not k or call.v is not v
        else "an empty call (Lq or Lk is 0)"
        if call.empty
        else "a mask holding a tensor compared by identity (Mask.by_value() is False)"
        if call.mask is not None and not call.mask.by_value()
        else "q, k and v starting at one address"
        if plans.aliasing(q, k, v) is not None
        else None
    )
    if why is not None or key is None:
        raise ValueError(f"plan: this call cannot be planned: {why}; call multihead.attention(q, k, v, ...) instead")
    return plans.Plan(key, dispatch(call, backend).runner(call), mask, scale, backend)


def prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    check_finite: bool = False,
    max_weights_bytes: int | None = DEFAULT_MAX_WEIGHTS_BYTES,
    backend: str = "auto",
) -> AttentionCall:
    """The arguments of :func:`attention`, validated, as the one :class:`AttentionCall` the later
    steps read: the softcap appended to the score modifiers, the sinks and what the caller gets
    back (weights of which heads and rows, LSE) as fields. Raises on any bad argument, naming it,
    before any kernel runs."""
    check_backend_name(backend)
    check_finite_flag("attention", check_finite)
    if softcap is not None:
        score_mod = [*_as_list(score_mod), softcap_mod(softcap)]
    check_sinks(sinks, q)
    call = validate_call(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
        return_weights=return_weights,
        return_lse=return_lse,
    )
    heads, rows = validate_weights_selection(weights_heads, weights_rows, q=q, return_weights=return_weights)
    check_weights_bytes(max_weights_bytes, q=q, k=k, heads=heads, rows=rows, return_weights=return_weights)
    returns = Returns(return_weights, return_lse, heads, rows) if return_weights or return_lse else None
    return dataclasses.replace(
        call,
        return_lse=call.return_lse or sinks is not None,  # a sink joins through the LSE
        sinks=sinks,
        returns=returns,
        check_finite=check_finite,
    )


def dispatch(call: AttentionCall, backend: str = "auto") -> Backend:
    """The backend that runs ``call``: ``backend`` itself if it can (else
    :class:`~multihead.backends.registry.BackendRefusedError` with its reasons), or for ``"auto"``
    the first in :data:`~multihead.backends.registry.AUTO_ORDER` that neither refuses the call nor
    prefers a later one (``multihead.explain`` prints why)."""
    return select_backend(call, backend)[0]


def finish(call: AttentionCall, result: AttentionResult, poisoned: Tensor | None = None) -> Tensor | AttentionResult:
    """What :func:`attention` returns for ``call`` from what its backend gave (the output, and the
    LSE when the kernel has one): the sinks joined, the weights recomputed from ``q``, ``k`` and the
    LSE for the selected heads and rows, the LSE computed where the kernel gave none. ``poisoned``
    ``(B, Hq, Lq)``: rows the non-finite rules made NaN (``check_finite=True``), NaN in what is
    derived here too."""
    if call.returns is None and call.sinks is None:
        return result.output
    returns, lse = call.returns or Returns(), result.lse
    q, k = call.q, call.k  # as validated (a scale <= 0 folded into q, a strided last dim made unit)
    if lse is None and (call.sinks is not None or (returns.lse and not returns.weights)):
        lse = lse_by_blocks(q, k, call.mask, call.score_mod, call.scale)  # the kernel has none: one blockwise pass
        if poisoned is not None:
            lse = lse.masked_fill(poisoned, float("nan"))
    weights = result.weights  # backends give none; an empty call's are known
    if returns.weights and weights is None:
        # exp(S - lse) recomputed from q, k a block at a time, for the selected heads and rows only;
        # without a kernel LSE, the LSE comes from the same blocks.
        heads, rows = returns.heads, returns.rows
        weights, block_lse = weights_by_blocks(q, k, call.mask, call.score_mod, call.scale, lse, heads, rows)
        if lse is None and returns.lse:
            lse = (
                block_lse
                if heads is None and rows is None
                else lse_by_blocks(q, k, call.mask, call.score_mod, call.scale)
            )
        if poisoned is not None:
            weights = weights.masked_fill(_select(poisoned, heads, rows).unsqueeze(-1), float("nan"))
            lse = None if lse is None else lse.masked_fill(poisoned, float("nan"))
    output = result.output
    if call.sinks is not None:
        assert lse is not None  # computed above whenever there are sinks
        output, lse, factor = apply_sinks(output, lse, call.sinks)
        if weights is not None:
            weights = weights * _select(factor, returns.heads, returns.rows).unsqueeze(-1).to(weights.dtype)
    if not (returns.weights or returns.lse):
        return output
    return AttentionResult(output, None if weights is None else weights.to(q.dtype), lse if returns.lse else None)


def _keep_plans(
    call: AttentionCall,
    chosen: Backend,
    backend: str,
    inputs: tuple[Tensor, Tensor, Tensor],
    key: plans.Key | None,
    growing: plans.Key | None,
) -> None:
    """Store the runner of a plain call for the calls that repeat it: under its signature, and under
    its growing cache's key when the runner serves any ``Lk`` and ``auto`` picks the same backend
    across ``Lk``'s bucket (:mod:`multihead.plans`)."""
    runner = None
    if key is not None and plans.worth_keeping(key, call, *inputs):
        runner = chosen.runner(call)
        plans.store(key, runner, inputs)
    if growing is not None and plans.worth_keeping(growing, call, *inputs):
        runner = runner or chosen.runner(call)
        if runner.any_kv_len and _chosen_over_bucket(call, chosen, backend):
            plans.store(growing, runner)


def _as_list(score_mod: ScoreModArg) -> list[ScoreMod | Callable[..., Tensor]]:
    if score_mod is None:
        return []
    if isinstance(score_mod, (list, tuple)):
        return list(score_mod)
    return [cast("ScoreMod | Callable[..., Tensor]", score_mod)]  # one modifier or function


def _select(t: Tensor, heads: Tensor | None, rows: Tensor | None) -> Tensor:
    """``t (B, Hq, Lq, ...)`` at the selected query heads and rows."""
    t = t if heads is None else t[:, heads]
    return t if rows is None else t[:, :, rows]


def _chosen_over_bucket(call: AttentionCall, chosen: Backend, backend: str) -> bool:
    """Whether dispatch picks ``chosen`` at both ends of ``call``'s ``Lk`` bucket
    (:func:`multihead.plans.kv_len_bucket`), asked with K/V of those lengths as zero-stride views
    of the call's first key (refusals read shapes, dtypes and devices, never values). The
    thresholds are monotone in ``Lk``, so then it picks ``chosen`` across the bucket."""
    if backend != "auto":
        return True  # a forced backend is the backend
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    for kv_len in plans.kv_len_bucket(Lk):
        k = call.k[:, :, :1].expand(B, Hkv, kv_len, D)
        v = call.v[:, :, :1].expand(B, Hkv, kv_len, Dv)
        if select_backend(dataclasses.replace(call, k=k, v=v), backend)[0] is not chosen:
            return False
    return True


def _empty(call: AttentionCall) -> AttentionResult:
    """The result of an attention with ``Lq == 0`` or ``Lk == 0``, known without a kernel: output
    zeros (every row is fully masked), LSE ``-inf``, weights zeros when asked for, connected to the
    inputs so that gradients are zeros."""
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    q, k, v = call.q, call.k, call.v
    # Every row sees no key, so even a NaN query gives 0 (conventions: fully masked rows).
    anchor = zero_anchor(q, k, v).to(q.dtype)
    output = torch.zeros((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device) + anchor
    lse = torch.full((B, Hq, Lq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    weights = None
    if call.returns is not None and call.returns.weights:
        heads, rows = call.returns.heads, call.returns.rows
        nh = Hq if heads is None else len(heads)
        nr = Lq if rows is None else len(rows)
        weights = torch.zeros((B, nh, nr, Lk), dtype=q.dtype, device=q.device) + anchor
    return AttentionResult(output, weights, lse)
