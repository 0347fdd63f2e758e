"""The CPU one-token projection (``backends/cpu_gemv.c``): ``F.linear`` for bf16 weights and 1 to 4
rows of bf16 input, against float64 and against ``F.linear`` itself; what it refuses; and the layers'
projections through it (``layers/projection.project``), hooks and replacements of ``nn.Linear``
still called."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh
from multihead.backends import cpu_gemv
from multihead.layers import projection

TAKES = cpu_gemv.kernel() is not None and bool(cpu_gemv.kernel().mh_gemv_takes())
WHY = cpu_gemv.unavailable() or "no AVX512-BF16"
pytestmark = pytest.mark.skipif(not TAKES, reason=f"no one-token kernel here: {WHY}")


def _kernel(x, weight, bias=None):
    """The kernel itself, whatever the size (``supports`` sends fewer than 2^13 weights to F.linear)."""
    return cpu_gemv._run(cpu_gemv.kernel(), x, weight, bias, 2)


def _bound(x, weight, bias):
    """One bf16 rounding of the output, plus fp32 sums over ``in_features`` products."""
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    return want, 2.0**-8 * want.abs() + 2.0**-20 * magnitude


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (3, 31), (4, 32), (5, 33), (513, 576), (64, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_float64_within_one_bf16_rounding(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    assert cpu_gemv.supports(x, weight, bias) == (out_features * in_features >= 2**13)
    got = _kernel(x, weight, bias)
    if cpu_gemv.supports(x, weight, bias):
        assert torch.equal(cpu_gemv.linear(x, weight, bias), got)
    want, bound = _bound(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert bool(((got.double() - want).abs() <= bound).all())
    ref = F.linear(x, weight, bias)  # PyTorch's bf16 call: at most one rounding step apart
    assert bool(((got.double() - ref.double()).abs() <= 2.0**-7 * ref.double().abs() + 2 * bound).all())


def test_views_strided_weights_and_leading_dims():
    """A weight whose rows are a slice of a larger tensor, inputs that are transposed or expanded
    views with leading dimensions, against float64."""
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(40, 100, generator=gen).bfloat16()
    weight = big[3:33, 7:71]  # rows of stride 100
    seq_first = torch.randn(1, 2, 64, generator=gen).bfloat16().transpose(0, 1)  # (2, 1, 64): rows of stride 64
    expanded = torch.randn(1, 1, 64, generator=gen).bfloat16().expand(3, 1, 64)  # rows of stride 0
    for x in (seq_first, expanded):
        got = _kernel(x, weight)
        want, bound = _bound(x, weight, None)
        assert got.shape == (*x.shape[:-1], 30)
        assert bool(((got.double() - want).abs() <= bound).all())


def test_nan_and_inf_reach_the_outputs_they_reach_in_f_linear():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 48, generator=gen).bfloat16()
    weight = torch.randn(6, 48, generator=gen).bfloat16()
    x[0, 5] = float("nan")  # every output of row 0
    weight[2, 7] = float("inf")  # output 2 of row 1 (row 0 is NaN already)
    weight[4, 9] = float("inf")
    weight[4, 10] = float("-inf")  # inf - inf: NaN
    got, ref = _kernel(x, weight), F.linear(x.double(), weight.double())
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[torch.isinf(got)].sign(), ref[torch.isinf(ref)].sign().to(got.dtype))


def test_what_it_refuses_runs_f_linear():
    x, weight = torch.randn(1, 64).bfloat16(), torch.randn(128, 64).bfloat16()
    assert cpu_gemv.supports(x, weight)
    assert not cpu_gemv.supports(x, weight[:127]), "fewer than 2^13 weights: the call's fixed cost"
    assert not cpu_gemv.supports(x.float(), weight.float()), "fp32"
    assert not cpu_gemv.supports(x.half(), weight.half()), "fp16"
    assert not cpu_gemv.supports(torch.randn(5, 64).bfloat16(), weight), "five rows: a GEMM's work"
    assert not cpu_gemv.supports(torch.randn(0, 64).bfloat16(), weight), "no rows"
    assert not cpu_gemv.supports(x, weight.T.contiguous().T), "weight rows not contiguous"
    assert not cpu_gemv.supports(x, weight, torch.randn(128)), "an fp32 bias"
    assert not cpu_gemv.supports(x, torch.randn(128, 63).bfloat16()), "sizes that do not match"
    wanting = nn.Parameter(weight.clone())
    assert not cpu_gemv.supports(x, wanting), "a gradient wanted"
    with torch.no_grad():
        assert cpu_gemv.supports(x, wanting), "no gradient wanted under no_grad"
    # and the refused calls still give F.linear's answer
    assert torch.equal(cpu_gemv.linear(torch.randn(5, 64).bfloat16() * 0, weight), torch.zeros(5, 128).bfloat16())
    y = cpu_gemv.linear(x, wanting)
    y.sum().backward()
    assert wanting.grad is not None and wanting.grad.shape == weight.shape


@pytest.mark.parametrize("B,H,M", [(1, 16, 1), (2, 3, 4), (3, 1, 2)])
def test_per_head_products_equal_float64(B, H, M):
    """``x W_hᵀ`` and ``x W_h`` per head (MLA's ``W_UV`` and ``W_UK``): the weights views of one
    matrix as the layer takes them, ``x`` a transposed view as the layer's heads are, sizes that
    leave tails (33 features, 70 columns), against float64."""
    gen = torch.Generator().manual_seed(B * 100 + H * 10 + M)
    N, V, C = 33, 20, 70
    w = torch.randn(H * (N + V), C, generator=gen).bfloat16().view(H, N + V, C)
    w_uk, w_uv = w[:, :N], w[:, N:]  # (H, N, C), (H, V, C): rows of stride C, heads of stride (N + V)·C
    q = torch.randn(B, M, H, N, generator=gen).bfloat16().transpose(1, 2)  # (B, H, M, N)
    o = torch.randn(B, M, H, C, generator=gen).bfloat16().transpose(1, 2)  # (B, H, M, C)
    for x, weight, transposed, want in (
        (q, w_uk, False, q.double() @ w_uk.double()),
        (o, w_uv, True, o.double() @ w_uv.double().transpose(-1, -2)),
    ):
        assert cpu_gemv.supports_heads(x, weight, transposed) == (weight.numel() >= 2**13)
        got = cpu_gemv._run_heads(cpu_gemv.kernel(), x, weight, transposed, 2)
        w_abs = weight.double().abs()
        magnitude = x.double().abs() @ (w_abs.transpose(-1, -2) if transposed else w_abs)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert bool(((got.double() - want).abs() <= 2.0**-8 * want.abs() + 2.0**-20 * magnitude).all())


def test_per_head_products_refuse_and_fall_back():
    x, w = torch.randn(1, 4, 1, 32).bfloat16(), torch.randn(4, 32, 64).bfloat16()
    assert cpu_gemv.supports_heads(x, w, transposed=False)
    assert not cpu_gemv.supports_heads(x, w, transposed=True), "x W_hᵀ needs 64 features"
    assert not cpu_gemv.supports_heads(x, w[:, :, :63], transposed=False), "fewer than 2^13 weights"
    assert not cpu_gemv.supports_heads(torch.randn(1, 4, 5, 32).bfloat16(), w, False), "five rows"
    assert not cpu_gemv.supports_heads(torch.randn(1, 3, 1, 32).bfloat16(), w, False), "three heads for four"
    assert not cpu_gemv.supports_heads(x.float(), w.float(), False), "fp32"
    torch.testing.assert_close(cpu_gemv.heads_matmul(x.float(), w.float()), x.float() @ w.float())


def test_bad_rows_raise_a_clear_error():
    lib = cpu_gemv.kernel()
    with pytest.raises(ValueError, match="1 to 4"):
        cpu_gemv._run(lib, torch.randn(6, 32).bfloat16(), torch.randn(4, 32).bfloat16(), None, 2)


def test_project_calls_hooks_and_replacements_of_linear_themselves():
    """``project`` bypasses only a plain ``nn.Linear`` without hooks: a forward hook, a global one,
    or a subclass's forward (LoRA-like) still run, and the answers agree."""
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(128, 64, dtype=torch.bfloat16)  # 2^13 weights: the kernel takes it
    x = torch.randn(1, 1, 128, generator=gen).bfloat16()
    calls = []

    class Scaled(nn.Linear):
        def forward(self, x):
            calls.append("subclass")
            return super().forward(x) * 2

    with torch.no_grad():
        assert cpu_gemv.supports(x, linear.weight, linear.bias)
        plain = projection.project(linear, x)
        handle = linear.register_forward_hook(lambda m, i, o: calls.append("hook"))
        hooked = projection.project(linear, x)
        handle.remove()
        handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append("global"))
        globally = projection.project(linear, x)
        handle.remove()
        scaled = Scaled(128, 64, dtype=torch.bfloat16)
        scaled.load_state_dict(linear.state_dict())
        doubled = projection.project(scaled, x)
    assert calls == ["hook", "global", "subclass"]
    _, bound = _bound(x, linear.weight, linear.bias)
    for y in (hooked, globally):
        assert bool(((y.double() - plain.double()).abs() <= 2 * bound + 2.0**-7 * plain.double().abs()).all())
    assert bool(((doubled.double() - 2 * plain.double()).abs() <= 4 * bound + 2.0**-6 * plain.double().abs()).all())


