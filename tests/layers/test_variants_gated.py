"""``GatedAttention`` (Qiu et al., 2025; Qwen3-Next) against its equations.

* the layer equals the paper's gate at G1, written plainly below in fp64 (a loop over heads, the
  gate ``σ(x W_g)`` per channel or per head on each head's output, then ``W_O``): outputs, weights
  and the gradient of every parameter and of the input; MHA, GQA, MQA; self- and cross-attention
  with ``Lq ≠ Lk``; no mask, causal, key padding with fully masked rows; odd lengths;
* fp32 and bf16 by the relative rule of ``shared/TESTING.md``;
* prefill + decode steps with a cache (and RoPE) == the full causal forward;
* ``torch.compile``, ``batch_first=False``, non-contiguous inputs; bad arguments in one table.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative
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
from variants_math import allowed_table, linear, rope, softmax_rows

E = 48


def published_gated(params, x, memory=None, *, Hq, Hkv, D, gate, allowed, positions=None):
    """Gated attention at G1 from the paper's equations, in the dtype of ``x``: per head ``h``
    (KV head ``h // (Hq / Hkv)``) ``o_h = softmax(q_h k_gᵀ / sqrt(D)) v_g``, times
    ``σ(x W_g)`` (its ``D`` channels of head ``h``, or its entry ``h``), heads joined, ``W_O``.
    Returns ``(y (B, Lq, E), probabilities (B, Hq, Lq, Lk))``."""
    memory = x if memory is None else memory
    q = linear(x, params, "q_proj").unflatten(-1, (Hq, D)).transpose(1, 2)  # (B, Hq, Lq, D)
    k = linear(memory, params, "k_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)  # (B, Hkv, Lk, D)
    v = linear(memory, params, "v_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)
    if positions is not None:
        q, k = rope(q, positions), rope(k, positions)
    g = torch.sigmoid(linear(x, params, "gate_proj"))  # (B, Lq, Hq·D) or (B, Lq, Hq)
    outs, probs = [], []
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        p = softmax_rows(q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(D), allowed)  # (B, Lq, Lk)
        o = p @ v[:, kv]  # (B, Lq, D)
        outs.append(o * (g[..., h * D : (h + 1) * D] if gate == "elementwise" else g[..., h : h + 1]))
        probs.append(p)
    return linear(torch.cat(outs, dim=-1), params, "out_proj"), torch.stack(probs, dim=1)


def _layer(Hq=6, Hkv=2, gate="elementwise", dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    layer = mh.GatedAttention(E, Hq, num_kv_heads=Hkv, gate=gate, gate_bias=True, **kw).to(dtype)
    with torch.no_grad():  # a gate far from 0.5 everywhere: make its weights matter
        layer.gate_proj.weight.mul_(4.0)
    return layer


def _x(B, L, dtype=torch.float64, seed=1):
    return draw(B, L, E, dtype, seed)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"Lq{s[0]}-Lk{s[1]}")
@pytest.mark.parametrize("kind", MASKS)
def test_equals_the_equations_forward_and_gradients(gate, heads, shape, kind):
    (Hq, Hkv), (Lq, Lk) = heads, shape
    B = 3
    layer = _layer(Hq, Hkv, gate)
    x = _x(B, Lq).requires_grad_()
    memory = x if Lq == Lk else _x(B, Lk, seed=2).requires_grad_()
    mask, allowed = mask_case(kind, B, Lq, Lk)
    out, weights = layer(x, None if memory is x else memory, mask=mask, need_weights=True)

    params = {n: p.detach().clone().requires_grad_() for n, p in fp64_params(layer).items()}
    expected, probs = published_gated(
        params, x, None if memory is x else memory, Hq=Hq, Hkv=Hkv, D=E // Hq, gate=gate, allowed=allowed
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, probs)

    assert_gradients_match(layer, out, expected, [x] if memory is x else [x, memory], params)
    if kind == "padding":  # a row with no key: attention gives 0, the gate changes nothing
        torch.testing.assert_close(out[1], layer.out_proj.bias.expand(Lq, E))


def test_headwise_is_elementwise_with_one_gate_per_head():
    """``headwise`` equals ``elementwise`` whose gate rows repeat each head's row ``D`` times."""
    head = _layer(6, 2, "headwise")
    elem = _layer(6, 2, "elementwise")
    state = head.state_dict()
    D = E // 6
    state["gate_proj.weight"] = head.gate_proj.weight.detach().repeat_interleave(D, dim=0)
    state["gate_proj.bias"] = head.gate_proj.bias.detach().repeat_interleave(D, dim=0)
    elem.load_state_dict(state)
    x = _x(2, 9)
    torch.testing.assert_close(elem(x, mask=mh.causal()), head(x, mask=mh.causal()))


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 10.0), (torch.bfloat16, 2.0)])
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_low_precision_by_the_relative_rule(dtype, factor, gate):
    """Against the fp64 equations of the rounded weights and input; the baseline is the same
    equations computed in ``dtype`` (shared/TESTING.md: 10 for fp32, whose sums are reordered by
    the fused kernels, 2 for bf16)."""
    layer = _layer(6, 2, gate, dtype=dtype)
    x = _x(2, 37, dtype=dtype)
    allowed = allowed_table(2, 37, 37, causal=True)
    kw = {"Hq": 6, "Hkv": 2, "D": 8, "gate": gate, "allowed": allowed}
    ref, _ = published_gated(fp64_params(layer), x.double(), **kw)
    low = {n: p.detach() for n, p in layer.state_dict().items()}
    baseline, _ = published_gated(low, x, **kw)
    assert_relative(layer(x, mask=mh.causal()), ref, baseline, factor, what=f"{dtype} output")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_prefill_and_decode_equal_the_full_forward(cache):
    """With RoPE: a prompt of 6, then one token at a time, then a chunk of 4, equals the full
    causal forward; and it equals the equations with RoPE at the same positions."""
    Hq, Hkv, D = 6, 2, 8
    layer = _layer(Hq, Hkv, causal=True, rope=RotaryEmbedding(D))
    x = _x(2, 13)
    full = layer(x)
    expected, _ = published_gated(
        fp64_params(layer),
        x,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        gate="elementwise",
        allowed=allowed_table(2, 13, 13, causal=True),
        positions=torch.arange(13),
    )
    torch.testing.assert_close(full, expected)
    assert_prefill_and_decode(layer, x, full, cache, Hkv, D)


