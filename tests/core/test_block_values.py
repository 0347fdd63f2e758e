"""The block protocol's values (``Extent``, ``Block``) and the refusal of old-signature overrides."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import multihead as mh
from multihead.blocks import Block, Extent
from multihead.masks import BlockState, Mask
from multihead.validation import validate_call


def test_extent_and_block_are_frozen_values():
    e, b = Extent(2, 3, 5, 7), Block(1, 4, 2, 6)
    assert e == Extent(2, 3, 5, 7) and hash(e) == hash(Extent(2, 3, 5, 7)) and e != Extent(2, 3, 5, 8)
    assert b == Block(1, 4, 2, 6) and len({b, Block(1, 4, 2, 6)}) == 1
    for obj, field in ((e, "batch"), (b, "q0")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, 0)
    assert tuple(e) == (2, 3, 5, 7) and tuple(b) == (1, 4, 2, 6)  # unpack in field order


def test_the_helpers_read_the_same_positions():
    e, b = Extent(2, 3, 5, 7), Block(1, 4, 2, 6)
    assert (b.rows, b.cols) == (3, 4)
    assert Block.whole(e) == e.whole() == Block(0, 5, 0, 7)
    assert e.rows(1, 3) == Block(1, 3, 0, 7)
    assert b.shifted(2, -1) == Block(3, 6, 1, 5) and b.with_keys(0, 1) == Block(1, 4, 0, 1)
    assert e.with_lengths(9, 11) == Extent(2, 3, 9, 11) and e.with_heads(1) == Extent(2, 1, 5, 7)
    assert e.lengths == (5, 7)
    with pytest.raises(ValueError, match=r"not known here \(Lq=None, Lk=None\)"):
        _ = Extent(2, 3, None, None).lengths


def test_the_call_gives_its_extent():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8)
    call = validate_call(
        q, k, k, mask=None, scale=None, dropout_p=0.0, dropout_mask=None, return_weights=False, return_lse=False
    )
    assert call.extent == Extent(2, 4, 5, 7)
    assert call.extent.whole() == Block(0, 5, 0, 7)


def test_a_mask_answers_the_same_questions_through_the_protocol():
    mask = mh.sliding_window(2) & mh.key_padding([6, 3])
    extent, block = Extent(2, 1, 6, 6), Block(2, 5, 1, 4)
    whole = mask.materialize(2, 1, 6, 6).expand(2, 1, 6, 6)
    want = whole[:, :, 2:5, 1:4]
    assert torch.equal(mask.materialize_block(extent, block).expand_as(want), want)
    state = mask.block_state(extent, block)
    assert state is BlockState.PARTIAL and not bool(want.all()) and bool(want.any())
    lo, hi = mask.key_range(extent, block)
    seen = want.any(0).any(0).any(0).nonzero().flatten() + 1
    assert lo <= int(seen.min()) and int(seen.max()) < hi and (lo, hi) != (0, 0)


def test_a_subclass_with_the_old_positional_signature_is_refused_where_it_is_defined():
    with pytest.raises(TypeError, match=r"Old\.block_state\(q0, q1, k0, k1.*takes \(extent, block, \.\.\.\)"):

        class Old(Mask):  # noqa: F841 (defining it is the test)
            def _mod(self, b, h, q, kv, q_len, kv_len):
                return kv <= q

            def _describe(self):
                return "old"

            def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
                return BlockState.PARTIAL

    with pytest.raises(TypeError, match=r"OldCheck\.check\(batch, heads, q_len, kv_len\).*takes \(extent, \.\.\.\)"):

        class OldCheck(Mask):  # noqa: F841
            def _mod(self, b, h, q, kv, q_len, kv_len):
                return kv <= q

            def _describe(self):
                return "old"

            def check(self, batch, heads, q_len, kv_len):
                pass


def test_a_subclass_in_the_new_protocol_is_read_by_every_backend_question():
    class EveryOther(Mask):
        """Keys of even position only; answers block_state itself."""

        kind = "custom"

        def _mod(self, b, h, q, kv, q_len, kv_len):
            return kv % 2 == 0

        def _describe(self):
            return "every_other()"

        def block_state(self, extent, block):
            if block.cols == 1:
                return BlockState.FULL if block.k0 % 2 == 0 else BlockState.EMPTY
            return BlockState.PARTIAL

    m = EveryOther()
    assert m.block_state(Extent(1, 1, 4, 4), Block(0, 4, 2, 3)) is BlockState.FULL
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 9, 8, dtype=torch.float64), torch.randn(1, 2, 9, 8, dtype=torch.float64)
    want = mh.reference_attention(q, k, v, mask=mh.custom(lambda b, h, qi, ki: ki % 2 == 0)).output
    torch.testing.assert_close(mh.attention(q, k, v, mask=m), want)


def test_a_score_modifier_with_the_old_positional_signature_is_refused_where_it_is_defined():
    with pytest.raises(TypeError, match=r"OldBias\.bias_block\(batch, heads, q0.*takes \(extent, block, \.\.\.\)"):

        class OldBias(mh.scores.ScoreMod):  # noqa: F841 (defining it is the test)
            kind = "additive"

            def __call__(self, score, b, h, q_idx, kv_idx):
                return score

            def _describe(self):
                return "old"

            def bias_block(self, batch, heads, q0, q1, k0, k1, device=None, dtype=torch.float32):
                return torch.zeros(1, 1, q1 - q0, k1 - k0)


def test_a_score_modifier_answers_through_the_protocol():
    alibi = mh.positions.ALiBi(2).for_lengths(3, 5)
    extent, block = Extent(1, 2, 3, 5), Block(1, 3, 2, 5)
    whole = alibi.bias_block(extent, extent.whole())  # (1, H, Lq, Lk)
    torch.testing.assert_close(alibi.bias_block(extent, block), whole[:, :, 1:3, 2:5])
    scores = torch.zeros(1, 2, 2, 3)
    torch.testing.assert_close(alibi.apply_block(extent, block, scores), whole[:, :, 1:3, 2:5])
    with pytest.raises(ValueError, match="num_heads=2 but the attention has Hq=3"):
        alibi.check(Extent(1, 3, 3, 5))
