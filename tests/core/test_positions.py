"""Masks at absolute positions: a block of an attention, read through ``shifted`` (offsets) or
``at`` (position tensors), is the same slice of the whole mask, for every mask kind, both
alignments, square and non-square, on every block of a grid (the property KV caches and ring
attention stand on); and the structural answers of a block agree with its materialized form."""

import itertools

import pytest
import torch

import multihead as mh
from multihead.blocks import Extent
from multihead.masks import BlockState


def _masks(Lq, Lk):
    gen = torch.Generator().manual_seed(Lq * 1000 + Lk)
    q_ids = torch.sort(torch.randint(0, 3, (2, Lq), generator=gen)).values
    kv_ids = torch.sort(torch.randint(0, 3, (2, Lk), generator=gen)).values
    table = torch.rand(2, 1, Lq, Lk, generator=gen) > 0.4
    return {
        "causal_br": mh.causal(),
        "causal_tl": mh.causal("top_left"),
        "window_br": mh.sliding_window(3),
        "window_tl_2_1": mh.sliding_window(2, 1, align="top_left"),
        "window_right_unbounded": mh.sliding_window(2, None),
        "key_padding": mh.key_padding(torch.tensor([Lk, max(0, Lk - 3)])),
        "padding_table": mh.key_padding(torch.rand(2, Lk, generator=gen) > 0.3),
        "document": mh.document(q_ids, kv_ids),
        "prefix_lm": mh.prefix_lm(2),
        "causal&padding": mh.causal() & mh.key_padding(torch.tensor([Lk, 1])),
        "document&causal_br": mh.document(q_ids, kv_ids) & mh.causal(),
        "window|prefix": mh.sliding_window(1) | mh.prefix_lm(2),
        "~causal_br": ~mh.causal(),
        "custom": mh.custom(lambda b, h, q, kv: (q + 2 * kv + b) % 3 != 0),
        "bool_tensor": table,
        "window_per_sequence": mh.sliding_window(2, kv_lengths=[Lk, max(0, Lk - 3)], q_lengths=[Lq, max(0, Lq - 1)]),
        "document_causal": mh.document_causal(q_ids, kv_ids),
    }


SHAPES = [(8, 8), (5, 11), (11, 5), (1, 9), (9, 1)]
GRIDS = [(1, 1), (2, 3), (3, 2), (4, 4)]


