"""Hook points (multihead.hooks): reading and patching q, k, v, scores, pattern and output in a
layer's forward, weights selections on layers and captures, and a fast path untouched by them."""

import inspect

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh
from helpers import LargestAllocation
from multihead import hooks
from multihead.conventions import repeat_kv

DT = torch.float64


def _layer(**options):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(24, 6, num_kv_heads=3, dtype=DT, **options).eval()


def _identity(seen: list):
    def fn(t, name):
        seen.append((name, tuple(t.shape)))
        return None

    return fn


# ------------------------------------------------------------------ identity hooks change nothing
@pytest.mark.parametrize(
    "options,mask",
    [
        ({"causal": True}, None),
        ({}, mh.key_padding(torch.tensor([5, 3]))),
        ({"sinks": True}, mh.sliding_window(2)),
        ({"causal": True, "softcap": 5.0}, None),
    ],
    ids=["causal", "padding", "sinks-window", "softcap"],
)
def test_scores_and_pattern_hooks_that_change_nothing_give_the_fast_path(options, mask):
    layer = _layer(**options)
    if layer.sinks is not None:
        nn.init.normal_(layer.sinks)
    x = torch.randn(2, 5, 24, dtype=DT)
    fast, fast_w = layer(x, mask=mask, need_weights=True)
    seen = []
    with hooks.hooked(layer, {"*": _identity(seen)}):
        explicit, explicit_w = layer(x, mask=mask, need_weights=True)
    assert [n for n, _ in seen] == ["q", "k", "v", "scores", "pattern", "output"]
    assert dict(seen)["k"] == (2, 3, 5, 4) and dict(seen)["pattern"] == (2, 6, 5, 5)  # GQA: Hkv heads of k
    torch.testing.assert_close(explicit, fast)
    torch.testing.assert_close(explicit_w, fast_w)
    assert "_multihead_hooks" not in layer.__dict__  # removed at the end of the with block


def test_identity_hooks_in_latent_attention_and_the_torch_drop_in():
    torch.manual_seed(1)
    mla = mh.MultiHeadLatentAttention(
        32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, dtype=DT
    ).eval()
    x = torch.randn(2, 6, 32, dtype=DT)
    for mode in ("naive", "absorbed"):
        mla.mode = mode
        fast = mla(x)
        with mla.add_hook("pattern", lambda t, n: None):
            torch.testing.assert_close(mla(x), fast)
    drop_in = mh.compat.MultiheadAttention(16, 4, batch_first=True, dtype=DT).eval()
    y = torch.randn(2, 5, 16, dtype=DT)
    fast, w = drop_in(y, y, y, attn_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))
    with drop_in.add_hook("scores", lambda t, n: None):
        out, w2 = drop_in(y, y, y, attn_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))
    torch.testing.assert_close(out, fast)
    torch.testing.assert_close(w2, w)


# ------------------------------------------------------------------ patching does what the math says
def test_ablating_a_head_subtracts_its_share_of_the_output_projection():
    layer = _layer(causal=True)
    x = torch.randn(2, 7, 24, dtype=DT)
    heads_out = {}
    with layer.add_hook("output", lambda y, n: heads_out.setdefault("y", y)):
        full = layer(x)
    y = heads_out["y"]  # (B, Hq, Lq, D)
    h, D = 4, layer.head_dim

    def ablate(t, name):
        t = t.clone()
        t[:, h] = 0
        return t

    with layer.add_hook("output", ablate):
        ablated = layer(x)
    # out = sum_h y_h W_O[:, hD:(h+1)D]^T + b: removing head h removes exactly its term
    share = y[:, h] @ layer.out_proj.weight[:, h * D : (h + 1) * D].T  # (B, Lq, E)
    torch.testing.assert_close(ablated, full - share)


