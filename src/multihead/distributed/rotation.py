"""The point-to-point schedule of :func:`multihead.distributed.ring_attention`: K/V shards
travelling round the ring in the forward and backward (:class:`Rotation`), and the gradients of
the keys going back to the ranks that own them (:class:`GradientReturn`), each overlapped with
the computation of the step before. Which steps send and receive is the plan's
(:func:`multihead.distributed.plan.plan_ring`); this module only moves tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.distributed.plan import RingPlan

__all__ = ["Rotation", "GradientReturn", "buffers_like"]


def buffers_like(k: Tensor, v: Tensor):
    """Receive buffers for another rank's ``k (B, Hkv, Sk, D)`` and ``v (B, Hkv, Sk, Dv)``."""
    return lambda: [
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    ]


class Rotation:
    """Iterate ``(s, keys held at step s)`` over step 0 and the plan's ``steps``, receiving the
    next step's shard (and sending this rank's to whoever needs it) while the current step computes.

    At step ``s`` rank ``r`` receives ``(k, v)`` from ``r - s`` and sends its own to ``r + s``,
    only where the plan says the receiving side has a visible block. Every rank walks the same
    steps and posts its messages at the same points, so each send meets its receive in order
    (``held`` is ``None`` at a step where this rank receives nothing). ``held`` is a list
    ``[k, v]`` the caller may empty once done with it (the rotation keeps no other reference),
    so at most two received shards are alive: the one computed on and the next one arriving."""

    def __init__(self, plan: RingPlan, group, own: tuple[Tensor, Tensor] | None, new_buffers):
        self.plan, self.group, self.own, self.new_buffers = plan, group, own, new_buffers

    def __iter__(self):
        steps = (0,) + self.plan.steps
        sends: list = []
        pending = self._start(steps[1], sends) if len(steps) > 1 else None
        for i, s in enumerate(steps):
            held = None
            if s > 0:
                assert pending is not None  # started at the previous step
                held, works = pending
                for work in works:
                    work.wait()
                del works  # a finished receive keeps its buffer alive
                pending = self._start(steps[i + 1], sends) if i + 1 < len(steps) else None
            yield s, held
        for w in sends:
            w.wait()

    def _start(self, s: int, sends: list):
        P, r, plan = self.plan.world, self.plan.rank, self.plan
        buffers, works = None, []
        if plan.send[s]:
            to = _peer(self.group, (r + s) % P)
            assert self.own is not None  # a rank that sends holds its own shard
            sends += [dist.isend(t, to, self.group, tag=_tag(s, i)) for i, t in enumerate(self.own)]
        if plan.recv[s]:
            buffers = self.new_buffers()
            source = _peer(self.group, (r - s) % P)
            works = [dist.irecv(t, source, self.group, tag=_tag(s, i)) for i, t in enumerate(buffers)]
        return buffers, works


class GradientReturn:
    """After step ``s`` of the backward: the gradients ``[dk, dv]`` of the keys held at step ``s``
    go back to their owner ``r - s``, and those of this rank's keys come back from ``r + s``
    (posted at the same point on both sides). Received gradients are added to ``dkv_own`` one step
    later (overlapped with the next step) in step order: the same sum order on every run. A sent
    gradient is released one step later too, so at most one is in flight whatever ``P``."""

    def __init__(self, plan: RingPlan, group, dkv_own: list[Tensor]):
        self.plan, self.group, self.dkv_own = plan, group, dkv_own
        self.sent: list = []
        self.pending: tuple | None = None

    def exchange(self, s: int, dkv: list[Tensor] | None) -> None:
        P, r, plan = self.plan.world, self.plan.rank, self.plan
        sent = []
        if plan.recv[s]:
            to = _peer(self.group, (r - s) % P)
            assert dkv is not None  # a step that received keys computed their gradients
            sent = [(g, dist.isend(g, to, self.group, tag=_tag(s, 2 + i))) for i, g in enumerate(dkv)]
        incoming = None
        if plan.send[s]:
            buffers = [torch.empty_like(g) for g in self.dkv_own]
            source = _peer(self.group, (r + s) % P)
            incoming = (buffers, [dist.irecv(g, source, self.group, tag=_tag(s, 2 + i)) for i, g in enumerate(buffers)])
        self._release_sent()
        self._add_pending()
        self.sent, self.pending = sent, incoming

    def finish(self) -> None:
        self._release_sent()
        self._add_pending()

    def _release_sent(self) -> None:
        for _, work in self.sent:
            work.wait()
        self.sent = []

    def _add_pending(self) -> None:
        if self.pending is not None:
            buffers, works = self.pending
            for own, buffer, work in zip(self.dkv_own, buffers, works):
                work.wait()
                own += buffer
            self.pending = None


def _tag(s: int, i: int) -> int:
    """Message tags of step ``s``: ``k`` (0), ``v`` (1), their gradients ``dk`` (2) and ``dv`` (3)."""
    return 4 * s + i


def _peer(group, group_rank: int) -> int:
    """``isend``/``irecv`` take global ranks."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
