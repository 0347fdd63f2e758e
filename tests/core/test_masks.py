"""Masks: their meaning, their pictures, composition, shifting, and that every structural answer
a backend may rely on agrees with the materialized mask."""

import pytest
import torch

import multihead as mh
from multihead.blocks import Block, Extent
from multihead.masks import BlockState


def dense(mask, B=1, H=1, Lq=6, Lk=6):
    return mask.materialize(B, H, Lq, Lk).expand(B, H, Lq, Lk)


def test_causal_alignments_match_the_drawn_conventions():
    assert mh.causal().to_string(2, 5) == "████·\n█████"
    assert mh.causal("top_left").to_string(2, 5) == "█····\n██···"
    assert mh.causal().to_string(5, 2) == "··\n··\n··\n█·\n██"
    assert mh.causal("top_left").to_string(5, 2) == "█·\n██\n██\n██\n██"


def test_repr_draws_a_picture_and_names_the_mask():
    text = repr(mh.causal() & mh.sliding_window(2))
    assert (
        text.splitlines()[0] == "causal(align='bottom_right') & sliding_window(left=2, right=0, align='bottom_right')"
    )
    assert text.splitlines()[4] == "·███····"


def test_repr_draws_a_combination_at_its_own_length_and_cuts_long_ones():
    # A combination takes the lengths of the part that has them (here 1 query, 5 keys: a decoding
    # step of chunked attention); drawing it at 8 x 8 read the ids past their end (IndexError).
    step = mh.causal() & mh.document(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    assert repr(step).splitlines()[1:] == ["█████"]
    assert repr(mh.key_padding(torch.ones(1, 3, dtype=torch.bool))).splitlines()[1:] == ["███"] * 8
    # A long mask: the first 32 x 64, evaluated at its full lengths, and a line saying it is cut.
    lines = repr(mh.document(torch.arange(100).view(1, 100) // 30)).splitlines()
    assert len(lines) == 1 + 32 + 1 and lines[-1] == "(the first 32 x 64 of 100 x 100)"
    assert lines[30] == "█" * 30 + "·" * 34 and lines[31] == "·" * 30 + "█" * 30 + "·" * 4  # rows 29, 30
    bottom_right = mh.causal().to_string(40, 100).splitlines()
    assert bottom_right[0] == "█" * 61 + "·" * 3 and bottom_right[-1] == "(the first 32 x 64 of 40 x 100)"


def test_sliding_window_counts_left_plus_one_plus_right_keys():
    m = dense(mh.sliding_window(2, 1, align="top_left"), Lq=8, Lk=8)[0, 0]
    assert m.sum(-1).tolist() == [2, 3, 4, 4, 4, 4, 4, 3]
    assert bool(m[4, 2]) and bool(m[4, 5]) and not bool(m[4, 1]) and not bool(m[4, 6])


def test_mask_mod_is_the_meaning_and_square_without_lengths():
    m = mh.causal()
    assert bool(m.mask_mod(0, 0, 3, 3)) and not bool(m.mask_mod(0, 0, 3, 4))
    assert bool(m.mask_mod(0, 0, 0, 3, q_len=2, kv_len=5))  # bottom-right: query 0 sees key 3
    with pytest.raises(ValueError, match="both q_len and kv_len"):
        m.mask_mod(0, 0, 0, 0, q_len=2)


def test_key_padding_prefix_lm_and_document():
    kp = dense(mh.key_padding([2, 4]), B=2, Lq=3, Lk=5)
    assert kp[0, 0, 0].tolist() == [True, True, False, False, False]
    assert kp[1, 0, 2].tolist() == [True, True, True, True, False]
    table = torch.tensor([[True, False, True]])
    assert dense(mh.key_padding(table), Lq=2, Lk=3)[0, 0, 1].tolist() == [True, False, True]
    plm = dense(mh.prefix_lm(3), Lq=5, Lk=5)[0, 0]
    assert plm[0].tolist() == [True, True, True, False, False] and plm[4].all()
    doc = dense(mh.document(torch.tensor([0, 0, 1, 1, 1, 2])))[0, 0]
    assert doc[2].tolist() == [False, False, True, True, True, False] and doc[5].sum() == 1


def test_key_padding_takes_pytorchs_polarity_by_name():
    """Issue 28, item 9: nn.MultiheadAttention's key_padding_mask (True = padding) given to
    key_padding() positionally hides the real keys. Its polarity is said by name: pad=."""
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])  # PyTorch: lengths 3 and 5
    by_name = mh.key_padding(pad=pad)
    assert by_name == mh.key_padding(~pad)
    assert torch.equal(dense(by_name, B=2, Lq=2, Lk=5), dense(mh.key_padding([3, 5]), B=2, Lq=2, Lk=5))
    pad[0, 0] = True  # the mask keeps its own copy
    assert dense(by_name, B=2, Lq=1, Lk=5)[0, 0, 0].tolist() == [True, True, True, False, False]
    with pytest.raises(TypeError, match=r"key_padding: got both lengths and pad="):
        mh.key_padding([3, 5], pad=pad)
    with pytest.raises(
        TypeError, match=r"key_padding: expected lengths .* or pad= a bool \(B, Lk\) table with True = padding"
    ):
        mh.key_padding()
    with pytest.raises(
        TypeError,
        match=r"pad must be a bool \(B, Lk\) tensor with True = padding, got dtype "
        r"torch.int64; hint: pad=mask.bool\(\)",
    ):
        mh.key_padding(pad=pad.long())
    with pytest.raises(TypeError, match=r"got dtype torch.float32; hint: pad=mask == float\('-inf'\)"):
        mh.key_padding(pad=torch.zeros(2, 5))
    with pytest.raises(TypeError, match=r"pad must be a bool \(B, Lk\) tensor .*got list"):
        mh.key_padding(pad=[[True, False]])
    with pytest.raises(ValueError, match=r"pad must have shape \(B, Lk\), got \(5,\)"):
        mh.key_padding(pad=pad[0])


def test_operators_compose_like_boolean_algebra():
    a, b = mh.causal(), mh.sliding_window(2, 2)
    da, db = dense(a), dense(b)
    assert torch.equal(dense(a & b), da & db)
    assert torch.equal(dense(a | b), da | db)
    assert torch.equal(dense(~a), ~da)
    assert torch.equal(dense(a & torch.ones(6, 6, dtype=torch.bool)), da)  # tensors compose too


def test_masks_are_immutable():
    m = mh.causal()
    with pytest.raises(AttributeError, match="immutable"):
        m.align = "top_left"


def test_shifted_reads_positions_with_offsets():
    full = dense(mh.causal("top_left"), Lq=10, Lk=10)[0, 0]
    part = dense(mh.causal("top_left").shifted(4, 2), Lq=3, Lk=5)[0, 0]
    assert torch.equal(part, full[4:7, 2:7])
    twice = mh.causal("top_left").shifted(1, 0).shifted(3, 2)
    assert torch.equal(dense(twice, Lq=3, Lk=5)[0, 0], part)
    doc = mh.document(torch.tensor([0, 0, 0, 1, 1, 1, 1, 2]))
    assert torch.equal(dense(doc.shifted(2, 3), Lq=4, Lk=4)[0, 0], dense(doc, Lq=8, Lk=8)[0, 0, 2:6, 3:7])


def test_masks_are_boolean_and_a_float_mask_splits_into_pattern_and_bias():
    from multihead.call import mask_and_score_mod

    bias = torch.randn(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    with pytest.raises(TypeError, match="additive bias, not a mask"):
        mh.masks.as_mask(bias)
    mask, mod = mask_and_score_mod(bias, None)
    assert torch.equal(mask.materialize(1, 1, 4, 4)[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert isinstance(mod, mh.scores.Bias) and mod.kind == "additive"
    torch.testing.assert_close(mod.bias_block(Extent(1, 1, 4, 4), Block(0, 4, 0, 4))[0, 0], bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_what_a_float_mask_blocks_is_one_rule(dtype):
    """docs/conventions.md: -inf and values at or below finfo(dtype).min / 2 block; anything above is a bias."""
    lowest = torch.finfo(dtype).min
    values = [float("-inf"), lowest, lowest / 2, -1e4, -1.0, 0.0, 3.0, float("inf"), float("nan")]
    blocks = [True, True, True, False, False, False, False, False, False]
    got = mh.masks.additive_blocked(torch.tensor(values, dtype=dtype))
    assert got.tolist() == blocks, (dtype, got.tolist())
    twice = torch.full((2,), lowest, dtype=dtype) + lowest  # two masks summed: -inf
    assert bool(mh.masks.additive_blocked(twice).all())


def test_one_float_mask_means_one_thing_to_every_reader():
    """Regression: attention() read finfo.min as a bias (a row of it a uniform average) while the
    Hugging Face reading blocked it (the row zero); explain() and compat followed -inf alone."""
    from multihead.call import mask_and_score_mod
    from multihead.masks.recognize import from_dense

    allowed = mh.causal().materialize(1, 1, 6, 4)[0, 0]  # (Lq, Lk) = (6, 4): queries 0 and 1 see no key
    for blocked in (float("-inf"), torch.finfo(torch.float32).min):
        fm = torch.zeros(6, 4).masked_fill(~allowed, blocked)
        mask, _ = mask_and_score_mod(fm, None)
        assert torch.equal(mask.materialize(1, 1, 6, 4)[0, 0], allowed)
        found = from_dense(fm)
        assert found is not None and found.mask == mh.causal() and not found.bias
        q, k = torch.randn(1, 2, 6, 8, dtype=torch.float64), torch.randn(1, 2, 4, 8, dtype=torch.float64)
        res = mh.attention(q, k, k, mask=fm, return_lse=True)
        assert torch.equal(res.output[:, :, :2], torch.zeros_like(res.output[:, :, :2]))  # fully masked: 0
        assert torch.isneginf(res.lse[:, :, :2]).all()
        torch.testing.assert_close(res.output, mh.attention(q, k, k, mask=mh.causal()), rtol=0, atol=1e-12)


def test_masks_compare_and_hash_by_value_tensors_by_identity():
    assert mh.causal() == mh.causal() and hash(mh.causal()) == hash(mh.causal())
    assert mh.causal() & mh.sliding_window(3) == mh.causal() & mh.sliding_window(3)
    assert mh.causal() != mh.causal("top_left") and mh.sliding_window(3) != mh.sliding_window(4)
    # Small CPU tensors (lengths, ids, positions) by content; the mask keeps its own copy.
    assert mh.key_padding(torch.tensor([3, 5])) == mh.key_padding(torch.tensor([3, 5]))
    assert mh.key_padding(torch.tensor([3, 5])) != mh.key_padding(torch.tensor([3, 6]))
    # Large tensors by identity, and a tensor changed in place is another value (caches miss).
    table = torch.ones(1, 1, 128, 128, dtype=torch.bool)
    assert mh.masks.as_mask(table) == mh.masks.as_mask(table)  # two views of one tensor: one mask
    assert mh.masks.as_mask(table) != mh.masks.as_mask(table.clone())
    before = hash(mh.masks.as_mask(table))
    table[0, 0, 0, 0] = False
    assert hash(mh.masks.as_mask(table)) != before  # plan caches miss after an in-place change
    assert len({mh.causal(), mh.causal(), mh.causal("top_left")}) == 2


def test_building_a_mask_never_synchronises_with_the_host():
    """Host copies for structural questions are made on first use, not at construction."""
    kp = mh.key_padding(torch.tensor([3, 5]))
    doc = mh.document(torch.tensor([0, 0, 1, 1]))
    assert not any(k.endswith("_cache") for k in vars(kp)) and not any(k.endswith("_cache") for k in vars(doc))
    assert kp.block_state(Extent(1, 1, 2, 5), Block(0, 2, 0, 3)) is BlockState.FULL and "_max_cache" not in vars(kp)
    assert kp.block_state(Extent(1, 1, 2, 5), Block(0, 2, 3, 5)) is BlockState.PARTIAL and "_max_cache" in vars(kp)
    assert doc.key_range(Extent(1, 1, 4, 4), Block(0, 2, 0, 4)) == (0, 2) and "_sorted_cache" in vars(doc)


def test_integer_masks_are_refused_with_a_hint():
    with pytest.raises(TypeError, match=r"torch.int64.*polarity.*mask == 0"):
        mh.masks.as_mask(torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="uint8"):
        mh.masks.as_mask(torch.ones(3, 3, dtype=torch.uint8))


# ---------------------------------------------------------------- structure agrees with meaning
def structured_masks():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3], [0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]])
    kv_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3], [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]])
    return {
        "causal_br": mh.causal(),
        "causal_tl": mh.causal("top_left"),
        "window": mh.sliding_window(3),
        "window_lr_tl": mh.sliding_window(2, 4, align="top_left"),
        "window_unbounded_right": mh.sliding_window(1, None),
        "padding": mh.key_padding([11, 4]),
        "padding_table": mh.key_padding(torch.rand(2, 11, generator=torch.Generator().manual_seed(0)) > 0.4),
        "document": mh.document(ids, kv_ids),
        "document&causal": mh.document(ids, kv_ids) & mh.causal(),
        "prefix_lm": mh.prefix_lm(4),
        "~causal": ~mh.causal(),
        "shifted": mh.causal("top_left").shifted(3, -2),
        "custom": mh.custom(lambda b, h, q, kv: (q - kv) % 4 == 0),
        "tensor": mh.masks.as_mask(torch.rand(2, 1, 13, 11, generator=torch.Generator().manual_seed(1)) > 0.5),
    }


