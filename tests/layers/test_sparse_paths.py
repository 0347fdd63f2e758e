"""The fast paths of the sparse layers' choices against their plain definitions.

* ``best_first`` (one ``topk`` of order-preserving integer keys) == a stable descending sort's
  first ``n`` (ties to the lower index, ``-inf`` never chosen), with ties, ``±inf``, ``-0.0``,
  negative scores, in fp32/bf16/fp16, and fp64 (the sort);
* NSA's ``compressed_and_chosen`` (the compressed branch a query chunk at a time on the fused
  kernel, the probabilities recomputed from its LSE and ranked per chunk) == ``compressed`` +
  ``choose`` (the whole ``(B, Hq, Lq, nC)`` table): output, chosen blocks and gradients, over
  MHA/GQA/MQA, odd lengths, ``Lq < Lk`` (a cache's new tokens), chunk boundaries anywhere
  (``CHUNK_ROWS`` small), block sizes ± 1 around the length, rows with no complete compressed
  block (output 0, gradient 0); bf16 by the relative rule;
* MoBA's chunked choice == the choice from the whole table by a stable sort.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative
from multihead.layers import moba as moba_module
from multihead.layers import nsa as nsa_module
from multihead.layers.moba import MobaCore
from multihead.layers.nsa import NsaCore
from multihead.layers.ranking import best_first


def _stable_first(scores, n):
    ranked, order = torch.sort(scores.double(), dim=-1, descending=True, stable=True)
    n = min(n, scores.shape[-1])
    return torch.where(torch.isneginf(ranked[..., :n]), -1, order[..., :n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_best_first_is_the_stable_sort(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        m = int(torch.randint(1, 40, (), generator=g))
        n = int(torch.randint(1, 45, (), generator=g))
        s = (torch.randint(-3, 4, (4, 3, m), generator=g) * 0.5).to(dtype)  # many ties
        s[torch.rand(s.shape, generator=g) < 0.2] = float("-inf")
        s[torch.rand(s.shape, generator=g) < 0.1] = float("inf")
        s[torch.rand(s.shape, generator=g) < 0.1] = -0.0
        got = best_first(s, n)
        assert got.dtype == torch.int64
        assert torch.equal(got, _stable_first(s, n)), (s, n)
    s = torch.randn(3, 1000, generator=g, dtype=dtype)
    assert torch.equal(best_first(s, 16), _stable_first(s, 16))
    # rows without ties (the fp32 topk) beside rows with a tie at, above or below the n-th
    # best, and rows with fewer than n finite scores, in one call
    s = torch.randn(8, 300, generator=g, dtype=dtype)
    ranked = s.sort(dim=-1, descending=True).values
    s[1, 7] = ranked[1, 19]  # a tie across the boundary (n = 20)
    s[2, 9] = ranked[2, 3]  # a tie inside the chosen
    s[3, 11] = ranked[3, 40]  # a tie below the boundary: the fast order holds
    s[4, 50:] = float("-inf")
    s[5, 10:] = float("-inf")  # fewer than n finite
    s[6, :] = 0.0  # every score tied
    assert torch.equal(best_first(s, 20), _stable_first(s, 20))
    assert torch.equal(best_first(s[:, :20], 20), _stable_first(s[:, :20], 20))  # n = m


def _nsa(Hq, Hkv, l, d, ls, n, dtype=torch.float64):
    torch.manual_seed(0)
    layer = mh.NativeSparseAttention(
        8 * Hq,
        Hq,
        num_kv_heads=Hkv,
        compress_block=l,
        compress_stride=d,
        select_block=ls,
        select_count=n,
        window=5,
    ).to(dtype)
    with torch.no_grad():
        layer.compress_pos_k.normal_()
        layer.compress_pos_v.normal_()
    return layer


def _qkv(B, Hq, Hkv, Lq, Lk, D, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


CASES = [  # Hq, Hkv, l, d, ls, n, Lq, Lk, chunk rows
    (4, 2, 4, 2, 4, 3, 37, 37, 2048),
    (4, 2, 4, 2, 4, 3, 37, 37, 8),  # chunks of 2 tokens x 2 heads
    (6, 3, 8, 4, 8, 5, 101, 101, 30),  # chunk boundaries off the blocks' grid
    (4, 4, 4, 2, 8, 3, 7, 50, 8),  # the new tokens of a cache: Lq < Lk
    (4, 1, 4, 2, 4, 9, 13, 13, 2048),  # MQA, more blocks asked than there are
    (2, 1, 4, 4, 4, 3, 3, 3, 2048),  # shorter than a compressed block: every row reads nothing
    (4, 2, 8, 4, 16, 4, 15, 15, 8),  # L = select block - 1
    (4, 2, 8, 4, 16, 4, 17, 17, 8),  # L = select block + 1
    (4, 2, 8, 4, 8, 4, 7, 7, 2048),  # L = compress block - 1: no block
    (4, 2, 8, 4, 8, 4, 9, 9, 2048),  # L = compress block + 1
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Hq{}-Hkv{}-l{}-d{}-ls{}-n{}-Lq{}-Lk{}-rows{}".format(*c))
def test_nsa_chunked_compressed_branch_equals_the_table(case, monkeypatch):
    Hq, Hkv, l, d, ls, n, Lq, Lk, rows = case
    monkeypatch.setattr(nsa_module, "CHUNK_ROWS", rows)
    layer = _nsa(Hq, Hkv, l, d, ls, n)
    q, k, v = _qkv(2, Hq, Hkv, Lq, Lk, layer.head_dim)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    core = NsaCore(layer, torch.rand(2, Lq, 3 * Hq, dtype=torch.float64), None)
    want, p = core.compressed(q, k, v)
    chosen = core.choose(p, Lq, Lk)
    got, got_chosen = core.compressed_and_chosen(q, k, v)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_chosen, chosen)
    assert got_chosen.shape == (2, Hkv, Lq, min(n, math.ceil(Lk / ls)))
    none = (torch.arange(Lq) + Lk - Lq) < l - 1  # rows with no complete compressed block
    assert (got[:, :, none] == 0).all()
    if Lk < l:  # nothing to attend to: a constant 0, as the table's is
        assert not got.requires_grad
        return
    w = torch.randn_like(want)
    inputs = (q, k, v, layer.compress_k.weight, layer.compress_pos_v)  # unused where no block is complete: 0
    grads = torch.autograd.grad((want * w).sum(), inputs, allow_unused=True, materialize_grads=True)
    got_grads = torch.autograd.grad((got * w).sum(), inputs, allow_unused=True, materialize_grads=True)
    for a, b in zip(got_grads, grads):
        torch.testing.assert_close(a, b)
    assert (got_grads[0][:, :, none] == 0).all()


def test_nsa_chunked_compressed_branch_bf16(monkeypatch):
    monkeypatch.setattr(nsa_module, "CHUNK_ROWS", 24)
    layer = _nsa(4, 2, 4, 2, 4, 3)
    q, k, v = _qkv(2, 4, 2, 61, 61, layer.head_dim)
    core = NsaCore(layer, torch.rand(2, 61, 12, dtype=torch.float64), None)
    ref, _ = core.compressed(q, k, v)
    low = _nsa(4, 2, 4, 2, 4, 3, dtype=torch.bfloat16)
    core_low = NsaCore(low, torch.rand(2, 61, 12, dtype=torch.bfloat16), None)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    got, chosen = core_low.compressed_and_chosen(qb, kb, vb)
    baseline, _ = core_low.compressed(qb, kb, vb)  # the whole table in bf16
    assert got.dtype == torch.bfloat16 and chosen.shape == (2, 2, 61, 3)
    # the layer's weights are rounded to bf16 in both: compare against fp64 of those weights
    ref, _ = NsaCore(_nsa(4, 2, 4, 2, 4, 3).to(torch.bfloat16).double(), core.gates, None).compressed(
        qb.double(), kb.double(), vb.double()
    )
    assert_relative(got, ref, baseline, 2.0)


@pytest.mark.parametrize("Lq,Lk,chunk", [(37, 37, 1 << 20), (37, 37, 40), (5, 41, 30), (64, 64, 100), (65, 65, 7)])
def test_moba_chunked_choice_equals_the_sort(Lq, Lk, chunk, monkeypatch):
    monkeypatch.setattr(moba_module, "CHUNK_SCORES", chunk)
    q, k, _ = _qkv(2, 4, 2, Lq, Lk, 8, dtype=torch.float32)
    k[:, :, :8] = k[:, :, 8:16]  # equal block means: ties
    core = MobaCore(8, 3)
    B, Hq, _, D = q.shape
    nK = math.ceil(Lk / 8)
    means = torch.stack([k[:, :, j * 8 : (j + 1) * 8].mean(2) for j in range(nK)], 2)  # (B, Hkv, nK, D)
    scores = q @ means.repeat_interleave(2, dim=1).transpose(-1, -2)  # (B, Hq, Lq, nK)
    own = (torch.arange(Lq) + Lk - Lq) // 8
    block = torch.arange(nK)
    scores = scores.masked_fill(block > own[:, None], float("-inf")).masked_fill(block == own[:, None], float("inf"))
    assert torch.equal(core.choose(q, k), _stable_first(scores, 3))


def _small(kind):
    torch.manual_seed(5)
    if kind == "nsa":
        return mh.NativeSparseAttention(
            32, 4, num_kv_heads=2, compress_block=4, compress_stride=2, select_block=4, select_count=3, window=5
        )
    return mh.TopKIndexerAttention(32, 4, num_kv_heads=2, top_k=5, index_heads=2, index_dim=8)


@pytest.mark.parametrize("kind", ["nsa", "topk"])
def test_compile_breaks_only_at_the_selection(kind):
    """``torch.compile(fullgraph=False)`` of the layer equals eager, forward and the input's
    gradient; its graph breaks are all where the ``block_select`` mask reads its data-dependent
    table (``masks/select.py``: the table's width is the largest block chosen, read on the host
    with ``int(...)``, and the backend plans its tiles from it): the projections, the compressed
    branch (NSA), the indexer (top-k), the window and the gates trace into graphs."""
    torch._dynamo.reset()
    layer = _small(kind)
    x = torch.randn(2, 19, 32, requires_grad=True)
    out = torch.compile(layer, backend="aot_eager", fullgraph=False)(x)
    want = layer(x)
    torch.testing.assert_close(out, want)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g, g_want)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count >= 1  # the selection is data-dependent: a break is expected
    for reason in explained.break_reasons:
        frames = [f.filename.replace("\\", "/") for f in reason.user_stack]
        assert any(f.endswith("multihead/masks/select.py") for f in frames), (reason.reason, frames)


@pytest.mark.parametrize(
    "Hq,Hkv,ls,n,Lq,Lk",
    [
        (4, 2, 4, 3, 1, 37),  # one decode step
        (4, 4, 4, 3, 3, 41),  # three new tokens (speculative decoding)
        (6, 1, 5, 3, 1, 23),  # MQA, blocks of 5, the own block holds 3 keys
        (4, 2, 8, 2, 1, 17),  # L = 2 blocks + 1: the own block holds one key
        (4, 2, 8, 1, 1, 15),  # L = 2 blocks - 1, one block read: the own one
    ],
)
def test_nsa_decode_reads_only_the_chosen_blocks(Hq, Hkv, ls, n, Lq, Lk):
    """A few new tokens against a cache: the selected branch gathers each token's chosen blocks
    (``_selected_attention``) and equals the ``block_select`` mask over the whole cache, output
    and gradients; it never reads a key outside them (NaN there changes nothing)."""
    layer = _nsa(Hq, Hkv, 4, 1, ls, n)
    assert Lq * min(n, math.ceil(Lk / ls)) * ls < Lk  # the gathered path
    q, k, v = _qkv(2, Hq, Hkv, Lq, Lk, layer.head_dim)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    core = NsaCore(layer, torch.rand(2, Lq, 3 * Hq, dtype=torch.float64), None)
    with torch.no_grad():
        _, idx = core.compressed_and_chosen(q, k, v)
    want = mh.attention(q, k, v, mask=core._selected(idx, Hq), backend="reference")
    got = core._selected_attention(q, k, v, idx, "auto")
    torch.testing.assert_close(got, want)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    read = torch.zeros(2, Hkv, Lk, dtype=torch.bool)
    pos = torch.arange(Lk - Lq, Lk).view(1, 1, Lq, 1)
    for j in range(math.ceil(Lk / ls)):
        chosen = ((idx == j).any(-1, keepdim=True) & (j * ls <= pos)).any(2).squeeze(-1)  # (2, Hkv)
        read[:, :, j * ls : (j + 1) * ls] |= chosen.unsqueeze(-1)
    poisoned_k, poisoned_v = k.detach().clone(), v.detach().clone()
    poisoned_k[~read], poisoned_v[~read] = float("nan"), float("nan")
    again = core._selected_attention(q.detach(), poisoned_k, poisoned_v, idx, "auto")
    torch.testing.assert_close(again, want.detach())


def test_nsa_decode_gathered_bf16():
    layer = _nsa(4, 2, 4, 1, 4, 3)
    q, k, v = _qkv(1, 4, 2, 2, 61, layer.head_dim)
    core = NsaCore(layer, torch.rand(1, 2, 12, dtype=torch.float64), None)
    with torch.no_grad():
        _, idx = core.compressed_and_chosen(q, k, v)
    ref = mh.attention(q, k, v, mask=core._selected(idx, 4), backend="reference")
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    got = core._selected_attention(qb, kb, vb, idx, "auto")
    baseline = mh.attention(qb, kb, vb, mask=core._selected(idx, 4), backend="reference")
    assert got.dtype == torch.bfloat16
    assert_relative(got, ref, baseline, 2.0)


@pytest.mark.parametrize("rescale_above", [None, -1.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_key_major_join_with_far_apart_partials(rescale_above, dtype, monkeypatch):
    """The key-major forward joins a row's partials relative to its first LSE and rescales only
    when a later one is more than ``RESCALE_ABOVE`` above it: a later key block whose scores
    exceed the first's by ~140 (the rescale), always rescaling, never rescaling (ordinary
    scores) all equal the fp64 reference, output and LSE."""
    from multihead.backends import key_major

    if rescale_above is not None:
        monkeypatch.setattr(key_major, "RESCALE_ABOVE", rescale_above)
    monkeypatch.setattr(key_major, "CHUNK_SCORES", 1)  # one tile per chunk: a row's partials arrive one by one
    rescaled = []
    unique = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **kw: rescaled.append(1) or unique(*a, **kw))
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, L, D, bs = 1, 4, 2, 40, 8, 8
    q = torch.randn(B, Hq, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    if rescale_above is None:  # block 3's keys along every query: scores ~ +140 there, ~0 in block 0
        k[:, :, 3 * bs : 4 * bs] = 60.0 * q.mean(dim=(1, 2), keepdim=True).sign()
        q = q.abs() * q.mean(dim=(1, 2), keepdim=True).sign()
    idx = torch.full((B, Hkv, L, 3), -1, dtype=torch.long)
    own = torch.arange(L) // bs
    idx[..., 0] = own
    idx[..., 1] = 0
    idx[..., 2] = torch.where(own > 3, 3, -1)
    mask = mh.masks.block_select(idx, bs, num_heads=Hq, query_block_size=1) & mh.masks.causal()
    want, _, want_lse = mh.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    got, _, lse = mh.attention(*(t.to(dtype) for t in (q, k, v)), mask=mask, backend="blocksparse", return_lse=True)
    assert "key-major" in str(mh.explain(q, k, v, mask=mask, backend="blocksparse"))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    assert bool(rescaled) == (rescale_above != float("inf"))  # the rescaling path ran, or did not
