"""Score modifiers through every backend that declares them, against the fp64 reference:
outputs, LSE and gradients, including the gradient of a bias tensor that requires grad, with
fully masked rows still exact zeros. A backend that does not declare a modifier's kind is a skip
with its reasons (after proving that forcing it raises)."""

import pytest
import torch
from matrix import backend_params, factor, serve_or_skip

import multihead as mh
from helpers import DEVICES, assert_relative, naive_attention

BACKENDS = backend_params()
# (B, Hq, Hkv, Lq, Lk, D): GQA, Lq != Lk both ways, lengths across blocksparse's 256 block.
SHAPES = [(2, 4, 2, 13, 29, 16), (1, 6, 3, 300, 257, 8), (2, 2, 1, 257, 40, 24)]
MASKS = {
    "none": lambda B, Lq, Lk: None,
    "causal": lambda B, Lq, Lk: mh.causal(),
    "window&padding": lambda B, Lq, Lk: mh.sliding_window(37) & mh.key_padding(torch.tensor([Lk, Lk // 2][:B])),
    "empty_rows": lambda B, Lq, Lk: mh.key_padding(torch.tensor([Lk, 0])),  # batch element 1 sees nothing
}


def _mods(kind, B, Hq, Lq, Lk, gen, dtype, device="cpu"):
    """The modifiers of ``kind``; a bias is drawn from ``gen`` on CPU, then moved to ``device``."""
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)  # noqa: E731
    if kind == "bias":
        return [mh.scores.bias(draw(B, Hq, Lq, Lk))]
    if kind == "bias_heads":  # broadcast over batch and queries: (1, Hq, 1, Lk)
        return [mh.scores.bias(draw(1, Hq, 1, Lk))]
    if kind == "softcap":
        return [mh.scores.softcap(1.5)]
    return [mh.scores.bias(draw(Lq, Lk)), mh.scores.softcap(2.0)]


def _inputs(shape, dtype, seed):
    B, Hq, Hkv, Lq, Lk, D = shape
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, h, L, D, generator=gen, dtype=torch.float64).to(dtype)
        for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    ]


def _bias_leaf(mods):
    return mods[0].tensor if isinstance(mods[0], mh.scores.Bias) else None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mod_kind", ["bias", "bias_heads", "softcap", "bias+softcap"])
