"""The 2-D context-parallel mesh (:func:`multihead.distributed.hybrid_attention`: Ulysses inside a
group, the ring across groups) in spawned worlds, against single-process attention in fp64:
every factorisation ``R x U`` of the world (4 = 2 x 2, and the degenerate ``P x 1``, ``1 x P``),
both layouts, every mask kind, GQA with KV heads split and replicated, score modifiers and sinks;
outputs, LSE and the gradients of ``q``, ``k``, ``v`` and of the modifiers' tensors."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from dist_checks import check, make_mask
from dist_checks_scores import compare_modifier

from multihead.distributed import ContextParallel, Mesh2D, hybrid_attention, hybrid_positions, hybrid_shard

MASKS = ("none", "causal", "causal_top_left", "window_small", "window_large", "documents", "padding", "bool_tensor")


@functools.cache
def meshes(world: int) -> dict[tuple[int, int], Mesh2D]:
    """Every ``(R, U)`` with ``R·U = world``, as pairs of groups: rank ``r·U + u``. Every rank
    creates every group, in the same order (``new_group`` is collective)."""
    out = {}
    for U in range(1, world + 1):
        if world % U:
            continue
        R = world // U
        ring = [dist.new_group([r * U + u for r in range(R)]) for u in range(U)]
        ulysses = [dist.new_group([r * U + u for u in range(U)]) for r in range(R)]
        me = dist.get_rank()
        out[(R, U)] = Mesh2D(ring[me % U], ulysses[me // U])
    return out


def _compare(mesh: Mesh2D, layout: str, mask_kind: str, name=None, Hq=4, Hkv=2, **kw):
    shard = lambda t: hybrid_shard(t, mesh=mesh, dim=2, layout=layout)  # noqa: E731
    compare_modifier(
        hybrid_attention, name, mask_kind=mask_kind, layout=layout, Hq=Hq, Hkv=Hkv, shard=shard, mesh=mesh, **kw
    )


for _layout in ("zigzag", "contiguous"):

    def _masks(rank, world, layout=_layout):
        for (_R, U), mesh in meshes(world).items():
            for kind in MASKS:
                heads = dict(Hq=2 * U, Hkv=U)  # KV heads split over the Ulysses group
                _compare(mesh, layout, kind, **heads)

    check(f"mesh-{_layout}-masks")(_masks)


@check("mesh-gqa-and-modifiers")
def _gqa_modifiers(rank, world):
    for (_R, U), mesh in meshes(world).items():
        _compare(mesh, "zigzag", "causal", Hq=2 * U, Hkv=1)  # the KV head replicated over U
        _compare(mesh, "zigzag", "documents", Hq=4 * U, Hkv=2 * U)  # GQA, KV heads split
        _compare(mesh, "zigzag", "causal", name="alibi_sinks", Hq=2 * U, Hkv=U)
        _compare(mesh, "contiguous", "window_small", name="t5", Hq=2 * U, Hkv=1)
        _compare(mesh, "zigzag", "none", name="user_positions", Hq=2 * U, Hkv=U, lse=False)


@check("mesh-device-mesh-and-positions")
def _device_mesh(rank, world):
    """A 2-D ``DeviceMesh`` of dims (ring, ulysses) is taken as it is; the composed positions are
    a permutation of the sequence, the rank's rows of :func:`hybrid_shard`; ContextParallel's
    ``hybrid`` method shards, numbers and attends the same way."""
    from torch.distributed.device_mesh import init_device_mesh

    U = 2 if world % 2 == 0 else 1
    device_mesh = init_device_mesh("cpu", (world // U, U), mesh_dim_names=("ring", "ulysses"))
    _compare(device_mesh, "zigzag", "causal", Hq=2 * U, Hkv=U)
    whole = torch.arange(24).view(1, 1, 24, 1)
    pos = hybrid_positions(24 // world, mesh=device_mesh)
    assert torch.equal(hybrid_shard(whole, mesh=device_mesh, dim=2).flatten(), pos)
    everyone = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(everyone, pos)
    assert torch.equal(torch.cat(everyone).sort().values, torch.arange(24))
    cp = ContextParallel(group=device_mesh, method="hybrid")
    assert cp.world == world and torch.equal(cp.positions(24 // world), pos)
    x = torch.randn(2, 24, 3, dtype=torch.float64)
    assert torch.equal(cp.unshard(cp.shard(x)), x)


@check("mesh-bad-input-raises-everywhere")
def _bad_input(rank, world):
    """One rank's bad input (or a disagreement between two ranks of different Ulysses groups)
    raises on every rank of the mesh, and the mesh still works afterwards."""
    import pytest

    for (_R, U), mesh in meshes(world).items():
        S = 24 // world
        q = torch.randn(1, 2 * U, S, 8, dtype=torch.float64)
        bad_q = q[:, :, :-2] if rank == world - 1 else q
        pattern = r"hybrid_attention: (rank \d received bad input, so every rank stops here: hybrid_attention: )?q hol"
        with pytest.raises(ValueError, match=pattern):
            hybrid_attention(bad_q, q[:, :U], q[:, :U], mesh=mesh, mask=make_mask("causal", 1, 24, 24))
        mask = make_mask("causal" if rank == world - 1 else "causal_top_left", 1, 24, 24)
        with pytest.raises(ValueError, match=r"hybrid_attention: ranks disagree on mask"):
            hybrid_attention(q, q[:, :U], q[:, :U], mesh=mesh, mask=mask)
        # the LSE is sent back to the sequence by one more exchange: a rank that asks for it alone
        # would wait for the others
        with pytest.raises(ValueError, match=r"hybrid_attention: ranks disagree on return_lse"):
            hybrid_attention(q, q[:, :U], q[:, :U], mesh=mesh, return_lse=rank == 0)
        if U > 1:
            with pytest.raises(ValueError, match=rf"Hq={U + 1} query heads do not split over the {U} ranks of a"):
                hybrid_attention(q[:, :1].expand(1, U + 1, S, 8), q[:, :1], q[:, :1], mesh=mesh)
        _compare(mesh, "zigzag", "causal", Hq=2 * U, Hkv=U)  # still usable


@check("mesh-document-layout")
def _mesh_documents(rank, world):
    """The ring dimension of the mesh in a ``document_layout`` made for its ``R`` ranks."""
    from multihead import masks
    from multihead.distributed import document_layout

    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([5, 9, 3, 13, 18]))  # 48 tokens
    for (R, U), mesh in meshes(world).items():
        layout = document_layout(ids, R, min_chunk=1)
        for mask in (masks.document_causal(ids.view(1, -1)), masks.document(ids.view(1, -1))):
            _compare(mesh, layout, mask, Hq=2 * U, Hkv=U, Lq=48)
        _compare(mesh, layout, masks.document_causal(ids.view(1, -1)), name="alibi_sinks", Hq=2 * U, Hkv=1, Lq=48)
