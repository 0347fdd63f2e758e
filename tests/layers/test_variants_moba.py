"""``MixtureOfBlockAttention`` (MoBA, Lu et al., 2025) against its equations.

* the layer equals MoBA written plainly below in fp64 (per head and query token: block means,
  the own block always, the best earlier blocks by ``q · mean(K_block)`` with ties to the lower
  block, causal attention over the chosen keys): outputs, weights (zero outside the chosen
  blocks) and the gradient of every parameter and of the input; MHA, GQA, MQA; odd lengths,
  lengths shorter than a block, ``top_k`` above the blocks there are; with key padding (fully
  masked rows);
* prefill + decode steps with a ``DynamicKVCache`` (and RoPE) == the full forward;
* the choice is deterministic on ties; bad arguments in one table.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead.layers.moba import MobaCore
from multihead.positions import RotaryEmbedding
from variants_math import linear, rope, softmax_rows

E = 48


def published_moba(params, x, *, Hq, Hkv, D, bs, top_k, lengths=None, positions=None):
    """MoBA from the paper, one head and one query at a time. Returns ``(y, weights)``."""
    B, L, _ = x.shape
    q = linear(x, params, "q_proj").unflatten(-1, (Hq, D)).transpose(1, 2)  # (B, Hq, L, D)
    k = linear(x, params, "k_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)  # (B, Hkv, L, D)
    v = linear(x, params, "v_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)
    if positions is not None:
        q, k = rope(q, positions), rope(k, positions)
    heads, maps = [], []
    for h in range(Hq):
        g = h // (Hq // Hkv)
        rows, weights = [], []
        for b in range(B):
            allowed = torch.zeros(L, L, dtype=torch.bool)
            for i in range(L):
                own = i // bs
                means = [k[b, g, j * bs : min((j + 1) * bs, L)].detach().mean(0) for j in range(own)]
                scores = [float(q[b, h, i].detach() @ m) for m in means]
                earlier = sorted(range(own), key=lambda j: (-scores[j], j))[: top_k - 1]
                for j in [own, *earlier]:
                    allowed[i, j * bs : min((j + 1) * bs, i + 1)] = True
            if lengths is not None:
                allowed[:, lengths[b] :] = False
            p = softmax_rows(q[b, h] @ k[b, g].T / math.sqrt(D), allowed)  # (L, L)
            rows.append(p @ v[b, g])
            weights.append(p)
        heads.append(torch.stack(rows))
        maps.append(torch.stack(weights))
    return linear(torch.cat(heads, dim=-1), params, "out_proj"), torch.stack(maps, dim=1)


def _layer(Hq=6, Hkv=2, bs=4, top_k=2, seed=0, **kw):
    torch.manual_seed(seed)
    return mh.MixtureOfBlockAttention(E, Hq, num_kv_heads=Hkv, block_size=bs, top_k=top_k, **kw).double()


def _params(layer):
    return {name: p.detach().double() for name, p in layer.state_dict().items()}


def _x(B, L, seed=1):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("L,bs,top_k", [(13, 4, 2), (17, 3, 3), (3, 4, 2), (9, 2, 9)], ids=lambda c: str(c))
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "key-padding"])
def test_equals_the_equations_forward_and_gradients(heads, L, bs, top_k, padded):
    (Hq, Hkv), B = heads, 2
    layer = _layer(Hq, Hkv, bs, top_k)
    x = _x(B, L).requires_grad_()
    lengths = torch.tensor([L - 1, 0]) if padded else None
    mask = None if lengths is None else mh.key_padding(lengths)
    out, weights = layer(x, mask=mask, need_weights=True)
    params = {n: p.detach().clone().requires_grad_() for n, p in _params(layer).items()}
    expected, maps = published_moba(params, x, Hq=Hq, Hkv=Hkv, D=E // Hq, bs=bs, top_k=top_k, lengths=lengths)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, maps)
    grad = torch.randn_like(out)
    names = [n for n, _ in layer.named_parameters()]
    got = torch.autograd.grad(out, [x, *layer.parameters()], grad)
    want = torch.autograd.grad(expected, [x, *(params[n] for n in names)], grad)
    for name, g, w in zip(["x", *names], got, want, strict=True):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_prefill_and_decode_equal_the_full_forward():
    layer = _layer(6, 2, 4, 2, rope=RotaryEmbedding(8))
    x = _x(2, 19)
    full = layer(x)
    expected, _ = published_moba(_params(layer), x, Hq=6, Hkv=2, D=8, bs=4, top_k=2, positions=torch.arange(19))
    torch.testing.assert_close(full, expected)
    cache = mh.DynamicKVCache()
    steps = [layer(x[:, :7], kv_cache=cache)] + [layer(x[:, t : t + 1], kv_cache=cache) for t in range(7, 15)]
    steps.append(layer(x[:, 15:], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_ties_go_to_the_lower_block():
    """Keys that are all equal give every earlier block the same score: the lowest ones win."""
    q = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    k = torch.ones(1, 1, 17, 4, dtype=torch.float64)
    chosen = MobaCore(4, 3).choose(q, k)  # the query at position 16 (block 4) of 5 blocks
    assert chosen.tolist() == [[[[4, 0, 1]]]]
    assert MobaCore(4, 9).choose(q, k).tolist() == [[[[4, 0, 1, 2, 3]]]]  # fewer blocks than top_k


BAD = [
    (lambda: mh.MixtureOfBlockAttention(E, 6, block_size=0), ValueError, r"block_size must be a positive int, got 0"),
    (lambda: mh.MixtureOfBlockAttention(E, 6, top_k=True), ValueError, r"top_k must be a positive int"),
    (lambda: mh.MixtureOfBlockAttention(E, 6, causal=False), ValueError, r"causal must be True"),
    (
        lambda: mh.MixtureOfBlockAttention(E, 6)(torch.randn(1, 3, E), kv_cache=mh.StaticKVCache(1, 8, 6, 8)),
        TypeError,
        r"kv_cache must be a DynamicKVCache.*StaticKVCache",
    ),
]


@pytest.mark.parametrize("make,error,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_compile_with_a_break_at_the_selection():
    """``torch.compile`` runs the layer (the mask reads its table of chosen blocks on the host:
    a graph break there, not a failure); forward and input gradient equal eager."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    layer = mh.MixtureOfBlockAttention(32, 4, num_kv_heads=2, block_size=4, top_k=2)
    x = torch.randn(2, 13, 32, requires_grad=True)
    out = torch.compile(layer, backend="aot_eager")(x)
    torch.testing.assert_close(out, layer(x))
    (g,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(layer(x).sum(), x)
    torch.testing.assert_close(g, want)
