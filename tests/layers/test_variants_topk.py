"""``TopKIndexerAttention`` (DeepSeek-V3.2's DSA: a lightning indexer and top-k keys) against its
equations.

* the layer equals DSA written plainly in fp64 (``variants_math.published_topk``: the indexer
  score of every earlier token, the ``top_k`` best with ties to the lower position, every head's
  softmax over them) with the same weights: outputs, ``need_weights`` (zero outside the chosen
  keys) and the gradient of every attention parameter and of the input; MHA, GQA, MQA; odd
  lengths, ``top_k`` above the keys there are; with RoPE;
* the indexer is trained by its KL loss alone: the loss equals the KL written out, its gradient
  reaches the indexer's three maps and nothing else, and the main loss gives the indexer none;
* fp32 and bf16 by the relative rule; prefill + decode steps with a ``DynamicKVCache`` == the full
  forward; the selection runs on ``blocksparse``'s gathered path; bad arguments in one table.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative
from multihead.positions import RotaryEmbedding
from variants_cases import assert_decode_steps
from variants_math import published_topk_of

E = 48


def _layer(Hq=4, Hkv=2, top_k=5, HI=3, dI=8, seed=0, rope=False):
    torch.manual_seed(seed)
    return mh.TopKIndexerAttention(
        E,
        Hq,
        num_kv_heads=Hkv,
        top_k=top_k,
        index_heads=HI,
        index_dim=dI,
        rope=RotaryEmbedding(E // Hq) if rope else None,
    ).double()


def _x(B, L, seed=1):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("L,top_k", [(19, 5), (7, 9), (1, 3)], ids=lambda c: str(c))
@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
def test_equals_the_equations_forward_weights_and_gradients(heads, L, top_k, rope):
    (Hq, Hkv), B = heads, 2
    layer = _layer(Hq, Hkv, top_k, rope=rope)
    x = _x(B, L).requires_grad_()
    y, w = layer(x, need_weights=True)
    xr = x.detach().clone().requires_grad_()
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    want, want_w, chosen = published_topk_of(layer, params, xr, rope)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(w, want_w)
    assert all(len(c) == min(top_k, t + 1) for cb in chosen for t, c in enumerate(cb))
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    names = [n for n, _ in layer.named_parameters()]
    got = torch.autograd.grad((y * g).sum(), [x, *layer.parameters()], allow_unused=True)
    ref = torch.autograd.grad((want * g).sum(), [xr, *params.values()], allow_unused=True)
    for name, a, b in zip(["x", *names], got, ref):
        if name.startswith("index_"):  # the selection is not differentiated: no gradient from the main loss
            assert a is None and b is None, name
            continue
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


def _masks(B, L):
    """Masks a batch brings, with the keys each query may see ``(B, L, L)``: right padding, documents,
    and a bool tensor with a row that sees nothing."""
    lengths = torch.tensor([L, L - 6])
    padding = torch.arange(L)[None, None, :] < lengths[:, None, None]
    ids = torch.tensor([0] * 5 + [1] * (L - 5))
    documents = (ids[:, None] == ids[None, :]).expand(B, L, L)
    table = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(3)) < 0.6
    table[1, 0, 9] = False  # a query that sees no key
    return [
        ("padding", mh.key_padding(lengths), padding.expand(B, L, L)),
        ("documents", mh.document(ids), documents),
        ("bool", table, table[:, 0]),
    ]


@pytest.mark.parametrize("case", range(3), ids=["padding", "documents", "bool"])
def test_a_mask_is_joined_before_the_choice(case):
    """``mask=`` (the same for every head): the indexer chooses among the keys it allows, so each
    query reads its ``top_k`` best visible keys; a query that sees none gives 0. Against the
    equations with the candidates restricted, outputs, weights and gradients; GQA."""
    B, L = 2, 17
    layer = _layer(4, 2, top_k=4)
    _, mask, visible = _masks(B, L)[case]
    x = _x(B, L).requires_grad_()
    y, w = layer(x, mask=mask, need_weights=True)
    xr = x.detach().clone().requires_grad_()
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    want, want_w, chosen = published_topk_of(layer, params, xr, False, visible=visible)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(w, want_w)
    assert torch.equal(layer(x, mask=mask), y)  # the plain path (keys read a chunk at a time) too
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((y * g).sum(), [x, layer.q_proj.weight, layer.v_proj.weight])
    ref = torch.autograd.grad((want * g).sum(), [xr, params["q_proj.weight"], params["v_proj.weight"]])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_the_indexer_loss_is_the_kl_to_the_main_attention_and_trains_the_indexer_only():
    layer = _layer(4, 2, 5, rope=True)
    x = _x(2, 13)
    loss = layer.indexer_loss(x)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    _, weights, chosen = published_topk_of(layer, params, x, True)
    qi = (x @ params["index_q.weight"].T).unflatten(-1, (3, 8))
    ki = x @ params["index_k.weight"].T
    wi = x @ params["index_w.weight"].T
    total = 0.0
    for b in range(2):
        for t in range(13):
            keys = chosen[b][t]
            target = weights[b, :, t, keys].sum(0)
            target = target / target.sum()
            scores = torch.stack(
                [sum(wi[b, t, j] * torch.relu(qi[b, t, j] @ ki[b, s]) for j in range(3)) for s in keys]
            )
            total += float((target * (target.log() - torch.log_softmax(scores, 0))).sum())
    assert math.isclose(float(loss), total / 26, rel_tol=1e-9)
    loss.backward()
    for name, p in layer.named_parameters():
        trained = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert trained == name.startswith("index_"), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_by_the_relative_rule(dtype):
    layer = _layer(4, 2, 5, rope=True)
    x = _x(2, 17)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    ref = published_topk_of(layer, params, x, True)[0]
    low = _layer(4, 2, 5, rope=True).to(dtype)
    low.load_state_dict(layer.state_dict())
    got = low(x.to(dtype))
    base = published_topk_of(layer, {n: p.detach() for n, p in low.named_parameters()}, x.to(dtype), True)[0]
    assert_relative(got, ref, base, factor=10 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("prefill,step", [(1, 1), (8, 1), (6, 4)])
def test_prefill_and_decode_steps_equal_the_full_forward(prefill, step):
    layer = _layer(4, 2, 5, rope=True)
    assert_decode_steps(layer, _x(2, 22), prefill, step)


def test_a_reordered_cache_or_new_index_weights_are_refused_with_the_cache_unchanged():
    """The indexer keys of cached tokens come from the layer's input, which the cache does not
    hold: after ``reorder`` (rows moved, batch the same size) or a change of ``index_k`` they
    cannot be computed again, and reusing them selected by another row's keys (silently wrong).
    The step is refused, naming the cause, and the cache keeps its tokens."""
    layer = _layer(4, 2, 3)
    x = _x(2, 14)
    with torch.no_grad():
        cache = mh.DynamicKVCache()
        layer(x[:, :12], kv_cache=cache)
        cache.reorder(torch.tensor([1, 0]))
        keys = cache.keys.clone()
        with pytest.raises(RuntimeError, match=r"cache was reordered or reset .*\(revision 0 then, 1 now\)"):
            layer(x[[1, 0], 12:13], kv_cache=cache)
        assert cache.length == 12 and torch.equal(cache.keys, keys)
        cache = mh.DynamicKVCache()
        layer(x[:, :12], kv_cache=cache)
        layer.index_k.weight.mul_(2)
        with pytest.raises(RuntimeError, match="has new index_k weights"):
            layer(x[:, 12:13], kv_cache=cache)
        assert cache.length == 12
        cache.reset()  # a new sequence after a reset needs no earlier keys
        torch.testing.assert_close(layer(x[:, :13], kv_cache=cache), layer(x[:, :13]))


def test_the_selection_runs_gathered():
    layer = _layer(4, 2, 16)
    x = torch.randn(1, 300, E, dtype=torch.float64)
    core, _ = layer._heads(x)
    q = torch.randn(1, 4, 300, layer.head_dim, dtype=torch.float64)
    k = torch.randn(1, 2, 300, layer.head_dim, dtype=torch.float64)
    text = str(mh.explain(q, k, k, mask=core.mask(300, 300)))
    assert "blocksparse" in text and "key blocks" in text
    assert "selection density" in str(layer.explain(x))  # the layer's explain() reports the selection


@pytest.mark.parametrize(
    "kwargs,call,error,message",
    [
        ({"top_k": 0}, None, ValueError, "top_k must be a positive int"),
        ({"index_heads": 1.5}, None, ValueError, "index_heads must be a positive int"),
        ({"causal": False}, None, ValueError, "causal must be True"),
        ({}, {"score_mod": mh.scores.softcap(30.0)}, TypeError, "score_mod= is not supported"),
        ({}, {"mask": torch.rand(1, 4, 5, 5) < 0.5}, ValueError, "the mask differs between heads"),
        ({}, {"kv_cache": mh.StaticKVCache(1, 8, 2, 12)}, TypeError, "kv_cache must be a DynamicKVCache"),
    ],
)
def test_bad_arguments(kwargs, call, error, message):
    with pytest.raises(error, match=message):
        layer = mh.TopKIndexerAttention(E, 4, **{"num_kv_heads": 2, **kwargs})
        layer(torch.randn(1, 5, E), **(call or {}))


@pytest.mark.parametrize("case", range(2), ids=["padding", "documents"])
def test_a_masked_prefill_and_decode_steps_equal_the_masked_full_forward(case):
    B, L = 2, 17
    layer = _layer(4, 2, top_k=4)
    _, mask, _ = _masks(B, L)[case]  # mask objects at absolute positions: the same one for every step
    assert_decode_steps(layer, _x(B, L), 9, 1, mask=mask)