def test_a_patched_pattern_mixes_the_values_it_says():
    layer = _layer(causal=True)
    x = torch.randn(2, 7, 24, dtype=DT)
    got = {}

    def first_key_only(p, name):  # every row of head 5 attends to key 0 alone
        p = p.clone()
        p[:, 5] = 0
        p[:, 5, :, 0] = 1
        return p

    with hooks.hooked(
        layer,
        {
            "pattern": first_key_only,
            "v": lambda v, n: got.setdefault("v", v),
            "output": lambda y, n: got.setdefault("y", y),
        },
    ):
        _, w = layer(x, need_weights=True, weights_heads=5)
    v = repeat_kv(got["v"], 6)  # (B, Hq, Lk, D): head 5 reads KV head 5 // 2 = 2
    torch.testing.assert_close(got["y"][:, 5], v[:, 5, :1].expand(-1, 7, -1))
    assert torch.equal(w[:, 0, :, 0], torch.ones(2, 7, dtype=DT))  # weights are the pattern as patched


def test_zero_queries_give_the_running_mean_of_the_values():
    layer = _layer(causal=True)
    x = torch.randn(1, 6, 24, dtype=DT)
    got = {}
    with hooks.hooked(
        layer,
        {
            "q": lambda q, n: torch.zeros_like(q),
            "v": lambda v, n: got.setdefault("v", v),
            "output": lambda y, n: got.setdefault("y", y),
        },
    ):
        layer(x)
    v = repeat_kv(got["v"], 6)
    running_mean = v.cumsum(2) / torch.arange(1, 7, dtype=DT).view(1, 1, -1, 1)  # scores 0: uniform over keys <= i
    torch.testing.assert_close(got["y"], running_mean)


def test_a_replaced_score_reaches_the_gradient():
    layer = _layer(causal=True)
    x = torch.randn(1, 4, 24, dtype=DT, requires_grad=True)
    bias = torch.zeros(1, 6, 4, 4, dtype=DT, requires_grad=True)
    with layer.add_hook("scores", lambda s, n: s + bias):
        layer(x).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    assert torch.all(bias.grad.triu(1) == 0)  # masked scores stay -inf: no gradient reaches them


# ------------------------------------------------------------------ no hook: the fast path as it was
class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(
            tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)
        )
        self.ops.append((str(func), shapes))
        return out


