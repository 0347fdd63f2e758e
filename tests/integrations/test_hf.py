"""The Hugging Face backend (``multihead.integrations.hf``) against ``transformers``' own ``eager``.

Tiny random models (2 layers, hidden 64; no downloads) of several architectures. Each comparison
makes two checks on the fp32 model with ``attn_implementation="multihead"``:

* the relative rule of ``shared/TESTING.md``: its error against an fp64 reference is at most
  ``F32`` times the error of the fp32 ``eager`` model (the baseline);
* equal to fp32 ``eager`` at a relative 1e-5.

The fp64 reference is the same model in float64 with a test-only attention implementation,
``oracle64``: plain fp64 attention over the bool masks HF's own ``sdpa_mask`` builds (so it shares
no mask code with the backend under test). ``eager`` itself is no fp64 reference: it takes its
softmax in fp32, where ``finfo(float64).min`` becomes ``-inf`` and a left-padded row that sees no
key turns into NaN, which reaches every row of the next layer.

Padded queries are compared only where ``eager`` defines them: ``eager`` gives a query that sees no
key a uniform average of the values, ``multihead`` gives it 0 (conventions: fully masked rows).
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_relative, optional

transformers = optional("transformers", "the Hugging Face backend needs transformers (extra 'hf')", minversion="5.23")

import multihead  # noqa: E402
from hf_cases import VOCAB, oracle_registered, tiny_config  # noqa: E402
from multihead import masks  # noqa: E402
from multihead.integrations import hf as mh_hf  # noqa: E402
from multihead.integrations.hf_masks import from_dense, from_mask_function  # noqa: E402

# fp32 factor of the relative rule (TESTING.md: "about 10 in fp32"; an online softmax and other
# kernels reorder sums); logits pass through two layers of it.
F32 = 10.0


def _configs():
    t = transformers
    out = {
        "llama": lambda: t.LlamaConfig(**tiny_config()),  # GQA 4 x 2, RoPE
        "mistral": lambda: t.MistralConfig(**tiny_config(sliding_window=5)),  # every layer a window of 5
        "qwen2": lambda: t.Qwen2Config(**tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
        # alternating sliding / global layers, attention softcap
        "gemma2": lambda: t.Gemma2Config(
            **tiny_config(head_dim=16, sliding_window=4, attn_logit_softcapping=5.0, query_pre_attn_scalar=20)
        ),
    }
    if hasattr(t, "GptOssConfig"):  # sinks
        out["gpt_oss"] = lambda: t.GptOssConfig(
            **{
                **tiny_config(head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2),
                "intermediate_size": 32,
            }
        )
    return out


CONFIGS = _configs()
DECODERS = list(CONFIGS)
ENCODERS = ["bert"]


@pytest.fixture(scope="module", autouse=True)
def registered():
    with oracle_registered():
        yield mh_hf.register()


_MODELS: dict = {}


def model_pair(arch: str):
    """``(model fp32, model fp64)``, eval mode, eager; built once per architecture."""
    if arch not in _MODELS:
        torch.manual_seed(0)
        if arch == "bert":
            config = transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
            model = transformers.AutoModel.from_config(config, attn_implementation="eager")
        else:
            # gpt-oss: experts as plain matmuls (the grouped kernel has no float64)
            extra = {"experts_implementation": "eager"} if arch == "gpt_oss" else {}
            model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="eager", **extra)
        if arch == "gpt_oss":  # sinks start at 0: make them matter
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.normal_()
        model.eval()
        _MODELS[arch] = (model, copy.deepcopy(model).double())
    return _MODELS[arch]


def run(model, impl: str, grad: bool = False, **inputs):
    model.set_attn_implementation(impl)
    with torch.set_grad_enabled(grad):
        return model(**inputs)


def out_of(result):
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def three(arch: str, **inputs):
    """``(multihead fp32, oracle fp64, eager fp32)`` outputs of the same inputs."""
    m32, m64 = model_pair(arch)
    x = run(m32, "multihead", **inputs)
    base = run(m32, "eager", **inputs)
    ref = run(m64, "oracle64", **inputs)
    return x, ref, base


def compare(x, ref, base, what: str, magnitude: float | None = None):
    """The relative rule against the fp64 reference, and equal to fp32 eager at 1e-5 relative."""
    assert_relative(x, ref, base, F32, what, magnitude=magnitude)
    scale = float(base.abs().max()) if magnitude is None else magnitude
    torch.testing.assert_close(x, base, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what} vs eager: {m}")


def left_padded(batch=3, length=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, :4] = 0
    attention_mask[2, :1] = 0
    return ids, attention_mask


class Spy:
    """Records the keyword arguments of every :func:`multihead.attention` call the backend makes."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = multihead.attention

        def spy(q, k, v, **kwargs):
            self.calls.append(dict(kwargs, q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
            return original(q, k, v, **kwargs)

        monkeypatch.setattr(multihead, "attention", spy)


# ------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("arch", DECODERS)
def test_masks_arrive_as_objects_and_are_causal(arch, monkeypatch):
    spy = Spy(monkeypatch)
    m32, _ = model_pair(arch)
    ids, am = left_padded()
    run(m32, "multihead", input_ids=ids, attention_mask=am)
    assert len(spy.calls) == 2  # one per layer
    config = m32.config
    for i, call in enumerate(spy.calls):
        mask = call["mask"]
        assert isinstance(mask, masks.Mask), f"layer {i}: mask {type(mask).__name__}, not a multihead mask object"
        B, _, Lq, _ = call["q_shape"]
        Lk = call["k_shape"][2]
        assert call["k_shape"][1] == config.num_key_value_heads  # GQA passed as it is: no repeat_kv copies
        dense = mask.materialize(B, 1, Lq, Lk)
        future = torch.ones(Lq, Lk, dtype=torch.bool).triu(1 + Lk - Lq)
        assert not dense[..., future].any(), f"layer {i}: a query sees a future key: {mask!r}"
        assert not dense[1, :, :, :4].any() and not dense[2, :, :, :1].any(), "padding keys visible"
        assert "band" in mask.kinds() and "key_padding" in mask.kinds()
        layer_type = getattr(config, "layer_types", None)
        windowed = (layer_type[i] == "sliding_attention") if layer_type else getattr(config, "sliding_window", None)
        window = mask.materialize(B, 1, Lq, Lk)[0, 0].sum(-1).max()
        if windowed:
            assert int(window) == config.sliding_window, f"layer {i}: {mask!r}"
        else:
            assert int(window) == Lk


def test_without_the_mask_function_the_backend_gets_none_and_stays_causal(monkeypatch):
    """The trap of issue 13: an attention function registered alone receives ``attention_mask=None``
    (``transformers`` skips mask creation for a name its mask interface does not know)."""
    from transformers import AttentionInterface

    seen = []

    def attention_only(module, q, k, v, attention_mask, **kwargs):
        seen.append(attention_mask)
        return mh_hf.attention_forward(module, q, k, v, attention_mask, **kwargs)

    AttentionInterface.register("multihead_no_masks", attention_only)
    try:
        m32, m64 = model_pair("llama")
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
        x = out_of(run(m32, "multihead_no_masks", input_ids=ids))
        assert seen and all(s is None for s in seen)
        # register() registers the mask function too: a mask object arrives ...
        spy = Spy(monkeypatch)
        run(m32, "multihead", input_ids=ids)
        assert all(isinstance(c["mask"], masks.Mask) for c in spy.calls)
        # ... and even without it the backend falls back on the module's is_causal, as HF's sdpa does.
        compare(
            x,
            out_of(run(m64, "oracle64", input_ids=ids)),
            out_of(run(m32, "eager", input_ids=ids)),
            "logits without a mask function",
        )
    finally:
        AttentionInterface._global_mapping.pop("multihead_no_masks", None)


# ------------------------------------------------------------------------- logits equal to eager
@pytest.mark.parametrize("arch", DECODERS)
def test_left_padded_batch(arch):
    ids, am = left_padded()
    x, ref, base = (out_of(r) for r in three(arch, input_ids=ids, attention_mask=am))
    real = am.bool()
    assert torch.isfinite(x).all()
    compare(x[real], ref[real], base[real], f"{arch} logits (left padding)")


def test_encoder_right_padded_batch():
    ids, _ = left_padded()
    am = torch.ones_like(ids)
    am[1, 7:] = 0
    am[2, 10:] = 0
    x, ref, base = (out_of(r) for r in three("bert", input_ids=ids, attention_mask=am))
    real = am.bool()
    compare(x[real], ref[real], base[real], "bert hidden states (right padding)")


def test_encoder_mask_objects(monkeypatch):
    spy = Spy(monkeypatch)
    m32, _ = model_pair("bert")
    ids, _ = left_padded()
    am = torch.ones_like(ids)
    am[1, 7:] = 0
    run(m32, "multihead", input_ids=ids, attention_mask=am)
    assert [c["mask"] for c in spy.calls] == [masks.key_padding([11, 7, 11])] * 2  # no causal part, lengths
    spy.calls.clear()
    run(m32, "multihead", input_ids=ids)
    assert [c["mask"] for c in spy.calls] == [None, None]  # nothing blocked


@pytest.mark.parametrize("arch", DECODERS)
def test_packed_batch(arch, monkeypatch):
    """Position ids restarting inside a row: documents, as HF detects them (no cache, no 2-D mask)."""
    spy = Spy(monkeypatch)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(12))])
    x, ref, base = (out_of(r) for r in three(arch, input_ids=ids, position_ids=position_ids, use_cache=False))
    compare(x, ref, base, f"{arch} logits (packed)")
    if arch == "gpt_oss":  # its model passes no position_ids to HF's mask creation: no documents (eager neither)
        return
    docs = spy.calls[0]["mask"]
    assert "document" in docs.kinds() and "tensor" not in docs.kinds(), docs
    # The second document does not see the first; the unpacked row sees all of its past.
    dense = docs.materialize(2, 1, 12, 12)
    assert not dense[0, 0, 5:8, :5].any() and dense[1, 0, 2, :3].all()


