"""What context parallelism sends per rank and layer, as formulas of the shapes: the model behind
``docs/distributed.md``'s scale table, checked against :class:`~multihead.distributed.traffic.TrafficMeter`
in worlds of gloo processes (``tests/distributed``: formula == measured bytes).

Notation: a rank holds ``S = L/P`` positions of ``B`` sequences, ``Hq`` query heads and ``Hkv``
key/value heads of dims ``D`` (keys) and ``Dv`` (values), ``b`` bytes an element; ``b_acc`` the
bytes of the accumulation dtype (:func:`multihead.conventions.lse_dtype`: fp32 for fp16/bf16/fp32,
fp64 for fp64). All counts are bytes this rank *sends* (each rank receives as much, by symmetry,
where every step is visible)::

    ring, forward     m · B·Hkv·S·(D+Dv)·b                       m = the K/V messages it sends (P-1
    ring, backward    m · B·Hkv·S·(D+Dv)·(b + b_acc)               when every step is visible: no
                                                                   mask, causal zigzag)
    Ulysses, forward  (P-1)/P · B·S·(Hq·D + Hkv'·(D+Dv) + Hq·Dv)·b      Hkv' = max(Hkv, P): KV heads
    Ulysses, backward the same four exchanges, in the other direction      replicated to P ranks
    2-D (R × U)       Ulysses over U for the exchanges (inside a group) + the ring over R with
                      K/V shards of Hkv'/U heads and U·S positions (across groups)

(``+ (P-1)/P · B·Hq·S·b_acc`` for an LSE returned by Ulysses, and as much back if it has a
gradient; the ring's backward returns ``dk``, ``dv`` in the accumulation dtype, hence
``b + b_acc``.) The agreement checks' small
``all_gather_object`` is not payload and not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Traffic", "ring_traffic", "ulysses_traffic", "hybrid_traffic"]


@dataclass(frozen=True)
class Traffic:
    """Bytes a rank sends for one attention layer: ``forward`` and ``backward``, each split into
    ``inner`` (all-to-alls: inside a Ulysses group) and ``outer`` (ring messages: across groups)."""

    forward_inner: int
    forward_outer: int
    backward_inner: int
    backward_outer: int

    @property
    def forward(self) -> int:
        return self.forward_inner + self.forward_outer

    @property
    def backward(self) -> int:
        return self.backward_inner + self.backward_outer


def ring_traffic(
    *,
    B: int,
    Hkv: int,
    S: int,
    D: int,
    Dv: int,
    P: int,
    b: int,
    b_acc: int,
    messages: int | None = None,
    returns: int | None = None,
) -> Traffic:
    """:func:`~multihead.distributed.ring_attention`: ``messages`` K/V shards sent (default
    ``P - 1``: every step visible; a mask that hides steps sends at the steps of ``RingPlan.send``),
    again in the backward, and ``returns`` gradients of received shards sent back to their owners
    in the accumulation dtype (``RingPlan.recv``'s steps; default ``messages``)."""
    m = P - 1 if messages is None else messages
    g = m if returns is None else returns
    shard = B * Hkv * S * (D + Dv)  # elements of one K/V shard
    return Traffic(0, m * shard * b, 0, m * shard * b + g * shard * b_acc)


def ulysses_traffic(
    *, B: int, Hq: int, Hkv: int, S: int, D: int, Dv: int, P: int, b: int, b_acc: int = 4, return_lse: bool = False
) -> Traffic:
    """:func:`~multihead.distributed.ulysses_attention`: four all-to-alls each way, ``(P-1)/P`` of
    each leaves the rank; KV heads replicated to ``P`` when ``Hkv < P``."""
    hkv = max(Hkv, P)
    elements = B * S * (Hq * D + hkv * (D + Dv) + Hq * Dv)  # q, k, v, out: equal on the way back
    forward = elements * b * (P - 1) // P
    if return_lse:
        forward += B * Hq * S * b_acc * (P - 1) // P  # the local call's LSE
    return Traffic(forward, 0, elements * b * (P - 1) // P, 0)


def hybrid_traffic(
    *,
    B: int,
    Hq: int,
    Hkv: int,
    S: int,
    D: int,
    Dv: int,
    R: int,
    U: int,
    b: int,
    b_acc: int,
    messages: int | None = None,
    return_lse: bool = False,
) -> Traffic:
    """:func:`~multihead.distributed.hybrid_attention` on ``R`` ring ranks by ``U`` Ulysses
    ranks: Ulysses' exchanges over ``U`` around a ring over ``R`` whose K/V shards hold ``Hkv'/U``
    heads of ``U·S`` positions (the same elements as ``Hkv'`` heads of ``S``)."""
    inner = ulysses_traffic(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, Dv=Dv, P=U, b=b, b_acc=b_acc, return_lse=return_lse)
    hkv = max(Hkv, U)
    outer = ring_traffic(B=B, Hkv=hkv // U, S=U * S, D=D, Dv=Dv, P=R, b=b, b_acc=b_acc, messages=messages)
    return Traffic(inner.forward_inner, outer.forward_outer, inner.backward_inner, outer.backward_outer)