def test_without_hooks_the_fast_path_allocates_nothing_extra(monkeypatch):
    torch.manual_seed(2)
    layer = mh.MultiHeadAttention(64, 4, causal=True).eval()
    x = torch.randn(1, 128, 64)
    square = 4 * 128 * 128  # the (B, Hq, Lq, Lk) scores; the fast path's largest is the (B, L, 3E) projection

    def trace():
        with torch.no_grad(), _Trace() as t:
            layer(x)
        return t.ops

    trace()  # the first call builds what later calls reuse (fused q/k/v weights, the call's plan)
    before = trace()
    handle = layer.add_hook("pattern", lambda p, n: None)
    with torch.no_grad(), _Trace() as hooked_trace:
        layer(x)
    handle.remove()
    after = trace()
    assert after == before  # the same ATen ops, the same shapes: nothing left behind by the hooks
    largest = max((torch.Size(s).numel() for _, shapes in before for s in shapes), default=0)
    largest_hooked = max((torch.Size(s).numel() for _, shapes in hooked_trace.ops for s in shapes), default=0)
    assert largest < square <= largest_hooked  # the check can fail: a pattern hook materialises the square
    calls = []
    real = mh.layers.heads.attention
    monkeypatch.setattr(mh.layers.heads, "attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    layer(x)
    assert len(calls) == 1 and calls[0]["return_weights"] is False and "weights_heads" not in calls[0]


# ------------------------------------------------------------------ weights selections
def test_layer_weights_for_one_head_and_row_without_the_whole_square():
    torch.manual_seed(3)
    layer = mh.MultiHeadAttention(32, 4, causal=True).eval()
    x = torch.randn(1, 256, 32)
    out, full = layer(x, need_weights=True)
    out1, one = layer(x, need_weights=True, weights_heads=2, weights_rows=slice(-1, None))
    assert one.shape == (1, 1, 1, 256)
    torch.testing.assert_close(one, full[:, 2:3, -1:])
    torch.testing.assert_close(out1, out)
    with torch.no_grad(), LargestAllocation() as mem:
        layer(x, need_weights=True, weights_heads=[0], weights_rows=[255])
    assert mem.largest < 256 * 256  # not one (Lq, Lk) plane
    with pytest.raises(ValueError, match="weights_heads/weights_rows .* need need_weights=True"):
        layer(x, weights_heads=0)
    with pytest.raises(ValueError, match=r"weights_heads has indices \[7\] outside \[0, Hq=4\)"):
        layer(x, need_weights=True, weights_heads=7)
    # only the indices outside are named, and the message admits the negative ones it accepts
    with pytest.raises(ValueError, match=r"has indices \[-5, 4\] outside \[0, Hq=4\) \(or \[-4, 0\), counting from"):
        layer(x, need_weights=True, weights_heads=[0, -5, -1, 4])


def test_capture_with_selections_records_only_them():
    torch.manual_seed(4)
    model = nn.Sequential(mh.MultiHeadAttention(32, 4, causal=True), mh.MultiHeadAttention(32, 4)).eval()
    x = torch.randn(2, 9, 32)
    with mh.capture_attention(model) as full:
        model(x)
    with (
        mh.capture_attention(model, weights_heads=[3, 1], weights_rows=-1) as last,
        mh.capture_attention(model, weights_heads=0) as head0,
    ):
        _, w = model[0](x, need_weights=True, weights_rows=[0, 4])  # a third selection in the same pass
    assert last.names == ["0"] and last.weights[0].shape == (2, 2, 1, 9)
    torch.testing.assert_close(last.weights[0], full.weights[0][:, [3, 1]][:, :, [-1]])
    torch.testing.assert_close(head0.weights[0], full.weights[0][:, [0]])
    torch.testing.assert_close(w, full.weights[0][:, :, [0, 4]])
    layer = mh.MultiHeadAttention(32, 4, causal=True).eval()
    with torch.no_grad(), LargestAllocation() as mem, mh.capture_attention(layer, weights_heads=0, weights_rows=-1):
        layer(torch.randn(1, 256, 32))
    assert mem.largest < 256 * 256


def test_as_bertviz_refuses_a_capture_bertviz_cannot_read():
    """Regression: a selection's (B, 1, 1, Lk) tensors went to bertviz, which reads every head and row."""
    layer = mh.MultiHeadAttention(16, 2).eval()
    with mh.capture_attention(layer, weights_rows=-1) as cap:
        layer(torch.randn(1, 5, 16))
    with pytest.raises(
        ValueError,
        match=r"as_bertviz: .* kept only weights_heads=None, weights_rows=-1; open "
        r"capture_attention\(model\) without selections",
    ):
        cap.as_bertviz()
    with mh.capture_attention(layer) as cap:
        pass
    with pytest.raises(ValueError, match=r"recorded no layer; call the model inside"):
        cap.as_bertviz()
    with mh.capture_attention(layer) as cap:
        layer(torch.randn(1, 5, 16))
    assert [w.shape for w in cap.as_bertviz()] == [(1, 2, 5, 5)]


# ------------------------------------------------------------------ names, handles, bad input
def test_hooked_names_points_by_module_name_and_wildcard():
    torch.manual_seed(5)
    model = nn.ModuleDict({"enc": nn.Sequential(mh.MultiHeadAttention(16, 2), mh.MultiHeadAttention(16, 2))})
    assert "enc.1.pattern" in hooks.hook_points(model) and len(hooks.hook_points(model)) == 12
    seen = []
    with hooks.hooked(model, {"enc.*.pattern": _identity(seen), "enc.0.q": _identity(seen)}):
        model["enc"](torch.randn(1, 3, 16))
    assert [n for n, _ in seen] == ["enc.0.q", "enc.0.pattern", "enc.1.pattern"]
    assert all("_multihead_hooks" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match=r"'enc\.2\.pattern' names no hook point .*\['enc\.0\.q'"):
        with hooks.hooked(model, {"enc.2.pattern": _identity(seen)}):
            pass


@pytest.mark.parametrize(
    "call,error,message",
    [
        (
            lambda l: l.add_hook("weights", lambda t, n: None),
            ValueError,
            r"point must be one of \('q', .*got 'weights'",
        ),
        (lambda l: l.add_hook("q", 3), TypeError, "fn must be callable .* got int"),
        (
            lambda l: hooks.add_hook(nn.Linear(2, 2), "q", lambda t, n: None),
            TypeError,
            "multihead attention layer .* Linear",
        ),
        (lambda l: hooks.hooked(l, ["q"]).__enter__(), TypeError, "hooks must be a dict"),
    ],
)
def test_bad_hook_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call(_layer())


def test_a_replacement_of_another_shape_is_refused_with_the_point_named():
    layer = _layer()
    with layer.add_hook("output", lambda y, n: y[:, :1]):
        with pytest.raises(
            ValueError,
            match=r"at 'output' returned \(1, 1, 3, 4\); expected None or a tensor .* "
            r"\(1, 6, 3, 4\)",
        ):
            layer(torch.randn(1, 3, 24, dtype=DT))
    # Regression: a q hook giving another dtype failed later with "q, k and v must share a dtype".
    other = torch.float32 if DT != torch.float32 else torch.float64
    with layer.add_hook("q", lambda q, n: q.to(other)):
        with pytest.raises(
            TypeError,
            match=rf"at 'q' returned a {other} tensor on cpu; expected None or a tensor "
            rf"of the dtype and device it was given, {DT} on cpu",
        ):
            layer(torch.randn(1, 3, 24, dtype=DT))


def test_help_on_layer_constructors_shows_their_arguments():
    for cls, argument in (
        (mh.MultiHeadAttention, "num_kv_heads"),
        (mh.GroupedQueryAttention, "num_kv_heads"),
        (mh.MultiHeadLatentAttention, "kv_lora_rank"),
        (mh.compat.MultiheadAttention, "batch_first"),
    ):
        doc = inspect.getdoc(cls.__init__)
        assert argument in doc and "Initialize internal Module state" not in doc, cls


def test_the_torch_drop_in_selects_weights_too():
    torch.manual_seed(6)
    drop_in = mh.compat.MultiheadAttention(16, 4, batch_first=True).eval()
    y = torch.randn(2, 7, 16)
    _, full = drop_in(y, y, y, average_attn_weights=False)
    _, one = drop_in(y, y, y, average_attn_weights=False, weights_heads=[2], weights_rows=slice(3, 5))
    torch.testing.assert_close(one, full[:, [2], 3:5])
    _, mean = drop_in(y, y, y, weights_heads=[0, 3])  # averaged over the selected heads
    torch.testing.assert_close(mean, full[:, [0, 3]].mean(1))
    with pytest.raises(ValueError, match="weights_heads/weights_rows .* need need_weights=True"):
        drop_in(y, y, y, need_weights=False, weights_heads=0)


def test_hooks_see_what_attention_reads_while_decoding_with_a_cache():
    torch.manual_seed(7)
    layer = mh.MultiHeadAttention(
        32, 4, num_kv_heads=2, causal=True, rope=mh.positions.RotaryEmbedding(8), dtype=DT
    ).eval()
    x = torch.randn(2, 6, 32, dtype=DT)
    plain, hooked_cache = mh.DynamicKVCache(), mh.DynamicKVCache()
    layer(x[:, :5], kv_cache=plain)
    expected = layer(x[:, 5:], kv_cache=plain)
    layer(x[:, :5], kv_cache=hooked_cache)
    seen = []
    with hooks.hooked(layer, {"k": _identity(seen), "pattern": _identity(seen)}):
        step = layer(x[:, 5:], kv_cache=hooked_cache)
    assert seen == [("k", (2, 2, 6, 8)), ("pattern", (2, 4, 1, 6))]  # every cached key and the new one
    torch.testing.assert_close(step, expected)


def test_inside_torch_encoder_layers_hooks_run_where_pytorch_calls_the_drop_in():
    """As docs/hooks.md says: nn.TransformerEncoderLayer's own fast path (eval, no autograd) runs
    PyTorch's kernel instead of self_attn.forward, so no hook runs there; with autograd they do."""
    torch.manual_seed(8)
    block = nn.TransformerEncoderLayer(16, 4, batch_first=True)
    block.self_attn = mh.compat.MultiheadAttention(16, 4, batch_first=True)
    block.eval()
    seen = []
    block.self_attn.add_hook("pattern", _identity(seen))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        block(x)
    assert seen == []
    block(x)
    assert seen == [("pattern", (2, 4, 5, 5))]
