"""``multihead.compat.MultiheadAttention`` against ``torch.nn.MultiheadAttention`` itself."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import multihead as mh
from helpers import DEVICES
from multihead.layers.compat import MultiheadAttention

DT = torch.float64
E, H = 16, 4


def _pair(seed=0, **kwargs):
    """PyTorch's module and ours from the same seed: the same initialization, parameter for parameter."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, dtype=DT, **kwargs)
    torch.manual_seed(seed)
    ours = MultiheadAttention(E, H, dtype=DT, **kwargs)
    return ref.eval(), ours.eval()


def _inputs(B, L, S, batch_first, kdim=E, vdim=E, batched=True, self_attention=False, seed=1):
    g = torch.Generator().manual_seed(seed)

    def make(n, f):
        shape = (n, f) if not batched else ((B, n, f) if batch_first else (n, B, f))
        return torch.randn(shape, generator=g, dtype=DT)

    query = make(L, E)
    if self_attention:
        return query, query, query
    return query, make(S, kdim), make(S, vdim)


def _masks(kind, B, L, S, batched, g):
    """(key_padding_mask, attn_mask, is_causal) in PyTorch's polarity; no row fully masked."""
    kpm = am = None
    if "kpm" in kind:
        kpm = torch.rand((B, S) if batched else (S,), generator=g) > 0.6
        kpm[..., 0] = False  # key 0 always visible
        if "kpm_float" in kind:
            kpm = torch.zeros(kpm.shape, dtype=DT).masked_fill(kpm, float("-inf"))
    if "am2" in kind or "am3" in kind:
        shape = (L, S) if "am2" in kind else ((B * H, L, S) if batched else (H, L, S))
        am = torch.rand(shape, generator=g) > 0.6
        am[..., 0] = False
        if "float" in kind.split("+")[-1]:
            bias = torch.randn(shape, generator=g, dtype=DT)
            am = bias.masked_fill(am, float("-inf"))
    causal = kind == "causal"
    if causal:
        am = torch.ones(L, S, dtype=torch.bool).triu(1)  # PyTorch needs the mask beside the hint
    return kpm, am, causal


MASKS = [
    "none",
    "kpm_bool",
    "kpm_float",
    "am2_bool",
    "am2_float",
    "am3_bool",
    "am3_float",
    "kpm_bool+am2_bool",
    "kpm_bool+am3_float",
    "causal",
]
CONFIGS = [  # (batch_first, kdim, vdim, bias, add_bias_kv, add_zero_attn)
    (False, None, None, True, False, False),
    (True, None, None, True, False, False),
    (False, 12, 20, True, False, False),
    (True, None, None, False, True, False),
    (False, None, None, True, False, True),
    (True, 12, 8, True, True, True),
]


def _config_id(c):
    bf, kd, vd, bias, bkv, zero = c
    return (
        f"{'bf' if bf else 'sf'}-k{kd}v{vd}-{'bias' if bias else 'nobias'}"
        f"{'-biaskv' if bkv else ''}{'-zero' if zero else ''}"
    )


