"""The pretrained encoder on `multihead` layers: exact against sentence-transformers, attention
weights per layer, and every way a model folder can be wrong."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from helpers import optional
from multihead import capture_attention
from multihead.models import ModelFolderError, SentenceEncoder, load_bert

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread, slowly, at the kitchen table in the morning.",
    "Hi",
    "Ünïcödé text, numbers 12345 and punctuation?!",
]


@pytest.fixture(scope="module")
def reference(minilm_folder):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test-only dependency, and it must not reach a hub
    st = optional("sentence_transformers", "sentence-transformers is the test-only reference")
    return st.SentenceTransformer(str(minilm_folder), device="cpu")


def test_embeddings_equal_sentence_transformers(encoder, reference):
    ours = encoder.encode(SENTENCES)  # one padded batch: rows of different lengths
    theirs = reference.encode(SENTENCES, convert_to_tensor=True).cpu()
    assert ours.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(ours, theirs)  # fp32 defaults: rtol 1.3e-6, atol 1e-5
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)))


def test_long_text_truncated_like_sentence_transformers(encoder, reference):
    long = " ".join(["attention"] * 40 + [f"word{i}" for i in range(300)])
    with pytest.raises(ValueError, match=r"text 0 has \d+ tokens but the model reads at most 256"):
        encoder.encode([long])
    ours = encoder.encode([long, "short"], truncate=True)
    theirs = reference.encode([long, "short"], convert_to_tensor=True).cpu()
    torch.testing.assert_close(ours, theirs)


def test_batching_does_not_change_embeddings(encoder):
    one_by_one = torch.cat([encoder.encode([s]) for s in SENTENCES])
    torch.testing.assert_close(encoder.encode(SENTENCES, batch_size=3), one_by_one, rtol=1e-5, atol=1e-6)


def test_attention_maps_every_layer(encoder):
    maps = encoder.attention("The cat sat on the mat.")
    assert maps.tokens[0] == "[CLS]" and maps.tokens[-1] == "[SEP]" and "cat" in maps.tokens
    assert maps.names == [f"layers.{i}.attention" for i in range(6)]
    L = len(maps.tokens)
    for w in maps.weights:
        assert w.shape == (1, 12, L, L)
        assert bool((w >= 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 12, L))
    assert maps.stacked().shape == (6, 12, L, L)


def test_capture_attention_records_each_layer_with_padding(encoder):
    ids, mask, _ = encoder.tokenize(["a short one", "a much longer sentence than the first one"])
    with capture_attention(encoder.model) as cap:
        encoder.model(ids, mask)
    assert cap.names == [f"layers.{i}.attention" for i in range(6)]
    B, L = ids.shape
    n_real = int(mask[0].sum())
    for w in cap.as_bertviz():
        assert w.shape == (B, 12, L, L)
        torch.testing.assert_close(w.sum(-1), torch.ones(B, 12, L))
        assert float(w[0, :, :, n_real:].abs().max()) == 0.0  # padded keys get exactly no weight


def test_encode_rejects_bad_arguments(encoder):
    with pytest.raises(TypeError, match="list of str.*wrap a single text"):
        encoder.encode("not a list")
    with pytest.raises(ValueError, match="texts is empty"):
        encoder.encode([])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        encoder.encode(["x"], batch_size=0)


_DROP = object()


def _edit_config(folder, **changes):
    """Rewrite ``config.json`` with ``changes``; a value of ``_DROP`` removes the field."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not _DROP}))


# Each broken folder, and what the error must say.
BROKEN = [
    ("missing config", lambda f: (f / "config.json").unlink(), r"config\.json is missing"),
    ("config not json", lambda f: (f / "config.json").write_text("{nope"), r"config\.json is not valid JSON"),
    ("config missing a field", lambda f: _edit_config(f, hidden_size=_DROP), r"no 'hidden_size'"),
    (
        "hidden size mismatch",
        lambda f: _edit_config(f, hidden_size=768, num_attention_heads=12),
        r"tensor 'embeddings\.LayerNorm\.bias' has shape \(384,\) but config\.json implies \(768,\).*does not match",
    ),
    (
        "more layers than weights",
        lambda f: _edit_config(f, num_hidden_layers=12),
        r"lacks \d+ tensors.*num_hidden_layers=12",
    ),
    (
        "fewer layers than weights",
        lambda f: _edit_config(f, num_hidden_layers=3),
        r"holds 'encoder\.layer\.3\..*does not have",
    ),
    (
        "heads do not divide",
        lambda f: _edit_config(f, num_attention_heads=7),
        r"not divisible by num_attention_heads 7",
    ),
    ("not a bert", lambda f: _edit_config(f, model_type="gpt2"), r"model_type is 'gpt2'"),
    (
        "corrupt weights",
        lambda f: ((f / "model.safetensors").unlink(), (f / "model.safetensors").write_bytes(b"\x00" * 64)),
        r"model\.safetensors is corrupt or unreadable",
    ),
    ("missing weights", lambda f: (f / "model.safetensors").unlink(), r"model\.safetensors is missing"),
    ("missing tokenizer", lambda f: (f / "tokenizer.json").unlink(), r"tokenizer\.json is missing"),
    (
        "corrupt tokenizer",
        lambda f: (f / "tokenizer.json").write_text('{"version": "1.0"'),
        r"tokenizer\.json is corrupt",
    ),
]


@pytest.mark.parametrize("breakage, regex", [(b[1], b[2]) for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_model_folder(model_copy, breakage, regex):
    breakage(model_copy)
    with pytest.raises(ModelFolderError, match=regex) as info:
        SentenceEncoder.from_pretrained(model_copy)
    assert "\n" not in str(info.value)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match=re.escape(f"model folder {tmp_path / 'nope'} does not exist")):
        load_bert(tmp_path / "nope")
