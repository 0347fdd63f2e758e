"""``token_selected_attention`` (``layers/token_selection.py``), the top-k indexer's plain-call
path: query chunks against the union of the keys they chose, a boolean mask inside.

* the layer's plain call (no weights) equals DSA's fp64 equations, outputs and gradients, across
  chunk boundaries (chunk size ± 1, odd lengths) on both ways of reading the union (a view of the
  causal range, a copy of the chosen keys), MHA/GQA/MQA, ties in the indexer's scores;
* the function against the fp64 oracle with the selection as a dense mask: ``Lq ≠ Lk`` (a chunk
  of new tokens after cached ones), rows and whole chunks that chose nothing (zeros), non-contiguous
  inputs, fp32 and bf16 by the relative rule, gradients;
* prefill + decode steps with a ``DynamicKVCache`` == the full forward across chunks; a bad
  ``chosen`` raises with its shape.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
import multihead.layers.token_selection as ts
from helpers import assert_relative
from multihead.layers.token_selection import token_selected_attention
from multihead.positions import RotaryEmbedding
from multihead.reference import reference_attention
from variants_cases import assert_decode_steps
from variants_math import published_topk_of

E = 48


def _layer(Hq=4, Hkv=2, top_k=5, seed=0, rope=True):
    torch.manual_seed(seed)
    return mh.TopKIndexerAttention(
        E, Hq, num_kv_heads=Hkv, top_k=top_k, index_heads=3, index_dim=8, rope=_rope(Hq, rope)
    ).double()


def _rope(Hq, on):
    return RotaryEmbedding(E // Hq) if on else None


def _x(B, L, seed=1):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(params=[0.0, 2.0], ids=["view", "gather"])
def small_chunks(request, monkeypatch):
    """Chunks of 8 queries, the union read as a view of the causal range (``GATHER_BELOW = 0``)
    or always copied (``2``)."""
    monkeypatch.setattr(ts, "QUERY_CHUNK", 8)
    monkeypatch.setattr(ts, "GATHER_BELOW", request.param)


def _calls(monkeypatch):
    seen = []
    real = ts.token_selected_attention

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mh.layers.topk_indexer, "token_selected_attention", spy)
    return seen


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("L,top_k", [(7, 3), (8, 5), (9, 5), (17, 4), (23, 30)], ids=lambda c: str(c))
def test_plain_call_equals_the_equations_across_chunks(small_chunks, monkeypatch, heads, L, top_k):
    (Hq, Hkv), B = heads, 2
    seen = _calls(monkeypatch)
    layer = _layer(Hq, Hkv, top_k)
    x = _x(B, L).requires_grad_()
    y = layer(x)
    assert seen, "the plain call did not run token_selected_attention"
    xr = x.detach().clone().requires_grad_()
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    want = published_topk_of(layer, params, xr)[0]
    torch.testing.assert_close(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    names = [n for n, _ in layer.named_parameters()]
    got = torch.autograd.grad((y * g).sum(), [x, *layer.parameters()], allow_unused=True)
    ref = torch.autograd.grad((want * g).sum(), [xr, *params.values()], allow_unused=True)
    for name, a, b in zip(["x", *names], got, ref):
        if name.startswith("index_"):
            assert a is None and b is None, name
            continue
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


def test_ties_in_the_indexer_go_to_the_lower_position(small_chunks):
    layer = _layer(4, 2, 4)
    with torch.no_grad():
        layer.index_w.weight.zero_()  # every score 0: every choice a tie, the first top_k keys win
    x = _x(2, 19)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    want, _, chosen = published_topk_of(layer, params, x)
    assert chosen[0][18] == [0, 1, 2, 3]
    torch.testing.assert_close(layer(x), want)


@pytest.mark.parametrize("prefill,step", [(9, 1), (7, 3), (16, 5)])
def test_prefill_and_decode_steps_equal_the_full_forward(small_chunks, prefill, step):
    layer = _layer(4, 2, 5)
    assert_decode_steps(layer, _x(2, 26), prefill, step)


def _case(B, Hq, Hkv, Lq, Lk, n, dtype, seed=0):
    """q, k, v as non-contiguous views, and a causal choice (``-1`` padding, some empty rows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, Hq, 16, generator=g, dtype=torch.float64).transpose(1, 2)  # (B, Hq, Lq, D) view
    k = torch.randn(B, Lk, Hkv, 16, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, Lk, Hkv, 12, generator=g, dtype=torch.float64).transpose(1, 2)
    pos = torch.arange(Lq) + (Lk - Lq)
    scores = torch.rand(B, Lq, Lk, generator=g).masked_fill(torch.arange(Lk) > pos[:, None], -1.0)
    top = scores.topk(min(n, Lk), dim=-1)
    chosen = torch.where(top.values >= 0, top.indices, -1)
    chosen[:, 2:3] = -1  # a row that chose nothing
    chosen[0, 8:16] = -1  # batch 0's whole second chunk chose nothing
    chosen = chosen.unsqueeze(1)  # (B, 1, Lq, n)
    dense = torch.zeros(B, 1, Lq, Lk + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(chosen >= 0, chosen, Lk), True)
    return (q.to(dtype), k.to(dtype), v.to(dtype)), (q, k, v), chosen, dense[..., :Lk]


@pytest.mark.parametrize("Lq,Lk", [(17, 17), (13, 40), (9, 9), (1, 23)], ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_the_function_against_the_oracle(small_chunks, Lq, Lk, dtype):
    (q, k, v), (qr, kr, vr), chosen, dense = _case(2, 6, 2, Lq, Lk, 5, dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    got = token_selected_attention(*leaves, chosen)
    refs = [t.detach().requires_grad_() for t in (qr, kr, vr)]
    want = reference_attention(*refs, mask=dense).output
    assert (got[:, :, 2:3] == 0).all()  # a row with no key gives zeros (the fully masked rule)
    gout = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = torch.autograd.grad((got.double() * gout).sum(), leaves)
    wgrads = torch.autograd.grad((want * gout).sum(), refs)
    if dtype == torch.float64:
        torch.testing.assert_close(got, want)
        for a, b in zip(grads, wgrads):
            torch.testing.assert_close(a, b)
        return
    # the baseline: the same attention written naively in the low dtype from the same inputs
    base_refs = [t.detach().to(dtype).requires_grad_() for t in (qr, kr, vr)]
    base = reference_attention(*base_refs, mask=dense).output
    base_grads = torch.autograd.grad((base * gout.to(dtype)).sum(), base_refs)
    low = dtype != torch.float32
    assert_relative(got, want, base, factor=2 if low else 10)
    for name, a, b, c in zip("qkv", grads, wgrads, base_grads):
        assert_relative(a, b, c, factor=3 if low else 10, what=f"d{name}", magnitude=float(b.abs().max()))


def test_a_bad_choice_names_its_shape():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"chosen must be \(B=1, 1, Lq=5, n\), got \(1, 2, 5, 3\)"):
        token_selected_attention(q, q, q, torch.zeros(1, 2, 5, 3, dtype=torch.long))
