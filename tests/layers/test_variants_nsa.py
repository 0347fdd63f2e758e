"""``NativeSparseAttention`` (NSA, Yuan et al., 2025) against its equations.

* the layer equals NSA written plainly in fp64 (``variants_math.published_nsa``: one KV group and
  one query token at a time) with the same weights: outputs and the gradient of every parameter
  (gates, compression maps and their position encodings, projections) and of the input; MHA, GQA,
  MQA; odd lengths, lengths shorter than a compressed block (the compressed branch reads nothing),
  ``select_count`` above the blocks there are; with RoPE;
* fp32 and bf16 by the relative rule of shared/TESTING.md;
* prefill + decode steps (one token, several) with a ``DynamicKVCache`` == the full forward, and
  the compressed blocks are extended, not recomputed, as the cache grows;
* the selected branch runs on ``blocksparse``'s gathered path; the choice is deterministic;
* bad arguments in one table.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import assert_relative
from multihead.positions import RotaryEmbedding
from variants_cases import assert_decode_steps
from variants_math import published_nsa

E = 48


def _layer(Hq=4, Hkv=2, l=4, d=2, ls=4, n=3, w=5, seed=0, rope=False, **kw):
    torch.manual_seed(seed)
    layer = mh.NativeSparseAttention(
        E,
        Hq,
        num_kv_heads=Hkv,
        compress_block=l,
        compress_stride=d,
        select_block=ls,
        select_count=n,
        window=w,
        rope=RotaryEmbedding(E // Hq) if rope else None,
        **kw,
    ).double()
    with torch.no_grad():  # the position encodings start at zero: give them values the test can see
        layer.compress_pos_k.normal_()
        layer.compress_pos_v.normal_()
    return layer


def _params(layer):
    return {name: p.detach().double() for name, p in layer.state_dict().items()}


def _x(B, L, seed=1, dtype=torch.float64):
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _oracle(layer, x, rope=False):
    L = x.shape[1]
    return published_nsa(
        _params(layer) if not x.requires_grad else dict(layer.named_parameters()),
        x,
        Hq=layer.num_heads,
        Hkv=layer.num_kv_heads,
        D=layer.head_dim,
        l=layer.compress_block,
        d=layer.compress_stride,
        ls=layer.select_block,
        n=layer.select_count,
        w=layer.window,
        positions=torch.arange(L) if rope else None,
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize(
    "L,l,d,ls,n,w",
    [(23, 4, 2, 4, 3, 5), (17, 6, 3, 6, 2, 4), (3, 4, 2, 4, 3, 5), (13, 4, 4, 8, 9, 20)],
    ids=lambda c: str(c),
)
@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
def test_equals_the_equations_forward_and_gradients(heads, L, l, d, ls, n, w, rope):
    (Hq, Hkv), B = heads, 2
    layer = _layer(Hq, Hkv, l, d, ls, n, w, rope=rope)
    x = _x(B, L).requires_grad_()
    y = layer(x)
    xr = x.detach().clone().requires_grad_()
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    want = published_nsa(
        params,
        xr,
        Hq=Hq,
        Hkv=Hkv,
        D=layer.head_dim,
        l=l,
        d=d,
        ls=ls,
        n=n,
        w=w,
        positions=torch.arange(L) if rope else None,
    )
    torch.testing.assert_close(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((y * g).sum(), [x, *layer.parameters()], allow_unused=True)
    ref = torch.autograd.grad((want * g).sum(), [xr, *params.values()], allow_unused=True)
    for (name, p), a, b in zip([("x", x), *layer.named_parameters()], got, ref):
        a = torch.zeros_like(p) if a is None else a  # the compression is unused below one block
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")
    if L >= l:  # the gates and the compression maps are trained
        for name in ("gate_proj.weight", "compress_k.weight", "compress_v.weight", "compress_pos_k"):
            assert dict(layer.named_parameters())[name].grad is None  # autograd.grad, not .backward
            assert float(got[1 + [n for n, _ in layer.named_parameters()].index(name)].abs().sum()) > 0, name


def _masks(B, L):
    """Masks a batch brings, with the keys each query may see ``(B, L, L)``: right padding, documents
    (a compressed block across the boundary is seen by neither side), a bool tensor with a row that
    sees nothing."""
    lengths = torch.tensor([L, L - 6])
    padding = (torch.arange(L)[None, None, :] < lengths[:, None, None]).expand(B, L, L)
    ids = torch.tensor([0] * 9 + [1] * (L - 9))
    documents = (ids[:, None] == ids[None, :]).expand(B, L, L)
    table = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(3)) < 0.7
    table[1, 0, 12] = False  # a query that sees no key
    return [(mh.key_padding(lengths), padding), (mh.document(ids), documents), (table, table[:, 0])]


@pytest.mark.parametrize("case", range(3), ids=["padding", "documents", "bool"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_a_mask_joins_every_branch(case, heads):
    """``mask=`` (the same for every head): the selected and window branches read the keys it
    allows, a compressed block counts only where every key of it is allowed, a branch that sees
    nothing gives 0; against the equations so restricted, outputs and gradients."""
    (Hq, Hkv), B, L = heads, 2, 23
    layer = _layer(Hq, Hkv)
    mask, visible = _masks(B, L)[case]
    x = _x(B, L).requires_grad_()
    y = layer(x, mask=mask)
    xr = x.detach().clone().requires_grad_()
    params = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    want = published_nsa(params, xr, Hq=Hq, Hkv=Hkv, D=layer.head_dim, l=4, d=2, ls=4, n=3, w=5, visible=visible)
    torch.testing.assert_close(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((y * g).sum(), [x, *layer.parameters()], allow_unused=True)
    ref = torch.autograd.grad((want * g).sum(), [xr, *params.values()], allow_unused=True)
    for (name, p), a, b in zip([("x", x), *layer.named_parameters()], got, ref):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("case", range(2), ids=["padding", "documents"])
def test_a_masked_prefill_and_decode_steps_equal_the_masked_full_forward(case):
    B, L = 2, 23
    layer = _layer(4, 2)
    mask, _ = _masks(B, L)[case]  # mask objects at absolute positions: the same one for every step
    assert_decode_steps(layer, _x(B, L), 11, 1, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_by_the_relative_rule(dtype):
    layer = _layer(4, 2, 4, 2, 4, 3, 5, rope=True)
    x = _x(2, 21)
    ref = _oracle(layer, x, rope=True)
    low = _layer(4, 2, 4, 2, 4, 3, 5, rope=True).to(dtype)
    low.load_state_dict(layer.state_dict())
    got = low(x.to(dtype))
    base = published_nsa(
        {n: p.detach() for n, p in low.state_dict().items()},
        x.to(dtype),
        Hq=4,
        Hkv=2,
        D=layer.head_dim,
        l=4,
        d=2,
        ls=4,
        n=3,
        w=5,
        positions=torch.arange(21),
    )
    assert_relative(got, ref, base, factor=10 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("prefill,step", [(1, 1), (9, 1), (10, 3), (4, 5)])
def test_prefill_and_decode_steps_equal_the_full_forward(prefill, step):
    layer = _layer(4, 2, 4, 2, 4, 3, 5, rope=True)
    assert_decode_steps(layer, _x(2, 26), prefill, step)


def test_the_compressed_blocks_are_extended_as_the_cache_grows(monkeypatch):
    """A decode step compresses only the blocks its new token completes (none, or one)."""
    layer = _layer(4, 2, 4, 2, 4, 3, 5)
    x = _x(1, 20)
    firsts = []
    real = layer.compress

    def spy(k, v, first=0):
        out = real(k, v, first)
        firsts.append((first, out[0].shape[2]))
        return out

    monkeypatch.setattr(layer, "compress", spy)
    cache = mh.DynamicKVCache()
    with torch.no_grad():
        layer(x[:, :10], kv_cache=cache)
        for t in range(10, 20):
            layer(x[:, t : t + 1], kv_cache=cache)
    assert firsts[0] == (0, 4)  # blocks 0..3 end at 3, 5, 7, 9
    assert all(count <= 1 for _, count in firsts[1:])
    assert sum(count for _, count in firsts) == (20 - 4) // 2 + 1


def test_compressed_blocks_follow_a_reorder_and_the_compression_weights():
    """The compressed blocks kept beside a cache are derived from its rows and from φ's weights:
    after ``reorder`` (beam search: rows moved, batch the same size) or a change of ``compress_k``
    (an optimizer step between calls), a step equals the full forward of the reordered rows with
    the new weights (before, the old rows' blocks were reused: errors of order 1)."""
    layer = _layer(4, 2, 4, 2, 4, 3, 5)
    x = _x(2, 16)
    with torch.no_grad():
        for p in layer.parameters():  # weights large enough that stale blocks change the output
            p.normal_(0, 0.3)
        for order in ([1, 0], [1, 1]):
            cache = mh.DynamicKVCache()
            layer(x[:, :12], kv_cache=cache)
            cache.reorder(torch.tensor(order))
            step = layer(x[order, 12:13], kv_cache=cache)
            torch.testing.assert_close(step, layer(x[order, :13])[:, 12:])
        cache = mh.DynamicKVCache()
        layer(x[:, :12], kv_cache=cache)
        layer.compress_k.weight.mul_(2)
        torch.testing.assert_close(layer(x[:, 12:13], kv_cache=cache), layer(x[:, :13])[:, 12:])
        cache.crop(9)  # crop and rollback only shorten: the blocks of the kept slots stay valid
        revision = cache.revision
        steps = [layer(x[:, 9:11], kv_cache=cache), layer(x[:, 11:12], kv_cache=cache)]
        assert cache.revision == revision
        torch.testing.assert_close(torch.cat(steps, dim=1), layer(x[:, :12])[:, 9:])


def test_the_selected_branch_runs_gathered():
    layer = _layer(4, 2, 4, 2, 4, 3, 5)
    x = _x(1, 300)
    B, L = 1, 300
    q = torch.randn(B, 4, L, layer.head_dim, dtype=torch.float64)
    k = torch.randn(B, 2, L, layer.head_dim, dtype=torch.float64)
    core, _ = layer._heads(x)
    _, p = core.compressed(q, k, k)
    idx = core.choose(p, L, L)
    assert idx.shape == (B, 2, L, 3)
    assert torch.equal(idx, core.choose(p, L, L))  # deterministic
    mask = mh.masks.block_select(idx, 4, num_heads=4, query_block_size=1) & mh.masks.causal()
    text = str(mh.explain(q, k, k, mask=mask))
    assert "blocksparse" in text and "key blocks" in text
    assert "selection density" in str(layer.explain(x))  # the layer's explain() reports the selection


@pytest.mark.parametrize(
    "kwargs,call,error,message",
    [
        ({"compress_block": 0}, None, ValueError, "compress_block must be a positive int"),
        ({"compress_stride": 3}, None, ValueError, "compress_stride must divide"),
        ({"select_count": True}, None, ValueError, "select_count must be a positive int"),
        ({"causal": False}, None, ValueError, "causal must be True"),
        ({"dropout": 0.1}, None, ValueError, "dropout is not supported"),
        ({}, {"score_mod": mh.scores.softcap(30.0)}, TypeError, "score_mod= is not supported"),
        ({}, {"mask": torch.rand(1, 4, 5, 5) < 0.5}, ValueError, "the mask differs between heads"),
        ({}, {"need_weights": True}, TypeError, "need_weights is not supported"),
        ({}, {"kv_cache": mh.StaticKVCache(1, 8, 2, 12)}, TypeError, "kv_cache must be a DynamicKVCache"),
    ],
)
def test_bad_arguments(kwargs, call, error, message):
    with pytest.raises(error, match=message):
        layer = mh.NativeSparseAttention(
            E, 4, **{"num_kv_heads": 2, "compress_block": 4, "compress_stride": 2, **kwargs}
        )
        layer(torch.randn(1, 5, E), **(call or {}))
