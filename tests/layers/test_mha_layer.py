"""`MultiHeadAttention`: the layer against the fp64 reference, its properties and its integrations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh
from helpers import DEVICES, assert_relative

DT = torch.float64


@torch.no_grad()
def reference_layer(layer: mh.MultiHeadAttention, query, key=None, value=None, mask=None):
    """The layer computed plainly: projections by hand, :func:`multihead.reference_attention` in
    fp64. Returns ``(output, weights)`` in the layer's layout."""
    key = query if key is None else key
    value = key if value is None else value
    if not layer.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    D = layer.head_dim

    def heads(x, proj, n):
        return (
            F.linear(x.double(), proj.weight.double(), None if proj.bias is None else proj.bias.double())
            .unflatten(-1, (n, D))
            .transpose(1, 2)
        )  # (B, n, L, D)

    q = heads(query, layer.q_proj, layer.num_heads)
    k = heads(key, layer.k_proj, layer.num_kv_heads)
    v = heads(value, layer.v_proj, layer.num_kv_heads)
    if layer.causal:
        mask = mh.causal() if mask is None else mh.masks.as_mask(mask) & mh.causal()
    out, weights, _ = mh.reference_attention(q, k, v, mask=mask, compute_dtype=DT)
    out = F.linear(
        out.transpose(1, 2).flatten(2),
        layer.out_proj.weight.double(),
        None if layer.out_proj.bias is None else layer.out_proj.bias.double(),
    )
    return (out if layer.batch_first else out.transpose(0, 1)), weights


CASES = [  # (Hq, Hkv, head_dim, kdim, vdim, causal, batch_first, Lq, Lk, mask)
    (4, 4, None, None, None, False, True, 9, 9, None),
    (4, 4, None, None, None, True, True, 9, 9, "padding"),
    (8, 2, None, None, None, True, False, 7, 13, None),  # GQA cross-attention, bottom-right causal
    (6, 3, 5, 11, 7, False, True, 13, 6, "bool"),  # head_dim not d_model // H, kdim/vdim
    (8, 1, None, None, None, False, False, 5, 5, "additive"),  # MQA
    (2, 2, None, None, None, True, True, 1, 17, "window"),  # one query (a decode step)
]


def _case_id(c):
    Hq, Hkv, hd, kd, vd, causal, bf, Lq, Lk, mask = c
    return f"H{Hq}x{Hkv}-hd{hd}-k{kd}v{vd}-{'causal' if causal else 'full'}-{'bf' if bf else 'sf'}-L{Lq}x{Lk}-{mask}"


