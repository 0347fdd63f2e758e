"""The one value-object base of masks and score modifiers (:mod:`multihead.values`)."""

from __future__ import annotations

import copy

import pytest
import torch

import multihead as mh
from multihead.masks import Mask
from multihead.positions import ALiBi
from multihead.scores import RelativeBias, ScoreMod
from multihead.values import Value


def test_masks_and_modifiers_share_the_value_base():
    assert issubclass(Mask, Value) and issubclass(ScoreMod, Value)
    for make in (lambda: mh.causal(), lambda: ALiBi(4), lambda: mh.scores.softcap(30.0)):
        a, b = make(), make()
        assert a is not b and a == b and hash(a) == hash(b)
    assert mh.scores.softcap(30.0) != mh.scores.softcap(20.0)
    assert ALiBi(4) != ALiBi(4, symmetric=True)
    assert mh.causal() != mh.scores.softcap(1.0)  # different types never compare equal
    chain = mh.scores.as_score_mod([ALiBi(2), mh.scores.softcap(5.0)])
    assert chain == mh.scores.as_score_mod([ALiBi(2), mh.scores.softcap(5.0)])  # nested values by value


def test_fields_are_set_once():
    for obj, field, new in ((mh.causal(), "align", "top_left"), (mh.scores.softcap(3.0), "cap", 4.0)):
        with pytest.raises(AttributeError, match=rf"{type(obj).__name__} is immutable.*setting '{field}'"):
            setattr(obj, field, new)
        with pytest.raises(AttributeError, match="immutable"):
            delattr(obj, field)
    alibi = ALiBi(2)
    hash(alibi)
    with pytest.raises(AttributeError, match="immutable"):  # no new field once the value was read
        alibi.extra = 1


def test_a_user_relative_bias_sets_its_fields_in_init_as_documented():
    class Linear(RelativeBias):
        """docs/positions.md: subclass RelativeBias and implement bias(h, distance, dtype)."""

        def __init__(self, num_heads: int, slope: float):
            super().__init__(num_heads)
            self.slope = slope  # a plain assignment in __init__: set once

        def bias(self, h, distance, dtype=torch.float64):
            return self.slope * distance.to(dtype) + 0 * h

        def _describe(self):
            return f"Linear({self.slope})"

    a = Linear(2, 0.5)
    assert a == Linear(2, 0.5) and a != Linear(2, 0.25)
    bound = a.for_lengths(3, 5)  # a copy with the alignment bound, the original unchanged
    assert (bound.offset, a.offset, bound.slope) == (2, None, 0.5)
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64)
    want = mh.attention(q, k, v, score_mod=ALiBi(2, slopes=[0.5, 0.5]), backend="reference")
    torch.testing.assert_close(mh.attention(q, k, v, score_mod=a), want)


def test_replace_and_copies_recompute_derived_values():
    mask = mh.key_padding(torch.tensor([3, 5]))
    hash(mask), mask.by_value()
    assert "_value_cache" in vars(mask)
    for other in (copy.copy(mask), copy.deepcopy(mask), mask._replace()):
        assert not any(name.startswith("_") for name in vars(other)) and other == mask
    bias = mh.scores.bias(torch.randn(1, 1, 80, 80))  # beyond the size compared by content
    twin = copy.deepcopy(bias)  # another tensor: another value (tensors by identity)
    assert twin.tensor is not bias.tensor and twin != bias


def test_to_moves_every_tensor_and_keeps_the_value_where_nothing_moves():
    bias = mh.scores.bias(torch.randn(1, 2, 3, 3))
    assert bias.to("cpu") is bias
    meta = bias.to("meta")
    assert meta.tensor.device.type == "meta" and isinstance(meta, type(bias)) and meta.name == bias.name
    doc = mh.document(torch.tensor([0, 0, 1])) & mh.causal()
    assert doc.to("cpu") is doc and doc.to("meta").parts[0].q_ids.device.type == "meta"
