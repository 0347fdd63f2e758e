"""ALiBi and T5's relative position bias against independent implementations written out here.

* the slopes against the paper's published rule (recursive: the closest power of two, then every
  other slope of twice as many heads), written from scratch;
* ALiBi through every backend against the fp64 reference run with a dense ``scores.bias``
  tensor built here from the aligned positions (``i + Lk - Lq`` bottom-right, ``i`` top-left);
* T5 buckets against a plain-Python loop over distances (and Hugging Face's
  ``T5Attention._relative_position_bucket`` when ``transformers`` is importable);
* the gradient of the T5 table through every backend against the reference run with a dense
  bias built by indexing the table (fp64 with ``assert_close``, fp32/bf16 by the relative rule).
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from backends.matrix import backend_params, factor, serve_or_skip  # tests/backends/matrix.py
from helpers import aligned_distance, assert_relative, loop_bucket, optional, paper_slopes
from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes, relative_position_bucket

BACKENDS = backend_params()
DT = torch.float64


# ------------------------------------------------------------------ the independent formulas
def dense_alibi(slopes: list[float], Lq: int, Lk: int, symmetric: bool, align: str) -> torch.Tensor:
    """``(1, Hq, Lq, Lk)`` fp64: ``m_h (j - i)``, or ``-m_h |j - i|`` for the symmetric form."""
    d = aligned_distance(Lq, Lk, align).to(DT)
    m = torch.tensor(slopes, dtype=DT).view(-1, 1, 1)
    return (-m * d.abs() if symmetric else m * d).unsqueeze(0)


def dense_t5_bias(
    table: torch.Tensor, Lq: int, Lk: int, bidirectional: bool, num_buckets: int, max_distance: int, align: str
) -> torch.Tensor:
    """``(1, Hq, Lq, Lk)``: ``table[bucket(j - i), h]`` by indexing (differentiable in ``table``)."""
    d = aligned_distance(Lq, Lk, align)
    lo = int(d.min())  # the loop's bucket of every distance that occurs, then looked up per entry
    lookup = torch.tensor(
        [loop_bucket(x, bidirectional, num_buckets, max_distance) for x in range(lo, int(d.max()) + 1)]
    )
    return table[lookup[d - lo]].permute(2, 0, 1).unsqueeze(0)  # (Lq, Lk, Hq) -> (1, Hq, Lq, Lk)


def naive_with_lse(q, k, v, mask, bias):
    """Attention done plainly in the inputs' dtype (the error baseline): output and LSE."""
    B, Hq, Lq, D = q.shape
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-2, -1)) * D**-0.5 + bias
    if mask is not None:
        s = s.masked_fill(~mask.materialize(B, Hq, Lq, k.shape[2]), float("-inf"))
    has_key = ~torch.isneginf(s).all(-1, keepdim=True)
    s = s.masked_fill(~has_key, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(~has_key[..., 0], float("-inf"))
    return torch.softmax(s, -1).masked_fill(~has_key, 0.0) @ v, lse


def _qkv(B, Hq, Hkv, Lq, Lk, D, seed, dtype=DT, device="cpu"):
    gen = torch.Generator().manual_seed(seed)  # drawn on CPU, then moved
    return [
        torch.randn(B, h, L, D, generator=gen, dtype=DT).to(dtype).to(device).requires_grad_()
        for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    ]


# ------------------------------------------------------------------------------- slopes
def test_alibi_slopes_for_eight_heads_are_one_half_to_one_256th():
    got = alibi_slopes(8)
    assert got.dtype == DT and tuple(got.shape) == (8,)
    assert torch.equal(got, torch.tensor([1 / 2**i for i in range(1, 9)], dtype=DT))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 12, 16, 24, 40])
def test_alibi_slopes_follow_the_papers_rule(n):
    got = alibi_slopes(n)
    want = torch.tensor(paper_slopes(n), dtype=DT)
    assert tuple(got.shape) == (n,)
    # The paper's ``start * start**i`` rounds once per power (up to ~n ulps from the closed form);
    # a wrong rule is off by a factor of 2^(1/n) or more, at least 1e-3 relative.
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0.0)
    assert len(set(got.tolist())) == n and bool(((got > 0) & (got < 1)).all())


def test_alibi_uses_the_slopes_it_is_given_and_the_default_ones_otherwise():
    q, k, v = (torch.randn(1, 3, 6, 8, dtype=DT) for _ in range(3))
    mine = [0.9, 0.05, 0.3]
    got = mh.attention(q, k, v, score_mod=ALiBi(3, slopes=mine), backend="reference")
    want = mh.reference_attention(q, k, v, score_mod=mh.scores.bias(dense_alibi(mine, 6, 6, False, "bottom_right")))
    torch.testing.assert_close(got, want.output, rtol=1e-12, atol=1e-12)
    default = mh.attention(q, k, v, score_mod=ALiBi(3), backend="reference")
    assert not torch.allclose(default, got)


