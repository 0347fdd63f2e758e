"""Bad input: one table of (inputs, exception type, message regex). Messages name the argument,
what was received and what was expected; validation happens before any computation."""

import pytest
import torch

import multihead as mh

q = torch.randn(2, 8, 5, 16)
k = torch.randn(2, 2, 7, 16)
v = torch.randn(2, 2, 7, 12)

BAD = [
    (
        "q rank",
        dict(q=torch.randn(2, 5, 16)),
        ValueError,
        r"q must have 4 dims \(B, Hq, Lq, D\), got shape \(2, 5, 16\)",
    ),
    ("k rank", dict(k=torch.randn(7, 16)), ValueError, r"k must have 4 dims"),
    ("not a tensor", dict(v=[[1.0]]), TypeError, r"v must be a torch.Tensor .* got list"),
    (
        "integer q",
        dict(q=torch.ones(2, 8, 5, 16, dtype=torch.int64)),
        TypeError,
        r"q must be a floating-point tensor \(B, Hq, Lq, D\), got dtype torch.int64",
    ),
    # Tensors without strides or sizes: named, with the conversion, before PyTorch's own errors.
    (
        "sparse q",
        dict(q=q.to_sparse()),
        TypeError,
        r"q must be a dense \(strided\) tensor \(B, Hq, Lq, D\), got layout torch.sparse_coo; hint: q.to_dense\(\)",
    ),
    (
        "mkldnn k",
        dict(k=k.to_mkldnn()),
        TypeError,
        r"k must be a dense \(strided\) tensor .*got layout torch._mkldnn",
    ),
    (
        "nested q",
        dict(q=torch.nested.nested_tensor([q[0], q[1, :, :3]], layout=torch.jagged)),
        TypeError,
        r"q must be a dense tensor .*got a nested tensor; hint: pad it \(q.to_padded_tensor\(0.0\)\).*key_padding",
    ),
    ("head dim", dict(k=torch.randn(2, 2, 7, 8)), ValueError, r"head dims differ: q has D=16 but k has D=8"),
    ("k/v length", dict(v=torch.randn(2, 2, 6, 12)), ValueError, r"k and v lengths differ: k has Lk=7, v has 6"),
    ("k/v heads", dict(v=torch.randn(2, 1, 7, 12)), ValueError, r"k and v head counts differ: k has Hkv=2, v has 1"),
    (
        "Hq % Hkv",
        dict(k=torch.randn(2, 3, 7, 16), v=torch.randn(2, 3, 7, 12)),
        ValueError,
        r"Hq=8 heads, not divisible by Hkv=3 .*one of \[1, 2, 4, 8\]",
    ),
    ("batch", dict(k=torch.randn(3, 2, 7, 16)), ValueError, r"batch sizes differ: q has B=2, k has 3"),
    (
        "dtype mismatch",
        dict(k=torch.randn(2, 2, 7, 16, dtype=torch.float64)),
        TypeError,
        r"share a dtype, got q torch.float32, k torch.float64",
    ),
    ("device mismatch", dict(k=torch.randn(2, 2, 7, 16, device="meta")), ValueError, r"one device, got q cpu, k meta"),
    # Issue 28, item 10: a mask tensor is reported by its own shape, not the 4-D view it becomes.
    (
        "mask shape",
        dict(mask=torch.ones(5, 6, dtype=torch.bool)),
        ValueError,
        r"mask of shape \(5, 6\) is not broadcastable to \(B, H, Lq, Lk\) = \(2, 8, 5, 7\)",
    ),
    (
        "3-D mask shape",
        dict(mask=torch.ones(2, 1, 7, dtype=torch.bool)),
        ValueError,
        r"mask of shape \(2, 1, 7\) is not broadcastable to \(B, H, Lq, Lk\) = \(2, 8, 5, 7\); its dims line up "
        r"with the last 3",
    ),
    (
        "float mask shape",
        dict(mask=torch.zeros(3, 5, 7)),
        ValueError,
        r"mask of shape \(3, 5, 7\) is not broadcastable to \(B, H, Lq, Lk\)",
    ),
    # A (B, Lk) table is PyTorch's key_padding_mask given as mask=: the hint names key_padding and its polarity.
    (
        "(B, Lk) bool mask",
        dict(mask=torch.ones(2, 7, dtype=torch.bool)),
        ValueError,
        r"mask of shape \(2, 7\) is not broadcastable .*hint: a 2-D mask is \(Lq, Lk\), and \(2, 7\) = \(B, Lk\) "
        r"looks like a key padding mask: pass mask=multihead.key_padding\(lengths_or_table\).*True = a real key, "
        r"the opposite of PyTorch's key_padding_mask \(True = padding\): "
        r"mask=multihead.key_padding\(~key_padding_mask\)",
    ),
    (
        "(B, Lk) additive mask",
        dict(mask=torch.zeros(2, 7)),
        ValueError,
        r"mask of shape \(2, 7\) .*key padding mask.*"
        r"mask=multihead.key_padding\(~multihead.masks.additive_blocked\(mask\)\)",
    ),
    (
        "mask on another device",
        dict(mask=torch.ones(5, 7, dtype=torch.bool, device="meta")),
        ValueError,
        r"mask is on meta but q is on cpu; .*build the mask on cpu",
    ),
    (
        "additive mask on another device",
        dict(mask=torch.zeros(5, 7, device="meta")),
        ValueError,
        r"mask is on meta but q is on cpu",
    ),
    ("mask rank", dict(mask=torch.ones(1, 1, 1, 5, 7, dtype=torch.bool)), ValueError, r"mask must have 2 to 4 dims"),
    ("mask int dtype", dict(mask=torch.ones(5, 7, dtype=torch.int32)), TypeError, r"mask has dtype torch.int32"),
    ("mask uint8", dict(mask=torch.ones(5, 7, dtype=torch.uint8)), TypeError, r"polarity"),
    (
        "mask type",
        dict(mask="causal"),
        TypeError,
        r"mask must be a multihead mask, a bool or float tensor, or None; got str",
    ),
    (
        "key_padding batch",
        dict(mask=mh.key_padding([7, 7, 7])),
        ValueError,
        r"key_padding: mask has 3 batch elements but the input has B=2",
    ),
    (
        "document length",
        dict(mask=mh.document(torch.zeros(4, dtype=torch.long))),
        ValueError,
        r"document: q_ids has length 4 but Lq=5",
    ),
    ("dropout high", dict(dropout_p=1.0), ValueError, r"dropout_p must be a number in \[0, 1\), got 1.0"),
    ("dropout negative", dict(dropout_p=-0.1), ValueError, r"dropout_p must be a number in \[0, 1\), got -0.1"),
    ("scale", dict(scale=float("nan")), ValueError, r"scale must be a finite number or None"),
    ("backend", dict(backend="flash9"), ValueError, r"unknown backend 'flash9'; known backends: 'auto', .*'sdpa'"),
    ("return flag", dict(return_lse=1), TypeError, r"return_lse must be a bool, got int"),
    (
        "dropout_mask shape",
        dict(dropout_p=0.1, dropout_mask=torch.ones(5, 7, dtype=torch.bool)),
        ValueError,
        r"dropout_mask must have shape \(B, Hq, Lq, Lk\) = \(2, 8, 5, 7\)",
    ),
    (
        "empty batch",
        dict(q=torch.randn(0, 8, 5, 16)),
        ValueError,
        r"q has a zero-size dimension: shape \(0, 8, 5, 16\); expected B, heads and head dims >= 1 \(only the lengths",
    ),
    # Issue 9, item 10: batch dimensions do not broadcast; the message says how to expand.
    (
        "broadcast batch",
        dict(k=torch.randn(1, 2, 7, 16)),
        ValueError,
        r"batch sizes differ: q has B=2, k has 1.*expand the smaller one \(e.g. k.expand\(2, -1, -1, -1\)",
    ),
    ("3-D input", dict(q=torch.randn(8, 5, 16)), ValueError, r"q must have 4 dims \(B, Hq, Lq, D\).*hint"),
    # Issue 28, item 9: q, k, v in FlashAttention's (B, L, H, D). Where shapes show it (the heads do
    # not group, or a mask of the whole sequence does not fit), the error says to transpose; a call
    # valid in (B, H, L, D) is never refused (test_a_valid_call_is_not_taken_for_the_transposed_layout).
    (
        "(B, L, H, D) inputs",
        dict(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2)),
        ValueError,
        r"q has Hq=5 heads, not divisible by Hkv=7 .*; hint: multihead takes \(B, H, L, D\); if q, k and v are "
        r"\(B, L, H, D\) \(FlashAttention's layout\), pass q.transpose\(1, 2\), k.transpose\(1, 2\), "
        r"v.transpose\(1, 2\) \(read that way: Hq=8, Hkv=2, Lq=5, Lk=7\), and out.transpose\(1, 2\)",
    ),
    (
        "(B, L, H, D) decoding step",
        dict(q=q[:, :, -1:].transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2)),
        ValueError,
        r"q has Hq=1 heads, not divisible by Hkv=7 .*hint: .*\(read that way: Hq=8, Hkv=2, Lq=1, Lk=7\)",
    ),
    (
        "(B, L, H, D) self-attention, mask tensor",
        dict(q=k.transpose(1, 2), v=v.transpose(1, 2), k=k.transpose(1, 2), mask=torch.ones(7, 7, dtype=torch.bool)),
        ValueError,
        r"mask of shape \(7, 7\) is not broadcastable to \(B, H, Lq, Lk\) = \(2, 7, 2, 2\).*; hint: multihead "
        r"takes \(B, H, L, D\); .*q.transpose\(1, 2\).*\(read that way: Hq=2, Hkv=2, Lq=7, Lk=7\)",
    ),
    (
        "(B, L, H, D) self-attention, key_padding table",
        dict(q=k.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), mask=mh.key_padding(torch.ones(2, 7) > 0)),
        ValueError,
        r"key_padding: bool table has 7 keys but Lk=2; hint: .*q.transpose\(1, 2\).*Lq=7, Lk=7",
    ),
    (
        "(B, L, H, D) self-attention, documents",
        dict(q=k.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), mask=mh.document(torch.arange(7) // 3)),
        ValueError,
        r"document: q_ids has length 7 but Lq=2; hint: .*q.transpose\(1, 2\)",
    ),
    # Issue 9, item 8: what was silently accepted.
    (
        "shifted key_padding, wrong batch",
        dict(mask=mh.key_padding([3, 4, 5]).shifted(0, 2)),
        ValueError,
        r"key_padding: mask has 3 batch elements but the input has B=2",
    ),
    (
        "shifted tensor mask, wrong shape",
        dict(mask=mh.masks.as_mask(torch.ones(3, 6, 7, dtype=torch.bool)).shifted(1, 0)),
        ValueError,
        r"mask of shape \(1, 3, 6, 7\) is not broadcastable to \(B, H, Lq, Lk\)",
    ),
    (
        "shifted document past its ids",
        dict(mask=mh.document(torch.zeros(2, 8, dtype=torch.long)).shifted(0, 2)),
        ValueError,
        r"shifted: the block's Lk=7 at kv_offset=2 reads positions \[2, 9\), outside the whole attention's Lk=8",
    ),
    (
        "at positions past the whole",
        dict(mask=mh.causal().at(torch.arange(5) + 4, torch.arange(7), q_len=6, kv_len=7)),
        ValueError,
        r"at: q_positions hold values in \[4, 8\], outside the whole attention's Lq=6",
    ),
    (
        "custom of the wrong shape",
        dict(mask=mh.custom(lambda b, h, i, j: torch.ones(3, dtype=torch.bool), name="bad")),
        ValueError,
        r"custom mask 'bad' returned shape \(3,\), which does not broadcast to its index grid",
    ),
    (
        "score_mod list element",
        dict(score_mod=[mh.scores.softcap(2.0), "x"]),
        TypeError,
        r"score_mod\[1\] must be a multihead.scores modifier or a function "
        r"fn\(score, b, h, q_idx, kv_idx\) -> score, got str",
    ),
    (
        "score_mod function of the wrong shape",
        dict(score_mod=lambda s, b, h, qi, ki: s.sum(-1)),
        ValueError,
        r"score_mod\(<lambda>\) returned shape .* for scores of shape .*; it must keep the shape of the scores",
    ),
    (
        "score_mod function returning None",
        dict(score_mod=lambda s, b, h, qi, ki: None),
        TypeError,
        r"score_mod\(<lambda>\) returned NoneType; it must return the modified scores",
    ),
    (
        "bias on another device",
        dict(score_mod=mh.scores.bias(torch.zeros(5, 7, device="meta"))),
        ValueError,
        r"score_mod bias\(.*\) holds a tensor on meta but q is on cpu",
    ),
]


