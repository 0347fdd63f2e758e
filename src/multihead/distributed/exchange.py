"""The all-to-all between sequence shards and head shards (Ulysses' exchange, and the 2-D mesh's
inside a Ulysses group).

::

    to_heads     x (B, H, S, E) on each of P ranks  ->  (B, H·replicas/P, P·S, E): every position
                 of the runs, in position order, for this rank's heads
    to_sequence  y (B, H/P, P·S, E)                 ->  (B, H, S, E): this rank's positions

Both are differentiable; each one's gradient is the other (replicated heads' gradients summed).

One ``all_to_all_single`` per batch row, into and out of buffers laid out so that nothing is
copied twice::

    to_heads, row b     send = x[b] viewed (P, H/P, S, E): head block j to rank j (no copy when x
                        is contiguous); receive (P, H/P, S, E) into scratch; copy run by run into
                        the result in position order
    to_sequence, row b  send = scratch (P, H/P, S, E): rank j's positions, copied run by run from
                        y[b]; receive straight into result[b] viewed (P, H/P, S, E): the result
                        is what arrives, no reorder

Why a scratch buffer that lives as long as the caller wants (:class:`Scratch`): gloo's worker
thread drops its own reference to a finished collective's tensors a moment *after* the collective
returns to the caller. A buffer the caller frees right after the call is then freed by that thread,
later — and under load, after the caller has allocated its next buffer: the exchange's peak grew by
a buffer in about one call in a hundred (``tests/distributed``' Ulysses memory check failed that
way in loaded runs). Reusing one scratch buffer for every exchange of a call, and freeing it only
after the last one, makes the peak independent of when that thread runs; it also saves an
allocation per exchange. One row at a time keeps the scratch at ``1/B`` of a shard and makes the
send (``to_heads``) and the receive (``to_sequence``) views for every ``B``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.distributed.checks import Shards
from multihead.distributed.layout import pieces

__all__ = ["Runs", "Scratch", "to_heads", "to_sequence", "check_one_sequence", "check_head_split", "kv_replicas"]


def check_one_sequence(where: str, shards: Shards) -> None:
    """The exchange moves one sequence: ``q`` and ``k`` hold as many positions on each rank."""
    if shards.Sq != shards.Sk:
        raise ValueError(
            f"{where}: q holds {shards.Sq} positions but k holds {shards.Sk} on this rank; the "
            "all-to-all exchanges one sequence, so expected equal shards (use ring_attention for Lq != Lk)"
        )


def check_head_split(where: str, shards: Shards, P: int, ranks: str, hint: str) -> None:
    """The exchange over ``P`` ranks (``ranks``: how the messages name them) gives each rank
    ``Hq/P`` query heads, and ``Hkv/P`` KV heads or one replicated (:func:`kv_replicas`); ``hint``
    ends the message about query heads."""
    if shards.Hq % P:
        raise ValueError(
            f"{where}: Hq={shards.Hq} query heads do not split over {ranks}; expected a multiple of {P}; hint: {hint}"
        )
    if shards.Hkv % P and P % shards.Hkv:
        raise ValueError(
            f"{where}: Hkv={shards.Hkv} key/value heads neither split over {ranks} nor divide {P} (to be "
            f"replicated); expected a multiple or a divisor of {P}"
        )


def kv_replicas(P: int, Hkv: int) -> int:
    """How many of the ``P`` ranks receive each KV head: with ``P > Hkv``, the ``P/Hkv`` ranks whose
    query heads read it (rank ``j`` gets KV head ``kv_head_of(j·Hq/P) = j // (P/Hkv)``), else 1."""
    return P // Hkv if Hkv % P else 1


class Runs:
    """Where each rank's shard sits in the whole sequence: ``(rank, local, start, length)`` runs of
    consecutive positions (:func:`~multihead.distributed.layout.pieces`), one per contiguous
    shard, two per zigzag shard, more for a document layout."""

    def __init__(self, shard_len: int, world: int, layout):
        self.S, self.P, self.layout = shard_len, world, layout
        self.runs = [(r, *p) for r in range(world) for p in pieces(shard_len, r, world, layout)]


class Scratch:
    """Flat buffers that the exchanges of a call send from or receive into (module docstring: why),
    by role: ``"a"`` receives in :func:`to_heads` and sends in :func:`to_sequence`; ``"b"`` sends
    in :func:`to_heads` when ``x`` cannot be sent as a view (KV heads replicated, a strided
    ``x``). :meth:`reserve` sizes a role once, before the first exchange, so that it never grows
    (growing would free the old buffer while gloo may still hold it)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def reserve(self, like: Tensor, numel: int, role: str = "a") -> None:
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            self._buffers[role] = like.new_empty(numel)

    def take(self, like: Tensor, shape: tuple[int, ...], role: str = "a") -> Tensor:
        """A ``shape`` view of the role's buffer (its first elements), ``like``'s dtype and device."""
        self.reserve(like, math.prod(shape), role)
        return self._buffers[role][: math.prod(shape)].view(shape)


def to_heads(x: Tensor, group, runs: Runs, replicas: int = 1, scratch: Scratch | None = None) -> Tensor:
    """Sequence shards ``(B, H, S, E)`` -> head shards ``(B, H·replicas/P, P·S, E)``, the positions
    of ``runs`` in order; virtual head ``h·replicas + i`` is head ``h`` (KV heads sent to the
    ``replicas`` ranks whose query heads read them). ``scratch``: shared by the exchanges of one
    call (:class:`Scratch`); a fresh one when ``None``."""
    return _SequenceToHeads.apply(x, group, runs, replicas, scratch)


def to_sequence(y: Tensor, group, runs: Runs, scratch: Scratch | None = None) -> Tensor:
    """Head shards ``(B, H/P, P·S, E)`` -> this rank's sequence shard ``(B, H, S, E)``."""
    return _HeadsToSequence.apply(y, group, runs, scratch)


def _sequence_to_heads(x: Tensor, group, runs: Runs, replicas: int, scratch: Scratch) -> Tensor:
    B, H, S, E = x.shape
    P = runs.P
    Hs = H * replicas // P
    out = x.new_empty(B, Hs, P * S, E)  # (B, Hs, L, E) in position order
    for b in range(B):
        if replicas == 1 and x[b].is_contiguous():
            send = x[b].view(P, Hs, S, E)  # head block j for rank j: a view
        else:  # Hs = 1 with replicas: rank j receives head j // replicas; one copy writes the replicas
            send = scratch.take(x, (P, Hs, S, E), role="b")
            send.view(H, replicas, S, E).copy_(x[b].unsqueeze(1).expand(H, replicas, S, E))
        received = scratch.take(x, (P, Hs, S, E))  # [i]: rank i's positions of this rank's heads
        dist.all_to_all_single(received, send, group=group)
        for r, local, start, length in runs.runs:
            out[b, :, start : start + length].copy_(received[r, :, local : local + length])
    return out


def _heads_to_sequence(y: Tensor, group, runs: Runs, scratch: Scratch) -> Tensor:
    B, Hs, _, E = y.shape
    P, S = runs.P, runs.S
    out = y.new_empty(B, P * Hs, S, E)  # (B, H, S, E): row b viewed (P, Hs, S, E) is what arrives
    for b in range(B):
        send = scratch.take(y, (P, Hs, S, E))  # [j]: rank j's positions
        for r, local, start, length in runs.runs:
            send[r, :, local : local + length].copy_(y[b, :, start : start + length])
        dist.all_to_all_single(out[b].view(P, Hs, S, E), send, group=group)
    return out


class _SequenceToHeads(torch.autograd.Function):
    """:func:`_sequence_to_heads`; its gradient is the opposite exchange (replicas summed)."""

    @staticmethod
    def forward(ctx, x, group, runs: Runs, replicas: int, scratch: Scratch | None):
        ctx.group, ctx.runs, ctx.replicas = group, runs, replicas
        return _sequence_to_heads(x, group, runs, replicas, scratch or Scratch())

    @staticmethod
    def backward(ctx, grad):
        g = _heads_to_sequence(grad, ctx.group, ctx.runs, Scratch())  # (B, H·replicas, S, ·)
        if ctx.replicas > 1:
            g = g.unflatten(1, (-1, ctx.replicas)).sum(2)  # (B, H, S, ·)
        return g, None, None, None, None


class _HeadsToSequence(torch.autograd.Function):
    """:func:`_heads_to_sequence`; its gradient is the opposite exchange."""

    @staticmethod
    def forward(ctx, y, group, runs: Runs, scratch: Scratch | None):
        ctx.group, ctx.runs = group, runs
        return _heads_to_sequence(y, group, runs, scratch or Scratch())

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group, ctx.runs, 1, Scratch()), None, None, None