@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_output_attentions(arch):
    ids, am = left_padded()
    if arch == "bert":
        am = torch.ones_like(ids)
        am[1, 7:] = 0
    x, ref, base = three(arch, input_ids=ids, attention_mask=am, output_attentions=True)
    assert len(x.attentions) == 2
    real = am.bool()
    for layer, (w, r, b) in enumerate(zip(x.attentions, ref.attentions, base.attentions, strict=True)):
        assert w.shape == r.shape
        rows = real[:, None, :, None].expand_as(w)  # queries that are real tokens
        compare(w[rows], r[rows], b[rows], f"{arch} weights of layer {layer}")


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        lambda t: t.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            ffn_dim=96,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
        ),
    ],
    ids=["gpt2", "opt"],
)
def test_output_attentions_reach_models_that_ask_through_the_output_collector(make):
    # GPT-2 and OPT do not pass output_attentions to the attention function: transformers' output
    # collector asks for the weights. Without reading it, model(..., output_attentions=True) got ().
    config = make(transformers)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="multihead").eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x, base = ours(input_ids=ids, output_attentions=True), eager(input_ids=ids, output_attentions=True)
        plain = ours(input_ids=ids)
    assert len(x.attentions) == len(base.attentions) == 2
    for w, b in zip(x.attentions, base.attentions, strict=True):
        torch.testing.assert_close(w, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.logits, base.logits, rtol=1e-5, atol=1e-5)
    assert plain.attentions is None  # not asked: none computed