def _on(device, *tensors):
    """Each tensor on ``device``; one tensor passed twice stays one (self-attention's fused path)."""
    moved = {}
    return [None if t is None else moved.setdefault(id(t), t.to(device)) for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_matches_torch(config, mask_kind, device):
    """Ours on ``device`` against PyTorch's module on CPU."""
    bf, kdim, vdim, bias, bkv, zero = config
    ref, ours = _pair(kdim=kdim, vdim=vdim, bias=bias, add_bias_kv=bkv, add_zero_attn=zero, batch_first=bf)
    for (name, a), (name_b, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name  # same keys, same initialization
    B, L, S = 3, 5, 7
    same = kdim is None and mask_kind == "causal"
    query, key, value = _inputs(B, L, L if same else S, bf, kdim or E, vdim or E, self_attention=same)
    g = torch.Generator().manual_seed(2)
    kpm, am, causal = _masks(mask_kind, B, L, key.shape[1 if bf else 0], True, g)
    ours.to(device)
    on_device = _on(device, query, key, value, kpm, am)
    for need, average in ((False, True), (True, True), (True, False)):
        kwargs = dict(
            key_padding_mask=kpm, attn_mask=am, need_weights=need, average_attn_weights=average, is_causal=causal
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch deprecates mixing bool and float masks
            expected_out, expected_w = ref(query, key, value, **kwargs)
        if causal and (bkv or zero) and not need:
            # PyTorch's own paths disagree here: without weights it drops attn_mask for SDPA's
            # top-left is_causal over S + extra keys, hiding the appended keys from all but the
            # last queries; with weights it pads attn_mask and shows them to every query. We
            # follow the padded mask (PyTorch's documented meaning), on both paths.
            expected_out = ref(query, key, value, **{**kwargs, "need_weights": True})[0]
        q_d, k_d, v_d, kpm_d, am_d = on_device
        out, w = ours(q_d, k_d, v_d, **{**kwargs, "key_padding_mask": kpm_d, "attn_mask": am_d})
        torch.testing.assert_close(out.cpu(), expected_out)
        if need:
            torch.testing.assert_close(w.cpu(), expected_w)
        else:
            assert w is None and expected_w is None


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "kpm_bool", "am3_float"])
def test_unbatched_matches_torch(batch_first, mask_kind):
    ref, ours = _pair(batch_first=batch_first, add_bias_kv=True)
    query, key, value = _inputs(1, 4, 6, batch_first, batched=False)
    kpm, am, _ = _masks(mask_kind, 1, 4, 6, False, torch.Generator().manual_seed(3))
    for average in (True, False):
        expected = ref(query, key, value, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
        got = ours(query, key, value, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
        assert got[0].shape == (4, E)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


def test_load_state_dict_of_a_torch_checkpoint(tmp_path):
    torch.manual_seed(4)
    ref = nn.MultiheadAttention(E, H, kdim=10, vdim=6, add_bias_kv=True, dtype=DT).eval()
    torch.save(ref.state_dict(), tmp_path / "mha.pt")
    ours = MultiheadAttention(E, H, kdim=10, vdim=6, add_bias_kv=True, dtype=DT).eval()
    ours.load_state_dict(torch.load(tmp_path / "mha.pt"))  # strict: same keys, same shapes
    query, key, value = _inputs(2, 3, 5, False, 10, 6)
    for a, b in zip(ours(query, key, value), ref(query, key, value)):
        torch.testing.assert_close(a, b)
    ref.load_state_dict(ours.state_dict())  # and back


def test_fully_masked_rows_give_zeros_not_nan():
    ref, ours = _pair(batch_first=True)
    query, key, value = _inputs(2, 4, 5, True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1] = True  # batch element 1 has only padding keys
    am = torch.zeros(4, 5, dtype=torch.bool)
    am[2] = True  # query 2 is blocked from every key
    query.requires_grad_(True)
    out, w = ours(query, key, value, key_padding_mask=kpm, attn_mask=am)
    expected_out, expected_w = ref(query, key, value, key_padding_mask=kpm, attn_mask=am)
    assert expected_out.isnan().any()  # PyTorch's behaviour we fix
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    empty = torch.zeros(2, 4, dtype=torch.bool)
    empty[1] = True
    empty[:, 2] = True
    torch.testing.assert_close(out[empty], ours.out_proj.bias.expand(int(empty.sum()), E))  # attention 0
    assert (w[empty] == 0).all()
    torch.testing.assert_close(out[~empty], expected_out[~empty])
    torch.testing.assert_close(w[~empty], expected_w[~empty])
    out.sum().backward()
    assert torch.isfinite(query.grad).all()


def test_is_causal_is_honoured_without_attn_mask():
    ref, ours = _pair(batch_first=True)
    query, key, value = _inputs(2, 6, 6, True, self_attention=True)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    with pytest.raises(RuntimeError):  # PyTorch needs a mask beside the hint ...
        ref(query, key, value, is_causal=True, need_weights=False)
    expected = ref(query, key, value, attn_mask=causal)
    got = ours(query, key, value, is_causal=True)  # ... here the flag alone is enough
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    # a float causal mask (nn.Transformer.generate_square_subsequent_mask) is recognised as causal
    float_causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=DT)
    torch.testing.assert_close(ours(query, key, value, attn_mask=float_causal)[0], expected[0])


def test_an_attn_mask_that_spells_a_structure_runs_as_that_object(monkeypatch):
    """compat recognised the top-left causal pattern only; it reads attn_mask with the one recogniser
    (masks.recognize.from_dense), so a window or padding written out runs as the object too."""
    from multihead.layers import compat

    ref, ours = _pair(batch_first=True)
    query, key, value = _inputs(2, 7, 7, True, self_attention=True)
    seen = []
    real = compat.attend_heads
    monkeypatch.setattr(compat, "attend_heads", lambda *a, **kw: (seen.append(kw["mask"]), real(*a, **kw))[1])
    window = ~mh.sliding_window(2).materialize(1, 1, 7, 7)[0, 0]  # PyTorch's polarity: True = blocked
    lowest = torch.zeros(7, 7, dtype=DT).masked_fill(window, torch.finfo(DT).min)  # blocked, as -inf is
    for am in (window, lowest):
        expected = ref(query, key, value, attn_mask=am)
        got = ours(query, key, value, attn_mask=am)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
        assert seen[-1] == mh.sliding_window(2), seen[-1]
    biased = torch.randn(7, 7, dtype=DT, generator=torch.Generator().manual_seed(3)).masked_fill(window, float("-inf"))
    expected = ref(query, key, value, attn_mask=biased)[0]
    torch.testing.assert_close(ours(query, key, value, attn_mask=biased)[0], expected)
    assert isinstance(seen[-1], mh.masks.TensorMask)  # a bias besides: the tensor runs


def test_from_torch_and_to_torch_round_trip():
    for kdim, vdim, bias in ((None, None, True), (10, 12, False)):
        torch.manual_seed(5)
        ref = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, bias=bias, batch_first=True, dtype=DT).eval()
        native = mh.MultiHeadAttention.from_torch(ref)
        assert native.batch_first and native.q_proj.weight.dtype == DT and not native.training
        query, key, value = _inputs(2, 3, 4, True, kdim or E, vdim or E)
        am = torch.rand(3, 4) > 0.7
        am[:, 0] = False
        expected = ref(query, key, value, attn_mask=am, need_weights=False)[0]
        torch.testing.assert_close(native(query, key, value, mask=~am), expected)  # polarity flips
        back = native.to_torch()
        torch.testing.assert_close(back(query, key, value, attn_mask=am, need_weights=False)[0], expected)
    # and from our drop-in
    _, ours = _pair()
    torch.testing.assert_close(mh.MultiHeadAttention.from_torch(ours).q_proj.weight, ours.in_proj_weight[:E])


def test_to_torch_fills_missing_biases_with_zeros():
    torch.manual_seed(6)
    layer = mh.MultiHeadAttention(E, H, qkv_bias=False, out_bias=True, dtype=DT)
    module = layer.to_torch().eval()
    x = torch.randn(2, 3, E, dtype=DT)
    assert module.batch_first
    torch.testing.assert_close(module(x, x, x)[0], layer(x))
    assert float(module.in_proj_bias.detach().abs().sum()) == 0


def test_dropout_in_training_only():
    torch.manual_seed(7)
    ours = MultiheadAttention(E, H, dropout=0.5, dtype=DT)
    query, key, value = _inputs(2, 4, 4, False)
    train = ours(query, key, value, need_weights=False)[0]
    ours.eval()
    evaluated = ours(query, key, value, need_weights=False)[0]
    assert not torch.allclose(train, evaluated)
    torch.testing.assert_close(ours(query, key, value, need_weights=False)[0], evaluated)


def test_works_inside_transformer_encoder_layer():
    """Swapped into ``nn.TransformerEncoderLayer``, the drop-in computes what PyTorch's class did."""
    torch.manual_seed(8)
    enc = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True, dtype=DT).eval()
    x = torch.randn(2, 5, E, dtype=DT)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=DT)
    expected = enc(x, src_mask=mask, is_causal=True)
    swapped = MultiheadAttention(E, H, batch_first=True, dtype=DT)
    swapped.load_state_dict(enc.self_attn.state_dict())
    enc.self_attn = swapped
    torch.testing.assert_close(enc(x, src_mask=mask, is_causal=True), expected)


