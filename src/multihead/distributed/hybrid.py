"""``hybrid_attention``: a 2-D context-parallel mesh, Ulysses inside a group, the ring across
groups (USP's hybrid, LoongTrain's head x context parallelism).

``P = R · U`` ranks form a mesh of ``R`` ring ranks by ``U`` Ulysses ranks (:class:`Mesh2D`: two
process groups, or a 2-D ``DeviceMesh`` whose dims are ``(ring, ulysses)``). Ulysses alone
cannot use more ranks than heads; the ring alone sends its K/V over every link. Here the
all-to-alls stay inside a Ulysses group (one node, fast links) and only the ring's K/V shards,
``U`` times fewer heads of them, cross groups::

    q (B, Hq, S, D) on rank (r, u) ──all-to-all in ulysses group r──> (B, Hq/U, U·S, D)
        = ring rank r's shard of the sequence, heads [u·Hq/U, (u+1)·Hq/U)
    ring_attention over the ring group u (the whole mask, score modifiers and sinks read at
        those heads: multihead.masks.head_range, multihead.scores.head_range)
    out (B, Hq, S, Dv)    <──all-to-all in ulysses group r── (B, Hq/U, U·S, Dv)

**The layout is composed**: the sequence is cut over the ``R`` ring ranks in ``layout`` (zigzag
by default: balanced causal work across ring ranks), and each ring rank's shard is cut
contiguously over its ``U`` Ulysses ranks (the heads balance the work inside a group)::

    L = 16, R = 2, U = 2, zigzag    positions  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
    ring rank                                  0         1         1           0
    ring shard of ring rank 0: 0 1 2 3 12 13 14 15  ->  ulysses rank 0: 0 1 2 3, 1: 12 13 14 15

:func:`hybrid_shard`, :func:`hybrid_unshard` and :func:`hybrid_positions` cut, gather and number
a sequence this way (RoPE must rotate by :func:`hybrid_positions`). GQA: ``U`` divides ``Hkv``
(KV heads split) or ``Hkv`` divides ``U`` (each KV head replicated to the ranks that read it),
as for Ulysses; the ring has no condition on heads.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.call import AttentionResult, ScoreModArg
from multihead.distributed.checks import Shards, agree_mesh, check_call
from multihead.distributed.exchange import (
    Runs,
    Scratch,
    check_head_split,
    check_one_sequence,
    kv_replicas,
    to_heads,
    to_sequence,
)
from multihead.distributed.layout import (
    check_divisible,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from multihead.distributed.ring import ring_attention
from multihead.masks import Mask, head_range
from multihead.scores import head_range as score_head_range
from multihead.scores import sinks_range

__all__ = ["Mesh2D", "hybrid_attention", "hybrid_shard", "hybrid_unshard", "hybrid_positions"]

_WHERE = "hybrid_attention"


class Mesh2D(NamedTuple):
    """The two process groups of a 2-D context-parallel mesh: ``ring``, the ranks that hold the
    other Ulysses groups' parts of the sequence with the same heads (across nodes), and
    ``ulysses``, the ranks that share one ring rank's part of the sequence by heads (inside a
    node). :meth:`of` builds it from a 2-D ``DeviceMesh``."""

    ring: Any  # a ProcessGroup
    ulysses: Any

    @classmethod
    def of(cls, mesh) -> Mesh2D:
        """``mesh``: a :class:`Mesh2D`, a pair ``(ring_group, ulysses_group)``, or a 2-D
        ``torch.distributed.device_mesh.DeviceMesh`` of dims ``(ring, ulysses)``."""
        if isinstance(mesh, Mesh2D):
            return mesh
        if isinstance(mesh, tuple) and len(mesh) == 2:
            return cls(*mesh)
        if hasattr(mesh, "get_group") and getattr(mesh, "ndim", None) == 2:
            return cls(mesh.get_group(0), mesh.get_group(1))
        got = f"a {getattr(mesh, 'ndim', '?')}-D DeviceMesh" if hasattr(mesh, "get_group") else type(mesh).__name__
        raise TypeError(
            f"{_WHERE}: mesh must be a 2-D DeviceMesh of dims (ring, ulysses), a pair (ring_group, "
            f"ulysses_group) or a Mesh2D, got {got}"
        )

    def sizes(self) -> tuple[int, int]:
        """``(R, U)``."""
        return dist.get_world_size(self.ring), dist.get_world_size(self.ulysses)


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh,
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Tensor | AttentionResult:
    """Attention over a sequence sharded across a 2-D mesh of ``R x U`` ranks (module docstring),
    equal to :func:`multihead.attention` on the whole sequence.

    Arguments and result as in :func:`multihead.distributed.ring_attention`, with ``mesh`` (see
    :meth:`Mesh2D.of`) in place of ``group``: ``q (B, Hq, S, D)``, ``k (B, Hkv, S, D)``,
    ``v (B, Hkv, S, Dv)`` this rank's shard of ``L = R·U·S`` positions in the composed layout
    (:func:`hybrid_shard`); ``U`` divides ``Hq``, and ``U`` divides ``Hkv`` or ``Hkv`` divides
    ``U``. Inputs are checked and agreed on by every rank of the mesh before anything moves."""
    groups = Mesh2D.of(mesh)
    R, U = groups.sizes()
    u = dist.get_rank(groups.ulysses)

    def shapes(shards: Shards) -> None:
        check_one_sequence(_WHERE, shards)
        check_divisible(_WHERE, "L", shards.Lq, R, layout)
        check_head_split(
            _WHERE,
            shards,
            U,
            f"the {U} ranks of a Ulysses group",
            "a smaller Ulysses dimension, or ring_attention alone",
        )

    checked = check_call(
        _WHERE,
        q,
        k,
        v,
        R * U,
        shapes,
        partial(agree_mesh, _WHERE, groups.ulysses, groups.ring),
        mask=mask,
        score_mod=score_mod,
        softcap=softcap,
        sinks=sinks,
        layout=layout,
        scale=scale,
        return_lse=return_lse,
        backend=backend,
        agreed={"mesh": (R, U), "return_lse": return_lse},  # a rank asking for the LSE runs one more exchange
    )
    shards, mask, mod, scale = checked.shards, checked.mask, checked.score_mod, checked.scale

    S, Hq, Hkv = shards.Sq, shards.Hq, shards.Hkv
    runs = Runs(S, U, "contiguous")  # the ring shard's local order: Ulysses rank u holds [u·S, (u+1)·S)
    replicas = kv_replicas(U, Hkv)
    # One buffer for the three exchanges in (exchange.py: why); not kept through the ring, whose
    # K/V in flight dominate the memory, so the exchange out gets its own.
    scratch = Scratch()
    scratch.reserve(q, Hq * S * max(shards.D, shards.Dv))
    qh = to_heads(q, groups.ulysses, runs, 1, scratch)  # (B, Hq/U, U·S, D): ring rank r's shard, this rank's heads
    kh = to_heads(k, groups.ulysses, runs, replicas, scratch)  # (B, Hkv/U or 1, U·S, D)
    vh = to_heads(v, groups.ulysses, runs, replicas, scratch)  # (B, Hkv/U or 1, U·S, Dv)
    del scratch
    first, count = u * (Hq // U), Hq // U
    res = ring_attention(
        qh,
        kh,
        vh,
        group=groups.ring,
        mask=head_range(mask, first, count, Hq),
        score_mod=score_head_range(mod, first, count, Hq),
        sinks=sinks_range(sinks, first, count, Hq),
        layout=layout,
        scale=scale,
        return_lse=True,
        backend=backend,
    )
    assert isinstance(res, AttentionResult) and res.lse is not None  # asked for
    out = to_sequence(res.output, groups.ulysses, runs)  # (B, Hq, S, Dv)
    if not return_lse:
        return out
    lse = to_sequence(res.lse.unsqueeze(-1), groups.ulysses, runs).squeeze(-1)  # (B, Hq, S)
    return AttentionResult(out, None, lse)


def hybrid_shard(x: Tensor, *, mesh, dim: int, layout: str = "zigzag") -> Tensor:
    """This rank's shard of the whole sequence ``x`` (the same on every rank) in the composed
    layout: ``layout`` over the ring ranks, then contiguous over the Ulysses ranks."""
    groups = Mesh2D.of(mesh)
    ring_shard = shard_sequence(x, dim=dim, group=groups.ring, layout=layout)
    return shard_sequence(ring_shard, dim=dim, group=groups.ulysses, layout="contiguous")


def hybrid_unshard(x: Tensor, *, mesh, dim: int, layout: str = "zigzag") -> Tensor:
    """The whole sequence from every rank's shard (all-gathers; the inverse of :func:`hybrid_shard`)."""
    groups = Mesh2D.of(mesh)
    ring_shard = unshard_sequence(x, dim=dim, group=groups.ulysses, layout="contiguous")
    return unshard_sequence(ring_shard, dim=dim, group=groups.ring, layout=layout)


def hybrid_positions(
    shard_len: int, *, mesh, layout: str = "zigzag", device: torch.device | str | None = None
) -> Tensor:
    """The global positions ``(shard_len,)`` of this rank's tokens in the composed layout."""
    groups = Mesh2D.of(mesh)
    U = dist.get_world_size(groups.ulysses)
    u = dist.get_rank(groups.ulysses)
    ring = shard_positions(shard_len * U, group=groups.ring, layout=layout, device=device)  # (U·S,)
    return ring[u * shard_len : (u + 1) * shard_len]