# ------------------------------------------------------------------------ ALiBi through backends
ALIBI_SHAPES = [(2, 6, 3, 13, 40, 16), (2, 8, 2, 40, 13, 8), (1, 4, 1, 300, 257, 8)]


@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal&window"])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["paper", "symmetric"])
@pytest.mark.parametrize("shape", ALIBI_SHAPES, ids=lambda s: "B{}-H{}x{}-L{}x{}-D{}".format(*s))
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_alibi_through_every_backend_equals_a_dense_bias(backend, device, shape, symmetric, align, mask_kind):
    B, Hq, Hkv, Lq, Lk, D = shape
    mask = {
        "none": None,
        "causal": mh.causal(align),
        "causal&window": mh.causal(align) & mh.sliding_window(9, align=align),
    }[mask_kind]
    q, k, v = _qkv(*shape, seed=Lq * Lk + Hq, device=device)
    mod = ALiBi(Hq, symmetric=symmetric, align=align)
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=mod, return_lse=True)
    res = mh.attention(q, k, v, mask=mask, score_mod=mod, backend=backend, return_lse=True)
    got = mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu())  # compared on CPU
    dense = dense_alibi(paper_slopes(Hq), Lq, Lk, symmetric, align)
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    ref = mh.reference_attention(*leaves, mask=mask, score_mod=mh.scores.bias(dense))
    torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn(got.output.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    g_got = [g.cpu() for g in torch.autograd.grad(res.output, (q, k, v), grad_out.to(device))]
    g_ref = torch.autograd.grad(ref.output, leaves, grad_out)
    for name, g, r in zip("qkv", g_got, g_ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_the_two_alignments_differ_when_lengths_differ_and_agree_when_equal():
    """A guard on the test above: alignment is observable, so a swapped offset would fail it."""
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 5, 9, 8, seed=0))
    br = mh.attention(q, k, v, score_mod=ALiBi(2, symmetric=True), backend="reference")
    tl = mh.attention(q, k, v, score_mod=ALiBi(2, symmetric=True, align="top_left"), backend="reference")
    assert (br - tl).abs().max() > 1e-3
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 7, 7, 8, seed=0))
    br = mh.attention(q, k, v, score_mod=ALiBi(2, symmetric=True), backend="reference")
    tl = mh.attention(q, k, v, score_mod=ALiBi(2, symmetric=True, align="top_left"), backend="reference")
    torch.testing.assert_close(br, tl, rtol=0, atol=0)


