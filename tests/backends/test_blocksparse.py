"""The ``blocksparse`` backend against the fp64 reference, with block sizes small enough that
every case crosses several query and key blocks, plus block-boundary cases at the default size,
fully masked rows, and a guard that no ``Lq x Lk`` tensor is ever allocated."""

import pytest
import torch

import multihead as mh
from helpers import LargestAllocation, Case, assert_relative, covering_cases, make_inputs, naive_attention
from multihead.backends.blocksparse import DEFAULT_BLOCK_SIZE, BlockSparseBackend, block_plan
from multihead.validation import validate_call
from matrix import factor

STRUCTURED = ["none", "causal_br", "causal_tl", "window_3", "window_5_2_tl", "key_padding", "document",
              "prefix_lm", "causal&padding", "document&causal", "window|prefix", "~causal", "custom",
              "shifted_causal"]
CASES = [c for c in covering_cases(n_random=40, seed=4) if c.mask in STRUCTURED]


def _call(q, k, v, mask, **kw):
    return validate_call(q, k, v, mask=mask, scale=kw.get("scale"), dropout_p=0.0, dropout_mask=None,
                         return_weights=kw.get("return_weights", False), return_lse=True)


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("dtype,block", [(torch.float64, 8), (torch.float64, 32), (torch.float32, 16),
                                         (torch.bfloat16, 16)], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference_across_blocks(case, dtype, block):
    q64, k64, v64, mask = make_inputs(case)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    got = BlockSparseBackend(block).forward(_call(q, k, v, mask))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mh.reference_attention(qr, kr, vr, mask=mask)
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref.lse))
    grad_out = torch.randn(ref.output.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g_got = _grads(got.output, (q, k, v), grad_out.to(dtype))
    g_ref = _grads(ref.output, (qr, kr, vr), grad_out)
    if dtype == torch.float64:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        finite = torch.isfinite(ref.lse)
        torch.testing.assert_close(got.lse[finite], ref.lse[finite], rtol=1e-10, atol=1e-10)
        for a, b in zip(g_got, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        return
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    base = naive_attention(qn, kn, vn, mask)
    g_base = _grads(base, (qn, kn, vn), grad_out.to(dtype))
    assert_relative(got.output.detach(), ref.output.detach(), base.detach(), factor("blocksparse", dtype))
    # A gradient that is 0 in theory (one key) is computed from terms the size of the others.
    magnitude = max(float(r.abs().max()) for r in g_ref)
    for name, a, b, c in zip("qkv", g_got, g_ref, g_base):
        assert_relative(a, b, c, factor("blocksparse", dtype, gradients=True), f"d{name}", magnitude=magnitude)


BOUNDARY = [
    # (Lq, Lk, mask) at the default block size: lengths of block +/- 1, windows smaller and larger
    # than a block, documents starting mid-block, bottom-right causal with Lq != Lk.
    (DEFAULT_BLOCK_SIZE - 1, DEFAULT_BLOCK_SIZE + 1, lambda L, S: mh.causal()),
    (DEFAULT_BLOCK_SIZE + 1, DEFAULT_BLOCK_SIZE - 1, lambda L, S: mh.causal()),
    (2 * DEFAULT_BLOCK_SIZE + 1, 2 * DEFAULT_BLOCK_SIZE + 1, lambda L, S: mh.causal("top_left")),
    (3 * DEFAULT_BLOCK_SIZE + 1, 3 * DEFAULT_BLOCK_SIZE + 1, lambda L, S: mh.sliding_window(DEFAULT_BLOCK_SIZE // 4)),
    (3 * DEFAULT_BLOCK_SIZE - 1, 3 * DEFAULT_BLOCK_SIZE - 1, lambda L, S: mh.sliding_window(DEFAULT_BLOCK_SIZE + 37)),
    (2 * DEFAULT_BLOCK_SIZE, 3 * DEFAULT_BLOCK_SIZE, lambda L, S: mh.sliding_window(300, 17, align="top_left")),
    (3 * DEFAULT_BLOCK_SIZE, 3 * DEFAULT_BLOCK_SIZE,
     lambda L, S: mh.document(torch.repeat_interleave(torch.arange(4), torch.tensor([100, 300, 5, L - 405])))
     & mh.causal()),
    (2 * DEFAULT_BLOCK_SIZE + 1, 2 * DEFAULT_BLOCK_SIZE + 1, lambda L, S: mh.prefix_lm(DEFAULT_BLOCK_SIZE + 3)),
    (DEFAULT_BLOCK_SIZE + 1, 2 * DEFAULT_BLOCK_SIZE + 1,
     lambda L, S: mh.key_padding(torch.tensor([S, DEFAULT_BLOCK_SIZE - 1, 0])) & mh.causal()),
]


@pytest.mark.parametrize("Lq,Lk,make", BOUNDARY, ids=[f"case{i}" for i in range(len(BOUNDARY))])
def test_block_boundaries_at_default_size(Lq, Lk, make):
    gen = torch.Generator().manual_seed(Lq + Lk)
    B, Hq, Hkv, D = 3, 4, 2, 16
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, D + 8, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = make(Lq, Lk)
    got = mh.attention(q, k, v, mask=mask, backend="blocksparse", return_lse=True)
    ref = mh.reference_attention(q, k, v, mask=mask)
    torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref.lse))
    grads = torch.autograd.grad(got.output.sum() + got.lse.masked_fill(torch.isinf(got.lse), 0).sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.output.sum() + ref.lse.masked_fill(torch.isinf(ref.lse), 0).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grads():
    B, H, L, D = 2, 2, 300, 16
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    # Batch 1 sees no key at all; bottom-right causal with Lq > Lk leaves top rows empty too.
    mask = mh.key_padding(torch.tensor([200, 0])) & mh.causal()
    got = mh.attention(q, k[:, :, :200], v[:, :, :200], mask=mask, backend="blocksparse", return_lse=True)
    empty = torch.zeros(B, 1, L, dtype=torch.bool)
    empty[1] = True
    empty[0, 0, :100] = True  # query i sees keys j <= i - 100
    empty = empty.expand(B, H, L)
    assert torch.equal(torch.isneginf(got.lse), empty)
    assert bool((got.output[empty] == 0).all())
    got.output.sum().backward()
    assert torch.isfinite(q.grad).all() and bool((q.grad[empty] == 0).all())
    assert bool((k.grad[1] == 0).all()) and bool((v.grad[1] == 0).all())


@pytest.mark.parametrize("mask", [mh.sliding_window(128), mh.causal() & mh.key_padding(torch.tensor([4000])),
                                  mh.document(torch.repeat_interleave(torch.arange(4), 1024)) & mh.causal()],
                         ids=["window", "causal&padding", "documents"])
def test_no_tensor_of_lq_by_lk_is_allocated(mask):
    """A regression to materializing the mask (or the scores) makes this fail."""
    B, H, L, D = 1, 2, 4096, 16
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    with LargestAllocation() as probe:
        out = mh.attention(q, k, v, mask=mask, backend="blocksparse")
        out.sum().backward()
    bound = 4 * DEFAULT_BLOCK_SIZE * L  # a block-sized strip at most, far below B*H*L*L
    assert probe.largest <= bound, f"largest tensor {probe.largest} elements; bound {bound}, L^2 = {L * L}"
    assert probe.largest >= B * H * L * D  # the probe saw the real tensors


def test_plan_skips_empty_blocks_and_uses_no_mask_on_full_ones():
    L = 8 * DEFAULT_BLOCK_SIZE
    blocks = block_plan(mh.sliding_window(DEFAULT_BLOCK_SIZE), 1, 1, L, L, DEFAULT_BLOCK_SIZE)
    computed = sum((b.q1 - b.q0) * (p.k1 - p.k0) for b in blocks for p in b.pieces)
    assert computed <= 3 * DEFAULT_BLOCK_SIZE * L  # linear in L, not L^2
    kinds = {p.kind for b in blocks for p in b.pieces}
    assert "causal" in kinds  # the right edge runs as is_causal, with no mask tensor
    causal = block_plan(mh.causal(), 1, 1, L, L, DEFAULT_BLOCK_SIZE)
    assert all(p.kind != "masked" for b in causal for p in b.pieces)


def test_refusals_name_their_reason():
    q = torch.randn(1, 2, 8, 4)
    backend = mh.get_backend("blocksparse")
    assert any("tensor" in r for r in backend.refusals(_call(q, q, q, torch.ones(8, 8, dtype=torch.bool))))
    call = validate_call(q, q, q, mask=None, scale=None, dropout_p=0.1, dropout_mask=None,
                         return_weights=False, return_lse=False)
    assert any("dropout" in r for r in backend.refusals(call))
    with pytest.raises(mh.BackendRefusedError, match="dropout"):
        mh.attention(q, q, q, dropout_p=0.1, backend="blocksparse")


BANDS = {
    "causal&window_br": lambda: mh.causal() & mh.sliding_window(37),
    "window_2sided_tl": lambda: mh.sliding_window(9, 5, align="top_left"),
    "window_br": lambda: mh.sliding_window(16),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 203, 203, 24), (1, 3, 1, 150, 211, 16), (1, 2, 2, 64, 203, 8)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("band", list(BANDS))
def test_band_interior_runs_as_one_batched_call_and_matches_the_reference(band, shape, dtype):
    """The interior query blocks of a band run as one kernel call (plan says so); forward, LSE and
    gradients (including the LSE's) equal the reference, with the edge blocks run one by one."""
    B, Hq, Hkv, Lq, Lk, D = shape
    backend = BlockSparseBackend(16)
    mask = BANDS[band]()
    gen = torch.Generator().manual_seed(Lq)
    q64, k64, v64 = (torch.randn(B, h, L, D, generator=gen, dtype=torch.float64) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    call = _call(q, k, v, mask)
    plan = backend._plan(call)
    assert plan.run is not None and plan.run.blocks >= 2
    assert any("as one batched kernel call" in line for line in backend.plan(call))
    got = backend.forward(call)
    grad_out = torch.randn(got.output.shape, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(got.lse.shape, generator=gen, dtype=torch.float64).masked_fill(torch.isneginf(got.lse), 0)
    loss = (got.output.double() * grad_out).sum() + (got.lse.double().nan_to_num(0, 0, 0) * grad_lse).sum()
    g_got = torch.autograd.grad(loss, (q, k, v))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mh.reference_attention(qr, kr, vr, mask=mask)
    loss = (ref.output * grad_out).sum() + (ref.lse.nan_to_num(0, 0, 0) * grad_lse).sum()
    g_ref = torch.autograd.grad(loss, (qr, kr, vr))
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref.lse))
    if dtype == torch.float64:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        for g, r in zip(g_got, g_ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
        return
    base_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    base = naive_attention(*base_leaves, mask)
    g_base = torch.autograd.grad((base.double() * grad_out).sum(), base_leaves)
    assert_relative(got.output, ref.output, base, factor("blocksparse", dtype))
    magnitude = max(float(r.abs().max()) for r in g_ref)
    for name, g, r, b in zip("qkv", g_got, g_ref, g_base):
        # The LSE's gradient has no naive counterpart here; the baseline's error still sets the scale.
        assert_relative(g, r, b, 2 * factor("blocksparse", dtype, gradients=True), f"d{name}", magnitude=magnitude)


def test_a_band_with_a_bias_is_not_batched_but_stays_exact():
    backend = BlockSparseBackend(16)
    q = torch.randn(1, 2, 100, 8, dtype=torch.float64)
    bias = mh.scores.bias(torch.randn(1, 2, 100, 100, dtype=torch.float64))
    call = validate_call(q, q, q, mask=mh.sliding_window(10), score_mod=bias, scale=None, dropout_p=0.0,
                         dropout_mask=None, return_weights=False, return_lse=True)
    assert backend._plan(call).run is None  # the shared window mask cannot carry a per-position bias
    ref = mh.reference_attention(q, q, q, mask=mh.sliding_window(10), score_mod=bias)
    torch.testing.assert_close(backend.forward(call).output, ref.output, rtol=1e-10, atol=1e-10)