@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_score_modifiers_match_the_reference_forward_and_backward(backend, device, shape, mask_kind, mod_kind, dtype):
    B, Hq, Hkv, Lq, Lk, D = shape
    if mask_kind == "empty_rows" and B == 1:
        pytest.skip("needs two batch elements")
    q, k, v = (t.to(device) for t in _inputs(shape, dtype, seed=Lq + Lk))
    mask = MASKS[mask_kind](B, Lq, Lk)
    gen = torch.Generator().manual_seed(7)
    mods = _mods(mod_kind, B, Hq, Lq, Lk, gen, dtype, device)
    leaf = _bias_leaf(mods)
    if leaf is not None:
        leaf.requires_grad_()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=mods, return_lse=True)

    res = mh.attention(q, k, v, mask=mask, score_mod=mods, backend=backend, return_lse=True)
    grad_out = torch.randn(res.output.shape, generator=gen, dtype=torch.float64)
    tensors = [q, k, v] + ([leaf] if leaf is not None else [])
    g_got = [g.cpu() for g in torch.autograd.grad(res.output, tensors, grad_out.to(dtype).to(device))]
    got = mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu())  # compared on CPU
    tensors = [t.detach().cpu() for t in tensors]

    ref_t = [t.double().requires_grad_() for t in tensors]
    ref_mods = _mods(mod_kind, B, Hq, Lq, Lk, torch.Generator().manual_seed(7), torch.float64)
    if leaf is not None:
        ref_mods[0] = mh.scores.bias(ref_t[3])
    ref = mh.reference_attention(*ref_t[:3], mask=mask, score_mod=ref_mods)
    g_ref = torch.autograd.grad(ref.output, ref_t, grad_out)

    empty = torch.isneginf(ref.lse)
    assert torch.equal(torch.isneginf(got.lse), empty)
    assert torch.equal(got.output[empty], torch.zeros_like(got.output[empty]))  # exact zeros
    if dtype == torch.float64:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
        for g, r in zip(g_got, g_ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
        return
    base_t = [t.clone().requires_grad_() for t in tensors]
    base_mods = _mods(mod_kind, B, Hq, Lq, Lk, torch.Generator().manual_seed(7), dtype)
    if leaf is not None:
        base_mods[0] = mh.scores.bias(base_t[3])
    base = naive_attention(*base_t[:3], mask, score_mod=base_mods)
    g_base = torch.autograd.grad(base, base_t, grad_out.to(dtype))
    assert_relative(got.output, ref.output, base, factor(backend, dtype))
    magnitude = max(float(r.abs().max()) for r in g_ref)
    for name, g, r, b in zip(["q", "k", "v", "bias"], g_got, g_ref, g_base):
        assert_relative(g, r, b, factor(backend, dtype, gradients=True), f"grad {name}", magnitude=magnitude)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_a_bias_gradient_is_zero_where_the_mask_blocks(backend, device):
    B, Hq, Lq, Lk = 1, 2, 9, 9
    q, k, v = (t.to(device) for t in _inputs((B, Hq, Hq, Lq, Lk, 8), torch.float64, seed=1))
    bias = torch.randn(B, Hq, Lq, Lk, dtype=torch.float64).to(device).requires_grad_()
    serve_or_skip(backend, q, k, v, mask=mh.sliding_window(2), score_mod=mh.scores.bias(bias))
    out = mh.attention(q, k, v, mask=mh.sliding_window(2), score_mod=mh.scores.bias(bias), backend=backend)
    out.square().sum().backward()
    grad = bias.grad.cpu()
    blocked = ~mh.sliding_window(2).materialize(1, 1, Lq, Lk).expand_as(grad)
    assert torch.equal(grad[blocked], torch.zeros_like(grad[blocked]))
    assert bool((grad[~blocked] != 0).any())


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_common_part_of_a_rows_bias_costs_no_precision_in_fp32(device):
    """Softmax needs only a row's differences. A bias whose rows sit at -3000 (ALiBi far from its
    keys) holds fp32 scores to ulp(3000) = 2.4e-4 if it is added as it is; sdpa's fused kernel
    gets it shifted to 0 at each row's largest visible entry, and the LSE back. (On CUDA, without
    the shift, the efficient kernel's backward recomputed such scores 20 ulps off its forward.)
    The blockwise paths (blocksparse, reference in fp32) keep a row's LSE in fp32 itself, so they
    hold it to ulp(|LSE|): not asked of them here."""
    backend = "sdpa"
    B, Hq, Lq, Lk, D = 2, 4, 17, 40, 16
    q, k, v = (t.to(device) for t in _inputs((B, Hq, Hq, Lq, Lk, D), torch.float32, seed=5))
    gen = torch.Generator().manual_seed(6)
    small = torch.randn(B, Hq, Lq, Lk, generator=gen, dtype=torch.float64)
    offset = -3000.0 - 100.0 * torch.arange(Lq, dtype=torch.float64).view(1, 1, Lq, 1)  # per row
    bias64 = small + offset
    mask = mh.key_padding(torch.tensor([Lk, 1]))  # batch element 1: each row sees one key
    mod = mh.scores.bias(bias64.float().to(device))
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=mod, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = mh.attention(*leaves, mask=mask, score_mod=mod, backend=backend, return_lse=True)
    grads = torch.autograd.grad(got.output, leaves, torch.ones_like(got.output))
    # The oracle sees the same fp32-rounded bias: only the kernel's arithmetic is under test.
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = mh.attention(
        *ref_leaves, mask=mask, score_mod=mh.scores.bias(bias64.float().double()), backend="reference", return_lse=True
    )
    ref_grads = torch.autograd.grad(ref.output, ref_leaves, torch.ones_like(ref.output))
    torch.testing.assert_close(got.output.cpu().double(), ref.output, rtol=0, atol=2e-6)
    torch.testing.assert_close(got.lse.cpu().double(), ref.lse, rtol=1e-7, atol=0)  # |lse| ~ 3000-4600
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.cpu().double(), r, rtol=0, atol=2e-5, msg=lambda m: f"grad {name}: {m}")


