"""``ring_attention``: exact attention over a sequence sharded across the ranks of a group.

Each rank holds ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)`` and ``v (B, Hkv, Sk, Dv)``: its shard
of a sequence of ``Lq = P·Sq`` queries and ``Lk = P·Sk`` keys, in the ``zigzag`` or
``contiguous`` layout (:mod:`multihead.distributed.layout`). At step ``s`` rank ``r`` attends to
the keys of rank ``r - s``, received point to point while the previous step computes; each block
is one :func:`multihead.attention` call with the global mask read at the block's absolute
positions, and the partial results are joined by log-sum-exp (:func:`multihead.merge_partials`)
in fp32 (fp64 for fp64 inputs). Which blocks are computed, skipped or joined is decided once by
:func:`multihead.distributed.plan.plan_ring` from the mask's structure.

Backward (the custom ``autograd.Function`` below) receives the K/V shards again, recomputes each
block with :func:`multihead.attention` under autograd, and sends each block's ``dK``/``dV`` back to
the rank that owns those keys. For a block with partial result ``(o_i, lse_i)`` inside the merged
``(out, lse)``, with ``w_i = exp(lse_i - lse)``::

    dL/do_i   = w_i · dout
    dL/dlse_i = w_i · (rowsum(dout · (o_i - out)) + dlse)

which is the derivative of :func:`~multihead.merge_partials`; the block's own backward (whatever
backend runs it) takes it from there. Rows that see none of a block's keys have ``w_i = 0``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.attention import attention
from multihead.call import AttentionResult
from multihead.conventions import lse_dtype
from multihead.distributed.checks import (Shards, agree, check_group, check_mask, check_qkv, check_scale,
                                          mask_fingerprint)
from multihead.distributed.layout import check_divisible, check_layout, chunks_per_rank
from multihead.distributed.plan import RingPlan, plan_ring
from multihead.masks import Mask
from multihead.merge import merge_partials

__all__ = ["ring_attention"]

_WHERE = "ring_attention"


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, mask: Mask | Tensor | None = None,
                   layout: str = "zigzag", scale: float | None = None, return_lse: bool = False,
                   backend: str = "auto") -> Tensor | AttentionResult:
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

    Every rank of ``group`` must call it with shards of the same shape. Inputs are checked on
    every rank before any K/V moves, and one bad input raises on every rank.
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
                    raise ValueError(f"{_WHERE}: {name} holds {n} positions on this rank, an odd number; the 'zigzag' "
                                     f"layout holds two equal chunks per rank, so the whole length must be a multiple "
                                     f"of {2 * world}; hint: pad the sequence (and mask the padding with "
                                     f"key_padding()) or use layout='contiguous'")
        check_divisible(_WHERE, "Lq", shards.Lq, world, layout)
        mask = check_mask(_WHERE, mask, shards)
        scale = check_scale(_WHERE, scale, shards.D)
        if not isinstance(return_lse, bool):
            raise TypeError(f"{_WHERE}: return_lse must be a bool, got {type(return_lse).__name__}")
        if not isinstance(backend, str):
            raise TypeError(f"{_WHERE}: backend must be a str ('auto' or a registered name), got {type(backend).__name__}")
        summary = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "dtype": str(q.dtype),
                   "layout": layout, "mask": mask_fingerprint(mask), "scale": scale, "return_lse": return_lse,
                   "backend": backend, "requires_grad": tuple(t.requires_grad for t in (q, k, v))}
    except (TypeError, ValueError) as e:
        error = e
    agree(_WHERE, group, rank, error, summary)
    plan = _cached_plan(world, rank, shards, mask, layout)
    return shards, mask, plan, scale


_PLANS: dict = {}


def _cached_plan(world: int, rank: int, shards: Shards, mask, layout: str) -> RingPlan:
    """Plans keyed on what the mask means (masks hash by value), so a model's layers share one."""
    key = (world, rank, shards.B, shards.Hq, shards.Sq, shards.Sk, mask, layout)
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_ring(world=world, rank=rank, batch=shards.B, heads=shards.Hq, q_shard=shards.Sq,
                         kv_shard=shards.Sk, mask=mask, layout=layout)
        if len(_PLANS) >= 32:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, plan: RingPlan, scale: float, group, backend: str):
        acc = lse_dtype(q.dtype)
        B, Hq, Sq, _ = q.shape
        D = k.shape[3]
        out = torch.zeros(B, Hq, Sq, v.shape[3], dtype=acc, device=q.device)  # (B, Hq, Sq, Dv), merged so far
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=acc, device=q.device)  # (B, Hq, Sq)
        own = _pack(k, v) if any(plan.send) else None  # (B, Hkv, Sk, D + Dv): one message per step
        for s, held in _Rotation(plan, group, own, _pack_like(k, v)):
            if not plan.calls[s]:
                continue
            kv_k, kv_v = (k, v) if s == 0 else (held[..., :D], held[..., D:])
            for c in plan.calls[s]:
                res = attention(q[:, :, c.q0:c.q1], kv_k[:, :, c.k0:c.k1], kv_v[:, :, c.k0:c.k1], mask=c.mask,
                                scale=scale, return_lse=True, backend=backend)
                o, l = merge_partials([out[:, :, c.q0:c.q1], res.output.to(acc)], [lse[:, :, c.q0:c.q1], res.lse])
                out[:, :, c.q0:c.q1] = o
                lse[:, :, c.q0:c.q1] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.mask, ctx.scale, ctx.group, ctx.backend = plan, mask, scale, group, backend
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, group, backend = ctx.plan, ctx.scale, ctx.group, ctx.backend
        acc = lse.dtype
        D = k.shape[3]
        dout = torch.zeros_like(out) if dout is None else dout.to(acc)  # (B, Hq, Sq, Dv)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_own = torch.zeros(k.shape[:3] + (D + v.shape[3],), dtype=acc, device=q.device)  # (B, Hkv, Sk, D + Dv)
        own = _pack(k, v) if any(plan.send) else None
        returns = _GradientReturn(plan, group, dkv_own)
        for s, held in _Rotation(plan, group, own, _pack_like(k, v)):
            dkv = None
            if plan.calls[s]:
                kv_k, kv_v = (k, v) if s == 0 else (held[..., :D], held[..., D:])
                dkv = dkv_own if s == 0 else torch.zeros_like(dkv_own)  # gradients of the keys held at step s
            for c in plan.calls[s]:
                rows = slice(c.q0, c.q1)
                gq, gk, gv = _block_backward(q[:, :, rows], kv_k[:, :, c.k0:c.k1], kv_v[:, :, c.k0:c.k1], c.mask, scale,
                                             backend, out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
                                             None if dlse is None else dlse[:, :, rows])
                dq[:, :, rows] += gq
                dkv[:, :, c.k0:c.k1, :D] += gk
                dkv[:, :, c.k0:c.k1, D:] += gv
            if s > 0:
                returns.exchange(s, dkv)  # back to the owner of these keys, rank r - s
        returns.finish()
        return dq.to(q.dtype), dkv_own[..., :D].to(k.dtype), dkv_own[..., D:].to(v.dtype), None, None, None, None, None