def _cuts(length, pieces):
    """Block boundaries: ``pieces`` roughly equal parts, the last part one row long when possible."""
    cuts = sorted({0, length, *(length * i // pieces for i in range(1, pieces)), max(0, length - 1)})
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("Lq,Lk", SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("kind", list(_masks(8, 8)))
def test_every_block_of_a_grid_is_the_slice_of_the_whole_mask(kind, Lq, Lk):
    mask = _masks(Lq, Lk)[kind]
    mask = mh.masks.as_mask(mask)
    full = mask.materialize(2, 3, Lq, Lk).expand(2, 3, Lq, Lk)
    for qp, kp in GRIDS:
        for (q0, q1), (k0, k1) in itertools.product(_cuts(Lq, qp), _cuts(Lk, kp)):
            want = full[:, :, q0:q1, k0:k1]
            block = mask.shifted(q0, k0, q_len=Lq, kv_len=Lk)
            got = block.materialize(2, 3, q1 - q0, k1 - k0).expand_as(want)
            assert torch.equal(got, want), f"shifted block q[{q0}:{q1}] k[{k0}:{k1}]"
            at = mask.at(torch.arange(q0, q1), torch.arange(k0, k1), q_len=Lq, kv_len=Lk)
            assert torch.equal(at.materialize(2, 3, q1 - q0, k1 - k0).expand_as(want), want)
            # What backends ask of a block agrees with its materialized form.
            lq, lk = q1 - q0, k1 - k0
            extent = Extent(2, 3, lq, lk)
            state = block.block_state(extent, extent.whole())  # FULL/EMPTY are promises; PARTIAL may be cautious
            assert state is not BlockState.FULL or bool(want.all())
            assert state is not BlockState.EMPTY or not bool(want.any())
            lo, hi = block.key_range(extent, extent.whole())
            visible_keys = want.any(0).any(0).any(0).nonzero().flatten()
            if len(visible_keys):
                assert lo <= int(visible_keys.min()) and int(visible_keys.max()) < hi
            empty = block.empty_rows(extent)
            want_empty = ~want.any(-1)
            got_empty = torch.zeros_like(want_empty) if empty is None else empty.expand_as(want_empty)
            assert torch.equal(got_empty, want_empty)
            offset = block.causal_offset(lq, lk)
            if offset is not None:
                i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
                assert torch.equal((j <= i + offset).expand_as(want), want)


def test_the_issue_example_bottom_right_block_of_a_4x8_mask():
    m = mh.causal()
    whole = m.materialize(1, 1, 4, 8)[0, 0, 2:4, 4:8]
    block = m.shifted(2, 4, q_len=4, kv_len=8).materialize(1, 1, 2, 4)[0, 0]
    assert whole.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert torch.equal(block, whole)


def test_decode_steps_read_the_last_row_one_query_at_a_time():
    """Lq = 1 blocks at the last rows: what a KV cache asks at every step."""
    Lq, Lk = 6, 10
    for mask in (mh.causal(), mh.sliding_window(3), mh.causal() & mh.key_padding(torch.tensor([7]))):
        full = mask.materialize(1, 1, Lq, Lk)[0, 0]
        for i in range(Lq):
            row = mask.shifted(i, 0, q_len=Lq, kv_len=Lk).materialize(1, 1, 1, Lk)[0, 0]
            assert torch.equal(row, full[i : i + 1])


def test_positions_per_batch_row_read_left_padded_sequences():
    """``at`` with ``(B, L)`` positions: each batch row reads its own positions."""
    q_pos = torch.tensor([[0, 1, 2, 3], [-2, -1, 0, 1]])  # row 1 is left-padded by two
    m = mh.causal("top_left").at(q_pos, q_pos)
    dense = m.materialize(2, 1, 4, 4)
    assert torch.equal(dense[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(dense[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    ring = torch.tensor([4, 5, 2, 3])  # a ring buffer of 4 slots after 6 tokens: slot s holds position ring[s]
    window = mh.sliding_window(2, align="top_left").at(torch.tensor([5]), ring)
    assert window.materialize(1, 1, 1, 4)[0, 0, 0].tolist() == [True, True, False, True]


def test_shifted_blocks_compose_and_print_themselves():
    m = mh.causal().shifted(2, 3, q_len=6, kv_len=9).shifted(1, 1)
    assert m == mh.causal().shifted(3, 4, q_len=6, kv_len=9)
    assert "shifted(q_offset=3, kv_offset=4, q_len=6, kv_len=9)" in repr(m)
    assert torch.equal(m.materialize(1, 1, 2, 3), mh.causal().materialize(1, 1, 6, 9)[..., 3:5, 4:7])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocksparse"])
def test_a_positioned_mask_runs_on_every_backend_without_an_lq_by_lk_tensor(backend):
    """A ring-buffer window read at positions: blocksparse evaluates it a block at a time."""
    from helpers import LargestAllocation

    gen = torch.Generator().manual_seed(0)
    Lq, Lk = 600, 700
    q = torch.randn(1, 2, Lq, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, Lk, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = mh.sliding_window(64).at(torch.arange(Lq) + 100, torch.arange(Lk), q_len=Lq + 100, kv_len=Lk)
    want = mh.reference_attention(q, k, v, mask=mask)
    with LargestAllocation() as seen:
        got = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    torch.testing.assert_close(got.output, want.output, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-10, atol=1e-10)
    if backend == "blocksparse":
        assert seen.largest < Lq * Lk // 2
