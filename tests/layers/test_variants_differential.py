"""``DifferentialAttention`` (Ye et al., DIFF Transformer) against its equations.

* the layer equals the paper's equations, written plainly below in fp64 (a loop over heads, two
  softmax maps of the query/key halves, ``A1 - λ A2`` on the values, ``λ`` from its four vectors
  and ``λ_init``, the per-head RMSNorm times ``1 - λ_init``): outputs, the combined map of
  ``need_weights`` and the gradient of every parameter (the four ``λ`` vectors and the norm's
  weight included) and of the input; MHA, GQA, MQA; self- and cross-attention with ``Lq ≠ Lk``;
  no mask, causal, key padding with fully masked rows; odd lengths;
* fp32 and bf16 by the relative rule of ``shared/TESTING.md``;
* prefill + decode steps with a cache (and RoPE on each half) == the full causal forward;
* ``torch.compile``, ``explain`` (the call of one map), hooks; bad arguments in one table.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative
from multihead.layers.differential import lambda_init
from multihead.layers.heads import Attend
from multihead.positions import RotaryEmbedding
from variants_cases import (
    HEADS,
    MASKS,
    SHAPES,
    assert_gradients_match,
    assert_prefill_and_decode,
    draw,
    fp64_params,
    mask_case,
)
from variants_math import allowed_table, linear, rms_norm, rope, softmax_rows

E = 48


def published_differential(params, x, memory=None, *, Hq, Hkv, D, lam_init, allowed, positions=None, eps=1e-5):
    """Differential attention from the paper's equations, in the dtype of ``x``. Per head ``h``
    (KV head ``g = h // (Hq / Hkv)``), with ``d = D / 2``::

        A1 = softmax(q_h[:d] k_g[:d]ᵀ / sqrt(d)),  A2 = softmax(q_h[d:] k_g[d:]ᵀ / sqrt(d))
        λ  = exp(λq1·λk1) - exp(λq2·λk2) + λ_init
        o_h = (1 - λ_init) · RMSNorm((A1 - λ A2) v_g),   y = [o_1 .. o_Hq] W_O

    RoPE (when ``positions``) turns each half alone. Returns ``(y, A1 - λ A2 (B, Hq, Lq, Lk))``."""
    memory = x if memory is None else memory
    d = D // 2
    q = linear(x, params, "q_proj").unflatten(-1, (Hq, D)).transpose(1, 2)  # (B, Hq, Lq, D)
    k = linear(memory, params, "k_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)  # (B, Hkv, Lk, D)
    v = linear(memory, params, "v_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)
    q1, q2, k1, k2 = q[..., :d], q[..., d:], k[..., :d], k[..., d:]
    if positions is not None:
        q1, q2, k1, k2 = (rope(t, positions) for t in (q1, q2, k1, k2))
    lam = (
        torch.exp((params["lambda_q1"] * params["lambda_k1"]).sum())
        - torch.exp((params["lambda_q2"] * params["lambda_k2"]).sum())
        + lam_init
    ).to(x.dtype)
    outs, maps = [], []
    for h in range(Hq):
        g = h // (Hq // Hkv)
        a1 = softmax_rows(q1[:, h] @ k1[:, g].transpose(-1, -2) / math.sqrt(d), allowed)  # (B, Lq, Lk)
        a2 = softmax_rows(q2[:, h] @ k2[:, g].transpose(-1, -2) / math.sqrt(d), allowed)
        a = a1 - lam * a2
        outs.append(rms_norm(a @ v[:, g], params["subln.weight"], eps) * (1 - lam_init))  # (B, Lq, D)
        maps.append(a)
    return linear(torch.cat(outs, dim=-1), params, "out_proj"), torch.stack(maps, dim=1)


def _layer(Hq=6, Hkv=2, dtype=torch.float64, seed=0, depth=4, **kw):
    torch.manual_seed(seed)
    layer = mh.DifferentialAttention(E, Hq, num_kv_heads=Hkv, depth=depth, **kw).to(dtype)
    with torch.no_grad():  # λ far from λ_init and a norm weight that is not all ones: make them matter
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(layer, name).normal_(0, 0.4)
        layer.subln.weight.copy_(torch.rand_like(layer.subln.weight) + 0.5)
    return layer


def _x(B, L, dtype=torch.float64, seed=1):
    return draw(B, L, E, dtype, seed)


def test_lambda_init_follows_depth():
    assert lambda_init(1) == pytest.approx(0.2)
    assert lambda_init(12) == pytest.approx(0.8 - 0.6 * math.exp(-3.3))
    assert _layer(depth=7).lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.8))
    assert _layer(lambda_init=0.5).lambda_init == 0.5


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"Lq{s[0]}-Lk{s[1]}")
@pytest.mark.parametrize("kind", MASKS)
def test_equals_the_equations_forward_and_gradients(heads, shape, kind):
    (Hq, Hkv), (Lq, Lk) = heads, shape
    B = 3
    layer = _layer(Hq, Hkv)
    x = _x(B, Lq).requires_grad_()
    memory = x if Lq == Lk else _x(B, Lk, seed=2).requires_grad_()
    mask, allowed = mask_case(kind, B, Lq, Lk)
    out, weights = layer(x, None if memory is x else memory, mask=mask, need_weights=True)

    params = {n: p.detach().clone().requires_grad_() for n, p in fp64_params(layer).items()}
    expected, maps = published_differential(
        params,
        x,
        None if memory is x else memory,
        Hq=Hq,
        Hkv=Hkv,
        D=E // Hq,
        lam_init=layer.lambda_init,
        allowed=allowed,
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, maps)

    assert_gradients_match(layer, out, expected, [x] if memory is x else [x, memory], params)
    if kind == "padding":  # a row with no key: both maps are 0, so is the normalised head
        torch.testing.assert_close(out[1], layer.out_proj.bias.expand(Lq, E))


def test_combined_map_rows_sum_to_one_minus_lambda():
    layer = _layer(6, 2)
    _, weights = layer(_x(2, 9), mask=mh.causal(), need_weights=True, weights_heads=[1, 4], weights_rows=[0, 8])
    assert weights.shape == (2, 2, 2, 9)
    lam = float(layer.lambda_full())
    torch.testing.assert_close(weights.sum(-1), torch.full((2, 2, 2), 1 - lam, dtype=torch.float64))
    _, full = layer(_x(2, 9), mask=mh.causal(), need_weights=True)
    torch.testing.assert_close(weights, full[:, [1, 4]][:, :, [0, 8]])


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 10.0), (torch.bfloat16, 2.0)])
def test_low_precision_by_the_relative_rule(dtype, factor):
    """Against the fp64 equations of the rounded weights and input; the baseline is the same
    equations in ``dtype`` (shared/TESTING.md: 10 for fp32, 2 for bf16)."""
    layer = _layer(6, 2, dtype=dtype)
    x = _x(2, 37, dtype=dtype)
    kw = {"Hq": 6, "Hkv": 2, "D": 8, "lam_init": layer.lambda_init, "allowed": allowed_table(2, 37, 37, causal=True)}
    ref, _ = published_differential(fp64_params(layer), x.double(), **kw)
    low = {n: p.detach() for n, p in layer.state_dict().items()}
    baseline, _ = published_differential(low, x, **kw)
    assert_relative(layer(x, mask=mh.causal()), ref, baseline, factor, what=f"{dtype} output")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_prefill_and_decode_equal_the_full_forward(cache):
    """With RoPE on each half: a prompt of 6, then one token at a time, then a chunk of 4, equals
    the full causal forward, which equals the equations at the same positions."""
    Hq, Hkv, D = 6, 2, 8
    layer = _layer(Hq, Hkv, causal=True, rope=RotaryEmbedding(D // 2))
    x = _x(2, 13)
    full = layer(x)
    expected, _ = published_differential(
        fp64_params(layer),
        x,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        lam_init=layer.lambda_init,
        allowed=allowed_table(2, 13, 13, causal=True),
        positions=torch.arange(13),
    )
    torch.testing.assert_close(full, expected)
    assert_prefill_and_decode(layer, x, full, cache, Hkv, D)


def test_a_sliding_window_reaches_both_maps():
    """Mask objects other than causal/padding reach both maps: a sliding window equals the
    equations with the window's table."""
    layer = _layer(6, 3)
    x = _x(2, 17)
    i, j = torch.arange(17)[:, None], torch.arange(17)[None, :]
    allowed = ((j <= i) & (j >= i - 4)).expand(2, 17, 17)  # 4 keys before and the aligned one
    expected, _ = published_differential(
        fp64_params(layer), x, Hq=6, Hkv=3, D=8, lam_init=layer.lambda_init, allowed=allowed
    )
    torch.testing.assert_close(layer(x, mask=mh.sliding_window(4)), expected)


def test_compile():
    """The differential layer traces into one graph (eager backend: fast); its backward compiles."""
    torch._dynamo.reset()
    layer = _layer(4, 2, dtype=torch.float32, causal=True)
    x = torch.randn(2, 5, E, requires_grad=True)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    out = torch.compile(layer, backend="aot_eager")(x)
    got = torch.autograd.grad(out.sum(), [x, layer.lambda_q1])
    want = torch.autograd.grad(layer(x).sum(), [x, layer.lambda_q1])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_explain_and_hooks():
    """``explain`` reports one map's call (``[q1 | 0]`` against the whole keys); ``q``/``output``
    hooks see both halves and the combined heads; ``scores`` hooks are refused with a hint."""
    layer = _layer(6, 2, causal=True)
    x = _x(2, 7)
    report = layer.explain(x)
    assert report.shape == (2, 6, 2, 7, 7, 8, 8)
    assert report.backend == layer.explain(x).backend
    seen = []
    with layer.add_hook("q", lambda t, name: seen.append(("q", t.shape))):
        with layer.add_hook("output", lambda t, name: seen.append(("output", t.shape))):
            layer(x)
    assert seen == [("q", (2, 6, 7, 8)), ("output", (2, 6, 7, 8))]
    with layer.add_hook("scores", lambda t, name: None):
        with pytest.raises(ValueError, match=r"'scores'/'pattern' hooks are points of one softmax.*DifferentialCore"):
            layer(x)


BAD = [
    (lambda: mh.DifferentialAttention(E, 8, head_dim=7), ValueError, r"head_dim must be even.*head_dim=7"),
    (lambda: mh.DifferentialAttention(E, 6, depth=0), ValueError, r"depth must be the layer's index from 1.*0"),
    (lambda: mh.DifferentialAttention(E, 6, depth=True), ValueError, r"depth must be"),
    (lambda: mh.DifferentialAttention(E, 6, lambda_init=float("nan")), ValueError, r"lambda_init must be a finite"),
    (lambda: mh.DifferentialAttention(E, 6, lambda_init=1.0), ValueError, r"lambda_init must be in \[0, 1\).*got 1\.0"),
    (
        lambda: mh.DifferentialAttention(E, 6, lambda_init=-0.1),
        ValueError,
        r"lambda_init must be in \[0, 1\).*got -0\.1",
    ),
    (lambda: mh.DifferentialAttention(E, 6, norm_eps=0), ValueError, r"norm_eps must be a positive finite .*, got 0"),
    (
        lambda: mh.DifferentialAttention(E, 6, norm_eps=float("inf")),
        ValueError,
        r"norm_eps must be a positive finite number, got inf",
    ),
    (
        lambda: mh.DifferentialAttention(E, 6, rope=RotaryEmbedding(8)),
        ValueError,
        r"rope rotates 8 .*// 2 = 4",
    ),
    (lambda: mh.DifferentialAttention(E, 6, rope="rope"), TypeError, r"rope must be None or a callable"),
    (lambda: mh.DifferentialAttention(E, 6, attend=Attend()), TypeError, r"attend is not supported.*two maps"),
    (lambda: mh.DifferentialAttention(E, 6).to_torch(), TypeError, r"difference of two maps"),
    (lambda: mh.DifferentialAttention.from_torch(torch.nn.MultiheadAttention(E, 6)), TypeError, r"not two"),
]


@pytest.mark.parametrize("make,error,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.slow
def test_compile_inductor():
    """Inductor (the slow tier): forward and backward, the λ vectors' gradients included, with
    RoPE on each half and a GQA layer, equal eager."""
    torch._dynamo.reset()
    layer = _layer(4, 2, dtype=torch.float32, causal=True, rope=RotaryEmbedding(E // 8))
    x = torch.randn(2, 9, E, requires_grad=True)
    out = torch.compile(layer)(x)
    torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
    wrt = [x, layer.lambda_q1, layer.lambda_k2, layer.subln.weight]
    got = torch.autograd.grad(out.sum(), wrt)
    want = torch.autograd.grad(layer(x).sum(), wrt)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
