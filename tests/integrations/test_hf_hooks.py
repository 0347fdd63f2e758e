"""Hook points, captures and the viewer's recording on Hugging Face models running the `multihead`
backend (``multihead.integrations.hf_hooks``): the real all-MiniLM-L6-v2 encoder and tiny random
Llama / Gemma-2 / Qwen2 decoders built from configs (2 layers, hidden 64; no downloads).

What is checked, and against what:

* names: the model's own module paths, six points per attention module, in module order;
* identity hooks (which force the explicit ``softmax(scores) · v`` path) change nothing: the
  relative rule of ``shared/TESTING.md`` against the model in fp64 with ``oracle64`` (plain fp64
  attention over HF's own bool masks; ``eager`` is no fp64 reference: it takes its softmax in
  fp32), with the fp32 ``eager`` model as the baseline;
* patching equals a manual edit of the weights, in fp64: a head's ``output`` zeroed equals its
  columns of the output projection zeroed, its ``q`` zeroed equals its rows of the query
  projection zeroed, a KV head's ``v`` zeroed equals its rows of the value projection zeroed;
* captures agree with the fp64 oracle's weights, and with HF's own ``output_attentions``;
* a model that cannot be hooked raises, saying why.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import assert_relative, optional

transformers = optional("transformers", "the Hugging Face backend needs transformers (extra 'hf')", minversion="5.23")

import multihead as mh  # noqa: E402
from hf_cases import VOCAB, oracle_registered, tiny_config  # noqa: E402
from multihead import hooks  # noqa: E402
from multihead.integrations import hf as mh_hf  # noqa: E402
from multihead.models import find_minilm  # noqa: E402
from multihead.viz.record import record_attention  # noqa: E402

F32 = 10.0  # TESTING.md's fp32 factor: an online softmax and the explicit path reorder sums
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**tiny_config()),  # GQA 4 x 2, RoPE
    # sliding window on layer 1 only (max_window_layers=1), biases on q, k, v
    "qwen2": lambda: transformers.Qwen2Config(
        **tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ),
    # alternating sliding / global layers, attention softcap, a scale that is not D^-0.5
    "gemma2": lambda: transformers.Gemma2Config(
        **tiny_config(head_dim=16, sliding_window=4, attn_logit_softcapping=5.0, query_pre_attn_scalar=20)
    ),
}
DECODERS = list(CONFIGS)


@pytest.fixture(scope="module", autouse=True)
def registered():
    with oracle_registered():
        yield mh_hf.register()


_MODELS: dict = {}


def decoder(arch: str, impl: str = "multihead", dtype=torch.float32):
    """A tiny random decoder of ``arch`` (one set of weights per architecture), eval mode."""
    if arch not in _MODELS:
        torch.manual_seed(0)
        _MODELS[arch] = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="eager")
        _MODELS[arch].eval()
    model = copy.deepcopy(_MODELS[arch]).to(dtype)
    model.set_attn_implementation(impl)
    return model


@pytest.fixture(scope="module")
def minilm():
    """The real all-MiniLM-L6-v2 (6 layers, 12 heads of 32), on the backend, and its tokenizer."""
    folder = find_minilm()
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="multihead").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def _ids(batch=2, length=11, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _zero_head(h: int, point: str):
    def patch(t, name):
        t = t.clone()
        t[:, h] = 0
        return t

    patch.__name__ = f"zero_{point}_{h}"
    return patch


def _sentences(tokenizer):
    # two lengths: the short one is right-padded, so padded keys are masked in every layer
    return tokenizer(
        ["The cat sat on the mat because it was tired.", "Attention is all you need"], return_tensors="pt", padding=True
    )


# ------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("arch", DECODERS)
def test_hook_points_are_named_by_the_models_module_paths(arch):
    model = decoder(arch)
    points = mh.hook_points(model)
    assert points == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in hooks.POINTS]


def test_minilm_has_six_points_in_each_of_its_six_layers(minilm):
    model, _ = minilm
    points = mh.hook_points(model)
    assert len(points) == 36
    assert points[:6] == [f"encoder.layer.0.attention.self.{p}" for p in hooks.POINTS]
    assert points[-1] == "encoder.layer.5.attention.self.output"


@pytest.mark.parametrize("arch", DECODERS)
def test_each_point_sees_its_shape(arch):
    model = decoder(arch)
    config = model.config
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // Hq
    seen: dict = {}
    with torch.no_grad(), mh.hooked(model, {"*": lambda t, name: seen.update({name: tuple(t.shape)})}):
        model(_ids(2, 9))
    layer = "model.layers.1.self_attn"
    assert seen[f"{layer}.q"] == (2, Hq, 9, D)
    assert seen[f"{layer}.k"] == seen[f"{layer}.v"] == (2, Hkv, 9, D)  # GQA: the KV heads, not repeated
    assert seen[f"{layer}.scores"] == seen[f"{layer}.pattern"] == (2, Hq, 9, 9)
    assert seen[f"{layer}.output"] == (2, Hq, 9, D)
    assert len(seen) == 12


# ------------------------------------------------------------------------- identity hooks
@pytest.mark.parametrize("arch", DECODERS)
def test_hooks_that_change_nothing_give_the_unhooked_model(arch):
    """Every point hooked (scores and pattern force the explicit path: the softcap of Gemma 2, its
    scale, the sliding windows all pass through it) and read only: the logits stay those of the
    model, by the relative rule against fp64 eager."""
    ids = _ids(2, 9)
    model = decoder(arch)
    with torch.no_grad():
        fast = model(ids).logits
        with mh.hooked(model, {"*": lambda t, name: None}):
            hooked = model(ids).logits
        ref = decoder(arch, "oracle64", torch.float64)(ids).logits
        base = decoder(arch, "eager")(ids).logits
    assert_relative(hooked, ref, base, F32, f"{arch} hooked")
    assert_relative(fast, ref, base, F32, f"{arch} unhooked")
    assert "_multihead_hooks" not in model.model.layers[0].self_attn.__dict__  # removed after the block


def test_minilm_hooks_that_change_nothing_give_the_unhooked_model(minilm):
    model, tokenizer = minilm
    batch = _sentences(tokenizer)
    with torch.no_grad():
        fast = model(**batch).last_hidden_state
        with mh.hooked(model, {"*.scores": lambda t, name: None}):
            hooked = model(**batch).last_hidden_state
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        base = eager(**batch).last_hidden_state
        eager.double().set_attn_implementation("oracle64")
        ref = eager(**batch).last_hidden_state
    real = batch["attention_mask"].bool()  # padded queries are not compared (conventions: rows, not tokens)
    assert_relative(hooked[real], ref[real], base[real], F32, "MiniLM hooked")
    assert_relative(fast[real], ref[real], base[real], F32, "MiniLM unhooked")


# ------------------------------------------------------------------------------ patching
def _projections(arch: str, model, layer: int):
    attn = model.model.layers[layer].self_attn
    return attn.q_proj, attn.v_proj, attn.o_proj


@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("point", ["output", "q", "v"])
def test_patching_a_head_equals_editing_its_weights(arch, point):
    """Zeroing head h at a point equals zeroing the weights that make it: ``output`` the head's
    columns of ``o_proj``; ``q`` its rows of ``q_proj`` (a zero query stays zero under RoPE); ``v``
    the KV head's rows of ``v_proj``. Both in fp64 on the backend, the edited model unhooked."""
    ids, layer, h = _ids(2, 9), 1, 1
    model = decoder(arch, dtype=torch.float64)
    with torch.no_grad():
        before = model(ids).logits
        with mh.hooked(model, {f"model.layers.{layer}.self_attn.{point}": _zero_head(h, point)}):
            patched = model(ids).logits
        edited = decoder(arch, "multihead", torch.float64)
        q_proj, v_proj, o_proj = _projections(arch, edited, layer)
        D = edited.model.layers[layer].self_attn.head_dim
        rows = slice(h * D, (h + 1) * D)
        if point == "output":
            o_proj.weight[:, rows] = 0
        else:
            proj = q_proj if point == "q" else v_proj
            proj.weight[rows] = 0
            if proj.bias is not None:  # Qwen2's q, k, v have biases
                proj.bias[rows] = 0
        manual = edited(ids).logits
    torch.testing.assert_close(patched, manual, rtol=1e-10, atol=1e-10)
    assert (patched - before).abs().max() > 1e-3  # the patch did something


