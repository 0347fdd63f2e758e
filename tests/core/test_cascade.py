"""``cascade_attention`` (a shared prefix attended once, per-request suffixes, merged by LSE)
equals attention over each request's concatenation ``prefix + suffix``."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import DEVICES

DT = torch.float64


def _inputs(B=3, Hq=4, Hkv=2, Lq=5, P=7, Ls=6, D=8, Dv=6, dtype=DT, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return t(B, Hq, Lq, D), t(1, Hkv, P, D), t(1, Hkv, P, Dv), t(B, Hkv, Ls, D), t(B, Hkv, Ls, Dv)


def _concatenated(q, pk, pv, k, v, mask):
    """The definition: each request attends to its own copy of the prefix, then its suffix."""
    B, Hq, Lq, _ = q.shape
    P, Ls = pk.shape[2], k.shape[2]
    full_k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
    full_v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
    suffix = (
        torch.ones(B, Hq, Lq, Ls, dtype=torch.bool)
        if mask is None
        else mh.masks.as_mask(mask).materialize(B, Hq, Lq, Ls).expand(B, Hq, Lq, Ls)
    )
    allowed = torch.cat([torch.ones(B, Hq, Lq, P, dtype=torch.bool), suffix], dim=-1)
    return mh.attention(q, full_k, full_v, mask=allowed, return_lse=True, backend="reference")


MASKS = {
    "none": None,
    "causal": mh.causal(),
    "padding": mh.key_padding(torch.tensor([6, 0, 3])),
    "causal+padding": mh.causal() & mh.key_padding(torch.tensor([6, 2, 0])),
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
    out = mh.cascade_attention(q, pk, pv, k, v, mask=mh.key_padding(torch.tensor([6, 0, 6])))
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
