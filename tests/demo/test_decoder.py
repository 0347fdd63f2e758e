"""The recall task's data, and the small decoder's KV cache against its uncached forward."""

from __future__ import annotations

import pytest
import torch

from multihead import capture_attention
from multihead.apps.demo import _decode_with_cache
from multihead.caches import DynamicKVCache, QuantizedKVCache
from multihead.models import CausalDecoder, DecoderConfig, RecallTask
from multihead.models.decoder import DecoderCache
from multihead.models.recall import IGNORE_INDEX


def test_recall_sequences_are_well_formed():
    task = RecallTask(num_pairs=6, num_queries=4, num_keys=10, num_values=7)
    seq = task.sample(200, torch.Generator().manual_seed(0))
    assert seq.shape == (200, task.seq_len) and task.seq_len == 20
    keys, values = seq[:, 0:12:2], seq[:, 1:12:2]
    assert bool((keys < 10).all()) and bool(((values >= 10) & (values < 17)).all())
    assert all(len(set(row.tolist())) == 6 for row in keys)  # distinct keys within a sequence
    asked, answers = seq[:, 12::2], seq[:, 13::2]
    for b in range(200):
        pairs = dict(zip(keys[b].tolist(), values[b].tolist()))
        assert len(set(asked[b].tolist())) == 4
        assert [pairs[k] for k in asked[b].tolist()] == answers[b].tolist()
    src = task.source_positions(seq)  # where the matching pair's value sits
    assert bool((seq.gather(1, src) == answers).all())


def test_only_answers_are_scored():
    task = RecallTask(num_pairs=3, num_queries=2, num_keys=5, num_values=5)
    seq = task.sample(4, torch.Generator().manual_seed(1))
    inputs, targets = task.inputs_and_targets(seq)
    assert inputs.shape == targets.shape == (4, task.seq_len - 1)
    scored = (targets != IGNORE_INDEX).nonzero()[:, 1].unique().tolist()
    assert scored == task.answer_positions().tolist() == [6, 8]
    assert bool((targets[:, scored] == seq[:, [7, 9]]).all())


@pytest.mark.parametrize(
    "sizes, regex",
    [
        (dict(num_pairs=0), "num_pairs must be a positive int"),
        (dict(num_pairs=9, num_keys=8), "num_pairs=9 distinct keys need num_keys >= num_pairs"),
        (dict(num_pairs=2, num_queries=3), "num_queries=3 must be <= num_pairs=2"),
    ],
)
def test_recall_task_rejects_bad_sizes(sizes, regex):
    with pytest.raises(ValueError, match=regex):
        RecallTask(**sizes)


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_kv_cache_decoding_equals_full_forward(kv_heads):
    torch.manual_seed(0)
    model = CausalDecoder(
        DecoderConfig(vocab_size=23, max_len=24, d_model=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads)
    ).eval()
    ids = torch.randint(23, (3, 17))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :5], cache)]  # prefill 5, then one token at a time, then a chunk of 3
        parts += [model(ids[:, t : t + 1], cache) for t in range(5, 14)]
        parts.append(model(ids[:, 14:], cache))
    assert cache.length == 17
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_the_model_cache_holds_one_layer_cache_per_block_and_resets():
    torch.manual_seed(0)
    model = CausalDecoder(
        DecoderConfig(vocab_size=13, max_len=12, d_model=16, num_layers=3, num_heads=4, num_kv_heads=2)
    ).eval()
    ids = torch.randint(13, (2, 7))
    cache = model.new_cache()
    assert isinstance(cache, DecoderCache) and len(cache) == 3
    assert all(isinstance(layer, DynamicKVCache) for layer in cache.layers)
    with torch.no_grad():
        first = torch.cat([model(ids[:, :4], cache), model(ids[:, 4:], cache)], dim=1)
        assert [layer.length for layer in cache.layers] == [7, 7, 7]
        assert tuple(cache[2].keys.shape) == (2, 2, 7, 4)  # (B, Hkv, T, D)
        cache.reset()
        assert cache.length == 0
        again = torch.cat([model(ids[:, :1], cache), model(ids[:, 1:], cache)], dim=1)
        full = model(ids)
    torch.testing.assert_close(first, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)
    assert repr(cache) == "DecoderCache(layers=3 x DynamicKVCache, length=7)"


