"""``ulysses_attention``: head-parallel attention over a sequence sharded across ranks (DeepSpeed
Ulysses).

Two all-to-alls around one local :func:`multihead.attention`::

    q (B, Hq, S, D) on each rank ──all-to-all──> (B, Hq/P, L, D): every position, Hq/P heads
                                    local attention(mask=the global mask) over the whole sequence
    out (B, Hq, S, Dv)    <──all-to-all── (B, Hq/P, L, Dv)

Rank ``j`` attends with query heads ``[j·Hq/P, (j+1)·Hq/P)``. K/V go the same way with their
``Hkv`` heads when ``P`` divides ``Hkv``; when ``P > Hkv`` (``Hkv`` divides ``P``) each KV head is
first repeated ``P/Hkv`` times, so rank ``j`` receives exactly the KV head its query heads read
(:func:`multihead.conventions.kv_head_of`). The sequence arrives in layout order (rank 0's shard,
rank 1's, ...) and is put in position order before the local call, so the mask is the global one
as it is. Communication per rank: ``(P-1)/P`` of its q, k, v and output shards, twice for the
backward, independent of the mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from multihead import scores
from multihead.attention import attention
from multihead.call import AttentionResult, ScoreModArg
from multihead.distributed.checks import (
    agree,
    call_summary,
    check_group,
    check_mask,
    check_qkv,
    check_scale,
    check_score_mod,
)
from multihead.distributed.layout import check_divisible, check_layout, pieces
from multihead.masks import Mask, head_range
from multihead.sinks import check_sinks

__all__ = ["ulysses_attention", "Runs", "to_heads", "to_sequence"]

_WHERE = "ulysses_attention"


def ulysses_attention(
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
    """Attention over a sequence sharded across ``group``, by exchanging sequence shards for head
    shards; equal to :func:`multihead.attention` on the whole sequence.

    Arguments and result as in :func:`multihead.distributed.ring_attention` (``q (B, Hq, S, D)``,
    ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` in ``layout``; the mask of the whole attention),
    with two more conditions: ``P`` divides ``Hq``, and ``P`` divides ``Hkv`` or ``Hkv`` divides
    ``P`` (KV heads are then replicated). Any mask: the local call sees the whole sequence.
    ``score_mod``, ``softcap`` and ``sinks`` as in :func:`~multihead.distributed.ring_attention`:
    the local call reads them at this rank's heads (:func:`multihead.scores.head_range`,
    :func:`multihead.scores.sinks_range`), at positions that are already the whole sequence's.
    """
    world, rank = check_group(group, _WHERE)
    error, summary, shards, mod = None, {}, None, None
    try:
        shards = check_qkv(_WHERE, q, k, v, world)
        check_layout(layout, _WHERE)
        if shards.Sq != shards.Sk:
            raise ValueError(
                f"{_WHERE}: q holds {shards.Sq} positions but k holds {shards.Sk} on this rank; the "
                "all-to-all exchanges one sequence, so expected equal shards (use ring_attention for "
                "Lq != Lk)"
            )
        check_divisible(_WHERE, "L", shards.Lq, world, layout)
        if shards.Hq % world:
            raise ValueError(
                f"{_WHERE}: Hq={shards.Hq} query heads do not split over {world} ranks; expected a "
                f"multiple of {world}; hint: ring_attention has no condition on heads"
            )
        if shards.Hkv % world and world % shards.Hkv:
            raise ValueError(
                f"{_WHERE}: Hkv={shards.Hkv} key/value heads neither split over {world} ranks nor divide "
                f"{world} (to be replicated); expected a multiple or a divisor of {world}"
            )
        mask = check_mask(_WHERE, mask, shards)
        scale = check_scale(_WHERE, scale, shards.D)
        if not isinstance(return_lse, bool):
            raise TypeError(f"{_WHERE}: return_lse must be a bool, got {type(return_lse).__name__}")
        if not isinstance(backend, str):
            raise TypeError(
                f"{_WHERE}: backend must be a str ('auto' or a registered name), got {type(backend).__name__}"
            )
        mod = check_score_mod(_WHERE, score_mod, softcap, shards)
        check_sinks(sinks, q)
        summary = call_summary(
            q,
            k,
            v,
            mask=mask,
            score_mod=mod,
            sinks=sinks,
            layout=layout,
            scale=scale,
            return_lse=return_lse,
            backend=backend,
        )
    except Exception as e:  # any failure here (a mask's fingerprint too) must reach the other ranks
        error = e
    agree(_WHERE, group, rank, error, summary)
    assert shards is not None and not isinstance(mask, Tensor)  # checked above: agree() raised on every rank otherwise

    S, Hq, Hkv = shards.Sq, shards.Hq, shards.Hkv
    runs = Runs(S, world, layout)
    # With P > Hkv each KV head travels to the P/Hkv ranks whose query heads read it: rank j
    # receives KV head kv_head_of(j·Hq/P) = j // (P/Hkv), replicated inside the exchange's one copy.
    replicas = world // Hkv if Hkv % world else 1
    qh = _SequenceToHeads.apply(q, group, runs, 1)  # (B, Hq/P, L, D) in position order
    kh = _SequenceToHeads.apply(k, group, runs, replicas)  # (B, Hkv/P or 1, L, D)
    vh = _SequenceToHeads.apply(v, group, runs, replicas)  # (B, Hkv/P or 1, L, Dv)
    # This rank's heads [first, first + Hq/P), read by the local call as 0 .. Hq/P - 1.
    first, count = rank * (Hq // world), Hq // world
    local_mask = head_range(mask, first, count, Hq)
    local_mod = scores.head_range(mod, first, count, Hq)
    local_sinks = scores.sinks_range(sinks, first, count, Hq)
    # The LSE only when asked for: under autograd a kernel without a differentiable LSE would
    # have it recomputed from the weights (row blocks of scores: memory and time for nothing).
    res = attention(
        qh,
        kh,
        vh,
        mask=local_mask,
        score_mod=local_mod,
        sinks=local_sinks,
        scale=scale,
        return_lse=return_lse,
        backend=backend,
    )
    if isinstance(res, Tensor):  # return_lse=False
        return _HeadsToSequence.apply(res, group, runs)  # (B, Hq, S, Dv)
    assert res.lse is not None  # asked for
    out = _HeadsToSequence.apply(res.output, group, runs)  # (B, Hq, S, Dv)
    lse = _HeadsToSequence.apply(res.lse.unsqueeze(-1), group, runs).squeeze(-1)  # (B, Hq, S)
    return AttentionResult(out, None, lse)


class Runs:
    """Where each rank's shard sits in the whole sequence: ``(rank, local, start, length)`` runs of
    consecutive positions (:func:`~multihead.distributed.layout.pieces`), one per contiguous
    shard, two per zigzag shard."""

    def __init__(self, shard_len: int, world: int, layout: str):
        self.S, self.P, self.layout = shard_len, world, layout
        self.runs = [(r, *p) for r in range(world) for p in pieces(shard_len, r, world, layout)]


def to_heads(x: Tensor, group, runs: Runs, replicas: int = 1) -> Tensor:
    """Sequence shards ``(B, H, S, ·)`` -> head shards ``(B, H·replicas/P, P·S, ·)``, the positions
    of ``runs`` in order (differentiable: its gradient is the opposite exchange)."""
    return _SequenceToHeads.apply(x, group, runs, replicas)


def to_sequence(y: Tensor, group, runs: Runs) -> Tensor:
    """Head shards ``(B, H/P, P·S, ·)`` -> this rank's sequence shard ``(B, H, S, ·)``."""
    return _HeadsToSequence.apply(y, group, runs)


# One exchange = one send buffer, one receive buffer, one reorder, each written by a single copy:
#   sequence -> heads: send (P, B, H/P, S, ·) is x's head blocks (a view of x when B = 1 and x is
#     contiguous); what arrives from rank i is rank i's positions; copied run by run into the
#     (B, H/P, L, ·) result in position order.
#   heads -> sequence: send (P, B, H/P, S, ·) is the positions of rank j, copied run by run from
#     y; what arrives is head block i of this rank's positions, (B, H, S, ·) as a view when B = 1.
# The send buffer is released before the reorder, so an exchange holds at most two buffers of
# its size at once (the previous version held four: the parts, the received parts, their
# concatenation and the reorder).


def _sequence_to_heads(x: Tensor, group, runs: Runs, replicas: int) -> Tensor:
    """``(B, H, S, ·)`` sequence shards -> ``(B, H·replicas/P, L, ·)`` head shards in position order;
    virtual head ``h·replicas + i`` is head ``h``."""
    B, H, S, E = x.shape
    P = runs.P
    Hs = H * replicas // P
    if replicas == 1:
        send = x.unflatten(1, (P, Hs)).transpose(0, 1).contiguous()  # (P, B, Hs, S, E)
    else:  # Hs = 1: rank j receives head j // replicas
        send = x.transpose(0, 1).unsqueeze(1).expand(H, replicas, B, S, E).contiguous().view(P, B, 1, S, E)
    received = torch.empty_like(send)  # [i]: rank i's positions of this rank's heads
    dist.all_to_all_single(received, send, group=group)
    del send
    out = x.new_empty(B, Hs, P * S, E)
    for r, local, start, length in runs.runs:
        out[:, :, start : start + length].copy_(received[r, :, :, local : local + length])
    return out


def _heads_to_sequence(y: Tensor, group, runs: Runs) -> Tensor:
    """``(B, H/P, L, ·)`` in position order -> ``(B, H, S, ·)`` this rank's sequence shard."""
    B, Hs, _, E = y.shape
    P, S = runs.P, runs.S
    send = y.new_empty(P, B, Hs, S, E)  # [j]: rank j's positions
    for r, local, start, length in runs.runs:
        send[r, :, :, local : local + length].copy_(y[:, :, start : start + length])
    received = torch.empty_like(send)  # [i]: head block i of this rank's positions
    dist.all_to_all_single(received, send, group=group)
    del send
    return received.transpose(0, 1).reshape(B, P * Hs, S, E)  # a view when B = 1


class _SequenceToHeads(torch.autograd.Function):
    """:func:`_sequence_to_heads`; its gradient is the opposite exchange (replicas summed)."""

    @staticmethod
    def forward(ctx, x, group, runs: Runs, replicas: int):
        ctx.group, ctx.runs, ctx.replicas = group, runs, replicas
        return _sequence_to_heads(x, group, runs, replicas)

    @staticmethod
    def backward(ctx, grad):
        g = _heads_to_sequence(grad, ctx.group, ctx.runs)  # (B, H·replicas, S, ·)
        if ctx.replicas > 1:
            g = g.unflatten(1, (-1, ctx.replicas)).sum(2)  # (B, H, S, ·)
        return g, None, None, None


class _HeadsToSequence(torch.autograd.Function):
    """:func:`_heads_to_sequence`; its gradient is the opposite exchange."""

    @staticmethod
    def forward(ctx, y, group, runs: Runs):
        ctx.group, ctx.runs = group, runs
        return _heads_to_sequence(y, group, runs)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group, ctx.runs, 1), None, None