@pytest.mark.parametrize("name,override,exc,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_clear_error(name, override, exc, pattern):
    args, override = dict(q=q, k=k, v=v), dict(override)
    args.update({key: override.pop(key) for key in ("q", "k", "v") if key in override})
    with pytest.raises(exc, match=pattern):
        mh.attention(args["q"], args["k"], args["v"], **override)
    with pytest.raises(exc, match=pattern):  # explain validates the same way
        mh.explain(args["q"], args["k"], args["v"], **override)


def test_a_valid_call_is_not_taken_for_the_transposed_layout():
    """The (B, L, H, D) hint joins an error only when the shapes read that way make a valid call;
    calls valid in (B, H, L, D) run, whatever their transposed reading would be."""
    hint = r"FlashAttention's layout"
    with pytest.raises(ValueError, match=hint):  # Lq=5, Lk=7 read as heads: only the transposed reading groups
        mh.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    # Hq=8, Hkv=3 is wrong either way (read transposed: Hq=5, Hkv=7): no hint
    with pytest.raises(ValueError, match=r"not divisible by Hkv=3") as info:
        mh.attention(q, torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 12))
    assert "hint" not in str(info.value)
    # A mask that fits neither reading: no hint either
    with pytest.raises(ValueError, match=r"mask of shape \(4, 7\)") as info:
        mh.attention(q, k, v, mask=torch.ones(4, 7, dtype=torch.bool))
    assert "hint" not in str(info.value)
    # Valid in (B, H, L, D), and also valid read transposed: accepted as documented
    for shape_q, shape_k in (
        ((2, 4, 6, 16), (2, 4, 6, 16)),
        ((2, 6, 4, 16), (2, 3, 2, 16)),
        ((1, 8, 8, 8), (1, 1, 8, 8)),
    ):
        qq, kk = torch.randn(shape_q), torch.randn(shape_k)
        assert mh.attention(qq, kk, kk, mask=mh.causal()).shape == shape_q