def _block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse):
    """Gradients of ``q, k, v`` of one block, from the gradients of the merged ``(out, lse)``: the
    CPU flash backward where it applies (``backend`` "auto" or "sdpa"), else autograd through the
    block's :func:`multihead.attention` call with that ``backend``."""
    if backend in ("auto", "sdpa") and _FLASH_BACKWARD is not None and q.device.type == "cpu" \
            and q.dtype in _FLASH_DTYPES:
        return _flash_block_backward(q, k, v, mask, scale, out, lse, dout, dlse)
    return _autograd_block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse)


def _autograd_block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse):
    """Any device, backend and mask: the block recomputed with :func:`multihead.attention` under
    autograd, and its output and LSE given the merge's gradients (module docstring)."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        res = attention(q, k, v, mask=mask, scale=scale, return_lse=True, backend=backend)
        part_lse = res.lse.detach()
        # w = exp(lse_i - lse): 0 where the block has no key for the row (also when no block has any)
        w = torch.where(torch.isneginf(part_lse), torch.zeros_like(part_lse), torch.exp(part_lse - lse))
        g_out = w.unsqueeze(-1) * dout  # (B, Hq, rows, Dv)
        g_lse = w * (dout * (res.output.detach().to(out.dtype) - out)).sum(-1)  # (B, Hq, rows)
        if dlse is not None:
            g_lse = g_lse + w * dlse
        gq, gk, gv = torch.autograd.grad([res.output, res.lse], [q, k, v], [g_out.to(res.output.dtype), g_lse],
                                         allow_unused=True)
    zero = torch.zeros_like
    return (zero(q) if gq is None else gq), (zero(k) if gk is None else gk), (zero(v) if gv is None else gv)


# PyTorch's CPU flash backward takes the output and LSE as arguments: given the *merged* ones it
# computes a block's share of the gradient directly (P = exp(S - lse), dS = P (dP - rowsum(dout·out))),
# FlashAttention's ring backward, with no recomputed forward and no LSE of the block.
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _flash_block_backward(q, k, v, mask, scale, out, lse, dout, dlse):
    """The CPU flash backward of one block against the merged ``(out, lse)``.

    The kernel wants one head size and equal head counts, and knows no LSE gradient, so::

        q, k  (B, H, ·, D)  -> padded with zeros to E       (scores unchanged)
        v     (B, H, ·, Dv) -> padded to E; with dlse, one column of 1s
        dout  -> padded; with dlse, that column holds dlse   (dP gains + dlse: dS = P (dP - Δ + dlse))
        out   -> padded with 0s                               (Δ = rowsum(dout·out) unchanged)

    with ``E = max(D, Dv) (+1 with dlse)``; GQA K/V are repeated and their gradients summed per
    group. Rows with no visible key anywhere (``lse = -inf``) get ``lse = +inf``: ``P = 0``."""
    B, Hq, rows, D = q.shape
    Hkv, keys, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    extra = dlse is not None
    E = max(D, Dv) + int(extra)
    dt = q.dtype
    qp = _pad(q, E)
    kp = _pad(k, E)
    vp = _pad(v, E)
    outp = _pad(out.to(dt), E)
    doutp = _pad(dout.to(dt), E)
    if extra:
        vp[..., -1] = 1
        doutp[..., -1] = dlse.to(dt)
    if G > 1:  # (B, Hkv, keys, E) -> (B, Hq, keys, E): query head h reads KV head h // G
        kp, vp = kp.repeat_interleave(G, dim=1), vp.repeat_interleave(G, dim=1)
    glse = lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()
    additive = None
    if mask is not None:
        allowed = mask.materialize(B, Hq, rows, keys, device=q.device)  # (B|1, Hq|1, rows, keys)
        additive = torch.zeros(allowed.shape, dtype=dt, device=q.device).masked_fill_(~allowed, float("-inf"))
    gq, gk, gv = _FLASH_BACKWARD(doutp.contiguous(), qp.contiguous(), kp.contiguous(), vp.contiguous(),
                                 outp.contiguous(), glse, 0.0, False, attn_mask=additive, scale=scale)
    gq, gk, gv = gq[..., :D], gk[..., :D], gv[..., :Dv]
    if G > 1:
        gk = gk.reshape(B, Hkv, G, keys, D).sum(2)
        gv = gv.reshape(B, Hkv, G, keys, Dv).sum(2)
    return gq, gk, gv


def _pad(x: Tensor, E: int) -> Tensor:
    """``x (…, d)`` as a new tensor ``(…, E)`` with zeros after it (always a copy: callers write into it)."""
    padded = x.new_zeros(x.shape[:-1] + (E,))
    padded[..., :x.shape[-1]] = x
    return padded


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k, v], dim=-1).contiguous()  # (B, Hkv, Sk, D + Dv)


def _pack_like(k: Tensor, v: Tensor):
    shape = k.shape[:3] + (k.shape[3] + v.shape[3],)
    return lambda: torch.empty(shape, dtype=k.dtype, device=k.device)


class _Rotation:
    """Iterate ``(s, keys held at step s)`` over step 0 and the plan's ``steps``, receiving the
    next step's shard (and sending this rank's to whoever needs it) while the current step computes.

    At step ``s`` rank ``r`` receives from ``r - s`` and sends to ``r + s``, only where the plan
    says the receiving side has a visible block. Every rank walks the same steps and posts its
    messages at the same points, so each send meets its receive in order (``held`` is ``None``
    at a step where this rank receives nothing)."""

    def __init__(self, plan: RingPlan, group, own: Tensor | None, new_buffer):
        self.plan, self.group, self.own, self.new_buffer = plan, group, own, new_buffer

    def __iter__(self):
        steps = (0,) + self.plan.steps
        sends: list = []
        pending = self._start(steps[1], sends) if len(steps) > 1 else None
        for i, s in enumerate(steps):
            held = None
            if s > 0:
                held, work = pending
                if work is not None:
                    work.wait()
                pending = self._start(steps[i + 1], sends) if i + 1 < len(steps) else None
            yield s, held
        for w in sends:
            w.wait()

    def _start(self, s: int, sends: list):
        P, r, plan = self.plan.world, self.plan.rank, self.plan
        buffer, recv = None, None
        if plan.send[s]:
            sends.append(dist.isend(self.own, _peer(self.group, (r + s) % P), self.group, tag=2 * s))
        if plan.recv[s]:
            buffer = self.new_buffer()
            recv = dist.irecv(buffer, _peer(self.group, (r - s) % P), self.group, tag=2 * s)
        return buffer, recv


class _GradientReturn:
    """After step ``s`` of the backward: the gradient of the keys held at step ``s`` goes back to
    their owner ``r - s``, and the gradient of this rank's keys comes back from ``r + s`` (posted
    at the same point on both sides). Received gradients are added to ``dkv_own`` one step later
    (overlapped with the next step) in step order: the same sum order on every run."""

    def __init__(self, plan: RingPlan, group, dkv_own: Tensor):
        self.plan, self.group, self.dkv_own = plan, group, dkv_own
        self.sends: list = []
        self.pending: tuple | None = None

    def exchange(self, s: int, dkv: Tensor | None) -> None:
        P, r, plan = self.plan.world, self.plan.rank, self.plan
        if plan.recv[s]:
            self.sends.append((dkv, dist.isend(dkv, _peer(self.group, (r - s) % P), self.group, tag=2 * s + 1)))
        incoming = None
        if plan.send[s]:
            buffer = torch.empty_like(self.dkv_own)
            incoming = (buffer, dist.irecv(buffer, _peer(self.group, (r + s) % P), self.group, tag=2 * s + 1))
        self._add_pending()
        self.pending = incoming

    def finish(self) -> None:
        self._add_pending()
        for _, work in self.sends:
            work.wait()

    def _add_pending(self) -> None:
        if self.pending is not None:
            buffer, work = self.pending
            work.wait()
            self.dkv_own += buffer
            self.pending = None


def _peer(group, group_rank: int) -> int:
    """``isend``/``irecv`` take global ranks."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
