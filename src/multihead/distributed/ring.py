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

import torch
from torch import Tensor

from multihead.attention import attention, dispatch
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import lse_dtype
from multihead.distributed.checks import (
    Shards,
    agree,
    call_summary,
    check_group,
    check_mask,
    check_qkv,
    check_scale,
)
from multihead.distributed.layout import check_divisible, check_layout, chunks_per_rank
from multihead.distributed.plan import RingPlan, plan_ring
from multihead.distributed.rotation import GradientReturn, Rotation, buffers_like
from multihead.masks import Mask
from multihead.memo import BoundedCache

__all__ = ["ring_attention"]

_WHERE = "ring_attention"


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    mask: Mask | Tensor | None = None,
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
    shards, mask, plan, scale = _prepare(q, k, v, group, mask, layout, scale, return_lse, backend)
    out, lse = _RingAttention.apply(q, k, v, mask, plan, scale, group, backend)
    return AttentionResult(out, None, lse) if return_lse else out


def _prepare(q, k, v, group, mask, layout, scale, return_lse, backend):
    world, rank = check_group(group, _WHERE)
    error, shards, summary = None, None, {}
    try:
        shards = check_qkv(_WHERE, q, k, v, world)
        check_layout(layout, _WHERE)
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
        mask = check_mask(_WHERE, mask, shards)
        scale = check_scale(_WHERE, scale, shards.D)
        if not isinstance(return_lse, bool):
            raise TypeError(f"{_WHERE}: return_lse must be a bool, got {type(return_lse).__name__}")
        if not isinstance(backend, str):
            raise TypeError(
                f"{_WHERE}: backend must be a str ('auto' or a registered name), got {type(backend).__name__}"
            )
        summary = call_summary(q, k, v, mask=mask, layout=layout, scale=scale, return_lse=return_lse, backend=backend)
    except Exception as e:  # any failure here (a mask's fingerprint too) must reach the other ranks
        error = e
    agree(_WHERE, group, rank, error, summary)
    assert shards is not None  # checked above: agree() raised on every rank otherwise
    plan = _cached_plan(world, rank, shards, mask, layout)
    return shards, mask, plan, scale


_PLANS: BoundedCache[tuple[object, ...], RingPlan] = BoundedCache(32)


def _cached_plan(world: int, rank: int, shards: Shards, mask, layout: str) -> RingPlan:
    """Plans keyed on what the mask means (masks hash by value), so a model's layers share one."""
    key = (world, rank, shards.B, shards.Hq, shards.Sq, shards.Sk, mask, layout)
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
        )
        _PLANS.put(key, plan)
    return plan


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, plan: RingPlan, scale: float, group, backend: str):
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
                _step_forward(plan.calls[s], q, kv[0], kv[1], out, lse, scale, backend)
            if held is not None:
                held.clear()  # freed before the shard after next arrives
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.mask, ctx.scale, ctx.group, ctx.backend = plan, mask, scale, group, backend
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
        for s, held in Rotation(plan, group, own, buffers_like(k, v)):
            dkv = None
            if plan.calls[s]:
                # gradients of the keys held at step s
                dkv = dkv_own if s == 0 else [torch.zeros_like(dkv_own[0]), torch.zeros_like(dkv_own[1])]
                kv = (k, v) if s == 0 else held
                assert kv is not None  # a step with calls has its shard
                _step_backward(plan.calls[s], q, kv[0], kv[1], dq, dkv[0], dkv[1], out, lse, dout, dlse, scale, backend)
            if held is not None:
                held.clear()  # these keys are done with: freed before the gradients travel
            if s > 0:
                returns.exchange(s, dkv)  # back to the owner of these keys, rank r - s
        returns.finish()
        return dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype), None, None, None, None, None


def _merge_into(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """``(out, lse) <- merge_partials([out, part], [lse, part_lse])``, written into ``out`` and
    ``lse`` (views of the merged result) with no temporary of ``out``'s size, so the forward's
    peak is the merged result, one block's output and the K/V in flight. The same weights as
    :func:`multihead.merge_partials` (``test_ring_pieces`` compares the two):
    ``w = exp(lse_i - lse_new)``, exactly 0 for a part a row cannot see; a row that sees neither
    keeps output 0 and LSE ``-inf``."""
    new = torch.logaddexp(lse, part_lse.to(lse.dtype))  # (B, H, rows); -inf only where both are
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).addcmul_(part, torch.exp(part_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def _step_forward(calls, q, k, v, out, lse, scale, backend) -> None:
    """One step of the forward: each call's partial result merged into ``(out, lse)``, one at a time."""
    for c in calls:
        res = attention(
            q[:, :, c.q0 : c.q1],
            k[:, :, c.k0 : c.k1],
            v[:, :, c.k0 : c.k1],
            mask=c.mask,
            scale=scale,
            return_lse=True,
            backend=backend,
        )
        assert res.lse is not None  # asked for
        _merge_into(out[:, :, c.q0 : c.q1], lse[:, :, c.q0 : c.q1], res.output.to(out.dtype), res.lse)
        del res  # before the next call's output exists


def _step_backward(calls, q, k, v, dq, dk, dv, out, lse, dout, dlse, scale, backend) -> None:
    """One step of the backward: each call's gradients added to ``dq`` (this rank's queries) and
    ``dk, dv`` (the keys ``k, v`` held at this step)."""
    for c in calls:
        rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
        gq, gk, gv = _block_backward(
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            c.mask,
            scale,
            backend,
            out[:, :, rows],
            lse[:, :, rows],
            dout[:, :, rows],
            None if dlse is None else dlse[:, :, rows],
        )
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv


def _block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse):
    """Gradients of ``q, k, v`` of one block, from the gradients of the merged ``(out, lse)``: from
    the backend that runs the block's call, where it offers them from ``(out, lse)``
    (:meth:`~multihead.backends.base.Backend.backward_from_lse`; on CPU the flash backward), else
    by autograd through the block's :func:`multihead.attention` call with that ``backend``."""
    call = AttentionCall(q, k, v, mask, None, scale, 0.0, None, True)  # the forward's block call
    grads = dispatch(call, backend).backward_from_lse(call, out, lse, dout, dlse)
    if grads is not None:
        return grads
    return _autograd_block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse)


def _autograd_block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse):
    """Any device, backend and mask: the block recomputed with :func:`multihead.attention` under
    autograd, and its output and LSE given the merge's gradients (module docstring)."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        res = attention(q, k, v, mask=mask, scale=scale, return_lse=True, backend=backend)
        assert res.lse is not None  # asked for
        part_lse = res.lse.detach()
        # w = exp(lse_i - lse): 0 where the block has no key for the row (also when no block has any)
        w = torch.where(torch.isneginf(part_lse), torch.zeros_like(part_lse), torch.exp(part_lse - lse))
        g_out = w.unsqueeze(-1) * dout  # (B, Hq, rows, Dv)
        g_lse = w * (dout * (res.output.detach().to(out.dtype) - out)).sum(-1)  # (B, Hq, rows)
        if dlse is not None:
            g_lse = g_lse + w * dlse
        gq, gk, gv = torch.autograd.grad(
            [res.output, res.lse], [q, k, v], [g_out.to(res.output.dtype), g_lse], allow_unused=True
        )
    zero = torch.zeros_like
    return (zero(q) if gq is None else gq), (zero(k) if gk is None else gk), (zero(v) if gv is None else gv)
