"""``cascade_attention`` (a shared prefix attended once, per-request suffixes, merged by LSE)
equals attention over each request's concatenation ``prefix + suffix``."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import DEVICES

DT = torch.float64
P = 7  # the prefix length of _inputs(): key_padding lengths count the prefix's keys too


def _inputs(B=3, Hq=4, Hkv=2, Lq=5, P=P, Ls=6, D=8, Dv=6, dtype=DT, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return t(B, Hq, Lq, D), t(1, Hkv, P, D), t(1, Hkv, P, Dv), t(B, Hkv, Ls, D), t(B, Hkv, Ls, Dv)


def _concatenated(q, pk, pv, k, v, mask):
    """The definition: each request attends to its own copy of the prefix, then its suffix, with
    the same mask (the whole attention's, Lq x (P + Ls))."""
    B = q.shape[0]
    full_k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
    full_v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
    return mh.attention(q, full_k, full_v, mask=mask, return_lse=True, backend="reference")


MASKS = {
    "none": None,
    "causal": mh.causal(),
    "padding": mh.key_padding(torch.tensor([P + 6, P + 0, P + 3])),
    "causal+padding": mh.causal() & mh.key_padding(torch.tensor([P + 6, P + 2, P + 0])),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_cascade_equals_attention_over_the_concatenation(mask, Hkv, device):
    """The cascade runs on ``device`` (its result copied back differentiably); the definition on CPU."""
    q, pk, pv, k, v = _inputs(Hkv=Hkv, grad=True)
    got = mh.cascade_attention(*(t.to(device) for t in (q, pk, pv, k, v)), mask=MASKS[mask], return_lse=True)
    got = mh.AttentionResult(got.output.cpu(), None, got.lse.cpu())
    want = _concatenated(q, pk, pv, k, v, MASKS[mask])
    torch.testing.assert_close(got.output, want.output, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got.output)
    grads = torch.autograd.grad((got.output * g).sum(), (q, pk, pv, k, v))
    want_grads = torch.autograd.grad((want.output * g).sum(), (q, pk, pv, k, v))
    for name, a, b in zip(("q", "prefix_k", "prefix_v", "k", "v"), grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


LS = 6  # the suffix length of _inputs()
# Masks of the whole attention, Lq x (P + Ls), built for the call's (B, Hq, Lq, Lk).
WHOLE_MASKS = {
    "none": lambda B, Hq, Lq, Lk: None,
    "causal": lambda B, Hq, Lq, Lk: mh.causal(),
    "causal_top_left": lambda B, Hq, Lq, Lk: mh.causal("top_left"),
    "sliding_window": lambda B, Hq, Lq, Lk: mh.sliding_window(4),
    "sliding_window_top_left": lambda B, Hq, Lq, Lk: mh.sliding_window(2, 1, align="top_left"),
    # per request: a length inside the prefix, every key, none (a request that sees no key)
    "key_padding": lambda B, Hq, Lq, Lk: mh.key_padding(torch.tensor([P - 3, P + LS, 0])),
    "causal&key_padding": lambda B, Hq, Lq, Lk: mh.causal() & mh.key_padding(torch.tensor([P + 2, P - 1, Lk])),
    "bool_tensor": lambda B, Hq, Lq, Lk: torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(1)) < 0.7,
    "float_tensor": lambda B, Hq, Lq, Lk: (
        torch.randn(1, Hq, Lq, Lk, generator=torch.Generator().manual_seed(2), dtype=DT)
        .masked_fill(torch.rand(1, Hq, Lq, Lk, generator=torch.Generator().manual_seed(3)) < 0.3, float("-inf"))
        .requires_grad_()
    ),
}
QUERY_LENGTHS = {"1": 1, "Ls-1": LS - 1, "Ls": LS, "Ls+1": LS + 1, "Ls+P+3": LS + P + 3}


@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("mask", list(WHOLE_MASKS))
@pytest.mark.parametrize("Lq", list(QUERY_LENGTHS))
def test_cascade_reads_the_whole_attentions_mask_for_every_query_length(Lq, mask, Hkv):
    """Issue 28: the mask is the concatenation's, read on each part's columns at their absolute
    positions. With Lq > Ls the first queries are prefix tokens (causal hides part of the prefix
    from them); with Lq > P + Ls some see nothing. Outputs, LSE and gradients (of the additive
    mask's tensor too) equal attention over the concatenation, in fp64."""
    B, Hq, Lq = 3, 4, QUERY_LENGTHS[Lq]
    q, pk, pv, k, v = _inputs(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, P=P, Ls=LS, grad=True)
    whole = WHOLE_MASKS[mask](B, Hq, Lq, P + LS)
    got = mh.cascade_attention(q, pk, pv, k, v, mask=whole, return_lse=True)
    want = _concatenated(q, pk, pv, k, v, whole)
    torch.testing.assert_close(got.output, want.output, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-12, atol=1e-12)  # -inf where a row sees nothing
    inputs = (q, pk, pv, k, v) + ((whole,) if isinstance(whole, torch.Tensor) and whole.requires_grad else ())
    g = torch.randn_like(got.output)
    grads = torch.autograd.grad((got.output * g).sum(), inputs)
    want_grads = torch.autograd.grad((want.output * g).sum(), inputs)
    for name, a, b in zip(("q", "prefix_k", "prefix_v", "k", "v", "mask"), grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "part, change",
    [
        ("prefix", lambda t: (t[0], t[1].float(), t[2].float(), t[3], t[4])),
        ("suffix", lambda t: (t[0], t[1], t[2], t[3].float(), t[4].float())),
    ],
)
def test_an_error_in_either_part_names_the_part_and_keeps_its_message(part, change):
    q, pk, pv, k, v = change(_inputs())
    with pytest.raises(TypeError, match=rf"cascade_attention: the {part} part \(.*\) failed: ") as info:
        mh.cascade_attention(q, pk, pv, k, v, mask=mh.causal())
    with pytest.raises(TypeError) as plain:  # the inner call's own error, as attention() raises it
        mh.attention(q, *((pk, pv) if part == "prefix" else (k, v)))
    assert str(info.value).endswith(str(plain.value))
    assert isinstance(info.value.__cause__, TypeError) and str(info.value.__cause__) == str(plain.value)


def test_a_mask_of_the_suffix_alone_is_refused_with_the_whole_lengths():
    q, pk, pv, k, v = _inputs()  # B=3, Hq=4, Lq=5, P=7, Ls=6
    with pytest.raises(ValueError, match=r"cascade_attention: .*Lq=5 queries x Lk = P \+ Ls = 13 keys"):
        mh.cascade_attention(q, pk, pv, k, v, mask=torch.ones(3, 4, 5, 6, dtype=torch.bool))


def test_fp32_cascade_is_as_close_to_the_truth_as_plain_fp32_attention():
    q, pk, pv, k, v = _inputs(B=8, Lq=1, P=300, Ls=40, dtype=torch.float32)
    got = mh.cascade_attention(q, pk, pv, k, v, mask=mh.causal())
    plain = _concatenated(q, pk, pv, k, v, mh.causal()).output  # fp32 through the reference backend
    truth = _concatenated(*(t.double() for t in (q, pk, pv, k, v)), mh.causal()).output
    err, base = (got.double() - truth).abs().max(), (plain.double() - truth).abs().max()
    assert err <= 4 * base + 4 * torch.finfo(torch.float32).eps, (err, base)


def test_a_request_without_suffix_sees_the_prefix_only_and_no_nan():
    q, pk, pv, k, v = _inputs()
    v[1] = float("nan")  # request 1 sees none of its suffix: the NaN must not reach it
    out = mh.cascade_attention(q, pk, pv, k, v, mask=mh.key_padding(torch.tensor([P + 6, P, P + 6])))
    prefix_only = mh.attention(q[1:2], pk, pv)
    torch.testing.assert_close(out[1:2], prefix_only, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out[1]).all()


def test_a_three_dim_prefix_is_one_copy():
    q, pk, pv, k, v = _inputs()
    torch.testing.assert_close(mh.cascade_attention(q, pk[0], pv[0], k, v), mh.cascade_attention(q, pk, pv, k, v))


@pytest.mark.parametrize(
    "change, pattern",
    [
        (
            lambda t: (t[0], t[1].expand(3, -1, -1, -1), t[2], t[3], t[4]),
            r"the prefix is shared, one copy: prefix_k/prefix_v must have batch 1",
        ),
        (lambda t: (t[0], t[1][:, :1], t[2][:, :1], t[3], t[4]), r"prefix and suffix must agree on Hkv, D and Dv"),
        (lambda t: (t[0][0], *t[1:]), r"q must be a 4-D tensor \(B, Hq, Lq, D\), got shape \(4, 5, 8\)"),
    ],
)
def test_bad_shapes_are_refused(change, pattern):
    with pytest.raises(ValueError, match=r"cascade_attention: " + pattern):
        mh.cascade_attention(*change(_inputs()))
