"""Every registered backend against the fp64 reference, generated from the registry: a backend
added later joins this matrix automatically. Refusals are checked too (forcing raises)."""

import pytest
import torch

import multihead as mh
from helpers import FACTOR, Case, assert_relative, covering_cases, make_inputs, naive_attention

BACKENDS = [b for b in mh.available_backends() if b != "flex"]  # flex compiles: its own slow tier
CASES = covering_cases(n_random=24)
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _run(backend, q, k, v, mask, **kw):
    return mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True, **kw)


def _refuses(backend, q, k, v, mask, **kw):
    from multihead.validation import validate_call

    call = validate_call(q, k, v, mask=mh.masks.as_mask(mask), scale=None, dropout_p=kw.get("dropout_p", 0.0),
                         dropout_mask=None, return_weights=kw.get("return_weights", False), return_lse=True)
    reasons = mh.get_backend(backend).refusals(call)
    if reasons:
        assert all(isinstance(r, str) and r for r in reasons)
        with pytest.raises(mh.BackendRefusedError, match=backend):
            _run(backend, q, k, v, mask, **kw)
    return bool(reasons)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_reference(backend, case, dtype):
    q64, k64, v64, mask = make_inputs(case)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    if _refuses(backend, q, k, v, mask):
        return
    got = _run(backend, q, k, v, mask)
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask)  # same rounded inputs
    assert got.output.dtype == dtype and got.output.shape == (case.B, case.Hq, case.Lq, case.Dv)
    if dtype == torch.float64:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
        return
    base = naive_attention(q, k, v, mask)
    assert_relative(got.output, ref.output, base, FACTOR[dtype][0])
    finite = torch.isfinite(ref.lse)
    assert torch.equal(torch.isneginf(got.lse), ~finite), "LSE must be -inf exactly on fully masked rows"
    # The naive baseline's LSE error: the same logsumexp done in the input dtype.
    scores = (q @ k.repeat_interleave(case.Hq // case.Hkv, 1).transpose(-2, -1)) * case.D ** -0.5
    m = mh.masks.as_mask(mask)
    if m is not None:
        dense = m.materialize(case.B, case.Hq, case.Lq, case.Lk, dtype=dtype)
        scores = scores + dense if m.is_additive else scores.masked_fill(~dense, float("-inf"))
    base_lse = torch.logsumexp(scores, -1)
    assert_relative(got.lse[finite].to(dtype), ref.lse[finite], base_lse[finite], FACTOR[dtype][0], "lse")


GRAD_CASES = [c for c in CASES if c.Lq * c.Lk <= 128 * 128][::2]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_reference(backend, case, dtype):
    q64, k64, v64, mask = make_inputs(case)
    grad_out = torch.randn(case.B, case.Hq, case.Lq, case.Dv, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(case.seed + 1))
    if _refuses(backend, q64.to(dtype), k64.to(dtype), v64.to(dtype), mask):
        return

    def grads(fn, dtype_):
        leaves = [t.to(dtype_).detach().requires_grad_() for t in (q64.to(dtype), k64.to(dtype), v64.to(dtype))]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype))
        return [t.grad for t in leaves]

    got = grads(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend=backend), dtype)
    ref = grads(lambda q, k, v: mh.reference_attention(q, k, v, mask=mask).output, torch.float64)
    for name, g, r in zip("qkv", got, ref):
        if dtype == torch.float64:
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
    if dtype != torch.float64:
        base = grads(lambda q, k, v: naive_attention(q, k, v, mask), dtype)
        magnitude = max(float(r.abs().max()) for r in ref)
        for name, g, r, b in zip("qkv", got, ref, base):
            assert_relative(g, r, b, FACTOR[dtype][1], f"grad {name}", magnitude=magnitude)


FULLY_MASKED = {
    "bool_rows": lambda B, H, Lq, Lk: torch.arange(Lq).view(-1, 1).expand(Lq, Lk) % 3 != 1,
    "every_row": lambda B, H, Lq, Lk: torch.zeros(Lq, Lk, dtype=torch.bool),
    "batch_element": lambda B, H, Lq, Lk: mh.key_padding([Lk, 0]),
    "causal_lq_gt_lk": lambda B, H, Lq, Lk: mh.causal(),
    "additive_rows": lambda B, H, Lq, Lk: torch.zeros(Lq, Lk).masked_fill(torch.arange(Lq).view(-1, 1) == 0, float("-inf")),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", list(FULLY_MASKED))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_exact_zeros_with_zero_grads(backend, kind, dtype):
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 9, 6, 16
    mask = FULLY_MASKED[kind](B, Hq, Lq, Lk)
    q, k, v = (torch.randn(B, h, L, D, dtype=dtype, requires_grad=True) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    if _refuses(backend, q, k, v, mask, return_weights=True):
        return
    res = mh.attention(q, k, v, mask=mask, backend=backend, return_weights=True, return_lse=True)
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask)
    empty = torch.isneginf(ref.lse)
    assert empty.any()
    assert torch.equal(res.output[empty], torch.zeros_like(res.output[empty]))
    assert torch.equal(res.weights[empty], torch.zeros_like(res.weights[empty]))
    assert torch.isneginf(res.lse[empty]).all() and torch.isfinite(res.lse[~empty]).all()
    (res.output.float().square().sum() + res.weights.float().sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all(), "NaN or inf in a gradient"
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_are_the_reference_probabilities(backend):
    case = Case(2, 6, 3, 33, 47, 16, 16, "causal&padding", seed=3)
    q, k, v, mask = make_inputs(case, dtype=torch.float32)
    if _refuses(backend, q, k, v, mask, return_weights=True):
        return
    res = mh.attention(q, k, v, mask=mask, backend=backend, return_weights=True)
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask)
    assert res.weights.shape == (2, 6, 33, 47) and res.lse is None
    torch.testing.assert_close(res.weights.double(), ref.weights, rtol=0, atol=2e-6)


def test_auto_picks_sdpa_for_dense_work_and_reference_is_last():
    q = torch.randn(1, 2, 16, 8)
    assert mh.explain(q, q, q).backend == "sdpa"
    assert mh.backends.AUTO_ORDER[-1] == "reference"