def test_a_model_that_uses_its_mask_as_a_tensor_is_told_why_it_cannot_run():
    # Models that edit or combine their masks themselves (Doge reads .dtype and calls masked_fill,
    # Bloom adds to it) get an error naming the cause and the fix, not a bare AttributeError.
    m = mh_hf.HFMask(masks.causal(), (1, 1, 4, 4))
    with pytest.raises(
        AttributeError, match=r"reads its attention mask's \.dtype as a tensor.*use attn_implementation='sdpa'"
    ):
        _ = m.dtype
    with pytest.raises(TypeError, match=r"computes with its attention mask as a tensor"):
        torch.zeros(1) + m
    with pytest.raises(TypeError, match=r"computes with its attention mask as a tensor"):
        m[:, :, :2]
    assert not hasattr(m, "__deepcopy__") and m.ndim == 4 and m.contiguous() is m
    if hasattr(transformers, "DogeConfig"):
        config = transformers.DogeConfig(**tiny_config())
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="multihead").eval()
        with pytest.raises(AttributeError, match=r"multihead: this model reads its attention mask's"):
            model(input_ids=torch.randint(0, VOCAB, (1, 6)))


@pytest.mark.parametrize("arch", DECODERS)
def test_generate_same_tokens(arch):
    m32, _ = model_pair(arch)
    ids, am = left_padded(length=7)
    with torch.no_grad():
        m32.set_attn_implementation("eager")
        expected = m32.generate(input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False)
        m32.set_attn_implementation("multihead")
        got = m32.generate(input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_generate_static_cache(arch, monkeypatch):
    """A static cache: generate() builds the masks ahead (HFMask passes through the model's mask
    creation), keys are the whole cache, and a part-filled cache reads a top-left band shifted."""
    m32, _ = model_pair(arch)
    ids, am = left_padded(length=7)
    kwargs = dict(input_ids=ids, attention_mask=am, max_new_tokens=5, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        m32.set_attn_implementation("eager")
        expected = m32.generate(**kwargs)
        m32.set_attn_implementation("multihead")
        spy = Spy(monkeypatch)
        got = m32.generate(**kwargs)
    assert torch.equal(got, expected)
    # A mask object in every call, but for a decoding step whose keys are all visible (a sliding
    # layer's cache of the window's size, past the padding): no mask, as HF's sdpa skips its own.
    assert all(isinstance(c["mask"], masks.Mask) or (c["mask"] is None and c["q_shape"][2] == 1) for c in spy.calls)
    assert all(isinstance(c["mask"], masks.Mask) for c in spy.calls if c["q_shape"][2] > 1)


@pytest.mark.parametrize("arch", DECODERS + ENCODERS)
def test_training_gradients(arch):
    """Training mode (dropout 0 in these configs): the same gradients as eager."""
    m32, m64 = model_pair(arch)
    ids, am = left_padded()
    if arch == "bert":
        am = torch.ones_like(ids)
        am[1, 7:] = 0
    real = am.bool()

    def grads(model, impl):
        model.train()
        model.zero_grad()
        out = out_of(run(model, impl, grad=True, input_ids=ids, attention_mask=am))
        (out[real].sin().sum()).backward()  # a loss that weighs every output differently
        model.eval()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    x, base, ref = grads(m32, "multihead"), grads(m32, "eager"), grads(m64, "oracle64")
    assert x.keys() == ref.keys() and len(x) > 4
    scale = max(float(g.abs().max()) for g in ref.values())
    for name in ref:
        compare(x[name], ref[name], base[name], f"{arch} grad {name}", magnitude=scale)


def test_dropout_in_training(monkeypatch):
    """``dropout`` reaches multihead as ``dropout_p`` in training (0 in eval) and is applied."""
    config = transformers.LlamaConfig(**tiny_config(attention_dropout=0.5))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="multihead")
    spy = Spy(monkeypatch)
    ids, am = left_padded()
    model.eval()
    with torch.no_grad():
        clean = model(input_ids=ids, attention_mask=am).logits
        model.train()
        torch.manual_seed(5)
        first = model(input_ids=ids, attention_mask=am).logits
        torch.manual_seed(5)
        again = model(input_ids=ids, attention_mask=am).logits
    assert [c["dropout_p"] for c in spy.calls] == [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    assert torch.equal(first, again)
    assert not torch.allclose(first, clean)


def test_encoder_decoder_position_bias():
    """T5: a relative position_bias in every self-attention, bidirectional encoder masks with
    padding, cross-attention masks over the encoder's keys, a causal decoder; and generate()."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    m32 = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    m64 = copy.deepcopy(m32).double()
    g = torch.Generator().manual_seed(6)
    ids, dec = torch.randint(1, VOCAB, (2, 9), generator=g), torch.randint(1, VOCAB, (2, 5), generator=g)
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    inputs = {"input_ids": ids, "attention_mask": am, "decoder_input_ids": dec}
    x, base, ref = run(m32, "multihead", **inputs), run(m32, "eager", **inputs), run(m64, "oracle64", **inputs)
    compare(x.logits, ref.logits, base.logits, "t5 logits")
    with torch.no_grad():
        m32.set_attn_implementation("eager")
        expected = m32.generate(input_ids=ids, attention_mask=am, max_new_tokens=6, do_sample=False)
        m32.set_attn_implementation("multihead")
        assert torch.equal(m32.generate(input_ids=ids, attention_mask=am, max_new_tokens=6, do_sample=False), expected)


# ----------------------------------------------------------------------- dense 4-D masks (a user's)
def _causal_padded_4d(am: torch.Tensor) -> torch.Tensor:
    L = am.shape[1]
    return (torch.ones(L, L, dtype=torch.bool).tril()[None] & am.bool()[:, None, :])[:, None]


def test_dense_additive_mask_is_recognised(monkeypatch):
    ids, am = left_padded()
    allowed = _causal_padded_4d(am)
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)  # HF's convention, not -inf
    spy = Spy(monkeypatch)
    x = out_of(run(model_pair("llama")[0], "multihead", input_ids=ids, attention_mask=additive))
    assert spy.calls[0]["mask"] == masks.causal() & masks.key_padding(am.bool())
    _, ref, base = three("llama", input_ids=ids, attention_mask=additive)
    real = am.bool()
    compare(x[real], out_of(ref)[real], out_of(base)[real], "logits (dense additive mask)")
    # A bool 4-D mask means the same to multihead (True = attend; eager would add it).
    y = out_of(run(model_pair("llama")[0], "multihead", input_ids=ids, attention_mask=allowed))
    assert torch.equal(x[real], y[real])


def test_dense_mask_without_structure_and_with_bias(monkeypatch):
    ids, _ = left_padded()
    g = torch.Generator().manual_seed(4)
    allowed = torch.rand(3, 1, 11, 11, generator=g) < 0.6
    allowed |= torch.eye(11, dtype=torch.bool)  # every query sees a key
    additive = torch.where(allowed, 0.1 * torch.randn(3, 1, 11, 11, generator=g), torch.finfo(torch.float32).min)
    spy = Spy(monkeypatch)
    x, ref, base = (out_of(r) for r in three("llama", input_ids=ids, attention_mask=additive))
    assert isinstance(spy.calls[0]["mask"], masks.TensorMask)
    assert spy.calls[0]["score_mod"] is not None  # the non-zero entries are a bias
    compare(x, ref, base, "logits (dense mask with a bias)")


@pytest.mark.parametrize(
    "case",
    [
        "causal",
        "causal_br",
        "window",
        "window_tl",
        "pad",
        "pad_left",
        "documents",
        "bidirectional_window",
        "none",
        "random",
    ],
)
def test_recognise(case):
    Lq, Lk, B = (5, 9, 2) if case in ("causal_br", "window") else (8, 8, 2)
    lengths = torch.tensor([Lk, Lk - 3])
    left = torch.ones(B, Lk, dtype=torch.bool)
    left[1, :2] = False
    expected = {
        "causal": masks.causal(),
        "causal_br": masks.causal() & masks.key_padding(lengths),
        "window": masks.sliding_window(2),
        "window_tl": masks.sliding_window(3, align="top_left") & masks.key_padding(left),
        "pad": masks.key_padding(lengths),
        "pad_left": masks.key_padding(left),
        "documents": masks.causal() & masks.document(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])),
        "bidirectional_window": masks.sliding_window(2, 2),
        "none": None,
        "random": "random",
    }[case]
    if expected == "random":
        allowed = torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(0)) < 0.5
        assert isinstance(from_dense(allowed, Lk)[0], masks.TensorMask)
        return
    allowed = (
        torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        if expected is None
        else expected.materialize(B, 1, Lq, Lk).expand(B, 1, Lq, Lk)
    )
    got, bias = from_dense(allowed, Lk)
    assert bias is None
    if expected is None:
        assert got is None
        return
    assert not isinstance(got, masks.TensorMask), f"{case}: structure not recognised"
    assert torch.equal(got.materialize(B, 1, Lq, Lk).expand(B, 1, Lq, Lk), allowed)


def test_the_old_recogniser_name_warns_with_the_new_one():
    from multihead.integrations import hf_masks

    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.warns(DeprecationWarning, match=r"now hf_masks.from_dense\(mask, kv_len\)"):
        assert hf_masks.recognise(allowed) == masks.causal()


def test_dense_refuses_integer_masks():
    with pytest.raises(TypeError, match="bool .* or additive float"):
        from_dense(torch.ones(1, 1, 3, 3, dtype=torch.long), 3)


# ----------------------------------------------- every HF mask factory, against HF's own bool mask
def _factories():
    from transformers import masking_utils as mu

    lp = torch.tensor([0, 2])
    blocks = torch.tensor(
        [[-1, -1, 0, 0, 0, 1, 1, -1, 2, 2, 2, 2, -1, -1], [0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 3, 3]]
    )
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3], list(range(14))])
    packed = mu.find_packed_sequence_indices(pos)

    def user_fn(b, h, q, kv):  # a model's own closure: read densely
        return (q + kv) % 3 != 0

    return {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "sliding": mu.sliding_window_causal_mask_function(3),
        "sliding_bidirectional": mu.sliding_window_bidirectional_mask_function(2),
        "chunked": mu.chunked_causal_mask_function(4, lp),
        # Packed documents as transformers 5.23 builds them (documents first) and as 5.24 does
        # (the remapped mask first), from factories both versions have.
        "packed": mu.and_masks(
            mu.packed_sequence_mask_function(packed),
            mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(3), pos),
        ),
        "packed_remap_first": mu.and_masks(
            mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(3), pos),
            mu.packed_sequence_mask_function(packed),
        ),
        "blockwise": mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks)),
        "or_full": mu.or_masks(mu.causal_mask_function, mu.sliding_window_overlay(3)),  # nothing blocked
        "user_or": mu.or_masks(mu.causal_mask_function, user_fn),
        "user_and": mu.and_masks(mu.sliding_window_causal_mask_function(4), user_fn),
    }


@pytest.mark.parametrize("name", list(_factories()))
@pytest.mark.parametrize(
    "frame",
    [(14, 14, 0, 0), (1, 14, 13, 0), (3, 14, 11, 0), (4, 14, 2, 0), (2, 5, 12, 9)],
    ids=["prefill", "decode", "chunk", "static", "window_cache"],
)
@pytest.mark.parametrize("padding", [False, True])
def test_mask_function_equals_hf(name, frame, padding):
    from transformers.masking_utils import sdpa_mask

    fn = _factories()[name]
    Lq, Lk, q_offset, kv_offset = frame
    if name.startswith("packed") and frame != (14, 14, 0, 0):
        pytest.skip("HF builds packed masks only without a cache (q_offset = kv_offset = 0)")
    am = None
    if padding:
        am = torch.ones(2, 14, dtype=torch.bool)
        am[1, :3] = False
    expected = sdpa_mask(
        batch_size=2,
        q_length=Lq,
        kv_length=Lk,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=fn,
        attention_mask=am,
        allow_is_causal_skip=False,
        use_vmap=True,
    )
    got = from_mask_function(
        fn,
        batch_size=2,
        q_length=Lq,
        kv_length=Lk,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=am,
        use_vmap=True,
    )
    if got is None:
        assert expected is None or bool(expected.all())
        return
    assert torch.equal(got.materialize(2, 1, Lq, Lk).expand(2, 1, Lq, Lk), expected.expand(2, 1, Lq, Lk)), (
        f"{name} {frame}: {got!r}"
    )
    if not name.startswith("user"):  # HF's own factories become structure, never a dense tensor
        assert "tensor" not in got.kinds(), f"{name}: read densely: {got!r}"


def test_a_decoding_step_that_sees_every_key_gets_no_mask():
    """HF's causal mask of a decoding step (one query after its cache) blocks nothing: no mask
    object, as transformers' sdpa skips its own (the call then needs no mask at all). A window
    shorter than the cache, a static cache's unfilled slots, or padding still give one."""
    from transformers import masking_utils as mu

    def read(fn, Lq, Lk, q_offset, am=None):
        return from_mask_function(fn, batch_size=2, q_length=Lq, kv_length=Lk, q_offset=q_offset, attention_mask=am)

    assert read(mu.causal_mask_function, 1, 1025, 1024) is None
    assert read(mu.causal_mask_function, 2, 1026, 1024) is not None  # two new tokens: the first not the last
    assert read(mu.sliding_window_causal_mask_function(4096), 1, 1025, 1024) is None
    assert read(mu.sliding_window_causal_mask_function(512), 1, 1025, 1024) is not None
    assert read(mu.causal_mask_function, 1, 2048, 1024) is not None  # a static cache: slots after the token
    padded = torch.ones(2, 1025, dtype=torch.bool)
    padded[1, :3] = False
    assert read(mu.causal_mask_function, 1, 1025, 1024, padded) is not None


def test_the_docs_usage_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    namespace: dict = {}
    exec(compile(block.group(1), "docs/integrations.md", "exec"), namespace)
    model = namespace["model"]
    assert model.config._attn_implementation == "multihead"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_register_warns_outside_the_tested_range_and_still_registers(monkeypatch):
    """A ``transformers`` outside the tested range gets a warning naming both versions; the
    backend registers (closures it does not know are read densely)."""
    import importlib

    from transformers import AttentionInterface

    # (the module register() imports: another test may have replaced this file's `transformers`)
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "6.1.0")
    try:
        with pytest.warns(mh_hf.UntestedTransformersWarning, match=r"tested with transformers>=5.23,<6, found 6\.1\.0"):
            assert mh_hf.register("multihead-newer") == "multihead-newer"
        assert "multihead-newer" in AttentionInterface._global_mapping
    finally:
        mh_hf.unregister("multihead-newer")


@pytest.mark.parametrize(
    "gone", ["transformers.AttentionInterface", "transformers.masking_utils.AttentionMaskInterface",
             "transformers.masking_utils.sdpa_mask"],
)  # fmt: skip
def test_register_refuses_a_transformers_without_an_interface(monkeypatch, gone):
    """Without the attention or the mask interface (or the evaluator of unknown closures) there is
    nothing to plug into: ``register`` names what is missing and registers nothing."""
    import importlib

    from transformers import AttentionInterface

    module, name = gone.rsplit(".", 1)
    # (set to None, not deleted: transformers' lazy module imports a deleted name again)
    monkeypatch.setattr(importlib.import_module(module), name, None)
    with pytest.raises(ImportError, match=rf"transformers {transformers.__version__} lacks {gone}, .*tested with"):
        mh_hf.register("multihead-no-interface")
    assert "multihead-no-interface" not in AttentionInterface._global_mapping


# ------------------------------------ a transformers that renamed or changed one of its closures
@pytest.fixture()
def fresh_closures():
    """The table of known closure kinds built again in the test (and after it, from the real factories)."""
    from multihead.integrations import hf_closures

    hf_closures.forget()
    yield hf_closures
    hf_closures.forget()


def _hf_dense(fn, Lq, Lk, q_offset):
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(
        batch_size=2, q_length=Lq, kv_length=Lk, q_offset=q_offset, mask_function=fn, allow_is_causal_skip=False
    ).expand(2, 1, Lq, Lk)


def test_an_unknown_closure_of_masking_utils_is_read_densely_with_one_warning(fresh_closures):
    """A closure built by a factory of ``masking_utils`` that this version does not know (a new or
    renamed factory in a later ``transformers``): the mask ``transformers`` evaluates for it, and
    one warning naming the closure and the version. A model's own closure: the same, silently."""
    import warnings

    from transformers import masking_utils as mu

    namespace = {"__name__": mu.__name__}
    source = (
        "def strided_overlay(stride):\n"
        "    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):\n"
        "        return (q_idx - kv_idx) % stride == 0\n"
        "    return inner_mask\n"
    )
    exec(compile(source, mu.__file__, "exec"), namespace)
    fn = mu.and_masks(mu.causal_mask_function, namespace["strided_overlay"](2))
    for frame in [(9, 9, 0), (3, 9, 6)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = from_mask_function(fn, batch_size=2, q_length=frame[0], kv_length=frame[1], q_offset=frame[2])
        assert torch.equal(got.materialize(2, 1, *frame[:2]).expand(2, 1, *frame[:2]), _hf_dense(fn, *frame))
        assert "tensor" in got.kinds()
        said = [w for w in caught if issubclass(w.category, mh_hf.UntestedTransformersWarning)]
        if frame == (9, 9, 0):
            assert len(said) == 1, [str(w.message) for w in caught]
            message = str(said[0].message)
            assert "transformers.masking_utils.'strided_overlay.<locals>.inner_mask'" in message
            assert f"transformers {transformers.__version__}" in message and "read densely" in message
        else:
            assert said == []  # once per closure per process

    def own(b, h, q, kv):  # a model's own closure: dense is what it is for
        return (q + kv) % 3 != 0

    with warnings.catch_warnings():
        warnings.simplefilter("error", mh_hf.UntestedTransformersWarning)
        got = from_mask_function(mu.and_masks(mu.causal_mask_function, own), batch_size=2, q_length=9, kv_length=9)
    assert torch.equal(
        got.materialize(2, 1, 9, 9).expand(2, 1, 9, 9), _hf_dense(mu.and_masks(mu.causal_mask_function, own), 9, 9, 0)
    )


def test_a_factory_that_changed_its_rule_is_read_densely_never_wrongly(fresh_closures, monkeypatch):
    """A later ``transformers`` keeps ``sliding_window_overlay``'s name and widens its window by one
    key: the closure's code object is the factory's, so only the probe against ``transformers``'
    own evaluation can tell. The kind is left out with one warning; the model's window masks are
    then read densely and equal what ``transformers`` builds; the other kinds stay structure."""
    from transformers import masking_utils as mu

    def sliding_window_overlay(sliding_window):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx >= q_idx - sliding_window  # one key wider than 5.23's `>`

        return inner_mask

    monkeypatch.setattr(mu, "sliding_window_overlay", sliding_window_overlay)
    fn = mu.sliding_window_causal_mask_function(3)  # built by the changed factory
    with pytest.warns(mh_hf.UntestedTransformersWarning, match=r"'window' closures .*sliding_window_overlay.*differs"):
        got = from_mask_function(fn, batch_size=2, q_length=9, kv_length=9)
    assert torch.equal(got.materialize(2, 1, 9, 9).expand(2, 1, 9, 9), _hf_dense(fn, 9, 9, 0))
    assert "tensor" in got.kinds()
    causal_only = from_mask_function(mu.causal_mask_function, batch_size=2, q_length=9, kv_length=9)
    assert causal_only == masks.causal()


def test_inside_a_model_calls_are_checked_only_when_registered_with_check_finite(monkeypatch):
    """A model's attention calls are unchecked, as every call is by default (a model then gives
    what transformers' sdpa gives for NaN inputs); ``register(check_finite=True)`` applies
    `multihead`'s non-finite rules. Either gives the same logits on finite inputs. The former
    ``nonfinite_check=`` warns and means the same; a flag that is not a bool is refused by name
    and registers nothing."""
    from transformers import AttentionInterface

    checked_name = mh_hf.register("multihead-checked", check_finite=True)
    seen: list[bool] = []
    attention = multihead.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["check_finite"])
        return attention(*args, **kwargs)

    monkeypatch.setattr(multihead, "attention", spy)
    model, _ = model_pair("llama")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    try:
        unchecked = out_of(run(model, "multihead", input_ids=ids))
        n = len(seen)
        checked = out_of(run(model, checked_name, input_ids=ids))
    finally:
        mh_hf.unregister(checked_name)
    assert n == model.config.num_hidden_layers and seen[:n] == [False] * n
    assert seen[n:] == [True] * n
    torch.testing.assert_close(unchecked, checked, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match=r"register\(check_finite=...\)"):
        mh_hf.register("multihead-old-name", nonfinite_check=True)
    mh_hf.unregister("multihead-old-name")
    with pytest.raises(TypeError, match=r"register: check_finite must be a bool, got str 'no'"):
        mh_hf.register("multihead-bad-flag", check_finite="no")
    assert "multihead-bad-flag" not in AttentionInterface._global_mapping
