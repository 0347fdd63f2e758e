"""Document-balanced sharding (``document_layout``), without processes: every rank holds exactly
``L/P`` positions and together they hold each once, every document is cut into ``2P`` chunks
paired as zigzag pairs them, causal work within documents is balanced where zigzag is not, the
ring's plan over it computes every visible pair once and skips pairs of runs in different
documents, and bad arguments are refused with their values."""

from __future__ import annotations

import pytest
import torch

from multihead import masks
from multihead.distributed import document_layout, plan_ring
from multihead.distributed.layout import pieces


def packed(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def pareto_lengths(total: int, seed: int = 0) -> list[int]:
    """Long-tailed document lengths (Pareto 1.2, 8 .. total / 4 tokens) filling ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = float(torch.rand((), generator=g))
        lengths.append(min(total // 4, int(8 * (1 - u) ** (-1 / 1.2))))
    lengths[-1] -= sum(lengths) - total
    return lengths


def causal_work(positions: torch.Tensor, ids: torch.Tensor) -> int:
    """Pairs ``document_causal`` shows the queries at ``positions``."""
    starts = torch.zeros_like(ids)
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    starts[change] = change
    starts = torch.cummax(starts, 0).values  # (L,): the start of each token's document
    return int((positions - starts[positions] + 1).sum())


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("min_chunk", [1, 4, 64])
def test_every_position_once_and_equal_shards(world, min_chunk):
    ids = packed(pareto_lengths(96 * world, seed=world))
    layout = document_layout(ids, world, min_chunk=min_chunk)
    held = [layout.positions(r) for r in range(world)]
    assert all(len(h) == ids.shape[0] // world for h in held)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(ids.shape[0]))
    for r in range(world):
        ps = layout.pieces(r)
        assert [p.local for p in ps] == [sum(p.length for p in ps[:i]) for i in range(len(ps))]
        assert all(a.start + a.length < b.start for a, b in zip(ps, ps[1:]))  # touching runs were joined
        assert pieces(layout.shard_len, r, world, layout) == ps


def test_a_document_is_cut_in_zigzag_pairs():
    """P = 2, documents of 8, 4 and 12 tokens (the picture in documents.py, min_chunk 1)."""
    layout = document_layout(packed([8, 4, 12]), 2, min_chunk=1)
    owner = torch.empty(24, dtype=torch.int64)
    for r in range(2):
        owner[layout.positions(r)] = r
    assert owner.tolist() == [0, 0, 1, 1, 1, 1, 0, 0] + [0, 1, 1, 0] + [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balances_packed_documents_where_zigzag_does_not(world):
    ids = packed(pareto_lengths(8192, seed=3))
    S = ids.shape[0] // world
    zigzag = [
        causal_work(torch.cat([torch.arange(p.start, p.start + p.length) for p in pieces(S, r, world, "zigzag")]), ids)
        for r in range(world)
    ]
    layout = document_layout(ids, world, min_chunk=8)
    balanced = [causal_work(layout.positions(r), ids) for r in range(world)]
    assert sum(balanced) == sum(zigzag)
    ratio = max(balanced) / (sum(balanced) / world)
    assert ratio <= 1.05, balanced
    assert ratio < max(zigzag) / (sum(zigzag) / world)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["document_causal", "documents", "causal"])
def test_the_plan_covers_every_visible_pair_once(world, kind):
    ids = packed([5, 9, 3, 7, 11, 2, 13, 6, 16])  # 72 tokens
    L = ids.shape[0]
    layout = document_layout(ids, world, min_chunk=1)
    mask = {"document_causal": masks.document_causal, "documents": masks.document}.get(kind, lambda _: masks.causal())(
        ids.view(1, L)
    )
    whole = mask.materialize(1, 1, L, L)[0, 0]
    covered = torch.zeros(L, L, dtype=torch.int64)
    for rank in range(world):
        plan = plan_ring(
            world=world, rank=rank, batch=1, heads=1, q_shard=L // world, kv_shard=L // world, mask=mask, layout=layout
        )
        q_pos = layout.positions(rank)
        for s, calls in enumerate(plan.calls):
            kv_pos = layout.positions((rank - s) % world)
            for c in calls:
                rows, cols = q_pos[c.q0 : c.q1], kv_pos[c.k0 : c.k1]
                covered[rows.view(-1, 1), cols.view(1, -1)] += 1
                block = whole[rows][:, cols]
                assert block.any(), "a call over pairs the mask hides"
                if c.mask is not None:
                    assert torch.equal(c.mask.materialize(1, 1, len(rows), len(cols))[0, 0], block)
    assert (covered <= 1).all() and (covered[whole] == 1).all()


def test_documents_on_one_rank_never_communicate():
    """Short documents packed in runs that stay on their rank: a document mask needs no message."""
    ids = packed([6, 6, 6, 6])
    layout = document_layout(ids, 2, min_chunk=64)  # all short: one segment, cut in 4 chunks of 6
    assert [p.start for p in layout.pieces(0)] == [0, 18] and [p.start for p in layout.pieces(1)] == [6]
    plans = [
        plan_ring(
            world=2,
            rank=r,
            batch=1,
            heads=1,
            q_shard=12,
            kv_shard=12,
            mask=masks.document(ids.view(1, -1)),
            layout=layout,
        )
        for r in range(2)
    ]
    assert all(p.messages == 0 and p.steps == () for p in plans)


def test_equal_by_value_and_described_briefly():
    ids = packed([10, 14])
    a, b = document_layout(ids, 2), document_layout(ids.clone(), 2)
    assert a == b and hash(a) == hash(b) and a != document_layout(ids, 4)
    assert repr(a).startswith("document_layout(<24 ids>, world=2) [")


@pytest.mark.parametrize(
    "args, exc, pattern",
    [
        (
            (torch.zeros(10), 2),
            TypeError,
            r"ids must be an integer tensor \(L,\) or \(1, L\), got a torch.float32 tensor",
        ),
        (
            (torch.zeros(2, 10, dtype=torch.int64), 2),
            ValueError,
            r"ids must have shape \(L,\) or \(1, L\), got \(2, 10\)",
        ),
        ((torch.zeros(10, dtype=torch.int64), 3), ValueError, r"L=10 positions, not a positive multiple of world=3"),
        ((torch.zeros(10, dtype=torch.int64), 0), ValueError, r"world must be a positive int, got 0"),
    ],
)
def test_bad_arguments(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        document_layout(*args)


def test_document_causal_block_state_is_structural_and_exact_enough():
    """Self-attention over one packing: ``document_causal``'s block answers come from the block's
    corners (a ring block is a shard wide: materializing it is what the plan must not do), and
    are never wrong: EMPTY blocks show nothing, FULL blocks everything."""
    from multihead.blocks import Block, Extent
    from multihead.masks import BlockState

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = packed(pareto_lengths(40, seed=int(torch.randint(1000, (), generator=g))))
        mask = masks.document_causal(ids.view(1, -1))
        dense = mask.materialize(1, 1, 40, 40)[0, 0]
        for _ in range(20):
            q0, q1 = sorted(torch.randint(0, 41, (2,), generator=g).tolist())
            k0, k1 = sorted(torch.randint(0, 41, (2,), generator=g).tolist())
            if q0 == q1 or k0 == k1:
                continue
            state = mask.block_state(Extent(1, 1, 40, 40), Block(q0, q1, k0, k1))
            block = dense[q0:q1, k0:k1]
            assert state is not BlockState.EMPTY or not block.any()
            assert state is not BlockState.FULL or block.all()
    big = masks.document_causal(torch.zeros(1, 1 << 20, dtype=torch.int64))  # one document of 2^20 tokens
    assert big.block_state(Extent(1, 1, 1 << 20, 1 << 20), Block(1 << 19, 1 << 20, 0, 1 << 19)) is BlockState.FULL
