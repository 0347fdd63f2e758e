"""``multihead.compat.MultiheadAttention`` inside PyTorch's ``nn.Transformer*`` modules.

Each test builds PyTorch's model, copies it, swaps every ``self_attn``/``multihead_attn`` for the
drop-in loaded with the same ``state_dict``, and runs both the same way: train mode (with
gradients, dropout 0), eval mode with autograd, and eval mode under ``torch.no_grad()`` and
``torch.inference_mode()``, where PyTorch's fast path (``torch._transformer_encoder_layer_fwd``,
nested tensors in ``nn.TransformerEncoder``) reads the module's weights and ``merge_masks``.
What PyTorch returns is the expectation, padded rows of 0 included; fp64, so
``assert_close``'s fp64 tolerance is the rule.

No case has a query row that sees no key: there the drop-in gives 0 and PyTorch NaN, on purpose
(``test_compat.py``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from multihead.layers.compat import MultiheadAttention

DT = torch.float64
E, H, FF = 16, 4, 24
B, L, S = 3, 7, 5  # batch, target (and encoder-layer) length, source length of a decoder
LENGTHS = (7, 4, 1)  # per batch element: right padding, and one row of a single key
MEMORY_LENGTHS = (5, 2, 3)

MODES = ("train", "eval", "no_grad", "inference_mode")


# ------------------------------------------------------------------------------------ helpers
def swap(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ``nn.MultiheadAttention`` replaced by the drop-in, same weights."""
    model = copy.deepcopy(model)
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.MultiheadAttention:
                ours = MultiheadAttention(
                    child.embed_dim,
                    child.num_heads,
                    dropout=child.dropout,
                    bias=child.in_proj_bias is not None,
                    add_bias_kv=child.bias_k is not None,
                    add_zero_attn=child.add_zero_attn,
                    kdim=child.kdim,
                    vdim=child.vdim,
                    batch_first=child.batch_first,
                    dtype=DT,
                )
                ours.load_state_dict(child.state_dict())
                ours.train(child.training)
                setattr(module, name, ours)
                swapped += 1
    assert swapped > 0, "no nn.MultiheadAttention found to swap"
    assert not any(type(m) is nn.MultiheadAttention for m in model.modules())
    return model


def _context(mode: str):
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


def run_both(make_model, make_inputs, call, mode: str, fast_path: bool | None = None):
    """Run PyTorch's model and its swapped copy in ``mode``; assert equal outputs and, with autograd,
    equal gradients of every parameter and input, and that both took PyTorch's encoder-layer fast
    path equally often (``fast_path``: whether they must have taken it; ``None``: not checked).
    Returns PyTorch's output."""
    torch.manual_seed(0)
    ref = make_model()
    ours = swap(ref)
    for model in (ref, ours):
        model.train(mode == "train")
    grads = mode in ("train", "eval")
    results, fast_calls = [], []
    fused = torch._transformer_encoder_layer_fwd

    def counting(*args, **kwargs):
        fast_calls[-1] += 1
        return fused(*args, **kwargs)

    for model in (ref, ours):
        fast_calls.append(0)
        inputs = make_inputs()
        if grads:
            for name, t in inputs.items():
                if isinstance(t, torch.Tensor) and "mask" not in name:  # masks are constants (learned: own test)
                    t.requires_grad_(True)
        with _context(mode), warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
            warnings.simplefilter("ignore", UserWarning)  # PyTorch's notes on nested tensors / fast path
            patch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
            out = call(model, **inputs)
        if grads:
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
            (out * cotangent).sum().backward()
        results.append((out, inputs, model))
    (out_ref, in_ref, m_ref), (out_ours, in_ours, m_ours) = results
    assert fast_calls[1] == fast_calls[0], f"fused encoder-layer calls: PyTorch {fast_calls[0]}, ours {fast_calls[1]}"
    if fast_path is not None:
        assert (fast_calls[0] > 0) == fast_path, f"fast path expected {fast_path}, PyTorch made {fast_calls[0]} calls"
    assert out_ref.shape == out_ours.shape
    torch.testing.assert_close(out_ours, out_ref, msg=lambda m: f"outputs differ in mode {mode}: {m}")
    if grads:
        for name, t in in_ref.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                torch.testing.assert_close(
                    in_ours[name].grad, t.grad, msg=lambda m, name=name: f"d/d{name} differs in mode {mode}: {m}"
                )
        params_ours = dict(m_ours.named_parameters())
        for name, p in m_ref.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(
                params_ours[name].grad, p.grad, msg=lambda m, name=name: f"grad of {name} differs in mode {mode}: {m}"
            )
    return out_ref


