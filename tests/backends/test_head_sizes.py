"""``Dv != D`` (MLA's shapes) on the sdpa backend: PyTorch's CPU flash kernel wants one head size,
so the backend brings the call to one (V as K's prefix, V padded, or Q and K padded) and the result
must still be exact: outputs, LSE and gradients against the fp64 reference, and explain() says so."""

from __future__ import annotations

import pytest
import torch

import multihead as mh

CASES = {  # name: (D, Dv, V is K's prefix)
    "v narrower": (48, 32, False),
    "v wider": (32, 40, False),
    "v is k's prefix (MLA absorbed)": (72, 64, True),
}
MASKS = {
    "none": None,
    "causal": mh.causal(),
    "padding": mh.key_padding(torch.tensor([50, 17])),
    "window": mh.sliding_window(9),
}


def _inputs(D, Dv, prefix, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, D, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(2, 2, 50, D, generator=g, dtype=dtype).requires_grad_()
    v = k[..., :Dv] if prefix else torch.randn(2, 2, 50, Dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", list(CASES))
def test_one_head_size_is_exact(case, mask):
    D, Dv, prefix = CASES[case]
    q, k, v = _inputs(D, Dv, prefix, torch.float32)
    got = mh.attention(q, k, v, mask=MASKS[mask], backend="sdpa", return_lse=True)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    v64 = k64[..., :Dv] if prefix else v.detach().double().requires_grad_()
    want = mh.attention(q64, k64, v64, mask=MASKS[mask], backend="reference", return_lse=True)
    plain = mh.attention(q, k, v, mask=MASKS[mask], backend="reference", return_lse=True)  # fp32 baseline
    assert got.output.shape == (2, 4, 40, Dv)
    for what, a, b, p in (("output", got.output, want.output, plain.output), ("lse", got.lse, want.lse, plain.lse)):
        err, base = (a.double() - b).abs().max(), (p.double() - b).abs().max()
        assert err <= 4 * base + 1e-6, (what, float(err), float(base))
    g = torch.randn_like(got.output)
    leaves = [q, k] if prefix else [q, k, v]
    grads = torch.autograd.grad((got.output * g).sum(), leaves)
    want_grads = torch.autograd.grad((want.output * g.double()).sum(), [q64, k64] if prefix else [q64, k64, v64])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "case, note",
    [
        ("v narrower", "V padded with zeros to D"),
        ("v wider", "Q and K padded with zeros to Dv"),
        ("v is k's prefix (MLA absorbed)", "V is the first Dv=64 features of K"),
    ],
)
def test_explain_names_the_fit_and_a_fused_kernel(case, note):
    D, Dv, prefix = CASES[case]
    q, k, v = (t.detach() for t in _inputs(D, Dv, prefix, torch.float32))
    text = str(mh.explain(q, k, v, mask=mh.causal(), backend="sdpa"))
    assert note in text and "PyTorch kernel: FLASH_ATTENTION" in text, text


def test_equal_head_sizes_are_left_alone():
    q, k, v = (t.detach() for t in _inputs(32, 32, False, torch.float32))
    assert "head sizes" not in str(mh.explain(q, k, v, backend="sdpa"))


@pytest.mark.parametrize("D, Dv", [(16, 8), (8, 16)])
@pytest.mark.parametrize("mask", list(MASKS))
def test_mqa_with_different_head_sizes(D, Dv, mask):
    """MQA with different head sizes stays exact on sdpa (the slow fuzz seeds 1284 and 1298 reproduce the
    expand-shape bug this guards)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 50, D, generator=g, dtype=torch.float64)
    v = torch.randn(2, 1, 50, Dv, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        mh.attention(q, k, v, mask=MASKS[mask], backend="sdpa"),
        mh.attention(q, k, v, mask=MASKS[mask], backend="reference"),
        rtol=1e-10,
        atol=1e-10,
    )