def _mask(kind, B, Lq, Lk, g):
    if kind == "padding":
        return mh.key_padding(torch.tensor([Lk, Lk // 2]))
    if kind == "bool":
        m = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
        m[1, 0, 2] = False  # one fully masked row
        return m
    if kind == "additive":
        return torch.randn(1, 1, Lq, Lk, generator=g, dtype=DT)
    if kind == "window":
        return mh.sliding_window(4)
    return None


def _setup(case):
    """The case's fp64 layer, inputs and mask, on CPU."""
    Hq, Hkv, hd, kd, vd, causal, bf, Lq, Lk, kind = case
    torch.manual_seed(0)
    E, B = 24, 2
    layer = mh.MultiHeadAttention(
        E, Hq, num_kv_heads=Hkv, head_dim=hd, kdim=kd, vdim=vd, causal=causal, batch_first=bf, dtype=DT
    )
    g = torch.Generator().manual_seed(1)
    shape = (lambda L, f: (B, L, f)) if bf else (lambda L, f: (L, B, f))
    query = torch.randn(shape(Lq, E), generator=g, dtype=DT)
    key = torch.randn(shape(Lk, kd or E), generator=g, dtype=DT)
    value = torch.randn(shape(Lk, vd or E), generator=g, dtype=DT)
    return layer, query, key, value, _mask(kind, B, Lq, Lk, g)


def _to(device, *things):
    """Tensors and masks of a case on ``device`` (a mask object is left as it is)."""
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in things]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference_with_weights(case, device):
    Hq, Lq, Lk = case[0], case[7], case[8]
    layer, query, key, value, mask = _setup(case)
    B = query.shape[0 if layer.batch_first else 1]
    expected_out, expected_w = reference_layer(layer, query, key, value, mask)  # on CPU
    layer.to(device)
    query, key, value, mask = _to(device, query, key, value, mask)
    out, weights = layer(query, key, value, mask=mask, need_weights=True)
    torch.testing.assert_close(out.cpu(), expected_out)
    assert weights.shape == (B, Hq, Lq, Lk)
    torch.testing.assert_close(weights.cpu(), expected_w)  # exactly the probabilities of the reference
    torch.testing.assert_close(layer(query, key, value, mask=mask).cpu(), expected_out)  # no weights: same output


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradients_match_reference(case, device):
    """The gradients of the inputs and of every parameter (MHA, GQA, MQA, cross-attention) against
    the reference layer's, by autograd through the fp64 reference on CPU."""
    layer, query, key, value, mask = _setup(case)
    inputs = [t.requires_grad_() for t in (query, key, value)]
    expected, _ = reference_layer.__wrapped__(layer, *inputs, mask)  # with gradients
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    params = list(layer.parameters())
    want = torch.autograd.grad(expected, inputs + params, grad_out)
    layer.to(device)  # in place: params are now the device copies
    inputs = [t.detach().to(device).requires_grad_() for t in inputs]
    out = layer(*inputs, mask=_to(device, mask)[0])
    got = torch.autograd.grad(out, inputs + list(layer.parameters()), grad_out.to(device))
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    names = ["query", "key", "value"] + [name for name, _ in layer.named_parameters()]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g.cpu(), w, msg=lambda m: f"grad {name}: {m}")


def test_self_attention_fused_projection_equals_separate():
    """Self-attention multiplies by the concatenated q/k/v weights once; outputs and gradients must
    equal three separate projections (distinct input tensors force the unfused path)."""
    torch.manual_seed(2)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, dtype=DT)
    x = torch.randn(2, 6, 32, dtype=DT)
    fused = layer(x)
    fused.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    separate = layer(x, x.clone(), x.clone())
    separate.square().sum().backward()
    torch.testing.assert_close(fused, separate)
    for g, p in zip(grads, layer.parameters()):
        torch.testing.assert_close(g, p.grad)
    memory = torch.randn(2, 9, 32, dtype=DT)  # cross-attention: key is value -> one k/v matmul
    torch.testing.assert_close(layer(x, memory), layer(x, memory, memory.clone()))


def test_projection_hooks_and_replacements_are_respected():
    """A hooked or replaced projection (LoRA, quantization) is called, never bypassed by fusion."""
    torch.manual_seed(3)
    layer = mh.MultiHeadAttention(16, 2)
    calls = []
    layer.k_proj.register_forward_hook(lambda m, i, o: calls.append("k"))
    x = torch.randn(1, 3, 16)
    layer(x)
    assert calls == ["k"]

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    plain = layer(x)
    scaled = Scaled(16, 16)
    scaled.load_state_dict(layer.v_proj.state_dict())
    layer.v_proj = scaled
    doubled_value = layer(x) - layer.out_proj.bias
    torch.testing.assert_close(doubled_value, 2 * (plain - layer.out_proj.bias))


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(4)
    E, Hq, Hkv = 32, 8, 2
    gqa = mh.GroupedQueryAttention(E, Hq, Hkv, dtype=DT)
    mha = mh.MultiHeadAttention(E, Hq, dtype=DT)
    G, D = Hq // Hkv, E // Hq
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for src, dst in ((gqa.k_proj, mha.k_proj), (gqa.v_proj, mha.v_proj)):
            # query head h reads KV head h // G: repeat each KV head's rows G times, in order
            dst.weight.copy_(src.weight.view(Hkv, D, E).repeat_interleave(G, dim=0).reshape(Hq * D, E))
            dst.bias.copy_(src.bias.view(Hkv, D).repeat_interleave(G, dim=0).reshape(-1))
    x, memory = torch.randn(2, 5, E, dtype=DT), torch.randn(2, 9, E, dtype=DT)
    mask = mh.key_padding(torch.tensor([9, 4]))
    torch.testing.assert_close(gqa(x, memory, mask=mask), mha(x, memory, mask=mask))
    torch.testing.assert_close(gqa(x, need_weights=True)[1], mha(x, need_weights=True)[1])