def _x(length: int, batch_first: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (B, length, E) if batch_first else (length, B, E)
    return torch.randn(shape, generator=g, dtype=DT)


def _padding(lengths, total: int):
    """PyTorch's key padding mask ``(B, total)``: ``True`` = padding."""
    return torch.arange(total).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)


def _causal(length: int):
    return nn.Transformer.generate_square_subsequent_mask(length, dtype=DT)  # float, -inf above the diagonal


def _memory_mask():
    """A bool ``(L, S)`` cross-attention mask (``True`` = blocked) leaving each row some key that
    every batch element has (key 0)."""
    g = torch.Generator().manual_seed(11)
    blocked = torch.rand((L, S), generator=g) < 0.5
    blocked[:, 0] = False
    return blocked


# ------------------------------------------------------------------------ TransformerEncoderLayer
ENCODER_MASKS = ("none", "key_padding", "causal", "causal+key_padding")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masks", ENCODER_MASKS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_layer(norm_first, batch_first, masks, mode):
    def make_model():
        return nn.TransformerEncoderLayer(
            E, H, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=DT
        )

    def make_inputs():
        inputs = {"src": _x(L, batch_first, 1)}
        if "key_padding" in masks:
            inputs["src_key_padding_mask"] = _padding(LENGTHS, L)
        if "causal" in masks:
            inputs.update(src_mask=_causal(L), is_causal=True)
        return inputs

    fast_path = batch_first and mode in ("no_grad", "inference_mode")
    run_both(make_model, make_inputs, lambda m, **kw: m(**kw), mode, fast_path=fast_path)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("masks", ["key_padding", "causal"])
def test_encoder_stack_fast_path_and_nested_tensors(masks, mode):
    """``nn.TransformerEncoder`` packs a padded batch into a nested tensor (padded rows come back
    0) and runs each layer's fast path."""

    def make_model():
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, dtype=DT)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

    def make_inputs():
        inputs = {"src": _x(L, True, 2)}
        if masks == "key_padding":
            inputs["src_key_padding_mask"] = _padding(LENGTHS, L)
        else:
            inputs.update(mask=_causal(L), is_causal=True)
        return inputs

    out = run_both(make_model, make_inputs, lambda m, **kw: m(**kw), mode, fast_path=True)
    if masks == "key_padding":  # PyTorch's nested path ran (what we compared against)
        assert bool((out[1, LENGTHS[1] :] == 0).all())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_encoder_layer_declining_its_fast_path_passes_nested_tensors(mode):
    """A hook makes a layer decline its fast path after ``nn.TransformerEncoder`` packed the batch:
    ``self_attn`` then receives nested tensors, which PyTorch's class takes on its own fast path."""

    def make_model():
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, dtype=DT)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        encoder.layers[0].linear1.register_forward_hook(lambda module, args, output: None)
        return encoder

    def make_inputs():
        return {"src": _x(L, True, 3), "src_key_padding_mask": _padding(LENGTHS, L)}

    seen = []
    original = MultiheadAttention._forward_nested

    def spy(self, *args, **kwargs):
        seen.append(True)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MultiheadAttention, "_forward_nested", spy)
        run_both(make_model, make_inputs, lambda m, **kw: m(**kw), mode, fast_path=True)  # layer 1's
    assert seen, "the nested path of the drop-in was not exercised"


# ------------------------------------------------------------------------ TransformerDecoderLayer
DECODER_MASKS = ("none", "causal", "key_padding", "memory_mask", "all")


def _decoder_inputs(masks: str, batch_first: bool) -> dict:
    inputs = {"tgt": _x(L, batch_first, 4), "memory": _x(S, batch_first, 5)}
    if masks in ("causal", "all"):
        inputs.update(tgt_mask=_causal(L), tgt_is_causal=True)
    if masks in ("key_padding", "all"):
        inputs.update(tgt_key_padding_mask=_padding(LENGTHS, L), memory_key_padding_mask=_padding(MEMORY_LENGTHS, S))
    if masks in ("memory_mask", "all"):
        inputs["memory_mask"] = _memory_mask()
    return inputs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masks", DECODER_MASKS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_decoder_layer(norm_first, batch_first, masks, mode):
    def make_model():
        return nn.TransformerDecoderLayer(
            E, H, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=DT
        )

    run_both(make_model, lambda: _decoder_inputs(masks, batch_first), lambda m, **kw: m(**kw), mode, fast_path=False)