def test_layouts_and_strides():
    """``batch_first=False`` and a non-contiguous input compute what the contiguous batch-first
    call computes."""
    layer = _layer(6, 2, "headwise")
    seq = _layer(6, 2, "headwise", batch_first=False)
    seq.load_state_dict(layer.state_dict())
    x = _x(3, 10)
    expected = layer(x, mask=mh.causal())
    torch.testing.assert_close(seq(x.transpose(0, 1), mask=mh.causal()).transpose(0, 1), expected)
    wide = torch.randn(3, 10, 2 * E, dtype=torch.float64)
    wide[..., ::2] = x
    torch.testing.assert_close(layer(wide[..., ::2], mask=mh.causal()), expected)


def test_compile():
    """The gated layer traces into one graph (eager backend: fast), and its backward compiles."""
    torch._dynamo.reset()
    layer = _layer(4, 2, dtype=torch.float32, causal=True)
    x = torch.randn(2, 5, E, requires_grad=True)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    out = torch.compile(layer, backend="aot_eager")(x)
    (g,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(layer(x).sum(), x)
    torch.testing.assert_close(g, want)


def test_gate_reaches_explain_hooks_and_capture():
    """``explain`` reports the plain attention call; an ``output`` hook sees the heads before the
    gate; captured weights equal ``need_weights``."""
    layer = _layer(6, 2, causal=True)
    x = _x(2, 7)
    report = layer.explain(x)
    assert report.backend
    seen = []
    with layer.add_hook("output", lambda y, name: seen.append(y.shape)):
        layer(x)
    assert seen == [(2, 6, 7, 8)]
    with mh.capture_attention(layer) as cap:
        layer(x)
    torch.testing.assert_close(cap.weights[0], layer(x, need_weights=True)[1])


BAD = [
    (
        lambda: mh.GatedAttention(E, 6, gate="channel"),
        ValueError,
        r"gate must be one of \('elementwise'.*'channel'",
    ),
    (lambda: mh.GatedAttention(E, 6, gate_bias=1), TypeError, r"gate_bias"),
    (lambda: mh.GatedAttention(E, 5), ValueError, r"d_model=48 is not divisible by num_heads=5"),
    (lambda: mh.GatedAttention(E, 6).to_torch(), TypeError, r"no output gate"),
    (lambda: mh.GatedAttention.from_torch(torch.nn.MultiheadAttention(E, 6)), TypeError, r"no gate to copy"),
]


@pytest.mark.parametrize("make,error,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.slow
def test_compile_inductor():
    """Inductor (the slow tier: minutes on a loaded CPU): forward and backward of the elementwise
    and headwise gates, with RoPE and a GQA layer, equal eager."""
    torch._dynamo.reset()
    for gate in ("elementwise", "headwise"):
        layer = _layer(4, 2, gate, dtype=torch.float32, causal=True, rope=RotaryEmbedding(E // 4))
        x = torch.randn(2, 9, E, requires_grad=True)
        out = torch.compile(layer)(x)
        torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
        (g,) = torch.autograd.grad(out.sum(), x)
        (want,) = torch.autograd.grad(layer(x).sum(), x)
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)