# ------------------------------------------------------------------------------- T5 buckets
BUCKET_SETTINGS = [(32, 128), (16, 64), (8, 20), (64, 256), (10, 50), (6, 7)]


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("num_buckets,max_distance", BUCKET_SETTINGS)
def test_t5_buckets_equal_a_plain_loop(num_buckets, max_distance, bidirectional):
    d = torch.arange(-1500, 1501)
    got = relative_position_bucket(d, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    want = torch.tensor([loop_bucket(int(x), bidirectional, num_buckets, max_distance) for x in d])
    assert got.dtype == torch.int64 and got.shape == d.shape
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"distances {d[bad][:10].tolist()}: got {got[bad][:10].tolist()}, want {want[bad][:10].tolist()}"
    )
    assert int(got.min()) >= 0 and int(got.max()) <= num_buckets - 1
    # a 2-D distance tensor is bucketed elementwise
    d2 = d[:1000].view(20, 50)
    assert torch.equal(
        relative_position_bucket(d2, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance),
        want[:1000].view(20, 50),
    )


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("num_buckets,max_distance", BUCKET_SETTINGS)
def test_t5_buckets_equal_hugging_face(num_buckets, max_distance, bidirectional):
    t5 = optional("transformers.models.t5.modeling_t5", "no Hugging Face cross-check")
    # HF passes relative_position = memory_position - context_position: key minus query, as here.
    d = torch.arange(-1500, 1501).view(1, -1)
    want = t5.T5Attention._relative_position_bucket(
        d, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    got = relative_position_bucket(d, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(got, want)


def test_the_t5_module_holds_a_registered_table_in_t5_layout():
    rel = RelativePositionBias(6, num_buckets=16, max_distance=40, bidirectional=False)
    assert tuple(rel.weight.shape) == (16, 6) and rel.weight.requires_grad
    assert [n for n, _ in rel.named_parameters()] == ["weight"]
    mod = rel()
    assert mod.tensors()[0] is rel.weight  # the modifier reads the parameter itself, not a copy
    rel.to(DT)
    assert rel.weight.dtype == DT and rel().tensors()[0] is rel.weight


# ------------------------------------------------------------ the T5 table's gradient, every backend
T5_SHAPES = [(2, 4, 2, 29, 13, 16), (1, 6, 3, 257, 300, 8), (2, 8, 8, 1, 70, 8)]


@pytest.mark.parametrize("dtype", [DT, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "causal"])
@pytest.mark.parametrize(
    "bidirectional,num_buckets,max_distance,align",
    [(True, 32, 128, "bottom_right"), (False, 16, 40, "bottom_right"), (True, 8, 20, "top_left")],
    ids=["bidi-32-128", "causal-16-40", "bidi-8-20-tl"],
)
@pytest.mark.parametrize("shape", T5_SHAPES, ids=lambda s: "B{}-H{}x{}-L{}x{}-D{}".format(*s))
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_t5_table_gradient_through_every_backend_equals_indexing_the_table(
    backend, device, shape, bidirectional, num_buckets, max_distance, align, mask_kind, dtype
):
    B, Hq, Hkv, Lq, Lk, D = shape
    mask = None if mask_kind == "none" else mh.causal(align)
    q, k, v = _qkv(*shape, seed=Lq + 3 * Lk, dtype=dtype, device=device)
    rel = RelativePositionBias(
        Hq, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional, align=align, dtype=dtype
    )
    with torch.no_grad():  # std 1 (not T5's init 0.02) so that the bias moves the softmax
        rel.weight.copy_(torch.randn(num_buckets, Hq, generator=torch.Generator().manual_seed(5), dtype=DT))
    rel.to(device)
    mod = rel()
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=mod, return_lse=True)
    res = mh.attention(q, k, v, mask=mask, score_mod=mod, backend=backend, return_lse=True)
    grad_out = torch.randn(res.output.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    g_got = [g.cpu() for g in torch.autograd.grad(res.output, (q, k, v, rel.weight), grad_out.to(dtype).to(device))]
    got = mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu())  # compared on CPU
    cpu_leaves = [t.detach().cpu() for t in (q, k, v, rel.weight)]

    leaves = [t.double().requires_grad_() for t in cpu_leaves]
    dense = dense_t5_bias(leaves[3], Lq, Lk, bidirectional, num_buckets, max_distance, align)
    ref = mh.reference_attention(*leaves[:3], mask=mask, score_mod=mh.scores.bias(dense))
    g_ref = torch.autograd.grad(ref.output, leaves, grad_out)
    if Lq > 1 or mask is None or align == "bottom_right":  # (else the one query sees one key: no table gradient)
        assert bool(g_ref[3].abs().sum() > 0)

    if dtype == DT:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
        for name, g, r in zip(["q", "k", "v", "table"], g_got, g_ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")
        return
    base_leaves = [t.clone().requires_grad_() for t in cpu_leaves]
    base_bias = dense_t5_bias(base_leaves[3], Lq, Lk, bidirectional, num_buckets, max_distance, align)
    base, base_lse = naive_with_lse(*base_leaves[:3], mask, base_bias)
    g_base = torch.autograd.grad(base, base_leaves, grad_out.to(dtype))
    empty = torch.isneginf(ref.lse)  # rows that see no key (bottom-right causal with Lq > Lk)
    assert torch.equal(torch.isneginf(got.lse), empty)
    assert torch.equal(got.output[empty], torch.zeros_like(got.output[empty]))
    assert_relative(got.output, ref.output, base, factor(backend, dtype))
    assert_relative(got.lse[~empty], ref.lse[~empty], base_lse[~empty], factor(backend, dtype), "lse")
    magnitude = max(float(r.abs().max()) for r in g_ref[:3])
    # The table's gradient sums dS = P * (dP - rowsum(dO * O)); a fused backward computes the two
    # terms by different sums (dP = dO . v by the matmul), so its rounding is at the scale of dP,
    # even where dS is exactly 0 (a row that sees one key) and the naive baseline gets exactly 0.
    dp = grad_out @ leaves[2].detach().repeat_interleave(Hq // Hkv, 1).transpose(-2, -1)  # (B, Hq, Lq, Lk)
    scale = {"table": float(dp.abs().max())}
    for name, g, r, b in zip(["q", "k", "v", "table"], g_got, g_ref, g_base):
        assert_relative(
            g,
            r,
            b,
            factor(backend, dtype, gradients=True),
            f"grad {name}",
            magnitude=max(magnitude, float(r.abs().max()), scale.get(name, 0.0)),
        )