@pytest.mark.parametrize("bias", ["zeros", "random"])
@pytest.mark.parametrize("attention", ["self", "cross"])
def test_an_in_proj_bias_of_another_dtype_runs_as_in_torch(attention, bias):
    """PyTorch's ``test_multihead_attn_fast_path_query_and_bias_have_different_dtypes``: an fp16
    ``in_proj_bias`` in an fp64 module. PyTorch's class declines its fast path and adds the bias
    after the matmul, promoted to fp64; ours did ``F.linear(x, w, b)``, whose fused kernel refused
    the mixed dtypes. Now both compute the same numbers (outputs, weights and the bias's gradient)."""
    torch.manual_seed(9)
    ref = nn.MultiheadAttention(4, 4, batch_first=True, dtype=DT).eval()
    if bias == "random":  # PyTorch's test keeps the initial zeros; a bias that is not 0 must be added
        ref.in_proj_bias = nn.Parameter(torch.randn(12, dtype=DT))
    ref.in_proj_bias = nn.Parameter(ref.in_proj_bias.to(torch.half))
    ours = MultiheadAttention(4, 4, batch_first=True, dtype=DT).eval()
    ours.load_state_dict(ref.state_dict())  # copies into our fp64 parameter: set the fp16 one again
    ours.in_proj_bias = nn.Parameter(ref.in_proj_bias.detach().clone())
    query = torch.randn(4, 4, 4, dtype=DT)
    key = query if attention == "self" else torch.randn(4, 5, 4, dtype=DT)
    with torch.no_grad():  # as PyTorch's test runs it
        expected = ref(query, key, key)
        got = ours(query, key, key)
    assert got[0].dtype == expected[0].dtype == DT
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    ref(query, key, key)[0].sum().backward()
    ours(query, key, key)[0].sum().backward()
    assert ours.in_proj_bias.grad is not None and ours.in_proj_bias.grad.dtype == torch.half
    torch.testing.assert_close(ours.in_proj_bias.grad, ref.in_proj_bias.grad)


def test_a_causal_attn_mask_with_is_causal_is_one_causal_object(monkeypatch):
    """What nn.TransformerEncoderLayer passes (the causal attn_mask and is_causal=True) runs as one
    top-left causal object, whose diagonal a backend can hand to a fused kernel."""
    from multihead.layers import compat

    _, ours = _pair(batch_first=True)
    query, key, value = _inputs(2, 6, 6, True, self_attention=True)
    seen = []
    real = compat.attend_heads
    monkeypatch.setattr(compat, "attend_heads", lambda *a, **kw: (seen.append(kw["mask"]), real(*a, **kw))[1])
    blocked = torch.ones(6, 6, dtype=torch.bool).triu(1)
    for am in (blocked, nn.Transformer.generate_square_subsequent_mask(6, dtype=DT)):
        for flag in (False, True):
            ours(query, key, value, attn_mask=am, is_causal=flag)
            assert seen[-1] == mh.causal("top_left") and seen[-1].causal_offset(6, 6) == 0, seen[-1]