def test_blocksparse_runs_a_bias_per_piece_never_an_lq_by_lk_tensor():
    from helpers import LargestAllocation

    Lq = Lk = 1024
    q, k, v = _inputs((1, 2, 2, Lq, Lk, 16), torch.float32, seed=3)
    bias = torch.randn(1, 2, 1, Lk)  # per-key bias, broadcast over queries
    mask = mh.sliding_window(64)
    want = mh.attention(q, k, v, mask=mask, score_mod=mh.scores.bias(bias), backend="reference")
    with LargestAllocation() as seen:
        got = mh.attention(q, k, v, mask=mask, score_mod=mh.scores.bias(bias), backend="blocksparse")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert seen.largest < Lq * Lk // 4
    assert "blocksparse" == mh.explain(q, k, v, mask=mask, score_mod=mh.scores.bias(bias)).backend


def test_softcap_caps_scores_and_explain_says_who_runs_it():
    q = torch.randn(1, 2, 8, 16) * 10
    res = mh.attention(q, q, q, score_mod=mh.scores.softcap(3.0), return_lse=True)
    ref = mh.reference_attention(q.double(), q.double(), q.double(), score_mod=mh.scores.softcap(3.0))
    torch.testing.assert_close(res.output.double(), ref.output, rtol=1e-5, atol=1e-5)
    assert float(res.lse.max()) <= 3.0 + torch.log(torch.tensor(8.0))  # every score <= cap
    report = mh.explain(q, q, q, mask=mh.causal(), score_mod=mh.scores.softcap(3.0))
    # sdpa's and blocksparse's kernels take only an additive mask; torch_blocks runs it a block at a time
    assert report.backend == "torch_blocks" and "blocksparse: score modifier softcap(3.0) is elementwise" in str(report)
    assert "sdpa: score modifier softcap(3.0) is elementwise" in str(report)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["sdpa", "blocksparse"])
def test_returned_weights_are_probabilities_with_large_biases(backend, dtype):
    """Issue 28, item 12: with a bias and ``q·k`` both ~100 (scores ~300), the entries that weigh
    sit far below the row's largest bias, and the fused kernel got the bias rounded to fp16/bf16
    there; the weights, recomputed with the bias in fp32 against the kernel's LSE, were not
    probabilities (rows summing to 0.95-1.06, weights above 1). The CPU flash kernel now takes the
    bias in fp32: rows sum to 1 within the rounding of the returned dtype, as the reference's do,
    and the weights are within the relative rule of the fp64 reference's."""
    B, H, L, D = 1, 4, 300, 64
    gen = torch.Generator().manual_seed(12)
    q, k = (3 * torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    bias = 60 * torch.randn(B, H, L, L, generator=gen, dtype=torch.float64)
    ref = mh.attention(q, k, v, score_mod=mh.scores.bias(bias), backend="reference", return_weights=True)
    lo = [t.to(dtype) for t in (q, k, v)]
    got = mh.attention(
        *lo, score_mod=mh.scores.bias(bias.float()), backend=backend, return_weights=True, return_lse=True
    )
    rows = got.weights.double().sum(-1)
    tol = 8 * torch.finfo(dtype).eps  # each weight rounded to the returned dtype
    assert float((rows - 1).abs().max()) <= tol, f"rows sum to {float(rows.min())}..{float(rows.max())}"
    assert float(got.weights.max()) <= 1.0
    s = (lo[0] @ lo[1].transpose(-2, -1)) * D**-0.5 + bias.float()  # plain code: the fp32 bias promotes
    base = torch.softmax(s, dim=-1).to(dtype)
    assert_relative(got.weights, ref.weights, base, factor(backend, dtype), "weights")