@pytest.mark.parametrize("layer_kind", ["mha", "mla"])
def test_a_bf16_decode_step_through_the_kernel_equals_the_one_without(layer_kind, monkeypatch):
    """A layer's bf16 decode step (its projections on the kernel) against the same step with the
    kernel refused (``F.linear``): the same cache, outputs within a bf16 rounding of each other's size."""
    torch.manual_seed(4)
    if layer_kind == "mha":
        layer = mh.MultiHeadAttention(256, 8, num_kv_heads=2, dtype=torch.bfloat16)
        cache_of, causal = mh.caches.DynamicKVCache, {"mask": mh.causal()}
    else:
        layer = mh.MultiHeadLatentAttention(
            256, 8, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, dtype=torch.bfloat16
        )
        layer.mode = "absorbed"
        cache_of, causal = mh.caches.LatentKVCache, {}  # (causal by default)
    layer.eval()
    prompt, token = torch.randn(1, 20, 256).bfloat16(), torch.randn(1, 1, 256).bfloat16()
    outs, runs, run, run_heads = [], [], cpu_gemv._run, cpu_gemv._run_heads
    monkeypatch.setattr(cpu_gemv, "_run", lambda *a: runs.append("linear") or run(*a))
    monkeypatch.setattr(cpu_gemv, "_run_heads", lambda *a: runs.append("heads") or run_heads(*a))
    for refuse in (False, True):
        if refuse:
            monkeypatch.setattr(cpu_gemv, "supports", lambda *a, **k: False)
            monkeypatch.setattr(cpu_gemv, "supports_heads", lambda *a, **k: False)
        cache = cache_of()
        with torch.no_grad():
            layer(prompt, kv_cache=cache, **causal)
            outs.append(layer(token, kv_cache=cache))
    got, want = outs
    # the token's projections ran on the kernel: q, k, v and out (MHA); q, the latent and out, and
    # the per-head W_UK and W_UV (MLA)
    assert sorted(runs) == (["linear"] * 4 if layer_kind == "mha" else ["heads"] * 2 + ["linear"] * 3), runs
    torch.testing.assert_close(got.float(), want.float(), rtol=0.0, atol=2.0**-6 * want.float().abs().max().item())