@pytest.mark.parametrize(
    "cache, error, regex",
    [
        (
            lambda: DecoderCache([DynamicKVCache()]),
            ValueError,
            r"cache: expected a DecoderCache of 2 layers \(model.new_cache\(\)\), got 1 layers",
        ),
        (
            lambda: DynamicKVCache(),
            TypeError,
            r"cache: expected None or a DecoderCache \(model.new_cache\(\)\), got DynamicKVCache",
        ),
    ],
)
def test_decoder_refuses_a_cache_that_does_not_fit(cache, error, regex):
    model = CausalDecoder(DecoderConfig(vocab_size=5, max_len=8, d_model=8, num_layers=2, num_heads=2))
    with pytest.raises(error, match=regex):
        model(torch.zeros(1, 3, dtype=torch.long), cache())
    with pytest.raises(
        TypeError, match=r"DecoderCache: layers must be a non-empty sequence of multihead.caches.KVCache"
    ):
        DecoderCache([None])


def test_cached_steps_are_captured_one_row_at_a_time():
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(vocab_size=11, max_len=8, d_model=16, num_layers=2, num_heads=2)).eval()
    ids = torch.randint(11, (1, 6))
    cache = model.new_cache()
    with torch.no_grad():
        model(ids[:, :4], cache)
        with capture_attention(model) as cap:
            model(ids[:, 4:5], cache)
    assert cap.names == ["blocks.0.attn", "blocks.1.attn"]
    assert [tuple(w.shape) for w in cap.weights] == [(1, 2, 1, 5)] * 2


def test_demo_decoder_stitches_cached_weights_into_the_full_matrix():
    task = RecallTask(num_pairs=3, num_queries=3, num_keys=6, num_values=6)
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(task.vocab_size, task.seq_len, d_model=32, num_layers=2, num_heads=4)).eval()
    seq = task.sample(1, torch.Generator().manual_seed(0))[0]
    decoded, weights, diff = _decode_with_cache(model, task, seq)
    assert diff < 1e-4
    assert decoded.shape == seq.shape
    assert torch.equal(decoded[: task.prompt_len], seq[: task.prompt_len])  # the pairs are given
    assert torch.equal(decoded[task.prompt_len :: 2], seq[task.prompt_len :: 2])  # so are the asked keys
    with torch.no_grad(), capture_attention(model) as cap:
        model(decoded.unsqueeze(0))
    torch.testing.assert_close(weights, torch.stack([w[0] for w in cap.weights]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_model_cache_is_exact_within_its_window_and_close_beyond(kind):
    """``new_cache("int8" | "fp8")``: a QuantizedKVCache per layer. Tokens in the sinks and the
    residual window are kept in full precision, so a short sequence decodes exactly; a long one
    stays within the 8-bit format's error of the full forward."""
    torch.manual_seed(0)
    model = CausalDecoder(DecoderConfig(vocab_size=29, max_len=200, d_model=32, num_layers=2, num_heads=4)).eval()
    ids = torch.randint(29, (2, 170))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(kind, batch_size=2)
        assert all(isinstance(layer, QuantizedKVCache) and layer.format == kind for layer in cache.layers)
        parts = [model(ids[:, :40], cache)] + [model(ids[:, t : t + 1], cache) for t in range(40, 170)]
    got = torch.cat(parts, dim=1)
    torch.testing.assert_close(got[:, :90], full[:, :90], rtol=1e-5, atol=1e-5)  # nothing quantized yet
    assert cache.layers[0]._quantized > 0  # the later steps read 8-bit slots
    error = (got - full).abs().max() / full.abs().max()
    assert error < (0.02 if kind == "int8" else 0.1), error
    assert (got.argmax(-1) == full.argmax(-1)).float().mean() > 0.95


def test_new_cache_refuses_an_unknown_kind():
    model = CausalDecoder(DecoderConfig(vocab_size=5, max_len=8, d_model=8, num_layers=1, num_heads=2))
    with pytest.raises(
        ValueError, match=r"new_cache: kind must be 'dynamic', 'static', 'sliding', 'int8' or 'fp8', got 'int4'"
    ):
        model.new_cache("int4")
