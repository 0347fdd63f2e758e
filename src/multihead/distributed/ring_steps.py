"""The steps of :func:`multihead.distributed.ring_attention`: what a rank computes with the keys
it holds at one step of the ring, forward and backward, one :class:`~multihead.distributed.plan.Call`
at a time. The ring itself (:mod:`multihead.distributed.ring`) walks the steps and moves tensors
(:mod:`multihead.distributed.rotation`); this module only computes.

* forward: each call's partial ``(o_i, lse_i)`` merged into the rank's ``(out, lse)`` in place
  (:func:`merge_into`);
* backward: each call's gradients against the *merged* ``(out, lse)``: from the backend that
  runs the call (``Backend.backward_from_lse``), or by autograd through the call
  (:func:`autograd_block_backward`), which is also how a score modifier's tensors get theirs;
* a score modifier of the whole attention is read at each call's absolute positions
  (:func:`block_mod`, :func:`multihead.scores.shifted`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.attention import attention, dispatch
from multihead.call import AttentionCall
from multihead.distributed.plan import Call
from multihead.scores import shifted

__all__ = [
    "merge_into",
    "block_mod",
    "step_forward",
    "step_backward",
    "block_backward",
    "autograd_block_backward",
    "ModGradients",
]


def merge_into(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
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


def block_mod(c: Call, positioned):
    """The score modifier of call ``c``: the whole attention's, read at the block's positions."""
    if positioned is None:
        return None
    mod, Lq, Lk = positioned
    assert c.q_start is not None and c.k_start is not None  # a plan made with positions=True
    return shifted(mod, c.q_start, c.k_start, q_len=Lq, kv_len=Lk)


def step_forward(calls, q, k, v, out, lse, scale, backend, positioned) -> None:
    """One step of the forward: each call's partial result merged into ``(out, lse)``, one at a time."""
    for c in calls:
        res = attention(
            q[:, :, c.q0 : c.q1],
            k[:, :, c.k0 : c.k1],
            v[:, :, c.k0 : c.k1],
            mask=c.mask,
            score_mod=block_mod(c, positioned),
            scale=scale,
            return_lse=True,
            backend=backend,
        )
        assert res.lse is not None  # asked for
        merge_into(out[:, :, c.q0 : c.q1], lse[:, :, c.q0 : c.q1], res.output.to(out.dtype), res.lse)
        del res  # before the next call's output exists


def step_backward(calls, q, k, v, grads, out, lse, dout, dlse, scale, backend, positioned) -> None:
    """One step of the backward: each call's gradients added to ``grads``: ``dq`` (this rank's
    queries), ``dk, dv`` (the keys ``k, v`` held at this step) and the modifier's tensors'."""
    dq, dk, dv, mod_grads = grads
    for c in calls:
        rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
        block = (q[:, :, rows], k[:, :, keys], v[:, :, keys])
        merged = (out[:, :, rows], lse[:, :, rows], dout[:, :, rows], None if dlse is None else dlse[:, :, rows])
        mod = block_mod(c, positioned)
        if mod is None:
            gq, gk, gv = block_backward(*block, c.mask, scale, backend, *merged)
        else:  # no kernel here takes a modifier in its backward from the LSE: autograd through the block
            gq, gk, gv, *gt = autograd_block_backward(*block, c.mask, scale, backend, *merged, mod, mod_grads.wanted)
            mod_grads.add(gt)
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv


def block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse):
    """Gradients of ``q, k, v`` of one block, from the gradients of the merged ``(out, lse)``: from
    the backend that runs the block's call, where it offers them from ``(out, lse)``
    (:meth:`~multihead.backends.base.Backend.backward_from_lse`; on CPU the flash backward), else
    by autograd through the block's :func:`multihead.attention` call with that ``backend``."""
    call = AttentionCall(q, k, v, mask, None, scale, 0.0, None, True)  # the forward's block call
    grads = dispatch(call, backend).backward_from_lse(call, out, lse, dout, dlse)
    if grads is not None:
        return grads
    return autograd_block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse)


def autograd_block_backward(q, k, v, mask, scale, backend, out, lse, dout, dlse, score_mod=None, wanted=()):
    """Any device, backend, mask and score modifier: the block recomputed with
    :func:`multihead.attention` under autograd, and its output and LSE given the merge's gradients
    (module docstring). Returns ``dq, dk, dv`` and the gradients of the ``wanted`` tensors that the
    modifier reads (``None`` where one does not reach them)."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        res = attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_lse=True, backend=backend)
        assert res.lse is not None  # asked for
        part_lse = res.lse.detach()
        # w = exp(lse_i - lse): 0 where the block has no key for the row (also when no block has any)
        w = torch.where(torch.isneginf(part_lse), torch.zeros_like(part_lse), torch.exp(part_lse - lse))
        g_out = w.unsqueeze(-1) * dout  # (B, Hq, rows, Dv)
        g_lse = w * (dout * (res.output.detach().to(out.dtype) - out)).sum(-1)  # (B, Hq, rows)
        if dlse is not None:
            g_lse = g_lse + w * dlse
        gq, gk, gv, *gt = torch.autograd.grad(
            [res.output, res.lse], [q, k, v, *wanted], [g_out.to(res.output.dtype), g_lse], allow_unused=True
        )
    zero = torch.zeros_like
    grads = (zero(q) if gq is None else gq), (zero(k) if gk is None else gk), (zero(v) if gv is None else gv)
    return grads + tuple(gt) if score_mod is not None else grads


class ModGradients:
    """The gradients of the tensors a score modifier reads (those that require grad), summed over
    every block of this rank; ``result()`` in the order of ``score_mod.tensors()``."""

    def __init__(self, tensors: tuple[Tensor, ...]):
        self.tensors = tensors
        self.wanted = tuple(t for t in self.tensors if t.requires_grad)
        self.sums: list = [None] * len(self.wanted)

    def add(self, grads) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.sums[i] = g if self.sums[i] is None else self.sums[i] + g

    def result(self) -> tuple:
        by_id = {id(t): g for t, g in zip(self.wanted, self.sums)}
        return tuple(by_id.get(id(t)) for t in self.tensors)