def test_mqa_is_gqa_with_one_group():
    torch.manual_seed(5)
    mqa = mh.MultiQueryAttention(24, 6, causal=True, dtype=DT)
    gqa = mh.GroupedQueryAttention(24, 6, 1, causal=True, dtype=DT)
    gqa.load_state_dict(mqa.state_dict())
    x = torch.randn(3, 7, 24, dtype=DT)
    torch.testing.assert_close(mqa(x), gqa(x))
    assert mqa.k_proj.out_features == 4 and mqa.num_kv_heads == 1


def test_sequence_first_is_the_transpose_without_copies():
    torch.manual_seed(6)
    bf = mh.MultiHeadAttention(16, 4, causal=True, dtype=DT)
    sf = mh.MultiHeadAttention(16, 4, causal=True, batch_first=False, dtype=DT)
    sf.load_state_dict(bf.state_dict())
    x = torch.randn(2, 5, 16, dtype=DT)
    out = sf(x.transpose(0, 1).contiguous())
    torch.testing.assert_close(out, bf(x).transpose(0, 1))
    assert out.transpose(0, 1).is_contiguous()  # a view of the (B, L, E) result, not a copy


def test_capture_records_weights_only_while_capturing(monkeypatch):
    torch.manual_seed(7)
    model = nn.Sequential(mh.MultiHeadAttention(16, 2, causal=True), mh.MultiHeadAttention(16, 2))
    x = torch.randn(1, 4, 16)
    asked = []
    real = mh.layers.heads.attention  # a layer's two call sites: its fast path, and a watched call

    def spy(*args, **kwargs):
        asked.append(kwargs.get("return_weights", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(mh.layers.heads, "attention", spy)
    monkeypatch.setattr(mh.hooks, "attention", spy)
    model(x)
    assert asked == [False, False]  # the fast path computes no weights
    with mh.capture_attention(model) as cap:
        model(x)
    assert cap.names == ["0", "1"]
    torch.testing.assert_close(cap.weights[0], model[0](x, need_weights=True)[1])
    assert asked[2:4] == [True, True]


def test_compile():
    """``torch.compile`` (the eager backend keeps it fast; inductor is in the slow tier): the causal
    MHA layer traces into one graph, and GQA with a padding mask compiles too."""
    torch._dynamo.reset()
    torch.manual_seed(8)
    layer = mh.MultiHeadAttention(16, 4, causal=True)
    x = torch.randn(2, 5, 16)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    gqa = mh.GroupedQueryAttention(16, 4, 2)
    mask = mh.key_padding(torch.tensor([5, 3]))
    torch.testing.assert_close(torch.compile(gqa, backend="aot_eager")(x, mask=mask), gqa(x, mask=mask))


@pytest.mark.slow
def test_compile_inductor():
    torch._dynamo.reset()
    torch.manual_seed(9)
    layer = mh.MultiHeadAttention(16, 4, causal=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    compiled = torch.compile(layer)
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)
    compiled(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_autocast_bf16():
    torch.manual_seed(10)
    layer = mh.MultiHeadAttention(32, 4, causal=True)
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    expected, _ = reference_layer(layer, x)
    # baseline: the same layer run naively in bf16 from the same rounded inputs and weights
    naive = mh.MultiHeadAttention(32, 4, causal=True, backend="reference").to(torch.bfloat16)
    naive.load_state_dict(layer.state_dict())
    assert_relative(out.detach(), expected, naive(x.bfloat16()).detach(), factor=2.0, what="autocast output")


def test_to_dtype_and_state_dict_round_trip(tmp_path):
    torch.manual_seed(11)
    layer = mh.GroupedQueryAttention(24, 6, 2, kdim=10, vdim=10, qkv_bias=(False, False, True))
    assert set(layer.state_dict()) == {
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "v_proj.bias",
        "out_proj.weight",
        "out_proj.bias",
    }
    torch.save(layer.state_dict(), tmp_path / "layer.pt")
    fresh = mh.GroupedQueryAttention(24, 6, 2, kdim=10, vdim=10, qkv_bias=(False, False, True))
    fresh.load_state_dict(torch.load(tmp_path / "layer.pt"))
    x, memory = torch.randn(2, 3, 24), torch.randn(2, 4, 10)
    torch.testing.assert_close(fresh(x, memory), layer(x, memory))
    layer64 = layer.to(DT)
    assert all(p.dtype == DT for p in layer64.parameters())
    torch.testing.assert_close(layer64(x.double(), memory.double()), fresh(x, memory).double(), atol=1e-5, rtol=1e-5)
    assert layer.to(torch.bfloat16)(x.bfloat16(), memory.bfloat16()).dtype == torch.bfloat16


def test_dropout_applies_in_training_only():
    torch.manual_seed(12)
    layer = mh.MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 6, 16)
    torch.manual_seed(0)
    first = layer(x)
    torch.manual_seed(0)
    torch.testing.assert_close(layer(x), first)  # reproducible under a seed
    layer.eval()
    evaluated = layer(x)
    assert not torch.allclose(first, evaluated)
    torch.testing.assert_close(evaluated, reference_layer(layer, x)[0].float())


def test_data_parallel_and_ddp(tmp_path):
    """DataParallel (on CPU it calls the module; where CUDA is present it wants the module on the
    first GPU, and replicates it on each) and a one-process gloo DistributedDataParallel."""
    import copy
    import gc

    import torch.distributed as dist

    torch.manual_seed(13)
    layer = mh.MultiHeadAttention(16, 2, causal=True)
    x = torch.randn(2, 5, 16)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    placed, x_placed = copy.deepcopy(layer).to(device), x.to(device)
    torch.testing.assert_close(nn.DataParallel(placed)(x_placed), placed(x_placed))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(layer)
        out = ddp(x)
        out.sum().backward()
        torch.testing.assert_close(out, layer(x))
        assert all(p.grad is not None for p in layer.parameters())
        # DDP's reducer holds the process group: let it go while the group is still registered.
        # Released later (with the test's frame) it destroys the gloo group itself, joining gloo's
        # thread while holding the GIL that thread waits for: the whole run hung there once.
        del ddp, out
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_backend_is_passed_through():
    torch.manual_seed(14)
    auto = mh.MultiHeadAttention(16, 2, causal=True, dtype=DT)
    forced = mh.MultiHeadAttention(16, 2, causal=True, backend="reference", dtype=DT)
    forced.load_state_dict(auto.state_dict())
    x = torch.randn(2, 5, 16, dtype=DT)
    torch.testing.assert_close(forced(x), auto(x))
    assert "backend='reference'" in repr(forced)


def test_compiled_layer_with_padding_and_gqa_has_no_graph_breaks():
    """Masks that must be materialized, and GQA, trace into one graph: no data-dependent
    branch or Python-valued kernel query in the compiled path."""
    layer = mh.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(2, 5, 16)
    mask = mh.key_padding(torch.tensor([5, 3]))
    report = torch._dynamo.explain(layer)(x, mask=mask)
    assert report.graph_break_count == 0, report.break_reasons
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, mask=mask), layer(x, mask=mask))


