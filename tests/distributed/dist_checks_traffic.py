"""Bytes moved per layer, measured (:class:`multihead.distributed.traffic.TrafficMeter`, counting
the payload of every call into ``torch.distributed``) against the formulas of
:mod:`multihead.distributed.cost` that ``docs/distributed.md``'s scale model uses: equal to the
byte, forward and backward, for the ring (every step visible; a window whose plan skips steps),
Ulysses (KV heads split and replicated) and every factorisation of the 2-D mesh, in each world."""

from __future__ import annotations

import torch
from dist_checks import check, note
from dist_checks_mesh import meshes

from multihead import masks
from multihead.conventions import lse_dtype
from multihead.distributed import hybrid_attention, hybrid_shard, plan_ring, ring_attention, shard_sequence
from multihead.distributed import ulysses_attention as ulysses
from multihead.distributed.cost import Traffic, hybrid_traffic, ring_traffic, ulysses_traffic
from multihead.distributed.traffic import TrafficMeter


def _measure(fn, q, k, v, grad, **kw) -> tuple[int, int]:
    """Bytes this rank sends in the forward, and in the backward, of ``fn``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with TrafficMeter() as meter:
        out = fn(q, k, v, **kw)
        forward = meter.sent
        out.backward(grad)
    return forward, meter.sent - forward


def _expect(name: str, measured: tuple[int, int], model: Traffic) -> None:
    note(f"{name}: sent forward {measured[0]} B, backward {measured[1]} B (formula {model.forward}, {model.backward})")
    assert measured == (model.forward, model.backward), (
        f"{name}: measured (forward, backward) = {measured} bytes sent, the formula of cost.py gives "
        f"({model.forward}, {model.backward}) = {model}"
    )


def _inputs(B, Hq, Hkv, L, D, Dv, dtype, shard):
    g = torch.Generator().manual_seed(5)
    q, k, v, gout = (torch.randn(B, h, L, d, generator=g) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv), (Hq, Dv)))
    return tuple(shard(t).to(dtype).contiguous() for t in (q, k, v, gout))


@check("traffic-equals-formulas")
def _traffic(rank, world):
    B, D, Dv = 2, 8, 6
    S = 4 * world  # a zigzag shard of whole chunks over any world
    L = S * world

    # The ring, bf16 (the gradients go back in fp32: b_acc = 4 != b = 2).
    for dtype in (torch.bfloat16, torch.float32):
        Hq, Hkv = 4, 2
        b, b_acc = torch.finfo(dtype).bits // 8, torch.finfo(lse_dtype(dtype)).bits // 8
        cases = (
            ("zigzag", "causal", masks.causal()),
            ("contiguous", "none", None),
            ("contiguous", "window 3", masks.sliding_window(3)),
        )
        for layout, label, mask in cases:
            q, k, v, g = _inputs(B, Hq, Hkv, L, D, Dv, dtype, lambda t: shard_sequence(t, layout=layout, dim=2))
            plan = plan_ring(world=world, rank=rank, batch=B, heads=Hq, q_shard=S, kv_shard=S, mask=mask, layout=layout)
            sends, recvs = sum(plan.send[s] for s in plan.steps), sum(plan.recv[s] for s in plan.steps)
            model = ring_traffic(
                B=B, Hkv=Hkv, S=S, D=D, Dv=Dv, P=world, b=b, b_acc=b_acc, messages=sends, returns=recvs
            )
            if mask is not None and layout == "zigzag":
                assert sends == world - 1, f"causal zigzag sends at every step, got {sends} of {world - 1}"
            measured = _measure(ring_attention, q, k, v, g, mask=mask, layout=layout)
            _expect(f"ring {layout} {label} {dtype}", measured, model)

    # Ulysses, fp32: KV heads split over the ranks, and one KV head replicated to every rank.
    for Hq, Hkv in ((2 * world, world), (2 * world, 1)):
        q, k, v, g = _inputs(B, Hq, Hkv, L, D, Dv, torch.float32, lambda t: shard_sequence(t, layout="zigzag", dim=2))
        model = ulysses_traffic(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, Dv=Dv, P=world, b=4)
        _expect(f"ulysses Hq={Hq} Hkv={Hkv}", _measure(ulysses, q, k, v, g, mask=masks.causal()), model)

    # Every R x U mesh; the inner (all-to-all) and outer (ring) parts in one count.
    for (R, U), mesh in meshes(world).items():
        Hq, Hkv = 2 * U, 1
        q, k, v, g = _inputs(B, Hq, Hkv, L, D, Dv, torch.float32, lambda t: hybrid_shard(t, mesh=mesh, dim=2))
        model = hybrid_traffic(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, Dv=Dv, R=R, U=U, b=4, b_acc=4)
        measured = _measure(hybrid_attention, q, k, v, g, mesh=mesh, mask=masks.causal())
        _expect(f"2-D {R}x{U} Hq={Hq} Hkv={Hkv}", measured, model)