@pytest.mark.parametrize("name", list(structured_masks()))
def test_structural_answers_agree_with_the_dense_mask(name):
    mask = structured_masks()[name]
    B, H, Lq, Lk = 2, 1, 13, 11
    full = dense(mask, B, H, Lq, Lk)
    extent = Extent(B, H, Lq, Lk)
    for q0 in range(0, Lq, 3):
        q1 = min(q0 + 3, Lq)
        lo, hi = mask.key_range(extent, extent.rows(q0, q1))
        visible = full[:, :, q0:q1].any(dim=(0, 1, 2)).nonzero().flatten()
        if len(visible):
            assert lo <= int(visible.min()) and int(visible.max()) < hi, (q0, lo, hi, visible)
        for k0 in range(0, Lk, 4):
            k1 = min(k0 + 4, Lk)
            block = full[:, :, q0:q1, k0:k1]
            state = mask.block_state(extent, Block(q0, q1, k0, k1))
            if state is BlockState.FULL:
                assert block.all(), (q0, k0)
            elif state is BlockState.EMPTY:
                assert not block.any(), (q0, k0)
    empty = mask.empty_rows(extent)
    truth = ~full.any(-1)
    if empty is None:
        assert not truth.any()
    else:
        assert torch.equal(empty.expand_as(truth), truth)
    offset = mask.causal_offset(Lq, Lk)
    if offset is not None:
        assert torch.equal(full[0, 0], torch.ones(Lq, Lk, dtype=torch.bool).tril(offset))


