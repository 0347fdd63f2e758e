"""``CausalDecoder.generate`` with each cache, and the compiled static-cache decode step: one
compilation for 64 steps, the same tokens as eager."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from multihead.models import CausalDecoder, DecoderConfig

V = 37


def _model(window=None, num_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    config = DecoderConfig(
        vocab_size=V, max_len=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads, window=window
    )
    return CausalDecoder(config).eval()


def _greedy_without_cache(model, prompt, n):
    """The definition: append the argmax of the full forward's last row, n times."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1] :]


@pytest.mark.parametrize("cache", ["static", "dynamic", "sliding"])
def test_greedy_generation_equals_the_uncached_definition(cache):
    model = _model(window=5 if cache == "sliding" else None)
    prompt = torch.randint(V, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, 20, cache=cache)
    assert out.shape == (2, 20) and out.dtype == torch.long
    assert torch.equal(out, _greedy_without_cache(model, prompt, 20))


def test_prompts_of_different_lengths_continue_after_their_own_last_token():
    model = _model()
    prompt = torch.randint(V, (3, 9), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([9, 4, 6])
    out = model.generate(prompt, 12, prompt_lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(out[b], _greedy_without_cache(model, prompt[b : b + 1, :n], 12)[0]), b


def test_sampling_is_reproducible_and_top_k_restricts_it():
    model = _model()
    prompt = torch.randint(V, (2, 5), generator=torch.Generator().manual_seed(3))
    a = model.generate(prompt, 16, temperature=1.0, generator=torch.Generator().manual_seed(4))
    b = model.generate(prompt, 16, temperature=1.0, generator=torch.Generator().manual_seed(4), cache="dynamic")
    assert torch.equal(a, b)
    top1 = model.generate(prompt, 16, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(5))
    assert torch.equal(top1, model.generate(prompt, 16))  # top_k=1 is greedy


def test_progress_is_printed_when_asked(capsys):
    model = _model()
    model.generate(torch.zeros(1, 2, dtype=torch.long), 70, progress=True)
    err = capsys.readouterr().err
    assert "generate: 64/70 tokens" in err and "generate: 70/70 tokens" in err


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(prompt_ids=torch.zeros(2, 3)),
            TypeError,
            r"prompt_ids must be an integer tensor \(B, P\), got dtype torch.float32",
        ),
        (dict(max_new_tokens=0), ValueError, r"max_new_tokens must be a positive int, got 0"),
        (dict(max_new_tokens=95), ValueError, r"3 prompt \+ 95 new tokens exceed the model's max_len=96"),
        (dict(temperature=-1.0), ValueError, r"temperature must be a number >= 0, got -1.0"),
        (dict(top_k=0), ValueError, r"top_k must be None or a positive int, got 0"),
        (dict(cache="paged"), ValueError, r"cache must be 'static', 'dynamic' or 'sliding', got 'paged'"),
        (dict(cache="sliding"), ValueError, r"kind='sliding' needs a model with a sliding window"),
        (dict(prompt_lengths=torch.tensor([3, 4])), ValueError, r"prompt_lengths must be in \[1, 3\], got \[3, 4\]"),
        (dict(compile=True, cache="dynamic"), ValueError, r"compile=True needs cache='static' .* cache='dynamic'"),
        (dict(compile="yes"), ValueError, r"compile=True needs cache='static' .* got compile='yes'"),
        (
            dict(prompt_lengths=torch.tensor([3, 3]), cache="dynamic"),
            ValueError,
            r"prompt_lengths .* needs cache='static'",
        ),
    ],
)
def test_generate_refuses_bad_arguments(kwargs, error, pattern):
    args = dict(prompt_ids=torch.zeros(2, 3, dtype=torch.long), max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        _model().generate(args.pop("prompt_ids"), args.pop("max_new_tokens"), **args)


def _compiled_decode(model, prompt, steps, backend):
    """Prefill eagerly, then ``steps`` one-token steps through one ``torch.compile``d step function."""
    B = prompt.shape[0]
    cache = model.new_cache("static", batch_size=B, max_len=prompt.shape[1] + steps + 1)
    step = torch.compile(model._step, backend=backend, fullgraph=True, dynamic=False)
    tokens = []
    with torch.no_grad():
        token = model(prompt, cache)[:, -1].argmax(-1)
        for _ in range(steps):
            tokens.append(token)
            token = step(token.view(B, 1), cache).argmax(-1)
    return torch.stack(tokens, dim=1)


def test_compiled_static_decode_never_recompiles():
    """64 steps, one compilation (a compile counter counts every frame dynamo compiles), and the
    same tokens as eager decoding."""
    model = _model()
    prompt = torch.randint(V, (2, 6), generator=torch.Generator().manual_seed(6))
    counter = CompileCounter()
    tokens = _compiled_decode(model, prompt, 64, counter)
    assert counter.frame_count == 1
    assert torch.equal(tokens, model.generate(prompt, 64, cache="static"))


@pytest.mark.slow
def test_inductor_compiled_static_decode_never_recompiles():
    model = _model()
    prompt = torch.randint(V, (2, 6), generator=torch.Generator().manual_seed(6))
    counter = CompileCounterWithBackend("inductor")
    tokens = _compiled_decode(model, prompt, 64, counter)
    assert counter.frame_count == 1
    assert torch.equal(tokens, model.generate(prompt, 64, cache="static"))
    assert torch.equal(model.generate(prompt, 64, compile=True), tokens)


@pytest.mark.parametrize("backend", ["auto", "decode"])
def test_an_inductor_compiled_step_writes_the_static_cache_in_place(backend):
    """A scatter_ into the cache became, under Inductor, a copy of every slot per step written back
    after it (five passes over max_len slots: a compiled step at 8192 slots was 6.7x slower than
    eager). The generated code must allocate nothing of the cache's size, and the step must still
    write each row's token at its own length (rows of different lengths) and match eager."""
    from torch._inductor.utils import run_and_get_code

    from multihead import MultiHeadAttention, StaticKVCache

    torch.manual_seed(0)
    E, H, S = 32, 4, 4099  # S: a size no other buffer of the step has
    layer = MultiHeadAttention(E, H, causal=True, backend=backend).eval()
    caches = [StaticKVCache(2, S, H, E // H) for _ in range(2)]
    x, prompt = torch.randn(2, 1, E), torch.randn(2, 7, E)
    with torch.no_grad():
        for cache in caches:
            layer(prompt, kv_cache=cache)
            cache.crop(torch.tensor([7, 4]))  # rows of different lengths: the general (index_put_) write
        torch._dynamo.reset()
        step = torch.compile(lambda x: layer(x, kv_cache=caches[0]), fullgraph=True, dynamic=False)
        got, codes = run_and_get_code(step, x)
        expected = layer(x, kv_cache=caches[1])
    shape = f"(2, {H}, {S}, {E // H})"
    copies = [line.strip() for code in codes for line in code.splitlines() if "empty_strided" in line and shape in line]
    assert copies == [], copies
    torch.testing.assert_close(got, expected)
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [8, 5]
    torch.testing.assert_close(caches[0].keys, caches[1].keys, rtol=0, atol=0)
    torch.testing.assert_close(caches[0].values, caches[1].values, rtol=0, atol=0)


def test_compiled_generate_serves_more_shapes_than_dynamos_recompile_limit(monkeypatch):
    """One compiled step per cache shape, each from its own copy of the step's code: a shared one
    failed outright (fullgraph=True) at the ninth shape a process decoded. The static cache's
    slots come in powers of two, so prompts of 1 to 13 tokens (+ 3 new) make 3 shapes, and nine
    batch sizes nine more; every run gives the eager tokens. (Dynamo's own "eager" backend: the
    limit is Dynamo's, and twelve Inductor compilations would take a minute.)"""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    model = _model()
    g = torch.Generator().manual_seed(9)
    runs = [(1, P) for P in range(1, 14, 3)] + [(B, 2) for B in range(1, 10)]
    for B, P in runs:
        prompt = torch.randint(V, (B, P), generator=g)
        assert torch.equal(model.generate(prompt, 3, compile=True), model.generate(prompt, 3)), (B, P)
    from multihead.models.decoder import _COMPILED_STEPS

    assert sorted(key[0][0:3:2] for key in _COMPILED_STEPS[model]) == sorted(
        [(1, 4), (1, 8), (1, 16)] + [(B, 8) for B in range(2, 10)]
    )
