"""Document-balanced sharding (:func:`multihead.distributed.document_layout`) in spawned worlds:
ring and Ulysses attention over packed documents cut per document, against single-process
attention in fp64 (outputs, LSE, gradients of ``q``, ``k``, ``v`` and of modifiers' tensors), and
a ``MultiHeadAttention(context_parallel=ContextParallel(layout=...))`` layer with RoPE at the
layout's global positions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_checks import assert_sharded_layer, check
from dist_checks_scores import compare_modifier

import multihead as mh
from multihead import masks
from multihead.distributed import ContextParallel, document_layout, ring_attention, ulysses_attention
from multihead.positions import RotaryEmbedding

LENGTHS = (5, 9, 3, 7, 11, 2, 13, 6, 16)  # 72 tokens: odd lengths, documents shorter than 2P and longer


def packed_ids() -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))  # (72,)


def document_masks(ids: torch.Tensor) -> dict:
    row = ids.view(1, -1)
    return {
        "document_causal": masks.document_causal(row),
        "documents": masks.document(row),
        "causal": masks.causal(),
        "window_documents": masks.sliding_window(4) & masks.document_causal(row),
        "none": None,
    }


@check("documents-ring")
def _ring(rank, world):
    ids = packed_ids()
    for min_chunk in (1, 8):
        layout = document_layout(ids, world, min_chunk=min_chunk)
        for mask in document_masks(ids).values():
            compare_modifier(ring_attention, None, mask_kind=mask, layout=layout, B=2, Lq=72)
    layout = document_layout(ids, world, min_chunk=1)
    mask = document_masks(ids)["document_causal"]
    compare_modifier(ring_attention, "alibi_sinks", mask_kind=mask, layout=layout, Lq=72)
    compare_modifier(ring_attention, "t5", mask_kind=mask, layout=layout, Lq=72, Hq=4, Hkv=1, lse=False)


@check("documents-ulysses")
def _ulysses(rank, world):
    ids = packed_ids()
    layout = document_layout(ids, world, min_chunk=1)
    heads = dict(Hq=2 * world, Hkv=world)
    for mask in document_masks(ids).values():
        compare_modifier(ulysses_attention, None, mask_kind=mask, layout=layout, Lq=72, **heads)
    compare_modifier(
        ulysses_attention, "alibi_sinks", mask_kind=document_masks(ids)["documents"], layout=layout, Lq=72, **heads
    )


@check("documents-layer")
def _layer(rank, world):
    """A causal GQA layer with RoPE over packed documents: the layer's positions are the layout's
    global positions, its call mask the whole sequence's documents."""
    ids = packed_ids()
    layout = document_layout(ids, world, min_chunk=1)
    E, H = 16, 4
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H, num_kv_heads=2, rope=RotaryEmbedding(E // H), causal=True).double()
    x = torch.randn(2, 72, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = masks.document(ids.view(1, -1))
    want = layer(x, mask=mask)
    want_grads = torch.autograd.grad((want * want).sum(), list(layer.parameters()))
    cp = ContextParallel(layout=layout)
    assert torch.equal(cp.positions(72 // world), layout.positions(dist.get_rank()))
    sharded = mh.MultiHeadAttention(
        E, H, num_kv_heads=2, rope=RotaryEmbedding(E // H), causal=True, context_parallel=cp
    ).double()
    sharded.load_state_dict(layer.state_dict())
    out = sharded(cp.shard(x, dim=1), mask=mask)
    assert_sharded_layer(sharded, out, cp, want, want_grads)
    torch.testing.assert_close(cp.unshard(cp.shard(x, dim=1), dim=1), x)
