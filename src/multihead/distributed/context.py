"""``ContextParallel``: how a layer shares one sequence with the other ranks of a group.

An object, not flags: it carries the group, the layout and the method, and answers what a
layer inside a sequence-sharded model needs besides the attention itself::

    cp = ContextParallel(layout="zigzag")                 # the whole world, ring attention
    x = cp.shard(tokens_embedded, dim=1)                  # (B, L/P, E): this rank's tokens
    pos = cp.positions(x.shape[1])                        # their global positions, for RoPE
    q, k = rope(q, pos), rope(k, pos)                     # (B, H, L/P, D) rotated at global positions
    out = cp.attention(q, k, v, mask=causal())            # the mask of the whole sequence

Everything position-wise (projections, MLPs, norms) runs on the shard unchanged; only attention
and positions need the group. A layer built with ``context_parallel=cp`` attends through
:class:`ContextParallelAttend` (its ``attend=`` seam), which also declares what sharded attention
cannot do yet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from multihead.distributed.checks import check_group
from multihead.distributed.hybrid import Mesh2D, hybrid_attention, hybrid_positions, hybrid_shard, hybrid_unshard
from multihead.distributed.layout import check_layout, shard_positions, shard_sequence, unshard_sequence
from multihead.distributed.ring import ring_attention
from multihead.distributed.ulysses import ulysses_attention
from multihead.layers.heads import Attend, merge_heads

__all__ = ["ContextParallel", "ContextParallelAttend", "METHODS"]

#: ``ring``: K/V travel, any heads, masks skip blocks; ``ulysses``: two all-to-alls, heads split;
#: ``hybrid``: a 2-D mesh, Ulysses inside a group and the ring across (``group`` is the mesh).
METHODS = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class ContextParallel:
    """A sequence sharded over ``group`` (default: the whole world) in ``layout``, attended with
    ``method`` (:func:`~multihead.distributed.ring_attention`,
    :func:`~multihead.distributed.ulysses_attention`, or :func:`~multihead.distributed.hybrid_attention`
    with ``group`` a 2-D mesh: a ``DeviceMesh`` of dims ``(ring, ulysses)`` or a pair of groups,
    the layout then composed as :mod:`multihead.distributed.hybrid` draws it)."""

    group: object = None
    layout: str = "zigzag"
    method: str = "ring"

    def __post_init__(self):
        check_layout(self.layout, "ContextParallel")
        if self.method not in METHODS:
            raise ValueError(
                f"ContextParallel: method must be one of {METHODS}, got {self.method!r}; hint: 'ring' "
                "has no condition on heads and skips masked blocks, 'ulysses' needs P to divide Hq, "
                "'hybrid' takes a 2-D mesh"
            )
        if self.method == "hybrid":
            Mesh2D.of(self.group)  # refused now, not at the first forward

    @property
    def world(self) -> int:
        """The number of ranks sharing the sequence."""
        if self.method == "hybrid":
            R, U = Mesh2D.of(self.group).sizes()
            return R * U
        return check_group(self.group, "ContextParallel")[0]

    def whole_length(self, shard_len: int) -> int:
        """The length of the whole sequence of which this rank holds ``shard_len`` tokens."""
        return shard_len * self.world

    def positions(self, shard_len: int, device: torch.device | str | None = None) -> Tensor:
        """``(shard_len,)`` int64: the global positions of this rank's tokens (what RoPE must see)."""
        if self.method == "hybrid":
            return hybrid_positions(shard_len, mesh=self.group, layout=self.layout, device=device)
        return shard_positions(shard_len, group=self.group, layout=self.layout, device=device)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of the whole sequence ``x`` (``dim=1`` for ``(B, L, E)``)."""
        if self.method == "hybrid":
            return hybrid_shard(x, mesh=self.group, layout=self.layout, dim=dim)
        return shard_sequence(x, group=self.group, layout=self.layout, dim=dim)

    def unshard(self, x: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence from every rank's shard (an all-gather; not differentiable)."""
        if self.method == "hybrid":
            return hybrid_unshard(x, mesh=self.group, layout=self.layout, dim=dim)
        return unshard_sequence(x, group=self.group, layout=self.layout, dim=dim)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask=None,
        score_mod=None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        scale: float | None = None,
        return_lse: bool = False,
        backend: str = "auto",
    ):
        """Sharded attention of ``q (B, Hq, S, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``
        under the mask and score modifiers of the whole sequence; same result as
        :func:`multihead.attention` on it."""
        fn: Callable[..., Any]
        if self.method == "hybrid":
            fn, where = hybrid_attention, {"mesh": self.group}
        else:
            fn, where = (ring_attention if self.method == "ring" else ulysses_attention), {"group": self.group}
        return fn(
            q,
            k,
            v,
            **where,
            mask=mask,
            score_mod=score_mod,
            softcap=softcap,
            sinks=sinks,
            layout=self.layout,
            scale=scale,
            return_lse=return_lse,
            backend=backend,
        )


class ContextParallelAttend(Attend):
    """A layer's ``attend=`` seam for a sequence sharded as ``cp`` says: the layer's input is this
    rank's shard (``cp.shard(x)``), its mask the whole sequence's, ``rope`` turns the shard's
    tokens at their global positions, and attention runs over the whole sequence through
    :meth:`ContextParallel.attention`, score modifiers and sinks included (read at absolute
    positions and at each rank's heads). Self-attention only; without caches, weights or dropout."""

    sharded = True

    def __init__(self, cp: ContextParallel):
        self.context_parallel = cp

    def check_layer(self, layer: str, options: Mapping[str, object]) -> None:
        if options.get("dropout"):
            raise ValueError(
                f"{layer}: context_parallel attention has no dropout yet; got dropout={options['dropout']}"
            )

    def check_call(
        self,
        layer: str,
        *,
        self_attention: bool,
        kv_cache: object,
        need_weights: bool,
        score_mod: object,
        dropout: float,
    ) -> None:
        for what, bad in (
            ("kv_cache", kv_cache is not None),
            ("need_weights=True", need_weights is True),
            ("dropout in training", bool(dropout)),
            ("a separate key (cross-attention)", not self_attention),
        ):
            if bad:
                raise ValueError(
                    f"{layer}: a context_parallel layer attends over a sharded sequence; it takes no "
                    f"{what}; hint: run such calls on a layer without context_parallel"
                )

    def mask_lengths(self, Lq: int, Lk: int) -> tuple[int, int]:
        whole = self.context_parallel.whole_length(Lq)  # self-attention: Lk = Lq
        return whole, whole

    def positions(self, Lq: int, device: torch.device) -> Tensor:
        return self.context_parallel.positions(Lq, device)  # (Lq,): this shard's global positions

    def attend_heads(
        self,
        layer: object,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        out_proj: Callable[[Tensor], Tensor],
        mask=None,
        score_mod=None,
        sinks: Tensor | None = None,
        backend: str = "auto",
        **refused: object,
    ) -> tuple[Tensor, None]:
        """``(out_proj(merge(attention over the whole sequence)) (B, Lq, E), None)``; ``mask`` and
        ``score_mod`` are the whole sequence's (the layer bound them to its lengths); the other
        arguments of :func:`~multihead.layers.heads.attend_heads` are the defaults that
        :meth:`check_layer` and :meth:`check_call` let through."""
        y = self.context_parallel.attention(
            q, k, v, mask=mask, score_mod=score_mod, sinks=sinks, backend=backend
        )  # (B, Hq, Lq, Dv)
        return out_proj(merge_heads(y)), None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.context_parallel!r})"