def test_forcing_a_backend_that_refuses_lists_its_reasons():
    keep = torch.ones(2, 8, 5, 7, dtype=torch.bool)
    with pytest.raises(mh.BackendRefusedError, match=r"backend 'sdpa' cannot serve this call: .*dropout_mask"):
        mh.attention(q, k, v, dropout_p=0.1, dropout_mask=keep, backend="sdpa")
    assert mh.explain(q, k, v, dropout_p=0.1, dropout_mask=keep).backend == "reference"


def test_mask_constructors_validate_their_arguments():
    with pytest.raises(ValueError, match=r"align must be one of \('bottom_right', 'top_left'\), got 'bottom'"):
        mh.causal("bottom")
    with pytest.raises(ValueError, match=r"sliding_window: left must be a non-negative int, got -1"):
        mh.sliding_window(-1)
    with pytest.raises(ValueError, match=r"key_padding: lengths must be >= 0"):
        mh.key_padding([3, -1])
    with pytest.raises(TypeError, match=r"document: q_ids must be an integer tensor, got dtype torch.float32"):
        mh.document(torch.zeros(3))
    with pytest.raises(TypeError, match=r"shifted: q_offset must be an int"):
        mh.causal().shifted(1.5, 0)
    with pytest.raises(
        ValueError,
        match=r"shifted: causal\(align='bottom_right'\) depends on the whole attention's "
        r"lengths.*pass q_len= and kv_len=",
    ):
        mh.causal().shifted(2, 4)  # the block's own lengths would put the diagonal in the wrong place
    with pytest.raises(TypeError, match=r"at: q_positions must be an integer tensor of shape \(L,\) or \(B, L\)"):
        mh.causal("top_left").at(torch.zeros(3), torch.arange(3))
    with pytest.raises(TypeError, match=r"custom: mask_mod must be callable"):
        mh.custom(3)


