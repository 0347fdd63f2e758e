"""The ring's plan, without processes: every visible query-key pair is computed exactly once,
blocks a mask hides are neither computed nor sent, zigzag balances causal work, and the sends
and receives of every step match."""

from __future__ import annotations

import pytest
import torch

from multihead import masks
from multihead.distributed import plan_ring
from multihead.distributed.layout import pieces, shard_sequence, unshard_sequence
from multihead.masks import BlockState

CASES = {
    "none": lambda B, L: None,
    "causal": lambda B, L: masks.causal(),
    "window-small": lambda B, L: masks.sliding_window(3),
    "window-large": lambda B, L: masks.sliding_window(L // 2 + 1),
    "window-two-sided": lambda B, L: masks.sliding_window(2, 5),
    "documents": lambda B, L: masks.document(torch.arange(L).div(7, rounding_mode="floor").expand(B, L)),
    "padding": lambda B, L: masks.key_padding(torch.tensor([L - 3, L // 3])),
    "causal-top-left": lambda B, L: masks.causal("top_left"),
}


def plans(world, layout, mask, Sq, Sk, B=2):
    return [
        plan_ring(world=world, rank=r, batch=B, heads=2, q_shard=Sq, kv_shard=Sk, mask=mask, layout=layout)
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("lengths", [(8, 8), (4, 8), (8, 4)], ids=["Lq=Lk", "Lq<Lk", "Lq>Lk"])
def test_every_visible_pair_exactly_once(world, layout, kind, lengths):
    Sq, Sk = lengths
    B, Lq, Lk = 2, Sq * world, Sk * world
    mask = CASES[kind](B, Lq)
    if kind == "documents":
        mask = masks.document(
            torch.arange(Lq).div(7, rounding_mode="floor").expand(B, Lq),
            torch.arange(Lk).div(7 * Lk // Lq or 1, rounding_mode="floor").expand(B, Lk),
        )
    whole = (
        torch.ones(B, 2, Lq, Lk, dtype=torch.bool)
        if mask is None
        else mask.materialize(B, 2, Lq, Lk).expand(B, 2, Lq, Lk)
    )
    covered = torch.zeros(Lq, Lk, dtype=torch.int64)
    all_plans = plans(world, layout, mask, Sq, Sk, B)
    for plan in all_plans:
        q_pos = _positions(Sq, plan.rank, world, layout)
        for s, calls in enumerate(plan.calls):
            kv_pos = _positions(Sk, (plan.rank - s) % world, world, layout)
            for c in calls:
                rows, cols = q_pos[c.q0 : c.q1], kv_pos[c.k0 : c.k1]
                covered[rows.view(-1, 1), cols.view(1, -1)] += 1
                block = whole[:, :, rows][:, :, :, cols]
                if c.mask is None:  # a call without a mask must see a fully visible block
                    assert block.all(), (kind, s, c)
                else:  # the shifted mask is the global mask at the block's positions
                    got = c.mask.materialize(B, 2, c.q1 - c.q0, c.k1 - c.k0).expand_as(block)
                    assert torch.equal(got, block), (kind, s, c)
    visible = whole.any(0).any(0)
    assert (covered <= 1).all(), "a query-key pair computed twice"
    assert (covered[visible] == 1).all(), "a visible query-key pair never computed"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kind", list(CASES))
def test_sends_meet_receives(world, layout, kind):
    all_plans = plans(world, layout, CASES[kind](2, 8 * world), 8, 8)
    for plan in all_plans:
        assert plan.steps == all_plans[0].steps  # every rank walks the same steps
        for s in range(1, world):
            # rank r sends to r + s exactly when r + s receives from r
            assert plan.send[s] == all_plans[(plan.rank + s) % world].recv[s]
            assert plan.recv[s] == bool(plan.calls[s])
            if plan.recv[s] or plan.send[s]:
                assert s in plan.steps


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work(world):
    """Zigzag: every rank scores the same number of query-key pairs (within 10%, here exactly);
    contiguous: the last rank scores P times the pairs of the first (its diagonal block and
    P - 1 full blocks, against the first rank's diagonal block alone)."""
    zig = [p.elements for p in plans(world, "zigzag", masks.causal(), 16, 16)]
    contiguous = [p.elements for p in plans(world, "contiguous", masks.causal(), 16, 16)]
    assert max(zig) <= 1.1 * min(zig), zig
    assert max(contiguous) == world * min(contiguous), contiguous


@pytest.mark.parametrize("world", [2, 4, 8])
def test_window_skips_steps_and_messages(world):
    """A window shorter than a shard needs only the previous rank's keys: one message per rank,
    one step walked, in the contiguous layout; no mask needs every step."""
    window = plans(world, "contiguous", masks.sliding_window(5), 16, 16)
    assert all(p.steps == (1,) for p in window)
    assert [p.messages for p in window] == [0] + [1] * (world - 1)
    assert all(p.steps_computed == (1 if p.rank == 0 else 2) for p in window)
    full = plans(world, "contiguous", None, 16, 16)
    assert all(p.messages == world - 1 and p.steps == tuple(range(1, world)) for p in full)
    # a window of two shards reaches two ranks back
    wide = plans(world, "contiguous", masks.sliding_window(20), 16, 16)
    assert all(p.steps == tuple(range(1, min(3, world))) for p in wide)


def test_documents_do_not_communicate_across_documents():
    """Packed documents that each fit in one shard: no rank needs another rank's keys."""
    world, S = 4, 8
    ids = torch.arange(world * S).div(S, rounding_mode="floor").view(1, -1)  # document r = shard r
    ps = plans(world, "contiguous", masks.document(ids), S, S, B=1)
    assert all(p.messages == 0 and p.steps == () for p in ps)


def test_plan_blocks_states():
    """Zigzag causal, P = 2: step 0 is the diagonal (two partial blocks and one full), step 1
    one full call of the late chunk's rows over both received chunks (the picture in plan.py)."""
    p = plan_ring(world=2, rank=0, batch=1, heads=1, q_shard=4, kv_shard=4, mask=masks.causal(), layout="zigzag")
    assert [c.state for c in p.calls[0]] == [BlockState.PARTIAL, BlockState.FULL, BlockState.PARTIAL]
    assert [(c.q0, c.q1, c.k0, c.k1, c.mask) for c in p.calls[1]] == [(2, 4, 0, 4, None)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kind", ["none", "causal", "window-large", "documents"])
def test_plans_for_score_modifiers_cover_consecutive_positions(world, layout, kind):
    """``positions=True`` (a score modifier reads positions): every call is one rectangle of
    consecutive positions starting at ``q_start``/``k_start``, the calls still cover every visible
    pair exactly once, and only the joins across runs that are not adjacent are undone."""
    S, B = 8, 2
    mask = CASES[kind](B, S * world)
    covered = torch.zeros(S * world, S * world, dtype=torch.int64)
    for rank in range(world):
        plain, positioned = (
            plan_ring(
                world=world, rank=rank, batch=B, heads=2, q_shard=S, kv_shard=S, mask=mask, layout=layout, positions=p
            )
            for p in (False, True)
        )
        assert plain.recv == positioned.recv and plain.send == positioned.send and plain.steps == positioned.steps
        assert plain.elements == positioned.elements
        q_pos = _positions(S, rank, world, layout)
        for s, calls in enumerate(positioned.calls):
            kv_pos = _positions(S, (rank - s) % world, world, layout)
            for c in calls:
                assert c.q_start is not None and c.k_start is not None, c
                rows, cols = q_pos[c.q0 : c.q1], kv_pos[c.k0 : c.k1]
                assert torch.equal(rows, torch.arange(c.q_start, c.q_start + c.q1 - c.q0)), c
                assert torch.equal(cols, torch.arange(c.k_start, c.k_start + c.k1 - c.k0)), c
                covered[rows.view(-1, 1), cols.view(1, -1)] += 1
    assert covered.max() <= 1
    # zigzag with no mask: rank 0's runs (chunks 0 and 2P - 1) are not adjacent, so its own step
    # is four calls, not one
    if kind == "none" and layout == "zigzag":
        first = {
            p: plan_ring(
                world=world, rank=0, batch=B, heads=2, q_shard=S, kv_shard=S, mask=None, layout=layout, positions=p
            )
            for p in (False, True)
        }
        assert len(first[True].calls[0]) == 4 and len(first[False].calls[0]) == 1
        assert first[False].calls[0][0].q_start is None


def _positions(S, rank, world, layout):
    return torch.cat([torch.arange(p.start, p.start + p.length) for p in pieces(S, rank, world, layout)])


@pytest.mark.parametrize("fn", [shard_sequence, unshard_sequence])
def test_the_sequence_dimension_is_never_guessed(fn):
    """Issue 28, item 9: a default dim=2 split the features E of a layer's (B, L, E) input without
    a complaint. dim is required and its absence is named, before torch.distributed is asked."""
    x = torch.randn(2, 8, 16)  # (B, L, E): the sequence is dim 1
    with pytest.raises(
        TypeError,
        match=rf"{fn.__name__}: dim is required \(keyword\), the sequence dimension of x \(2, 8, 16\): "
        r"dim=2 for \(B, H, L, D\) as attention takes it, dim=1 for \(B, L, E\) as a layer takes it",
    ):
        fn(x, layout="contiguous")
    with pytest.raises(TypeError, match=r"dim is required"):
        fn(x, dim=None)
