"""``multihead.masks.block_select``: the block-selection mask of trainable sparse attention.

* its meaning equals a loop over ``(b, h, i, j)`` reading the indices (``-1`` entries, repeated
  blocks, one row of heads, KV-head rows with ``num_heads``, one batch row, odd lengths);
* composed with ``causal()`` and key padding, attention through it equals the fp64 reference with
  the dense table it stands for, on every backend that does not refuse the call, outputs and
  gradients (fully masked rows included);
* its structural answers (``block_state``, ``key_range``) agree with its dense form on random
  blocks (never wrong, and exact where the block is whole blocks);
* a layer with a cache reads it at absolute positions: prefill + decode steps == the full forward;
* bad arguments in one table.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import refuses
from multihead.blocks import Block, Extent
from multihead.masks import BlockState, block_select


def _indices(B, H, nQ, nK, k, seed=0, causal=True):
    """Random selections of ``k`` key blocks per query block (``-1`` padding some rows, a repeat),
    causal ones (blocks up to the query's own) when ``causal``."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((B, H, nQ, k), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            for n in range(nQ):
                top = n + 1 if causal else nK
                picked = torch.randperm(top, generator=gen)[: min(k, top)]
                idx[b, h, n, : len(picked)] = picked
    idx[0, 0, -1, -1] = idx[0, 0, -1, 0]  # the same block twice counts once
    return idx


def _loop(idx, bs, B, Hq, Lq, Lk, num_heads=None, qbs=None):
    """The dense ``(B, Hq, Lq, Lk)`` table, one element at a time, from the definition."""
    qbs = bs if qbs is None else qbs
    Bi, H = idx.shape[:2]
    out = torch.zeros(B, Hq, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        for h in range(Hq):
            row = 0 if H == 1 else (h // (Hq // H) if num_heads else h)
            for i in range(Lq):
                chosen = set(idx[0 if Bi == 1 else b, row, i // qbs].tolist()) - {-1}
                for j in range(Lk):
                    out[b, h, i, j] = (j // bs) in chosen
    return out


@pytest.mark.parametrize(
    "B,Hi,Hq,Lq,Lk,bs,num_heads,qbs",
    [
        (2, 4, 4, 13, 13, 4, None, None),
        (2, 1, 4, 9, 17, 3, None, None),
        (1, 2, 6, 11, 11, 4, 6, None),
        (3, 3, 3, 7, 5, 2, None, None),
        (2, 2, 2, 9, 9, 4, None, 1),
    ],
    ids=["per-head", "one-row-Lq<Lk", "kv-rows", "Lq>Lk", "per-token"],
)
def test_meaning_equals_the_definition(B, Hi, Hq, Lq, Lk, bs, num_heads, qbs):
    nQ, nK = math.ceil(Lq / (qbs or bs)), math.ceil(Lk / bs)
    idx = _indices(B, Hi, nQ, nK, 2, causal=False)
    mask = block_select(idx, bs, num_heads=num_heads, query_block_size=qbs)
    mask.check(Extent(B, Hq, Lq, Lk))
    dense = mask.materialize(B, Hq, Lq, Lk).expand(B, Hq, Lq, Lk)
    assert torch.equal(dense, _loop(idx, bs, B, Hq, Lq, Lk, num_heads, qbs))
    one = block_select(idx[:1], bs, num_heads=num_heads, query_block_size=qbs)  # one batch row serves every row
    want = _loop(idx[:1], bs, B, Hq, Lq, Lk, num_heads, qbs)
    assert torch.equal(one.materialize(B, Hq, Lq, Lk).expand(B, Hq, Lq, Lk), want)


def test_masks_compare_by_value_and_draw_themselves():
    idx = torch.tensor([[[[0, -1], [0, 1], [2, 0]]]])
    mask = block_select(idx, 2) & mh.causal()
    assert mask == block_select(idx.clone(), 2) & mh.causal()
    assert "block_select(indices (1, 1, 3, 2), block_size=2" in repr(mask)
    assert mask.to_string() == "\n".join(["█·····", "██····", "███···", "████··", "██··█·", "██··██"])


BACKENDS = ["reference", "sdpa", "blocksparse", "torch_blocks", "decode"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Hq,Hkv,Hi", [(4, 4, 4), (4, 2, 2), (4, 1, 1)], ids=["MHA", "GQA-kv-rows", "MQA-one-row"])
def test_attention_through_it_equals_the_dense_reference(backend, Hq, Hkv, Hi):
    """``block_select & causal() & key_padding`` (one row has no key: fully masked rows) against
    the reference given the dense table; outputs and gradients, fp64."""
    B, L, bs, D = 2, 301, 32, 16  # L·L above blocksparse's smallest call, L not a multiple of bs
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for H in (Hq, Hkv, Hkv))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    nQ = math.ceil(L / bs)
    idx = _indices(B, Hi, nQ, nQ, 3)
    select = block_select(idx, bs, num_heads=Hq if 1 < Hi < Hq else None)
    mask = select & mh.causal() & mh.key_padding(torch.tensor([L - 7, 0]))
    if refuses(backend, q, k, v, mask=mask):
        pytest.skip(f"{backend} refuses this call (checked: forcing it raises)")
    got = mh.attention(q, k, v, mask=mask, backend=backend)
    dense = mask.materialize(B, Hq, L, L).expand(B, Hq, L, L).clone()
    want = mh.reference_attention(q, k, v, mask=dense).output
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_head_rows_are_bound_to_the_calls_query_heads_without_num_heads(backend):
    """The issue's spelling, ``block_select(indices, block_size)`` with one row per KV head of a GQA
    call: the call's ``Hq`` binds it (query head ``h`` reads row ``h // (Hq / Hkv)``), equal to the
    mask given ``num_heads=Hq``, on every backend and through a GQA layer."""
    B, Hq, Hkv, L, bs, D = 2, 4, 2, 97, 16, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for H in (Hq, Hkv, Hkv))
    nQ = math.ceil(L / bs)
    idx = _indices(B, Hkv, nQ, nQ, 3)
    mask = block_select(idx, bs) & mh.causal()
    named = block_select(idx, bs, num_heads=Hq) & mh.causal()
    if refuses(backend, q, k, v, mask=named):
        pytest.skip(f"{backend} refuses this call (checked: forcing it raises)")
    want = mh.reference_attention(q, k, v, mask=named.materialize(B, Hq, L, L).expand(B, Hq, L, L).clone()).output
    torch.testing.assert_close(mh.attention(q, k, v, mask=mask, backend=backend), want)
    layer = mh.MultiHeadAttention(Hq * D, Hq, num_kv_heads=Hkv).double()
    x = torch.randn(B, L, Hq * D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(layer(x, mask=block_select(idx, bs)), layer(x, mask=block_select(idx, bs, num_heads=Hq)))


def test_structure_agrees_with_the_dense_form():
    """On random blocks (aligned or not): EMPTY has nothing visible, FULL everything, PARTIAL
    something; ``key_range`` covers every visible key of its rows, for every batch and head."""
    B, H, L, bs = 2, 3, 50, 8
    nQ = math.ceil(L / bs)
    mask = block_select(_indices(B, H, nQ, nQ, 2, seed=5), bs)
    dense = mask.materialize(B, H, L, L).expand(B, H, L, L)
    gen = torch.Generator().manual_seed(6)
    seen = set()
    for _ in range(300):
        q0, q1 = sorted(torch.randint(0, L + 1, (2,), generator=gen).tolist())
        k0, k1 = sorted(torch.randint(0, L + 1, (2,), generator=gen).tolist())
        if torch.rand(1, generator=gen) < 0.5:  # whole blocks too
            q0, k0 = q0 // bs * bs, k0 // bs * bs
            q1, k1 = min(q0 + bs, L), min(k0 + bs, L)
        if q0 == q1 or k0 == k1:
            continue
        block = dense[:, :, q0:q1, k0:k1]
        state = mask.block_state(Extent(B, H, L, L), Block(q0, q1, k0, k1))
        seen.add(state)
        if state is BlockState.EMPTY:
            assert not block.any()
        elif state is BlockState.FULL:
            assert block.all()
        else:
            assert block.any()
        lo, hi = mask.key_range(Extent(B, H, L, L), Block(q0, q1, 0, L))
        visible = dense[:, :, q0:q1].any(dim=(0, 1, 2)).nonzero().flatten()
        if visible.numel():
            assert lo <= int(visible[0]) and int(visible[-1]) < hi
    assert seen == {BlockState.EMPTY, BlockState.FULL, BlockState.PARTIAL}


def test_a_layer_with_a_cache_reads_it_at_absolute_positions():
    """The selection of the whole sequence given at every step: prefill then one token at a
    time equals the full causal forward."""
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True).double()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    bs = 4
    nQ = math.ceil(21 / bs)
    mask = block_select(_indices(2, 2, nQ, nQ, 2, seed=9), bs, num_heads=4)
    full = layer(x, mask=mask)
    cache = mh.DynamicKVCache()
    steps = [layer(x[:, :10], mask=mask, kv_cache=cache)]
    steps += [layer(x[:, t : t + 1], mask=mask, kv_cache=cache) for t in range(10, 21)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


BAD = [
    (lambda: block_select(torch.zeros(1, 1, 2, 2), 4), TypeError, r"indices must be an integer tensor.*float32"),
    (
        lambda: block_select(torch.zeros(1, 2, 2, dtype=torch.long), 4),
        ValueError,
        r"shape \(B, H, ceil\(Lq / block_size\), k\).*\(1, 2, 2\)",
    ),
    (
        lambda: block_select(torch.zeros(1, 1, 2, 2, dtype=torch.long), 0),
        ValueError,
        r"block_size must be a positive int, got 0",
    ),
    (
        lambda: block_select(torch.zeros(1, 2, 2, 2, dtype=torch.long), 4, num_heads=3),
        ValueError,
        r"num_heads must be the query heads Hq, a multiple of the 2",
    ),
    (lambda: block_select(torch.full((1, 1, 2, 2), -2), 4).materialize(1, 1, 8, 8), ValueError, r"-1 for none, got -2"),
    (
        lambda: block_select(torch.zeros(2, 1, 2, 1, dtype=torch.long), 4).check(Extent(3, 1, 8, 8)),
        ValueError,
        r"2 batch rows, the call 3",
    ),
    (  # checked outside a call (nothing bound it to Hq): the message says how
        lambda: block_select(torch.zeros(1, 2, 2, 1, dtype=torch.long), 4).check(Extent(1, 4, 8, 8)),
        ValueError,
        r"give num_heads=4",
    ),
    (  # 3 rows of heads do not divide 4 query heads: no GQA mapping binds them
        lambda: mh.attention(*_qkv(4), mask=block_select(torch.zeros(1, 3, 2, 1, dtype=torch.long), 4)),
        ValueError,
        r"indices have 3 rows of heads, the call 4 query heads",
    ),
    (
        lambda: block_select(torch.zeros(1, 1, 2, 1, dtype=torch.long), 4).check(Extent(1, 1, 9, 9)),
        ValueError,
        r"9 queries make 3 blocks of 4, but indices name key blocks for 2",
    ),
    (
        lambda: block_select(torch.full((1, 1, 2, 1), 3), 4).check(Extent(1, 1, 8, 8)),
        ValueError,
        r"name key block 3, but 8 keys make 2 blocks",
    ),
    # num_heads that is not the call's Hq: with a row per query head it passed, and head h read
    # row h // (num_heads / H), another head's selection
    (
        lambda: mh.attention(*_qkv(4), mask=block_select(torch.zeros(1, 4, 2, 1, dtype=torch.long), 4, num_heads=8)),
        ValueError,
        r"num_heads=8 but the call has 4 query heads; expected num_heads=4",
    ),
    # A garbage index (torch.empty, token numbers for block numbers) is refused from the largest
    # one: the table as wide as it (8 TB here) used to be built first, a MemoryError.
    (
        lambda: mh.attention(*_qkv(), mask=block_select(torch.full((1, 1, 2, 1), 10**12), 4)),
        ValueError,
        r"name key block 1000000000000, but 8 keys make 2 blocks of 4; expected key-block numbers in \[0, 2\)",
    ),
    (
        lambda: mh.attention(*_qkv(), mask=block_select(torch.full((1, 1, 2, 1), -2), 4) & mh.causal()),
        ValueError,
        r"-1 for none, got -2; expected values >= -1",
    ),
]


def _qkv(heads=1):
    return [torch.randn(1, heads, 8, 4) for _ in range(3)]


@pytest.mark.parametrize("used_first", [True, False], ids=["used", "unused"])
def test_indices_changed_in_place_afterwards_change_no_mask(used_first):
    """The mask holds its own copy of ``indices`` (as key_padding and document do): a table shared
    with the caller meant the old selection if the mask had been used before the change, the new
    one if not, while ``mask.indices`` showed the new values."""
    idx = torch.tensor([[[[0], [0]]]])  # (1, 1, 2, 1): both query blocks read key block 0
    mask = block_select(idx, 4)
    expected = _loop(idx.clone(), 4, 1, 1, 8, 8)
    q, k, v = (torch.randn(1, 1, 8, 4, dtype=torch.float64) for _ in range(3))
    if used_first:
        mh.attention(q, k, v, mask=mask)
    idx[0, 0, 1, 0] = 1
    assert mask.indices[0, 0, 1, 0] == 0
    assert torch.equal(mask.materialize(1, 1, 8, 8).expand(1, 1, 8, 8), expected)
    torch.testing.assert_close(
        mh.attention(q, k, v, mask=mask), mh.attention(q, k, v, mask=expected, backend="reference")
    )


@pytest.mark.parametrize("make,error,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()