def test_a_decoder_generates_through_the_kernel_and_keeps_the_hooks_on_its_mlp(monkeypatch):
    """``CausalDecoder``'s MLP and head go through ``project``: its bf16 decode steps run them on
    the kernel, and an MLP with a forward hook is called whole (the hook sees every step)."""
    from multihead.models import CausalDecoder, DecoderConfig

    torch.manual_seed(5)
    model = CausalDecoder(DecoderConfig(vocab_size=384, max_len=64, d_model=128, num_layers=2, num_heads=4))
    model = model.eval().bfloat16()
    prompt = torch.randint(0, 384, (1, 9))
    runs, run = [], cpu_gemv._run
    monkeypatch.setattr(cpu_gemv, "_run", lambda *a: runs.append(tuple(a[2].shape)) or run(*a))
    model.generate(prompt, 3)
    assert (512, 128) in runs and (128, 512) in runs and (384, 128) in runs, runs  # MLP up, down; head
    seen = []
    model.blocks[0].mlp.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    model.generate(prompt, 3)
    assert seen == [(1, 9, 128), (1, 1, 128), (1, 1, 128)], seen  # the prompt, then each step


def test_the_nn_multiheadattention_drop_in_projects_a_bf16_query_on_the_kernel(monkeypatch):
    """``multihead.compat.MultiheadAttention`` (the ``nn.MultiheadAttention`` drop-in): its packed input
    projection and its ``out_proj`` (PyTorch's ``NonDynamicallyQuantizableLinear``) run a one-row
    bf16 call on the kernel, within a bf16 rounding of the same call without it, and of PyTorch's
    own class with the same weights."""
    torch.manual_seed(6)
    layer = mh.compat.MultiheadAttention(256, 8, batch_first=True, dtype=torch.bfloat16).eval()
    theirs = nn.MultiheadAttention(256, 8, batch_first=True, dtype=torch.bfloat16).eval()
    theirs.load_state_dict(layer.state_dict())
    q, memory = torch.randn(1, 1, 256).bfloat16(), torch.randn(1, 12, 256).bfloat16()
    runs, run = [], cpu_gemv._run
    monkeypatch.setattr(cpu_gemv, "_run", lambda *a: runs.append(tuple(a[2].shape)) or run(*a))
    with torch.no_grad():
        got = layer(q, memory, memory, need_weights=False)[0]
        assert runs == [(256, 256), (256, 256)], runs  # q's rows of in_proj, then out_proj
        monkeypatch.setattr(cpu_gemv, "supports", lambda *a, **k: False)
        without = layer(q, memory, memory, need_weights=False)[0]
        reference = theirs(q, memory, memory, need_weights=False)[0]
    scale = 2.0**-6 * reference.float().abs().max().item()
    torch.testing.assert_close(got.float(), without.float(), rtol=0.0, atol=scale)
    torch.testing.assert_close(got.float(), reference.float(), rtol=0.0, atol=scale)