def test_tight_structure_for_bands():
    """Bands answer exactly (FULL/EMPTY, not merely PARTIAL), which is what makes skipping pay."""
    m, extent = mh.sliding_window(4), Extent(1, 1, 16, 16)
    assert m.block_state(extent, Block(8, 12, 0, 4)) is BlockState.EMPTY
    assert m.block_state(extent, Block(8, 10, 6, 8)) is BlockState.FULL
    assert m.key_range(extent, extent.rows(8, 12)) == (4, 12)
    assert m.key_range(extent, Block(8, 12, 6, 16)) == (6, 12)  # clamped to the block's keys
    assert mh.causal().causal_offset(3, 7) == 4 and mh.causal("top_left").causal_offset(3, 7) == 0


def test_docs_conventions_draw_what_the_masks_print():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "conventions.md").read_text()
    for picture in (
        mh.causal().to_string(5, 2),
        mh.causal("top_left").to_string(2, 5),
        mh.prefix_lm(3).to_string(6, 6),
        mh.sliding_window(2).to_string(6, 6),
    ):
        rows = picture.splitlines()
        assert all(row in doc for row in rows)
    assert "h // G" in doc and "True` means may attend" in doc


def test_changing_the_callers_tensor_in_place_changes_no_mask():
    """Issue 9, item 7: masks are immutable; a plan cached for one must stay right."""
    lengths, ids, pos = torch.tensor([3]), torch.tensor([0, 0, 1, 1]), torch.arange(4)
    kp, doc, at = mh.key_padding(lengths), mh.document(ids), mh.causal("top_left").at(pos, pos)
    want = [m.materialize(1, 1, 4, 4).clone() for m in (kp, doc, at)]
    lengths.fill_(1), ids.fill_(7)
    pos.copy_(pos.flip(0))
    assert all(torch.equal(m.materialize(1, 1, 4, 4), w) for m, w in zip((kp, doc, at), want))
    # The same through blocksparse's and sdpa's plan caches: tests/backends/test_robustness.py (item 7).