# ---------------------------------------------------------------------------------- Transformer
TRANSFORMER_MASKS = ("none", "causal", "key_padding", "memory_mask", "all")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masks", TRANSFORMER_MASKS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer(batch_first, masks, mode):
    def make_model():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # enable_nested_tensor without batch_first
            return nn.Transformer(
                E,
                H,
                num_encoder_layers=2,
                num_decoder_layers=2,
                dim_feedforward=FF,
                dropout=0.0,
                batch_first=batch_first,
                dtype=DT,
            )

    def make_inputs():
        inputs = _decoder_inputs(masks, batch_first)
        inputs["src"] = inputs.pop("memory")
        if masks in ("causal", "all"):
            inputs.update(src_mask=_causal(S), src_is_causal=True)
        if masks in ("key_padding", "all"):
            inputs["src_key_padding_mask"] = _padding(MEMORY_LENGTHS, S)
            if masks == "key_padding":
                del inputs["tgt_key_padding_mask"]  # one case with the source padding only
        return inputs

    fast_path = batch_first and mode in ("no_grad", "inference_mode")  # the encoder's layers
    run_both(make_model, make_inputs, lambda m, **kw: m(**kw), mode, fast_path=fast_path)


def test_inference_mode_then_training_in_one_process():
    """Nothing made under ``inference_mode`` (a cached mask, say) leaks into a later autograd call."""
    torch.manual_seed(0)
    layer = swap(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=False, dtype=DT))
    kwargs = {"src_mask": _causal(L), "is_causal": True, "src_key_padding_mask": _padding(LENGTHS, L)}
    layer.eval()
    with torch.inference_mode():
        layer(_x(L, False, 6), **kwargs)
    layer.train()
    x = _x(L, False, 6).requires_grad_(True)
    layer(x, **kwargs).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


# ------------------------------------------------------------------------ a learned float mask
@pytest.mark.parametrize("kind", ["causal", "causal+key_padding", "random_2d", "random_3d"])
def test_gradient_of_a_learned_additive_attn_mask(kind):
    """PyTorch's float ``attn_mask`` is differentiable; a causal-looking one that requires grad is
    not swapped for the structured causal mask (which would drop its gradient)."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=DT)
    ours = MultiheadAttention(E, H, dtype=DT)
    ours.load_state_dict(ref.state_dict())
    x = _x(L, False, 14)
    g = torch.Generator().manual_seed(15)
    base = {
        "random_2d": lambda: torch.randn((L, L), generator=g, dtype=DT),
        "random_3d": lambda: torch.randn((B * H, L, L), generator=g, dtype=DT),
    }.get(kind, lambda: _causal(L))()
    kwargs = {"key_padding_mask": _padding(LENGTHS, L)} if "key_padding" in kind else {}
    grads = []
    for module in (ref, ours):
        mask = base.clone().requires_grad_(True)
        out, weights = module(x, x, x, attn_mask=mask, **kwargs)
        (out.sum() + weights.sum()).backward()
        grads.append((out, mask.grad))
    (out_ref, grad_ref), (out_ours, grad_ours) = grads
    torch.testing.assert_close(out_ours, out_ref)
    torch.testing.assert_close(grad_ours, grad_ref)


def test_float_attn_mask_keeps_fp64_precision():
    """An fp64 additive mask stays fp64 (built in fp32 it was only fp32-accurate: about 2e-8 here)."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=DT)
    ours = MultiheadAttention(E, H, dtype=DT)
    ours.load_state_dict(ref.state_dict())
    x = _x(L, False, 16)
    mask = torch.randn((L, L), generator=torch.Generator().manual_seed(17), dtype=DT)
    torch.testing.assert_close(
        ours(x, x, x, attn_mask=mask)[0], ref(x, x, x, attn_mask=mask)[0], rtol=1e-12, atol=1e-12
    )


# ---------------------------------------------------------------------------------- merge_masks
@pytest.mark.parametrize("attn", [None, "2d", "3d"])
@pytest.mark.parametrize("key_padding", [False, True])
def test_merge_masks_is_pytorchs(attn, key_padding):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True, dtype=DT)
    ours = MultiheadAttention(E, H, batch_first=True, dtype=DT)
    query = _x(L, True, 7)
    g = torch.Generator().manual_seed(8)
    attn_mask = {
        None: None,
        "2d": torch.randn((L, L), generator=g, dtype=DT),
        "3d": torch.randn((B * H, L, L), generator=g, dtype=DT),
    }[attn]
    kpm = torch.where(_padding(LENGTHS, L), float("-inf"), 0.0).to(DT) if key_padding else None
    expected, expected_type = ref.merge_masks(attn_mask, kpm, query)
    merged, mask_type = ours.merge_masks(attn_mask, kpm, query)
    assert mask_type == expected_type
    if expected is None:
        assert merged is None
    else:
        torch.testing.assert_close(merged, expected)