def test_masks_bias_moved_to_scores_with_a_clear_message():
    with pytest.raises(TypeError, match=r"multihead.masks.bias moved.*score_mod=multihead.scores.bias\(tensor\)"):
        mh.masks.bias(torch.zeros(5, 7))
    with pytest.raises(TypeError, match=r"a float tensor: an additive bias, not a mask.*scores.bias"):
        mh.causal() & torch.zeros(5, 7)
    with pytest.raises(TypeError, match=r"score_mod must be a multihead.scores modifier.*scores.bias\(tensor\)"):
        mh.attention(q, k, v, score_mod=torch.zeros(5, 7))
    with pytest.raises(ValueError, match=r"softcap: cap must be a finite number > 0, got 0"):
        mh.scores.softcap(0)
    with pytest.raises(
        TypeError, match=r"softcap: cap must be a Python number \(int or float\), got Tensor; use float"
    ):
        mh.scores.softcap(torch.tensor(3.0))
    with pytest.raises(ValueError, match=r"prefix_lm: prefix_len must be a non-negative int.*got -2"):
        mh.prefix_lm(-2)
    with pytest.raises(ValueError, match=r"bias of shape \(1, 1, 4, 7\) is not broadcastable to \(B, Hq, Lq, Lk\)"):
        mh.attention(q, k, v, score_mod=mh.scores.bias(torch.zeros(4, 7)))