def test_no_grad_calls_follow_every_weight_change():
    """An in-place update, load_state_dict and a dtype change are each seen by the next no-grad
    call (projection weights kept from before would give the old output)."""
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True).eval()
    fresh = lambda: mh.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True).eval()  # noqa: E731
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        before = layer(x)
        assert torch.equal(layer(x), before)
        layer.v_proj.weight.mul_(2.0)  # an optimizer step or a manual edit, in place
        after = layer(x)
    expected = fresh()
    expected.load_state_dict(layer.state_dict())
    torch.testing.assert_close(after, expected(x))  # with gradients: the concatenation in the graph
    assert not torch.allclose(after, before)
    other = fresh()
    with torch.no_grad():
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x), other(x))
        layer.double()
        torch.testing.assert_close(layer(x.double()), other.double()(x.double()))


def _copy_data(p, new):
    p.data.copy_(new)  # an EMA update: through .data, no version counter moves


def _scale_data(p, new):
    p.data.mul_(0.5)


def _assign_data(p, new):
    p.data = new  # another storage


def _copy_no_grad(p, new):
    with torch.no_grad():
        p.copy_(new)


IN_PLACE_UPDATES = {
    "data.copy_": _copy_data,
    "data.mul_": _scale_data,
    "data=": _assign_data,
    "no_grad copy_": _copy_no_grad,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param", [f"{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")])
@pytest.mark.parametrize("update", list(IN_PLACE_UPDATES))
def test_a_weight_changed_in_place_is_seen_by_the_next_no_grad_call_and_decode_step(update, param, device):
    """However a q/k/v weight or bias is changed in place (through ``.data``, which moves no version
    counter, or under ``no_grad``), the next no-grad call, cross-attention call and cached decode
    step compute what a layer built with the new weights computes: no projection weights are kept
    from before the change (on CUDA a no-grad self-attention joins the weights: per call)."""
    torch.manual_seed(0)
    make = lambda: mh.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True, dtype=DT, device=device).eval()  # noqa: E731
    layer = make()
    x, memory = torch.randn(2, 6, 16, dtype=DT).to(device), torch.randn(2, 9, 16, dtype=DT).to(device)

    def run(m):
        cache = mh.DynamicKVCache()
        prefill = m(x[:, :5], kv_cache=cache)
        step = m(x[:, 5:], kv_cache=cache)  # one decode step
        return m(x), m(x, memory), prefill, step, cache.keys[:, :, : cache.length]  # the stored keys: a k bias

    with torch.no_grad():
        before = run(layer)  # every projection path used once with the old weights
        p = layer.get_parameter(param)
        IN_PLACE_UPDATES[update](p, torch.randn(p.shape, dtype=DT).to(device))
        after = run(layer)
        fresh = make()
        fresh.load_state_dict(layer.state_dict())  # the new weights, in a layer that never saw the old
        want = run(fresh)
    for name, got, expected in zip(["self", "cross", "prefill", "decode step", "cached keys"], after, want):
        torch.testing.assert_close(got, expected, msg=lambda m: f"{update} on {param}, {name}: {m}")
    # The update changed what the layer computes. A k bias adds one constant to each query's
    # scores, which the softmax ignores: it shows in the cached keys only.
    shown = -1 if param == "k_proj.bias" else 0
    assert not torch.allclose(after[shown], before[shown])


# ---------------------------------------------------------------------------------- explain
def test_explain_reports_the_attention_call_the_layer_makes_and_leaves_a_cache_as_it_was():
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, dtype=DT)
    x, memory = torch.randn(2, 6, 32, dtype=DT), torch.randn(2, 9, 32, dtype=DT)
    q = layer.q_proj(x).view(2, 6, 4, 8).transpose(1, 2)  # (B, Hq, Lq, D); with gradients, as the call's
    k = layer.k_proj(x).view(2, 6, 2, 8).transpose(1, 2)  # (B, Hkv, Lk, D)
    v = layer.v_proj(x).view(2, 6, 2, 8).transpose(1, 2)
    want = mh.explain(q, k, v, mask=mh.sliding_window(3) & mh.causal())  # the call mask & the layer's causal()
    got = layer.explain(x, mask=mh.sliding_window(3))
    assert str(got) == str(want) and got.shape == (2, 4, 2, 6, 6, 8, 8)
    cross = layer.explain(x, memory, need_weights=True, weights_heads=0)
    assert cross.shape == (2, 4, 2, 6, 9, 8, 8) and str(cross).startswith("attention call")
    cache = mh.DynamicKVCache()
    layer(x[:, :5], kv_cache=cache)
    keys = cache.keys[:, :, :5].clone()
    step = layer.explain(x[:, 5:], kv_cache=cache)  # one decode step over the 5 cached keys and its own
    assert step.shape == (2, 4, 2, 1, 6, 8, 8)
    assert cache.length == 5 and torch.equal(cache.keys[:, :, :5], keys)
    with pytest.raises(ValueError, match=r"weights_heads/weights_rows select which weights to return"):
        layer.explain(x, weights_heads=0)


def test_explain_refuses_a_sharded_layer():
    from multihead.distributed import ContextParallel

    layer = mh.MultiHeadAttention(16, 4, causal=True, context_parallel=ContextParallel())
    with pytest.raises(ValueError, match=r"MultiHeadAttention.explain: this layer attends through .* sharded"):
        layer.explain(torch.randn(2, 4, 16))
