"""``multihead.viz.record_seq2seq``: a seq2seq model's encoder, decoder and cross attentions as one
model of the viewer (issue 32, item 2), on a tiny random BART running the `multihead` backend. The
recorded weights are checked against the model's own ``output_attentions`` in float64 on the
``eager`` implementation (an independent path: HF's softmax, not ours)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import optional

transformers = optional("transformers", "a seq2seq model of transformers (extra 'hf')", minversion="5.23")

from multihead.integrations import hf as mh_hf  # noqa: E402
from multihead.viz import render_viewer  # noqa: E402
from multihead.viz.seq2seq import attention_kind, record_seq2seq  # noqa: E402


@pytest.fixture(scope="module")
def bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).eval().double()
    model.set_attn_implementation(mh_hf.register())
    return model


SRC = torch.tensor([[0, 17, 23, 5, 41, 9, 2]])  # 7 source tokens
TGT = torch.tensor([[2, 0, 33, 12, 50]])  # 5 target tokens: Lq != Lk in the cross-attention
names = lambda ids: [f"w{i}" for i in ids[0].tolist()]  # noqa: E731


def test_three_kinds_recorded_and_equal_to_the_models_own_attentions(bart):
    sources = record_seq2seq(
        bart, input_ids=SRC, decoder_input_ids=TGT, src_tokens=names(SRC), tgt_tokens=names(TGT), name="bart"
    )
    assert [s.kind for s in sources] == ["encoder", "decoder", "cross"] and {s.name for s in sources} == {"bart"}
    enc, dec, cross = sources
    assert enc.layer_names == ["model.encoder.layers.0.self_attn", "model.encoder.layers.1.self_attn"]
    assert dec.layer_names == [f"model.decoder.layers.{i}.self_attn" for i in range(3)]
    assert cross.layer_names == [f"model.decoder.layers.{i}.encoder_attn" for i in range(3)]
    assert (cross.q_tokens, cross.k_tokens) == (names(TGT), names(SRC))
    eager = copy.deepcopy(bart)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=SRC, decoder_input_ids=TGT, output_attentions=True)
    for source, theirs in ((enc, out.encoder_attentions), (dec, out.decoder_attentions), (cross, out.cross_attentions)):
        assert len(source.weights) == len(theirs)
        for ours, hf in zip(source.weights, theirs):
            torch.testing.assert_close(ours.double(), hf[0], rtol=0, atol=1e-12)
    assert cross.queries[0].shape == (4, 5, 8) and cross.keys[0].shape == (4, 7, 8)  # (H, L, D) for the neuron view
    assert cross.scale == pytest.approx(8**-0.5)
    assert render_viewer(sources).count('"kind":"cross"') == 1


def test_the_kind_of_a_module_path():
    assert attention_kind("model.encoder.layers.0.self_attn") == "encoder"
    assert attention_kind("model.decoder.layers.1.self_attn") == "decoder"
    assert attention_kind("model.decoder.layers.1.encoder_attn") == "cross"  # BART, Marian, Whisper
    assert attention_kind("decoder.block.0.layer.1.EncDecAttention") == "cross"  # T5
    assert attention_kind("decoder.block.0.layer.0.SelfAttention") == "decoder"
    # HF's EncoderDecoderModel with a BERT decoder: "encoder" below "decoder" is the decoder's own stack
    assert attention_kind("decoder.bert.encoder.layer.0.crossattention.self") == "cross"
    assert attention_kind("decoder.bert.encoder.layer.0.attention.self") == "decoder"
    assert attention_kind("encoder.encoder.layer.0.attention.self") == "encoder"
    assert attention_kind("text_decoder.layers.0.cross_attn") == "cross"
    assert attention_kind("layers.0.attn") is None


def test_tokens_that_do_not_fit_the_weights_and_unknown_paths_are_refused(bart):
    with pytest.raises(ValueError, match=r"looks like encoder attention, \(Lq, Lk\) = \(6, 6\) .* are \(7, 7\)"):
        record_seq2seq(bart, input_ids=SRC, decoder_input_ids=TGT, src_tokens=names(SRC)[:6], tgt_tokens=names(TGT))
    with pytest.raises(ValueError, match=r"cannot tell which attention .* pass kind_of="):
        record_seq2seq(
            bart, input_ids=SRC, decoder_input_ids=TGT, src_tokens=names(SRC), tgt_tokens=names(TGT),
            kind_of=lambda path: None,
        )  # fmt: skip