# ------------------------------------------------------------------------------- nested tensors
@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
def test_nested_inputs_match_pytorchs_fast_path(average):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True, dtype=DT).eval()
    ours = MultiheadAttention(E, H, batch_first=True, dtype=DT).eval()
    ours.load_state_dict(ref.state_dict())
    x = _x(L, True, 9)
    nested = torch.nested.nested_tensor([x[b, :n] for b, n in enumerate(LENGTHS)])
    with torch.no_grad():
        out_ref, w_ref = ref(nested, nested, nested, average_attn_weights=average)
        out, w = ours(nested, nested, nested, average_attn_weights=average)
    assert out.is_nested
    for got, expected in zip(out.unbind(), out_ref.unbind(), strict=True):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(w, w_ref)  # padded (B, [H,] L, L), 0 on padded rows and keys


@pytest.mark.parametrize(
    ("build", "call", "error", "match"),
    [
        ({"batch_first": False}, {}, ValueError, r"batch_first=False.*batch_first=True"),
        ({}, {"key_padding_mask": _padding(LENGTHS, L)}, ValueError, r"nested inputs take no key_padding_mask"),
        ({}, {"attn_mask": _causal(L)}, ValueError, r"nested inputs take no key_padding_mask or attn_mask"),
        ({}, {"dense_key": True}, TypeError, r"all nested tensors or none"),
    ],
    ids=["seq_first", "key_padding_mask", "attn_mask", "mixed"],
)
def test_nested_inputs_bad_input(build, call, error, match):
    ours = MultiheadAttention(E, H, dtype=DT, **{"batch_first": True, **build})
    x = _x(L, True, 10)
    nested = torch.nested.nested_tensor([x[b, :n] for b, n in enumerate(LENGTHS)])
    call = dict(call)
    key = x if call.pop("dense_key", False) else nested
    with pytest.raises(error, match=match):
        ours(nested, key, nested, **call)


# ------------------------------------------------------------------------- compile and script
def _compiled_pair(cls, need_weights: bool, masks: str):
    torch.manual_seed(0)
    module = cls(E, H, dtype=DT)
    x = _x(L, False, 12)
    kwargs = {"need_weights": need_weights}
    if masks == "key_padding":
        kwargs["key_padding_mask"] = _padding(LENGTHS, L)
    if masks == "both":  # float, as the causal mask: PyTorch warns (a graph break) on mixed types
        kwargs["key_padding_mask"] = torch.where(_padding(LENGTHS, L), float("-inf"), 0.0).to(DT)
    if masks in ("causal", "both"):
        kwargs.update(attn_mask=_causal(L), is_causal=masks == "causal")
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    return compiled(x, x, x, **kwargs), module(x, x, x, **kwargs)


def _assert_same(got, expected):
    torch.testing.assert_close(got[0], expected[0])
    if expected[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], expected[1])


def test_pytorchs_class_compiles_fullgraph_with_weights():
    """The bar the drop-in is held to: PyTorch's class compiles without graph breaks by default."""
    _assert_same(*_compiled_pair(nn.MultiheadAttention, True, "both"))


@pytest.mark.parametrize("masks", ["none", "key_padding", "causal", "both"])
def test_compiles_fullgraph_without_weights(masks):
    _assert_same(*_compiled_pair(MultiheadAttention, False, masks))


@pytest.mark.parametrize("masks", ["none", "both"])
def test_compiles_fullgraph_with_default_need_weights(masks):
    _assert_same(*_compiled_pair(MultiheadAttention, True, masks))


def test_pytorchs_class_scripts():
    """The claim the error below relies on: PyTorch's class is TorchScript-able."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(nn.MultiheadAttention(E, H, dtype=DT))
    x = _x(L, False, 13)
    assert scripted(x, x, x)[0].shape == x.shape


@pytest.mark.parametrize("inside_layer", [False, True], ids=["module", "inside_encoder_layer"])
def test_torch_jit_script_is_refused_with_a_reason(inside_layer):
    ours = MultiheadAttention(E, H, dtype=DT)
    target = ours
    if inside_layer:
        target = nn.TransformerEncoderLayer(E, H, FF, dtype=DT)
        target.self_attn = ours
    with pytest.raises(
        TypeError,
        match=r"cannot be compiled by torch\.jit\.script.*TorchScript cannot compile.*"
        r"torch\.compile.*load_state_dict",
    ):
        torch.jit.script(target)
    if inside_layer:
        assert target.self_attn is ours  # scripting left the model as it was