def test_a_float_zero_one_mask_is_refused_not_added():
    """torch.tril(torch.ones(L, L)) means 'attend below the diagonal' in tutorials; as a float mask
    it would be added to the scores. multihead refuses it and says what to write instead."""
    tril = torch.tril(torch.ones(5, 7))
    with pytest.raises(ValueError, match=r"only 0s and 1s.*mask.bool\(\).*mask == 0.*scores.bias"):
        mh.attention(q, k, v, mask=tril)
    declared = mh.attention(q, k, v, score_mod=mh.scores.bias(tril))  # said to be additive: accepted
    torch.testing.assert_close(declared, mh.reference_attention(q, k, v, score_mod=mh.scores.bias(tril)).output)
    # All zeros (or all ones) shift every score of a row alike: harmless, accepted as a bias.
    torch.testing.assert_close(mh.attention(q, k, v, mask=torch.zeros(5, 7)), mh.attention(q, k, v))


@pytest.mark.parametrize(
    "key_padding_mask",
    [torch.tensor([[False] * 5, [False] * 3 + [True] * 2]), torch.zeros(2, 5)],
    ids=["bool", "float"],
)
def test_pytorchs_key_padding_mask_on_the_native_layer_says_what_to_write(key_padding_mask):
    """Issue 28, item 10: Python's bare 'unexpected keyword argument' becomes a message with the
    replacement, its polarity (PyTorch: True = padding; multihead: True = a real key) and the
    drop-in that takes PyTorch's signature."""
    layer, x = mh.MultiHeadAttention(16, 4), torch.randn(2, 5, 16)
    with pytest.raises(
        TypeError,
        match=r"MultiHeadAttention.forward\(\) takes no key_padding_mask \(got Tensor of shape \(2, 5\)\).*"
        r"Pass mask=multihead.key_padding\(lengths_or_table\).*True = a real key, the opposite of PyTorch's "
        r"key_padding_mask \(True = padding\): mask=multihead.key_padding\(~key_padding_mask\)\. "
        r"Or use multihead.compat.MultiheadAttention",
    ):
        layer(x, key_padding_mask=key_padding_mask)
    # What the message says to write runs, and key_padding_mask=None (PyTorch code's default) is no padding.
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    torch.testing.assert_close(layer(x, mask=mh.key_padding(~pad)), layer(x, mask=mh.key_padding([5, 3])))
    torch.testing.assert_close(layer(x, key_padding_mask=None), layer(x))
