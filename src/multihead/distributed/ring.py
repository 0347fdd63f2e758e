"""``ring_attention``: exact attention over a sequence sharded across the ranks of a group.

Each rank holds ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)`` and ``v (B, Hkv, Sk, Dv)``: its shard
of a sequence of ``Lq = P·Sq`` queries and ``Lk = P·Sk`` keys, in the ``zigzag`` or
``contiguous`` layout (:mod:`multihead.distributed.layout`). At step ``s`` rank ``r`` attends to
the keys of rank ``r - s``, received point to point while the previous step computes; each block
is one :func:`multihead.attention` call with the global mask read at the block's absolute
positions, and the partial results are joined by log-sum-exp (the weights of
:func:`multihead.merge_partials`, updated in place) in fp32 (fp64 for fp64 inputs). Which blocks
are computed, skipped or joined is decided once by :func:`multihead.distributed.plan.plan_ring`
from the mask's structure.

Backward (the custom ``autograd.Function`` below) receives the K/V shards again, computes each
block's share of the gradient against the *merged* output and LSE, and sends each block's
``dK``/``dV`` back to the rank that owns those keys. The backend that runs a block computes them
from the merged ``(out, lse)`` where it offers that (``Backend.backward_from_lse``: on CPU,
PyTorch's flash backward); elsewhere the block is recomputed with :func:`multihead.attention` under
autograd and given the merge's gradients: for a block with partial result ``(o_i, lse_i)`` inside
the merged ``(out, lse)``, with ``w_i = exp(lse_i - lse)``::

    dL/do_i   = w_i · dout
    dL/dlse_i = w_i · (rowsum(dout · (o_i - out)) + dlse)

which is the derivative of :func:`~multihead.merge_partials`; the block's own backward (whatever
backend runs it) takes it from there. Rows that see none of a block's keys have ``w_i = 0``.

Memory per rank (``docs/distributed.md``, Measured): the merged output and LSE, one block's
output, and the K/V in flight (this rank's shard as sent, the one computed on, the next one
arriving); the backward adds ``dq``, ``dk``, ``dv``, the gradients of the keys held at a step, one
sent gradient and one arriving. Nothing is of the whole sequence's size.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from multihead.call import AttentionResult, ScoreModArg
from multihead.conventions import lse_dtype
from multihead.distributed.checks import (
    Shards,
    agree,
    check_call,
    check_group,
)
from multihead.distributed.layout import check_divisible, chunks_per_rank
from multihead.distributed.plan import RingPlan, plan_ring
from multihead.distributed.ring_steps import ModGradients, step_backward, step_forward
from multihead.distributed.rotation import GradientReturn, Rotation, buffers_like
from multihead.masks import Mask
from multihead.memo import BoundedCache
from multihead.sinks import apply_sinks

__all__ = ["ring_attention"]

_WHERE = "ring_attention"


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Tensor | AttentionResult:
    """Attention over a sequence sharded across the ranks of ``group``, equal to
    :func:`multihead.attention` on the whole sequence.

    Args:
        q: ``(B, Hq, Sq, D)``, this rank's shard of the ``Lq = P·Sq`` queries.
        k: ``(B, Hkv, Sk, D)``, this rank's shard of the ``Lk = P·Sk`` keys (``Hkv`` divides
            ``Hq``; only the ``Hkv`` heads travel).
        v: ``(B, Hkv, Sk, Dv)``.
        group: the process group sharing the sequence (default: the whole world).
        mask: the mask of the *whole* attention ``(B, Hq, Lq, Lk)``, the same object on every
            rank: ``causal()`` (either alignment), ``sliding_window(...)``, ``document(ids)`` with
            the ids of the whole sequence, ``key_padding(lengths)``, their combinations, or a bool
            tensor over the whole sequence.
        score_mod: modifiers of the *whole* attention's scores, as :func:`multihead.attention`
            takes them (``positions.ALiBi(Hq)``, ``positions.RelativePositionBias``,
            ``scores.bias(t)`` with ``t`` over the whole sequence, a function ``fn(score, b, h,
            q_idx, kv_idx)`` of absolute positions, a list of them); each block reads them at
            its absolute positions (:func:`multihead.scores.shifted`). Tensors they read that
            require grad receive this rank's share of their gradient (the sum over ranks is the
            whole gradient, as for any parameter shared by the ranks).
        softcap: ``cap · tanh(s / cap)`` after ``score_mod``, as in :func:`multihead.attention`.
        sinks: ``(Hq,)`` per-head sink logits, joined to the merged result through its LSE
            (:mod:`multihead.sinks`); the returned LSE includes them, as one process's does.
        layout: ``"zigzag"`` (default; rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``:
            balanced causal work) or ``"contiguous"`` (rank ``r`` holds the ``r``-th of ``P``
            pieces: a sliding window then never communicates beyond its reach).
            :func:`~multihead.distributed.shard_sequence` cuts a sequence this way.
        scale: multiplies ``q k^T``; default ``1 / sqrt(D)``.
        return_lse: also return this shard's log-sum-exp ``(B, Hq, Sq)`` (differentiable).
        backend: the :func:`multihead.attention` backend of every block.

    Returns:
        ``(B, Hq, Sq, Dv)`` in the dtype of ``q`` (the rows of this rank's shard), or an
        :class:`~multihead.AttentionResult` ``(output, None, lse)`` with ``return_lse``.

    Every rank of ``group`` must call it with shards of the same shape and dtype, the same mask
    (compared by content), the same ``requires_grad`` and grad mode, and the same other arguments.
    Inputs are checked on every rank before any K/V moves, and one bad input or one disagreement
    raises on every rank (``docs/distributed.md``, Checked before anything moves).
    """
    shards, mask, mod, plan, scale = _prepare(
        q, k, v, group, mask, score_mod, softcap, sinks, layout, scale, return_lse, backend
    )
    positioned = None if mod is None else (mod, shards.Lq, shards.Lk)
    tensors = () if mod is None else tuple({id(t): t for t in mod.tensors()}.values())  # each once
    out, lse = _RingAttention.apply(q, k, v, mask, plan, scale, group, backend, positioned, *tensors)
    if sinks is not None:  # on the merged rows, as one process joins them to its whole rows
        out, lse, _ = apply_sinks(out, lse, sinks)
    return AttentionResult(out, None, lse) if return_lse else out


def _prepare(q, k, v, group, mask, score_mod, softcap, sinks, layout, scale, return_lse, backend):
    world, rank = check_group(group, _WHERE)

    def shapes(shards: Shards) -> None:
        if chunks_per_rank(layout) == 2:
            for name, n in (("q", shards.Sq), ("k", shards.Sk)):
                if n % 2:
                    raise ValueError(
                        f"{_WHERE}: {name} holds {n} positions on this rank, an odd number; the 'zigzag' "
                        f"layout holds two equal chunks per rank, so the whole length must be a multiple "
                        f"of {2 * world}; hint: pad the sequence (and mask the padding with "
                        f"key_padding()) or use layout='contiguous'"
                    )
        check_divisible(_WHERE, "Lq", shards.Lq, world, layout)
        check_divisible(_WHERE, "Lk", shards.Lk, world, layout)  # a layout object: Lk = Lq = its length

    checked = check_call(
        _WHERE,
        q,
        k,
        v,
        world,
        shapes,
        partial(agree, _WHERE, group, rank),
        mask=mask,
        score_mod=score_mod,
        softcap=softcap,
        sinks=sinks,
        layout=layout,
        scale=scale,
        return_lse=return_lse,
        backend=backend,
        agreed={"return_lse": return_lse},
    )
    shards, mod = checked.shards, checked.score_mod
    plan = _cached_plan(world, rank, shards, checked.mask, layout, positions=mod is not None)
    return shards, checked.mask, mod, plan, checked.scale


_PLANS: BoundedCache[tuple[object, ...], RingPlan] = BoundedCache(32)


def _cached_plan(world: int, rank: int, shards: Shards, mask, layout, positions: bool = False) -> RingPlan:
    """Plans keyed on what the mask means (masks hash by value), so a model's layers share one."""
    key = (world, rank, shards.B, shards.Hq, shards.Sq, shards.Sk, mask, layout, positions)
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_ring(
            world=world,
            rank=rank,
            batch=shards.B,
            heads=shards.Hq,
            q_shard=shards.Sq,
            kv_shard=shards.Sk,
            mask=mask,
            layout=layout,
            positions=positions,
        )
        _PLANS.put(key, plan)
    return plan


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, plan: RingPlan, scale: float, group, backend: str, positioned, *mod_tensors):
        # positioned: (score_mod of the whole attention, Lq, Lk) or None; mod_tensors: the
        # tensors it reads, inputs here so that autograd asks this function for their gradients.
        # An output the caller does not use reaches backward as None, not as zeros: an unused LSE
        # then costs no padded column in the flash backward.
        ctx.set_materialize_grads(False)
        acc = lse_dtype(q.dtype)
        B, Hq, Sq, _ = q.shape
        out = torch.zeros(B, Hq, Sq, v.shape[3], dtype=acc, device=q.device)  # (B, Hq, Sq, Dv), merged so far
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=acc, device=q.device)  # (B, Hq, Sq)
        own = (k.contiguous(), v.contiguous()) if any(plan.send) else None  # what travels: no copy when dense
        for s, held in Rotation(plan, group, own, buffers_like(k, v)):
            if plan.calls[s]:
                kv = (k, v) if s == 0 else held
                assert kv is not None  # a step with calls has its shard
                step_forward(plan.calls[s], q, kv[0], kv[1], out, lse, scale, backend, positioned)
            if held is not None:
                held.clear()  # freed before the shard after next arrives
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.mask, ctx.scale, ctx.group, ctx.backend = plan, mask, scale, group, backend
        ctx.positioned, ctx.mod_tensors = positioned, mod_tensors
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, group, backend = ctx.plan, ctx.scale, ctx.group, ctx.backend
        acc = lse.dtype
        dout = torch.zeros_like(out) if dout is None else dout.to(acc)  # (B, Hq, Sq, Dv)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_own = [
            torch.zeros(k.shape, dtype=acc, device=q.device),  # (B, Hkv, Sk, D)
            torch.zeros(v.shape, dtype=acc, device=q.device),
        ]  # (B, Hkv, Sk, Dv)
        own = (k.contiguous(), v.contiguous()) if any(plan.send) else None
        returns = GradientReturn(plan, group, dkv_own)
        positioned = ctx.positioned
        mod_grads = ModGradients(ctx.mod_tensors)
        for s, held in Rotation(plan, group, own, buffers_like(k, v)):
            dkv = None
            if plan.calls[s]:
                # gradients of the keys held at step s
                dkv = dkv_own if s == 0 else [torch.zeros_like(dkv_own[0]), torch.zeros_like(dkv_own[1])]
                kv = (k, v) if s == 0 else held
                assert kv is not None  # a step with calls has its shard
                step_backward(
                    plan.calls[s],
                    q,
                    kv[0],
                    kv[1],
                    (dq, dkv[0], dkv[1], mod_grads),
                    out,
                    lse,
                    dout,
                    dlse,
                    scale,
                    backend,
                    positioned,
                )
            if held is not None:
                held.clear()  # these keys are done with: freed before the gradients travel
            if s > 0:
                returns.exchange(s, dkv)  # back to the owner of these keys, rank r - s
        returns.finish()
        grads = (dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype))
        return grads + (None,) * 6 + mod_grads.result()
