"""The layer's position options: ``score_mod=`` (ALiBi, T5's ``RelativePositionBias`` as a
registered submodule), ``softcap=`` and ``sinks=True``, against the layer computed plainly in
fp64 here (projections, a dense bias built from the aligned positions, an explicit softmax with
the sink as one more column); cached decoding against the full causal forward; bad input.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh
from helpers import aligned_distance, paper_slopes
from helpers import loop_bucket as t5_bucket
from multihead.caches import DynamicKVCache
from multihead.positions import ALiBi, RelativePositionBias

DT = torch.float64
MHA = mh.MultiHeadAttention


# --------------------------------------------------------------------- the plain computation
def distance(Lq, Lk):
    return aligned_distance(Lq, Lk, "bottom_right")  # key minus query position, query i at i + Lk - Lq


def alibi_bias(H, Lq, Lk, symmetric=False):
    m = torch.tensor(paper_slopes(H), dtype=DT).view(-1, 1, 1)
    d = distance(Lq, Lk).to(DT)
    return -m * d.abs() if symmetric else m * d  # (H, Lq, Lk)


def t5_bias(rel: RelativePositionBias, table, Lq, Lk):
    d = distance(Lq, Lk)
    idx = torch.tensor(
        [[t5_bucket(int(x), rel.bidirectional, rel.num_buckets, rel.max_distance) for x in row] for row in d],
        dtype=torch.long,
    ).view(Lq, Lk)
    return table[idx].permute(2, 0, 1)  # (H, Lq, Lk)


def plain_layer(layer, x, memory=None, *, bias=None, softcap=None, sinks=None):
    """``layer`` (batch_first) computed plainly in fp64; ``bias (Hq, Lq, Lk)``, ``sinks (Hq,)``."""
    x = x.double()
    memory = x if memory is None else memory.double()
    H, G, D = layer.num_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim

    def heads(proj, inp, n):
        b = None if proj.bias is None else proj.bias.double()
        return F.linear(inp, proj.weight.double(), b).unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, L, D)

    q = heads(layer.q_proj, x, H)
    k = heads(layer.k_proj, memory, layer.num_kv_heads).repeat_interleave(G, dim=1)
    v = heads(layer.v_proj, memory, layer.num_kv_heads).repeat_interleave(G, dim=1)
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, Lq, Lk)
    if bias is not None:
        s = s + bias
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if layer.causal:
        s = s.masked_fill(distance(Lq, Lk) > 0, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Lq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :Lk]
    out = (p @ v).transpose(1, 2).flatten(2)  # (B, Lq, H·D)
    return F.linear(out, layer.out_proj.weight.double(), layer.out_proj.bias.double())


def _layer(H=4, Hkv=2, E=32, causal=True, dtype=DT, **kw):
    torch.manual_seed(0)
    return MHA(E, H, num_kv_heads=Hkv, causal=causal, dtype=dtype, **kw)


def _x(B, L, E=32, seed=1, dtype=DT):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=DT).to(dtype)


# ------------------------------------------------------------------------------------ ALiBi
@pytest.mark.parametrize("causal,symmetric", [(True, False), (False, True)], ids=["causal-paper", "encoder-symmetric"])
def test_layer_with_alibi_equals_the_plain_layer(causal, symmetric):
    layer = _layer(6, 3, E=36, causal=causal, score_mod=ALiBi(6, symmetric=symmetric))
    x = _x(2, 13, E=36)
    got = layer(x)
    want = plain_layer(layer, x, bias=alibi_bias(6, 13, 13, symmetric))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got - _plain_copy(layer)(x)).abs().max() > 1e-4  # ALiBi changed something


def _plain_copy(layer):
    """The same layer without position options (a guard that the options matter)."""
    copy = _layer(layer.num_heads, layer.num_kv_heads, E=layer.d_model, causal=layer.causal)
    copy.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if k.split(".")[0] in ("q_proj", "k_proj", "v_proj", "out_proj")}
    )
    return copy


def test_cross_attention_alibi_aligns_the_last_query_with_the_last_key():
    layer = _layer(4, 4, causal=False, score_mod=ALiBi(4))
    x, memory = _x(2, 5), _x(2, 17, seed=2)
    torch.testing.assert_close(
        layer(x, memory), plain_layer(layer, x, memory, bias=alibi_bias(4, 5, 17)), rtol=1e-10, atol=1e-10
    )


# ------------------------------------------------------------------------- T5 relative bias
def _rel(H=4, bidirectional=False, dtype=DT):
    torch.manual_seed(3)
    rel = RelativePositionBias(H, num_buckets=16, max_distance=24, bidirectional=bidirectional, dtype=dtype)
    with torch.no_grad():
        rel.weight.normal_()  # std 1: the bias matters
    return rel


def test_relative_position_bias_is_a_registered_submodule_that_trains_and_moves():
    rel = _rel()
    layer = _layer(score_mod=rel, dtype=torch.float32)
    assert layer.score_mod is rel
    assert dict(layer.named_parameters())["score_mod.weight"] is rel.weight
    assert "score_mod.weight" in layer.state_dict()
    layer.to(torch.float64)
    assert rel.weight.dtype == DT and layer.score_mod.weight is rel.weight

    x = _x(2, 21)
    out = layer(x)
    table = rel.weight.detach().clone().requires_grad_()
    want = plain_layer(layer, x, bias=t5_bias(rel, table, 21, 21))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=DT)
    out.backward(grad_out)
    (table_grad,) = torch.autograd.grad(want, table, grad_out)
    assert rel.weight.grad is not None and bool(rel.weight.grad.abs().sum() > 0)
    torch.testing.assert_close(rel.weight.grad, table_grad, rtol=1e-9, atol=1e-9)

    # a step of an optimizer over layer.parameters() changes the table
    before = rel.weight.detach().clone()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert not torch.equal(before, rel.weight.detach())


# --------------------------------------------------------------------------- softcap, sinks
def test_layer_softcap_caps_after_the_position_bias():
    layer = _layer(score_mod=ALiBi(4), softcap=1.5)
    assert layer.softcap == 1.5
    x = _x(2, 9) * 4  # large scores, so the cap binds
    got = layer(x)
    want = plain_layer(layer, x, bias=alibi_bias(4, 9, 9), softcap=1.5)  # bias, then the cap
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    uncapped = plain_layer(layer, x, bias=alibi_bias(4, 9, 9))
    assert (got - uncapped).abs().max() > 1e-3  # the cap binds on these scores


def test_layer_sinks_are_a_trained_parameter_per_query_head():
    layer = _layer(6, 2, E=36, sinks=True)
    assert isinstance(layer.sinks, nn.Parameter) and tuple(layer.sinks.shape) == (6,)
    assert torch.equal(layer.sinks.detach(), torch.zeros(6, dtype=DT))
    assert any(p is layer.sinks for p in layer.parameters())
    assert "sinks" in layer.state_dict()
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0, 3.0, -5.0]))
    x = _x(2, 10, E=36)
    out = layer(x)
    sinks = layer.sinks.detach().clone().requires_grad_()
    want = plain_layer(layer, x, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
    out.backward(grad_out)
    (sink_grad,) = torch.autograd.grad(want, sinks, grad_out)
    assert layer.sinks.grad is not None and bool((layer.sinks.grad != 0).all())
    torch.testing.assert_close(layer.sinks.grad, sink_grad, rtol=1e-9, atol=1e-9)
    layer.to(torch.float32)
    assert layer.sinks.dtype == torch.float32 and layer(x.float()).dtype == torch.float32


def test_layer_weights_with_sinks_and_a_position_bias_are_the_plain_probabilities():
    rel = _rel(4, bidirectional=True)
    layer = _layer(score_mod=rel, sinks=True, causal=False)
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([1.0, -2.0, 0.0, 3.0]))
    x = _x(2, 7)
    out, weights = layer(x, need_weights=True)
    # the plain probabilities, from the same computation as plain_layer
    H, D = 4, layer.head_dim
    q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias).unflatten(-1, (H, D)).transpose(1, 2)
    k = (
        F.linear(x, layer.k_proj.weight, layer.k_proj.bias)
        .unflatten(-1, (2, D))
        .transpose(1, 2)
        .repeat_interleave(2, 1)
    )
    s = q @ k.transpose(-2, -1) / math.sqrt(D) + t5_bias(rel, rel.weight.detach(), 7, 7)
    s = torch.cat([s, layer.sinks.detach().view(1, H, 1, 1).expand(2, H, 7, 1)], -1)
    torch.testing.assert_close(weights, torch.softmax(s, -1)[..., :7], rtol=1e-10, atol=1e-10)
    assert bool((weights.sum(-1) < 1).all())
    torch.testing.assert_close(out, layer(x), rtol=0, atol=0)


def test_a_call_score_mod_comes_after_the_layers_and_before_its_softcap():
    rel = _rel(4, bidirectional=False)
    layer = _layer(score_mod=rel, softcap=2.5)
    x = _x(2, 9)
    got = layer(x, score_mod=ALiBi(4, symmetric=True))
    bias = t5_bias(rel, rel.weight.detach(), 9, 9) + alibi_bias(4, 9, 9, symmetric=True)
    torch.testing.assert_close(got, plain_layer(layer, x, bias=bias, softcap=2.5), rtol=1e-10, atol=1e-10)


def test_layer_without_sinks_has_none():
    layer = _layer()
    assert layer.sinks is None and "sinks" not in dict(layer.named_parameters())


# ---------------------------------------------------------------------- cached decoding
def _decode(layer, x, chunks):
    cache, outs, t = DynamicKVCache(), [], 0
    for n in chunks:
        outs.append(layer(x[:, t : t + n], kv_cache=cache))
        t += n
        assert cache.length == t
    return torch.cat(outs, dim=1)


SCHEDULES = {"prefill+steps": [6, 1, 1, 1, 1, 1], "chunked": [3, 4, 1, 3], "steps-only": [1] * 11}
OPTIONS = {
    "alibi": lambda: dict(score_mod=ALiBi(4)),
    "alibi-symmetric": lambda: dict(score_mod=ALiBi(4, symmetric=True)),  # alignment shows in the output
    "t5-causal": lambda: dict(score_mod=_rel(4, bidirectional=False)),
    "t5-bidirectional": lambda: dict(score_mod=_rel(4, bidirectional=True)),
    "alibi+softcap+sinks": lambda: dict(score_mod=ALiBi(4), softcap=2.0, sinks=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, DT], ids=["fp32", "fp64"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cached_decoding_equals_the_full_causal_forward(option, schedule, dtype):
    layer = _layer(dtype=dtype, **OPTIONS[option]()).eval()
    if layer.sinks is not None:
        with torch.no_grad():
            layer.sinks.copy_(torch.tensor([0.5, -1.0, 1.0, 2.0]))
    x = _x(2, 11, dtype=dtype)
    with torch.no_grad():
        full = layer(x)
        cached = _decode(layer, x, SCHEDULES[schedule])
    torch.testing.assert_close(cached, full)  # the dtype's default tolerances
    if dtype == DT:
        if "alibi" in option:
            bias = alibi_bias(4, 11, 11, symmetric="symmetric" in option)
        else:
            bias = t5_bias(layer.score_mod, layer.score_mod.weight.detach(), 11, 11)
        want = plain_layer(
            layer, x, bias=bias, softcap=layer.softcap, sinks=None if layer.sinks is None else layer.sinks.detach()
        )
        torch.testing.assert_close(full, want, rtol=1e-10, atol=1e-10)


def test_top_left_alibi_would_not_survive_decoding():
    """Guard on the test above: with the bias aligned top-left, a decode step puts its query at
    position 0, so cached decoding differs from the full forward; bottom-right is what makes it hold.
    (Symmetric: the paper's form m·(j - i) only shifts a row by a constant, which the softmax ignores.)"""
    layer = _layer(score_mod=ALiBi(4, symmetric=True, align="top_left")).eval()
    x = _x(2, 11)
    with torch.no_grad():
        assert (_decode(layer, x, SCHEDULES["prefill+steps"]) - layer(x)).abs().max() > 1e-3


# ------------------------------------------------------------------------------- bad input
BAD = [
    ("softcap zero", lambda: MHA(16, 4, softcap=0), ValueError, r"softcap: cap must be a finite number > 0, got 0"),
    (
        "softcap negative",
        lambda: MHA(16, 4, softcap=-1.0),
        ValueError,
        r"softcap: cap must be a finite number > 0, got -1\.0",
    ),
    (
        "softcap inf",
        lambda: MHA(16, 4, softcap=float("inf")),
        ValueError,
        r"softcap: cap must be a finite number > 0, got inf",
    ),
    (
        "softcap str",
        lambda: MHA(16, 4, softcap="x"),
        TypeError,
        r"softcap: cap must be a Python number \(int or float\), got str",
    ),
    (
        "softcap bool",
        lambda: MHA(16, 4, softcap=True),
        TypeError,
        r"softcap: cap must be a Python number \(int or float\), got bool",
    ),
    ("softcap tensor", lambda: MHA(16, 4, softcap=torch.tensor(2.0)), TypeError, r"got Tensor; use float\(cap\)"),
    (
        "sinks str",
        lambda: MHA(16, 4, sinks="yes"),
        TypeError,
        r"MultiHeadAttention: sinks must be a bool, got str 'yes'",
    ),
    ("sinks int", lambda: MHA(16, 4, sinks=1), TypeError, r"MultiHeadAttention: sinks must be a bool, got int 1"),
    (
        "score_mod int",
        lambda: MHA(16, 4, score_mod=42),
        TypeError,
        r"MultiHeadAttention: score_mod must be a multihead.scores modifier, "
        r"a function fn\(score, b, h, q_idx, kv_idx\) "
        r"-> score, a list of them, or None; got int",
    ),
    (
        "score_mod tensor",
        lambda: MHA(16, 4, score_mod=torch.zeros(4, 5, 5)),
        TypeError,
        r"score_mod must be .* got Tensor; for a bias tensor use multihead.scores.bias\(tensor\)",
    ),
    (
        "score_mod list item",
        lambda: MHA(16, 4, score_mod=[ALiBi(4), 3]),
        TypeError,
        r"MultiHeadAttention: score_mod\[1\] must be a multihead.scores modifier or a function .* got int",
    ),
    (
        "alibi heads",
        lambda: MHA(16, 4, score_mod=ALiBi(3))(torch.randn(2, 5, 16)),
        ValueError,
        r"ALiBi\(3\) has num_heads=3 but the attention has Hq=4 query heads; build it with num_heads=4",
    ),
    (
        "t5 heads",
        lambda: MHA(16, 4, score_mod=RelativePositionBias(2))(torch.randn(2, 5, 16)),
        ValueError,
        r"has num_heads=2 but the attention has Hq=4 query heads; build it with num_heads=4",
    ),
    (
        "score_mod returns float",
        lambda: MHA(16, 4, score_mod=lambda s, b, h, q, k: 3.0)(torch.randn(2, 5, 16)),
        TypeError,
        r"returned float; it must return the modified scores",
    ),
]


@pytest.mark.parametrize("make,error,pattern", [pytest.param(m, e, p, id=i) for i, m, e, p in BAD])
def test_bad_position_options_are_refused_with_a_message(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()