@pytest.mark.parametrize("h", [0, 7])
def test_ablating_a_minilm_head_equals_zeroing_its_columns(minilm, h):
    model, tokenizer = minilm
    batch = _sentences(tokenizer)
    layer = 3
    with torch.no_grad():
        m64 = copy.deepcopy(model).double()
        with mh.hooked(m64, {f"encoder.layer.{layer}.attention.self.output": _zero_head(h, "output")}):
            patched = m64(**batch).last_hidden_state
        edited = copy.deepcopy(model).double()
        edited.encoder.layer[layer].attention.output.dense.weight[:, h * 32 : (h + 1) * 32] = 0
        manual = edited(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(patched[real], manual[real], rtol=1e-10, atol=1e-10)


def test_a_scores_hook_that_blocks_a_key_removes_it_from_the_pattern():
    model = decoder("llama", dtype=torch.float64)
    ids = _ids(1, 8)

    def block_key_2(scores, name):
        scores = scores.clone()
        scores[..., 2] = float("-inf")
        return scores

    with torch.no_grad(), mh.capture_attention(model) as cap:
        with mh.hooked(model, {"model.layers.0.self_attn.scores": block_key_2}):
            model(ids)
    first, second = cap.weights
    assert float(first[..., 2].abs().max()) == 0.0 and float(second[..., 2].abs().min()) == 0.0
    assert float(second[..., 3:, 2].min()) > 0  # the other layer still reads key 2
    torch.testing.assert_close(first.sum(-1)[..., 3:], torch.ones_like(first.sum(-1)[..., 3:]))


def test_hooks_run_at_every_step_of_generate_with_every_key_so_far():
    model = decoder("llama")
    ks = []
    with mh.hooked(model, {"model.layers.0.self_attn.k": lambda k, name: ks.append(k.shape[2])}):
        model.generate(_ids(1, 5), max_new_tokens=4, do_sample=False)
    assert ks == [5, 6, 7, 8]


# ------------------------------------------------------------------------------ captures
@pytest.mark.parametrize("arch", DECODERS)
def test_capture_records_every_layer_under_its_path_and_equals_hf_weights(arch):
    ids = _ids(2, 9)
    model = decoder(arch)
    with torch.no_grad(), mh.capture_attention(model) as cap:
        model(ids)
    assert cap.names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with torch.no_grad():
        eager32 = decoder(arch, "eager")(ids, output_attentions=True).attentions
        oracle = decoder(arch, "oracle64", torch.float64)(ids, output_attentions=True).attentions
    for i, (w, ref, base) in enumerate(zip(cap.weights, oracle, eager32)):
        assert w.shape == (2, 4, 9, 9)
        assert_relative(w, ref, base, F32, f"{arch} layer {i} weights")


def test_capture_selections_on_minilm(minilm):
    model, tokenizer = minilm
    batch = _sentences(tokenizer)
    with torch.no_grad():
        with mh.capture_attention(model) as full:
            model(**batch)
        with mh.capture_attention(model, weights_heads=[5, 2], weights_rows=-1) as last:
            out = model(**batch, output_attentions=True)
    assert len(full) == 6 and full.names[0] == "encoder.layer.0.attention.self"
    for w_full, w_last, w_hf in zip(full.weights, last.weights, out.attentions):
        torch.testing.assert_close(w_last, w_full[:, [5, 2]][:, :, -1:])
        torch.testing.assert_close(w_hf, w_full)  # output_attentions and a capture share one weights pass


def test_record_attention_on_minilm_gives_weights_and_vectors(minilm):
    model, tokenizer = minilm
    batch = tokenizer(["The cat sat on the mat."], return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    source = record_attention(model, tokens=tokens, name="MiniLM", **batch)
    L = len(tokens)
    assert source.layer_names[0] == "encoder.layer.0.attention.self" and len(source.layer_names) == 6
    weights = torch.stack(source.weights)  # the first (only) sequence of the batch, per layer
    assert tuple(weights.shape) == (6, 12, L, L)
    assert tuple(source.queries[0].shape) == tuple(source.keys[0].shape) == (12, L, 32)
    # the recorded weights are softmax(q kᵀ / √32) of the recorded vectors
    q, k = source.queries[2].double(), source.keys[2].double()
    expected = torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, dim=-1)
    torch.testing.assert_close(weights[2].double(), expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ refusals
def test_a_model_on_another_implementation_is_told_how_to_run_on_multihead():
    model = decoder("llama", "sdpa")
    for call in (
        lambda: mh.hook_points(model),
        lambda: mh.hooked(model, {"*.pattern": print}).__enter__(),
        lambda: mh.capture_attention(model).__enter__(),
        lambda: record_attention(model, _ids(1, 4), tokens=list("abcd")),
    ):
        with pytest.raises(
            ValueError,
            match=r"2 attention modules \(LlamaAttention\) run attn_implementation='sdpa'.*"
            r"set_attn_implementation\('multihead'\)",
        ):
            call()


def test_a_model_that_declares_no_attention_modules_is_told_so(monkeypatch):
    model = decoder("llama")
    for cls in {type(m) for m in model.modules() if hasattr(type(m), "_can_record_outputs")}:
        monkeypatch.setattr(cls, "_can_record_outputs", None)
    with pytest.raises(ValueError, match=r"declares no attention modules .*_can_record_outputs"):
        mh.hook_points(model)


def test_a_plain_module_has_no_hook_points_and_is_told_why():
    with pytest.raises(ValueError, match=r"hook_points: Linear has no attention layer to watch: .*MultiHeadAttention"):
        mh.hook_points(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"capture_attention: Sequential has no attention layer"):
        mh.capture_attention(nn.Sequential(nn.Linear(4, 4))).__enter__()


def test_add_hook_refuses_an_hf_module_it_was_not_told_about():
    model = decoder("qwen2")
    mlp = model.model.layers[0].mlp
    with pytest.raises(TypeError, match=r"add_hook: layer must be .* got Qwen2MLP; hint: hooked\(model"):
        hooks.add_hook(mlp, "pattern", print)