def test_document_causal_empty_rows_from_its_tables_equal_the_definition():
    """``document_causal`` answers "which rows see nothing" in O(L) from its run tables (the
    backends ask on every new mask); it must equal evaluating the mask, for sorted and unsorted
    ids, per-row batches, ``Lq != Lk`` and documents with more queries than keys."""
    from multihead.masks.base import Mask

    gen = torch.Generator().manual_seed(0)
    empty_rows_seen = 0
    for trial in range(600):
        B, Lq, Lk = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 3), (1, 12), (1, 12)))
        q, k = torch.randint(0, 4, (B, Lq), generator=gen), torch.randint(0, 4, (B, Lk), generator=gen)
        if trial % 3:
            q, k = q.sort().values, k.sort().values
        mask = mh.document_causal(q, k)
        want = Mask._empty_rows(mask, Extent(B, 1, Lq, Lk)).expand(B, 1, Lq)
        assert torch.equal(mask._empty_rows(Extent(B, 1, Lq, Lk)).expand(B, 1, Lq), want), (q, k)
        empty_rows_seen += int(want.sum())
    assert empty_rows_seen > 100  # the cases do reach rows that see nothing


def test_head_range_reads_the_whole_attentions_heads():
    """A rank of head-parallel attention (ulysses) holds heads [first, first + count) of Hq and
    calls attention on them alone: its mask is the whole mask at those heads."""
    B, Hq, L = 2, 6, 9
    g = torch.Generator().manual_seed(0)
    per_head = torch.rand(B, Hq, L, L, generator=g) < 0.5
    by_head = mh.custom(lambda b, h, qi, ki: (ki <= qi) | (ki % (h + 2) == 0), name="by_head")
    shared = torch.rand(B, 1, L, L, generator=g) < 0.5
    for whole in (mh.masks.as_mask(per_head), by_head, by_head & mh.causal(), mh.masks.as_mask(shared)):
        dense = whole.materialize(B, Hq, L, L).expand(B, Hq, L, L)
        for first, count in ((0, 2), (2, 2), (3, 3), (5, 1)):
            part = mh.masks.head_range(whole, first, count, Hq)
            part.check(Extent(B, count, L, L))
            got = part.materialize(B, count, L, L).expand(B, count, L, L)
            assert torch.equal(got, dense[:, first : first + count]), (whole, first, count)
            for q0, q1, k0, k1 in ((0, 4, 0, 4), (4, 9, 0, 9), (0, 1, 5, 9)):  # answers true of its heads
                state = part.block_state(Extent(B, count, L, L), Block(q0, q1, k0, k1))
                block = dense[:, first : first + count, q0:q1, k0:k1]
                assert state is not mh.masks.BlockState.FULL or bool(block.all())
                assert state is not mh.masks.BlockState.EMPTY or not bool(block.any())
    band = mh.causal() & mh.key_padding(torch.tensor([9, 5]))
    assert mh.masks.head_range(band, 2, 2, Hq) is band  # no head in its meaning: as it is
    assert mh.masks.head_range(None, 2, 2, Hq) is None
    assert isinstance(mh.masks.head_range(mh.masks.as_mask(per_head), 2, 2, Hq), mh.masks.TensorMask)  # sliced
    with pytest.raises(ValueError, match=r"heads \[5, 7\) are not a range of the 6 heads"):
        mh.masks.head_range(by_head, 5, 2, Hq)
    with pytest.raises(ValueError, match="read by a call of 3 heads; expected 2"):
        mh.masks.head_range(by_head, 0, 2, Hq).check(Extent(B, 3, L, L))
