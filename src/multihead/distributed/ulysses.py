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

from functools import partial

from torch import Tensor

from multihead import scores
from multihead.attention import attention
from multihead.call import AttentionResult, ScoreModArg
from multihead.distributed.checks import Shards, agree, check_call, check_group
from multihead.distributed.exchange import (
    Runs,
    Scratch,
    check_head_split,
    check_one_sequence,
    kv_replicas,
    to_heads,
    to_sequence,
)
from multihead.distributed.layout import check_divisible
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

    def shapes(shards: Shards) -> None:
        check_one_sequence(_WHERE, shards)
        check_divisible(_WHERE, "L", shards.Lq, world, layout)
        check_head_split(_WHERE, shards, world, f"{world} ranks", "ring_attention has no condition on heads")

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
    shards, mask, mod, scale = checked.shards, checked.mask, checked.score_mod, checked.scale

    S, Hq, Hkv = shards.Sq, shards.Hq, shards.Hkv
    runs = Runs(S, world, layout)
    replicas = kv_replicas(world, Hkv)  # replicated inside the exchange's one copy
    # One scratch buffer for the four exchanges (exchange.py: why), a batch row of the largest.
    scratch = Scratch()
    scratch.reserve(q, Hq * S * max(shards.D, shards.Dv))
    if replicas > 1 or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        scratch.reserve(q, Hq * S * max(shards.D, shards.Dv), role="b")
    qh = to_heads(q, group, runs, 1, scratch)  # (B, Hq/P, L, D) in position order
    kh = to_heads(k, group, runs, replicas, scratch)  # (B, Hkv/P or 1, L, D)
    vh = to_heads(v, group, runs, replicas, scratch)  # (B, Hkv/P or 1, L, Dv)
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
    del qh, kh, vh  # without autograd nothing else holds them: freed before the exchange out
    if isinstance(res, Tensor):  # return_lse=False
        return to_sequence(res, group, runs, scratch)  # (B, Hq, S, Dv)
    assert res.lse is not None  # asked for
    out = to_sequence(res.output, group, runs, scratch)  # (B, Hq, S, Dv)
    lse = to_sequence(res.lse.unsqueeze(-1), group, runs).squeeze(-1)  # (B, Hq, S): fp32, its own buffer
    return AttentionResult(out, None, lse)
