"""masks.recognize.from_dense: a dense mask tensor read back as the mask object it spells out (what
explain() advises), and key_padding's message for a (B, Lk) integer attention mask."""

import pytest
import torch

import multihead as mh
from multihead.masks.recognize import from_dense, recognize


def _dense(mask, B, Lq, Lk, H=1):
    return mask.materialize(B, H, Lq, Lk).expand(B, H, Lq, Lk).clone()


@pytest.mark.parametrize(
    "mask,B,Lq,Lk,expression",
    [
        (mh.causal(), 1, 13, 13, "causal()"),
        (mh.causal(), 1, 13, 17, "causal()"),
        (mh.causal("top_left"), 1, 13, 17, "causal('top_left')"),
        (mh.causal(), 1, 17, 13, "causal()"),
        (mh.causal("top_left"), 1, 17, 13, "causal('top_left')"),
        (mh.sliding_window(4), 1, 59, 59, "sliding_window(4)"),
        (mh.sliding_window(3, 2), 1, 40, 59, "sliding_window(3, right=2)"),
        (mh.sliding_window(5, 1, "top_left"), 1, 33, 20, "sliding_window(5, right=1, align='top_left')"),
        (mh.key_padding(torch.tensor([17, 9, 4])), 3, 13, 17, "key_padding(torch.tensor([17, 9, 4]))"),
        (
            mh.causal() & mh.key_padding(torch.tensor([13, 6])),
            2,
            13,
            13,
            "causal() & key_padding(torch.tensor([13, 6]))",
        ),
        (
            mh.sliding_window(3) & mh.key_padding(torch.tensor([20, 11])),
            2,
            20,
            20,
            "sliding_window(3) & key_padding(torch.tensor([20, 11]))",
        ),
        (mh.document(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3])), 1, 11, 11, "document(ids)"),
        (mh.document_causal(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3])), 1, 11, 11, "document_causal(ids)"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_structured_dense_masks_are_recognised_exactly(mask, B, Lq, Lk, expression):
    dense = _dense(mask, B, Lq, Lk)
    for given in (dense, dense.expand(B, 4, Lq, Lk), dense[0, 0] if B == 1 else dense):
        found = from_dense(given)
        assert found is not None and found.expression == expression and not found.bias
        # the object means exactly the tensor, wherever it is evaluated
        assert torch.equal(_dense(found.mask, B, Lq, Lk), dense)


def test_float_masks_read_as_pytorch_adds_them():
    fm = torch.nn.Transformer.generate_square_subsequent_mask(9)  # 0 below the diagonal, -inf above
    found = from_dense(fm)
    assert found.expression == "causal()" and not found.bias
    biased = fm + torch.arange(9.0)  # a bias on the visible scores too
    assert from_dense(biased).expression == "causal()" and from_dense(biased).bias
    assert from_dense(torch.zeros(5, 5)).expression == "None"  # nothing blocked, nothing added


def test_masks_without_a_structure_or_polarity_are_not_recognised():
    torch.manual_seed(0)
    assert from_dense(torch.rand(13, 17) > 0.5) is None
    per_head = torch.stack([torch.ones(8, 8, dtype=torch.bool).tril(), torch.ones(8, 8, dtype=torch.bool)])
    assert from_dense(per_head.unsqueeze(0)) is None  # no mask object differs per head
    assert from_dense(torch.ones(8, 8, dtype=torch.int64).tril()) is None  # 1 = attend or blocked?
    holes = torch.ones(8, 8, dtype=torch.bool).tril()
    holes[5, 2] = False
    assert from_dense(holes) is None  # almost causal is not causal


def test_what_the_hugging_face_recogniser_found_is_found_here():
    """Regression: three recognisers (this one, integrations/hf_masks.py's, compat's causal check)
    found different structures; the one left finds what each found."""
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2]])  # (B, L): each sequence its own
    cases = [
        (mh.causal() & mh.document(docs), 2, 8, 8),  # a packed batch
        (mh.sliding_window(2) & mh.document(torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])), 1, 8, 8),  # a window in documents
        (mh.masks.Band(None, 2, "bottom_right"), 1, 9, 9),  # every key before, two after
        (mh.causal() & mh.key_padding(torch.tensor([9, 6])), 2, 5, 9),
    ]
    for mask, B, Lq, Lk in cases:
        dense = _dense(mask, B, Lq, Lk)
        found = from_dense(dense)
        assert found is not None, mask
        assert torch.equal(_dense(found.mask, B, Lq, Lk), dense), (mask, found)
        assert not isinstance(found.mask, mh.masks.TensorMask)


def test_the_old_name_warns_with_the_new_one():
    with pytest.warns(DeprecationWarning, match="now masks.recognize.from_dense"):
        found = recognize(torch.ones(4, 4, dtype=torch.bool).tril())
    assert found.expression == "causal()"


def test_key_padding_of_an_integer_attention_mask_says_what_to_pass():
    """Regression: key_padding(hf_attention_mask) said 'must be an integer tensor of shape (B,), got
    dtype torch.int64' without a hint."""
    hf = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(
        TypeError,
        match=r"integer torch.int64 tensor of shape \(2, 4\).* expected a bool \(B, Lk\) "
        r"table .* key_padding\(mask.bool\(\)\), or key_padding\(mask.sum\(-1\)\)",
    ):
        mh.key_padding(hf)
    # both suggested fixes mean what the attention mask meant
    table, lengths = mh.key_padding(hf.bool()), mh.key_padding(hf.sum(-1))
    assert torch.equal(table.materialize(2, 1, 3, 4), lengths.materialize(2, 1, 3, 4))
