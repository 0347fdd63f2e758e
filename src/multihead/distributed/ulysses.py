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

from multihead.attention import attention
from multihead.call import AttentionResult
from multihead.distributed.checks import agree, call_summary, check_group, check_mask, check_qkv, check_scale
from multihead.distributed.layout import check_divisible, check_layout, layout_order
from multihead.masks import Mask, head_range

__all__ = ["ulysses_attention"]

_WHERE = "ulysses_attention"


def ulysses_attention(
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
    """Attention over a sequence sharded across ``group``, by exchanging sequence shards for head
    shards; equal to :func:`multihead.attention` on the whole sequence.

    Arguments and result as in :func:`multihead.distributed.ring_attention` (``q (B, Hq, S, D)``,
    ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)`` in ``layout``; the mask of the whole attention),
    with two more conditions: ``P`` divides ``Hq``, and ``P`` divides ``Hkv`` or ``Hkv`` divides
    ``P`` (KV heads are then replicated). Any mask: the local call sees the whole sequence.
    """
    world, rank = check_group(group, _WHERE)
    error, summary, shards = None, {}, None
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
        summary = call_summary(q, k, v, mask=mask, layout=layout, scale=scale, return_lse=return_lse, backend=backend)
    except Exception as e:  # any failure here (a mask's fingerprint too) must reach the other ranks
        error = e
    agree(_WHERE, group, rank, error, summary)
    assert shards is not None and not isinstance(mask, Tensor)  # checked above: agree() raised on every rank otherwise

    S, Hq, Hkv = shards.Sq, shards.Hq, shards.Hkv
    if Hkv % world:  # replicate: rank j then receives KV head kv_head_of(j·Hq/P)
        k = k.repeat_interleave(world // Hkv, dim=1)  # (B, P, S, D)
        v = v.repeat_interleave(world // Hkv, dim=1)  # (B, P, S, Dv)
    order = layout_order(S, world, layout).to(q.device)  # the position of each gathered row
    natural = None if layout == "contiguous" else torch.argsort(order)
    qh = _to_heads(q, group, natural)  # (B, Hq/P, L, D)
    kh = _to_heads(k, group, natural)  # (B, Hkv/P or 1, L, D)
    vh = _to_heads(v, group, natural)  # (B, Hkv/P or 1, L, Dv)
    local_mask = head_range(mask, rank * (Hq // world), Hq // world, Hq)  # this rank's heads, read as 0..Hq/P-1
    # The LSE only when asked for: under autograd a kernel without a differentiable LSE would
    # have it recomputed from the weights (row blocks of scores: memory and time for nothing).
    res = attention(qh, kh, vh, mask=local_mask, scale=scale, return_lse=return_lse, backend=backend)
    if isinstance(res, Tensor):  # return_lse=False
        return _to_sequence(res, group, order if natural is not None else None)  # (B, Hq, S, Dv)
    assert res.lse is not None  # asked for
    out = _to_sequence(res.output, group, order if natural is not None else None)  # (B, Hq, S, Dv)
    lse = _to_sequence(res.lse.unsqueeze(-1), group, order if natural is not None else None).squeeze(-1)
    return AttentionResult(out, None, lse)  # lse (B, Hq, S)


def _to_heads(x: Tensor, group, natural: Tensor | None) -> Tensor:
    """``(B, H, S, ·)`` sequence shards -> ``(B, H/P, L, ·)`` head shards in position order."""
    y = _AllToAll.apply(x, group, 1, 2)  # (B, H/P, L, ·) in layout order
    return y if natural is None else y.index_select(2, natural)


def _to_sequence(y: Tensor, group, order: Tensor | None) -> Tensor:
    """``(B, H/P, L, ·)`` in position order -> ``(B, H, S, ·)`` this rank's sequence shard."""
    y = y if order is None else y.index_select(2, order)  # layout order
    return _AllToAll.apply(y, group, 2, 1)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter`` into ``P`` parts, part ``j`` to rank ``j``; concatenate what
    arrives along ``gather`` in rank order. Its gradient is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: Tensor, group, scatter: int, gather: int) -> Tensor:
    P = dist.get_world_size(group)
    parts = [p.contiguous() for p in x.chunk(P, dim=scatter)]
    received = [torch.empty_like(parts[0]) for _ in range(P)]
    dist.all_to_all(received, parts, group=group)
    return torch.cat(received, dim=gather)
