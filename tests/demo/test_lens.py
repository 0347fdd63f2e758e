"""The logit lens (``multihead.viz.logit_lens``) and the viewer source's new fields: attention kinds,
sentence pairs, the lens (issue 32, item 2). The page that shows them is tested in Chromium in
``test_browser_controls.py``.

The lens is checked against the model itself, in fp64: the last block's readout is the model's own
next-token distribution (``softmax(model(ids))``), and every earlier block's is the final norm and
the unembedding applied by hand to the stream after that block (computed here by running the
blocks one by one, or from Hugging Face's ``output_hidden_states``).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import optional
from multihead.models import CausalDecoder, DecoderConfig
from multihead.viz import LogitLens, ViewerSource, logit_lens, record_attention, render_viewer

NAMES = lambda ids: [f"w{i}" for i in ids]  # noqa: E731


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return CausalDecoder(DecoderConfig(31, 40, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2)).eval().double()


def _by_hand(model: CausalDecoder, ids: torch.Tensor) -> torch.Tensor:
    """``(layers, L, V)`` probabilities: the stream after each block through norm and head."""
    x = model.tok_emb(ids) + model.pos_emb(torch.arange(ids.shape[1]))
    out = []
    for block in model.blocks:
        x = block(x)
        out.append(torch.softmax(model.head(model.norm(x))[0], dim=-1))
    return torch.stack(out)


def test_the_lens_of_a_causal_decoder_is_its_norm_and_head_after_each_block(decoder):
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])  # odd length on purpose
    lens = logit_lens(decoder, ids, token_names=NAMES, top_k=4)
    assert lens.layers == ["blocks.0", "blocks.1", "blocks.2"]
    assert lens.tokens == NAMES(ids[0].tolist())
    assert lens.top_ids.shape == lens.top_probs.shape == (3, 11, 4)
    expected = _by_hand(decoder, ids).topk(4, dim=-1)
    torch.testing.assert_close(lens.top_probs.double(), expected.values, rtol=0, atol=1e-6)  # fp32 probabilities
    assert torch.equal(lens.top_ids, expected.indices)
    # The last block's readout is the model's own prediction.
    own = torch.softmax(decoder(ids)[0], dim=-1).topk(4, dim=-1)
    assert torch.equal(lens.top_ids[-1], own.indices)
    torch.testing.assert_close(lens.top_probs[-1].double(), own.values, rtol=0, atol=1e-6)
    assert lens.top_names[1][7] == NAMES(lens.top_ids[1, 7].tolist())
    assert (lens.top_probs[..., :-1] >= lens.top_probs[..., 1:]).all()  # most likely first


def test_the_lens_of_one_sequence_of_a_batch(decoder):
    ids = torch.randint(0, 31, (3, 9), generator=torch.Generator().manual_seed(2))
    one = logit_lens(decoder, ids[1:2], token_names=NAMES)
    picked = logit_lens(decoder, ids, token_names=NAMES, batch=1)
    assert torch.equal(one.top_ids, picked.top_ids) and picked.tokens == NAMES(ids[1].tolist())
    torch.testing.assert_close(one.top_probs, picked.top_probs)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: logit_lens(m, torch.zeros(1, 4), token_names=NAMES), r"ids must be \(B, L\) integer"),
        (lambda m: logit_lens(m, torch.zeros(4, dtype=torch.long), token_names=NAMES), r"ids must be \(B, L\)"),
        (lambda m: logit_lens(m, torch.zeros(2, 4, dtype=torch.long), token_names=NAMES), r"B=2 .*batch=i"),
        (lambda m: logit_lens(m, torch.zeros(2, 4, dtype=torch.long), token_names=NAMES, batch=2), r"batch must be"),
        (lambda m: logit_lens(m, torch.zeros(1, 4, dtype=torch.long), token_names=NAMES, top_k=0), r"top_k must be"),
        (
            lambda m: logit_lens(torch.nn.Linear(2, 2), torch.zeros(1, 4, dtype=torch.long), token_names=NAMES),
            r"pass blocks=",
        ),
        (
            lambda m: logit_lens(m, torch.zeros(1, 4, dtype=torch.long), token_names=lambda ids: ["x"]),
            r"gave 1 names for 4",
        ),
    ],
    ids=["float-ids", "1d-ids", "batch-missing", "batch-out-of-range", "top-k-0", "unknown-model", "short-names"],
)
def test_bad_input_to_the_lens_is_refused_with_the_fix(decoder, call, match):
    with pytest.raises(ValueError, match=match):
        call(decoder)


def test_hugging_face_llama_lens_is_its_norm_and_lm_head(decoder):
    transformers = optional("transformers", "the lens of an HF model needs transformers (extra 'hf')", "5.23")
    from multihead.integrations import hf as mh_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(  # the tiny random Llama of tests/integrations/test_hf_hooks.py
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=mh_hf.register()).eval().double()
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(4))
    lens = logit_lens(model, ids, token_names=NAMES, top_k=3)
    assert lens.layers == ["model.layers.0", "model.layers.1"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    own = torch.softmax(out.logits[0], dim=-1).topk(3, dim=-1)  # the model's own prediction
    assert torch.equal(lens.top_ids[-1], own.indices)
    torch.testing.assert_close(lens.top_probs[-1].double(), own.values, rtol=0, atol=1e-6)
    # hidden_states[1] is the stream after layer 0 (the last entry is already normed: not used)
    first = torch.softmax(model.lm_head(model.model.norm(out.hidden_states[1]))[0], dim=-1).topk(3, dim=-1)
    assert torch.equal(lens.top_ids[0], first.indices)
    torch.testing.assert_close(lens.top_probs[0].double(), first.values, rtol=0, atol=1e-6)
    assert json.dumps(lens.to_json())  # what the page embeds


# ------------------------------------------------------------------- the source's new fields
T = ["a", "b", "c", "d", "e"]


def _w(lq: int, lk: int) -> torch.Tensor:
    return torch.softmax(torch.randn(2, 2, lq, lk, generator=torch.Generator().manual_seed(lq * lk)), -1)


def test_kinds_segments_and_the_lens_reach_the_page(decoder):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    lens = logit_lens(decoder, ids, token_names=NAMES)
    sources = [
        ViewerSource("s2s", T, T, _w(5, 5), kind="encoder", segments=[0, 0, 0, 1, 1]),
        ViewerSource(
            "s2s", T[:3], T, _w(3, 5), kind="cross", segments=torch.tensor([0, 0, 1]), k_segments=[0, 1, 1, 1, 1]
        ),
        ViewerSource("dec", NAMES([1, 2, 3, 4, 5]), NAMES([1, 2, 3, 4, 5]), _w(5, 5), logit_lens=lens),
    ]
    page = render_viewer(sources)
    data = json.loads(page.split('type="application/json">', 1)[1].split("</script>", 1)[0].replace("<\\/", "</"))
    enc, cross, dec = data["sources"]
    assert enc["kind"] == "encoder" and enc["segments"] == enc["k_segments"] == [0, 0, 0, 1, 1]
    assert cross["segments"] == [0, 0, 1] and cross["k_segments"] == [0, 1, 1, 1, 1]
    assert dec["lens"]["names"][2][4] == lens.top_names[2][4] and dec["lens"]["k"] == 5
    assert "kind" not in dec and "segments" not in dec


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ViewerSource("m", T, T, _w(5, 5), kind="seq2seq"), ValueError, r"kind must be None or one of"),
        (lambda: ViewerSource("m", T, T, _w(5, 5), segments=[0, 1]), ValueError, r"5 values of 0 .* got 2"),
        (lambda: ViewerSource("m", T, T, _w(5, 5), segments=[0, 1, 2, 1, 1]), ValueError, r"0 \(sentence A\) or 1"),
        (lambda: ViewerSource("m", T[:3], T, _w(3, 5), segments=[0, 0, 1]), ValueError, r"k_segments="),
        (lambda: ViewerSource("m", T, T, _w(5, 5), k_segments=[0, 0, 1, 1, 1]), ValueError, r"needs segments="),
        (lambda: ViewerSource("m", T, T, _w(5, 5), logit_lens={"names": []}), TypeError, r"multihead.viz.LogitLens"),
        (
            lambda: ViewerSource(
                "m",
                T,
                T,
                _w(5, 5),
                logit_lens=LogitLens(["b"], ["x"], torch.zeros(1, 1, 1), torch.ones(1, 1, 1), [[["y"]]]),
            ),
            ValueError,
            r"1 positions for 5 query tokens",
        ),
    ],
    ids=[
        "kind",
        "segments-length",
        "segments-values",
        "cross-needs-k-segments",
        "k-segments-alone",
        "lens-type",
        "lens-length",
    ],
)
def test_bad_new_fields_are_refused_with_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        render_viewer(make())


def test_one_model_name_takes_each_kind_once():
    enc = ViewerSource("s2s", T, T, _w(5, 5), kind="encoder")
    with pytest.raises(ValueError, match=r"each needs its own kind .* got 2 of kind 'encoder'"):
        render_viewer([enc, ViewerSource("s2s", T, T, _w(5, 5), kind="encoder")])
    with pytest.raises(ValueError, match=r"and one without a kind"):
        render_viewer([enc, ViewerSource("s2s", T, T, _w(5, 5))])
    render_viewer([enc, ViewerSource("other", T, T, _w(5, 5))])  # another name: another model


def test_record_attention_takes_the_sentences_of_a_pair_from_token_type_ids(encoder):
    ids_a, _, tokens_a = encoder.tokenize(["The cat sat."])
    ids_b, _, tokens_b = encoder.tokenize(["It was tired."])
    ids = torch.cat([ids_a, ids_b[:, 1:]], dim=1)  # [CLS] A [SEP] B [SEP]
    types = torch.cat([torch.zeros_like(ids_a), torch.ones_like(ids_b[:, 1:])], dim=1)
    tokens = tokens_a[0] + tokens_b[0][1:]
    source = record_attention(encoder.model, ids, token_type_ids=types, tokens=tokens, name="pair")
    assert source.segments == types[0].tolist() and 1 in source.segments
    single = record_attention(encoder.model, ids_a, tokens=tokens_a[0], name="one")
    assert single.segments is None  # no sentence B: no filter
