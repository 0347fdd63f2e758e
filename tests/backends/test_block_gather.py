"""``blocksparse``'s gathered path for ``block_select`` masks (``backends/block_gather.py``): each
(batch, unit of heads, query block) reads only its selected key blocks.

* equals the fp64 reference (outputs, LSE, gradients of q, k, v and of the LSE) over a matrix of
  head layouts (rows per query head, per KV group, one for all heads, GQA with rows that split a
  group), query blocks of the key-block size, larger, smaller and per token, ``Lq != Lk``, odd
  lengths, ``D != Dv``, and the other masks (none, causal in both alignments, key padding with NaN
  beyond the lengths, documents, a sliding window); fully masked rows (rows with no block) get 0;
* the causal diagonal on one grid runs as the kernel's ``is_causal`` (one shared triangle);
* fp32 and bf16 by the relative rule of shared/TESTING.md;
* ``explain()`` names the path and the selection's density; work follows the selection (the
  kernel sees only the gathered keys); a selection per query token runs key-major
  (``backends/key_major.py``: each chosen key block read once per tile of the queries that chose it).
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.backends import block_gather
from multihead.masks import block_select, causal, document, key_padding, sliding_window


def _indices(B, H, nQ, nK, k, gen, qbs, bs, Lk_minus_Lq=0):
    """Random key blocks (``-1`` sprinkled in, a repeat, one row with none at all)."""
    idx = torch.randint(-1, nK, (B, H, nQ, k), generator=gen)
    idx[0, 0, 0] = -1  # a query block with no key block: its rows are fully masked
    if k > 1 and nQ > 1:
        idx[-1, -1, -1, 1] = idx[-1, -1, -1, 0]  # the same block twice counts once
    return idx


def _rest(kind, B, Lq, Lk):
    if kind == "none":
        return None
    if kind == "causal":
        return causal()
    if kind == "causal_tl":
        return causal(align="top_left")
    if kind == "padding":
        return key_padding(torch.tensor([max(1, Lk - 5), Lk][:B]))
    if kind == "document":
        ids = (torch.arange(Lk) * 3 // Lk).expand(B, Lk)
        return document(ids[:, :Lq] if Lq <= Lk else ids[:, :1].expand(B, Lq), ids) if Lq <= Lk else None
    if kind == "window":
        return sliding_window(9) & causal()
    raise AssertionError(kind)


CASES = [
    # B, Hq, Hkv, rows of heads (H, num_heads), Lq, Lk, D, Dv, qbs, bs, k, rest
    (2, 4, 2, (2, 4), 70, 70, 8, 8, 16, 16, 3, "causal"),
    (1, 4, 4, (4, None), 64, 64, 8, 8, 16, 16, 2, "causal"),  # the diagonal as is_causal
    (2, 6, 3, (6, None), 37, 50, 8, 12, 8, 8, 3, "causal"),  # bottom-right, Dv != D
    (2, 8, 2, (1, None), 45, 45, 16, 16, 16, 8, 4, "causal_tl"),  # query blocks of two key blocks
    (1, 6, 3, (2, 6), 33, 33, 8, 8, 8, 8, 2, "none"),  # rows that split a KV group: per head
    (2, 4, 2, (2, 4), 21, 29, 8, 8, 1, 8, 2, "causal"),  # per token (MoBA, NSA)
    (2, 4, 4, (4, None), 40, 40, 8, 8, 4, 16, 2, "padding"),
    (2, 4, 2, (2, 4), 48, 48, 8, 8, 16, 16, 2, "document"),
    (1, 4, 1, (1, None), 50, 50, 8, 8, 16, 16, 3, "window"),
    (1, 2, 2, (2, None), 1, 33, 8, 8, 1, 8, 2, "causal"),  # one query
]


def _case_id(c):
    B, Hq, Hkv, (H, _), Lq, Lk, D, Dv, qbs, bs, k, rest = c
    return f"B{B}-H{Hq}x{Hkv}r{H}-L{Lq}x{Lk}-D{D}v{Dv}-q{qbs}k{bs}x{k}-{rest}"


def _call(case, dtype, seed=0):
    B, Hq, Hkv, (H, num_heads), Lq, Lk, D, Dv, qbs, bs, k, rest = case
    gen = torch.Generator().manual_seed(seed)
    idx = _indices(B, H, math.ceil(Lq / qbs), math.ceil(Lk / bs), k, gen, qbs, bs)
    mask = block_select(idx, bs, num_heads=num_heads, query_block_size=qbs)
    other = _rest(rest, B, Lq, Lk)
    mask = mask if other is None else mask & other
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64)
    kk = torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=gen, dtype=torch.float64)
    if rest == "padding":  # keys past a length may hold anything
        kk[0, :, Lk - 5 :] = float("nan")
        v[0, :, Lk - 5 :] = float("nan")
    return mask, q, kk, v


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_gathered_equals_the_reference(case):
    mask, q, k, v = _call(case, torch.float64)
    assert block_gather.selection_of(mask) is not None
    explained = mh.explain(q, k, v, mask=mask, backend="blocksparse")
    assert "gathered" in str(explained) and "selection density" in str(explained)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = mh.attention(*ins, mask=mask, backend="blocksparse", return_lse=True)
    want = mh.attention(*refs, mask=mask, backend="reference", return_lse=True)
    torch.testing.assert_close(got.output, want.output)
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(want.lse))
    finite = torch.isfinite(want.lse)
    torch.testing.assert_close(got.lse[finite], want.lse[finite])
    gen = torch.Generator().manual_seed(1)
    g_out = torch.randn(want.output.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(want.lse.shape, generator=gen, dtype=torch.float64)

    def loss(r):
        return (r.output * g_out).sum() + (r.lse.masked_fill(~finite, 0.0) * g_lse).sum()

    for a, b, name in zip(torch.autograd.grad(loss(got), ins), torch.autograd.grad(loss(want), refs), "qkv"):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


LOW = [CASES[0], CASES[3], CASES[5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", LOW, ids=[_case_id(c) for c in LOW])
def test_low_precision_by_the_relative_rule(case, dtype):
    mask, q, k, v = _call(case, torch.float64, seed=3)
    ref = mh.attention(q, k, v, mask=mask, backend="reference")
    ql, kl, vl = (t.to(dtype) for t in (q, k, v))
    got = mh.attention(ql, kl, vl, mask=mask, backend="blocksparse")
    base = naive_attention(ql, kl, vl, mask)
    assert_relative(got, ref, base, factor=10 if dtype == torch.float32 else 2)
    # gradients
    ins = [t.clone().requires_grad_() for t in (ql, kl, vl)]
    naive_in = [t.clone().requires_grad_() for t in (ql, kl, vl)]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ga = torch.autograd.grad((mh.attention(*ins, mask=mask, backend="blocksparse") * g.to(dtype)).sum(), ins)
    gb = torch.autograd.grad((naive_attention(*naive_in, mask) * g.to(dtype)).sum(), naive_in)
    gr = torch.autograd.grad((mh.attention(*ref_in, mask=mask, backend="reference") * g).sum(), ref_in)
    for a, b, r, name in zip(ga, gb, gr, "qkv"):
        assert_relative(a, r, b, factor=10 if dtype == torch.float32 else 3, what=f"d{name}", magnitude=1.0)


def test_the_causal_diagonal_runs_as_is_causal(monkeypatch):
    """Query blocks and key blocks on one grid with a causal mask: the own block is the kernel's
    ``is_causal`` with no mask tensor, the other blocks one call with a mask of one row."""
    seen = []
    real = block_gather.flash

    def spy(q, k, v, p, is_causal, attn_mask=None, scale=None):
        seen.append((is_causal, None if attn_mask is None else tuple(attn_mask.shape)))
        return real(q, k, v, p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(block_gather, "flash", spy)
    gen = torch.Generator().manual_seed(0)
    B, H, L, bs = 1, 2, 64, 16
    idx = torch.stack([torch.arange(4), torch.zeros(4, dtype=torch.long)], -1).expand(B, H, 4, 2).clone()
    mask = block_select(idx, bs) & causal()
    q, k, v = (torch.randn(B, H, L, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    got = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    torch.testing.assert_close(got, mh.attention(q, k, v, mask=mask, backend="reference"))
    assert (True, None) in seen  # the diagonal
    assert all(shape is None or shape[-2] == 1 for causal_, shape in seen if not causal_)  # one-row masks


def test_work_follows_the_selection(monkeypatch):
    """The kernel sees each query block's selected key blocks and no other: the keys passed are
    ``k · bs`` per unit and query block, whatever ``Lk`` is."""
    keys = []
    real = block_gather.flash

    def spy(q, k, v, p, is_causal, attn_mask=None, scale=None):
        keys.append(k.shape[0] * k.shape[2])
        return real(q, k, v, p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(block_gather, "flash", spy)
    B, H, bs, k = 1, 2, 16, 2
    for L in (256, 512):
        keys.clear()
        nQ = L // bs
        idx = torch.stack([torch.arange(nQ), torch.zeros(nQ, dtype=torch.long)], -1).expand(B, H, nQ, k)
        q = torch.randn(B, H, L, 8)
        mh.attention(q, q, q, mask=block_select(idx, bs) & causal(), backend="blocksparse")
        assert sum(keys) <= B * H * nQ * k * bs  # not ∝ L²


def test_per_token_selections_run_key_major(monkeypatch):
    """One query per block (NSA, MoBA, a top-k indexer): each chosen key block is read once per tile
    of the queries that chose it; the query rows the kernel sees are the pairs chosen (padded to
    tiles), not ``k · bs`` keys copied per query."""
    from multihead.backends import key_major

    rows = []
    real = key_major.flash

    def spy(q, k, v, p, is_causal, attn_mask=None, scale=None):
        assert k.shape[2] == 16  # one key block per tile
        rows.append(q.shape[0] * q.shape[2])
        return real(q, k, v, p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(key_major, "flash", spy)
    B, Hq, Hkv, L, bs, k = 1, 4, 2, 256, 16, 3
    gen = torch.Generator().manual_seed(0)
    own = (torch.arange(L) // bs).view(1, 1, L, 1)
    idx = torch.cat([own.expand(B, Hkv, L, 1), torch.randint(0, 4, (B, Hkv, L, k - 1), generator=gen)], -1).expand(
        B, Hkv, L, k
    )
    mask = block_select(idx, bs, num_heads=Hq, query_block_size=1) & causal()
    q = torch.randn(B, Hq, L, 8, dtype=torch.float64, generator=gen)
    kk, v = (torch.randn(B, Hkv, L, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    assert "key-major" in str(mh.explain(q, kk, v, mask=mask, backend="blocksparse"))
    got = mh.attention(q, kk, v, mask=mask, backend="blocksparse")
    torch.testing.assert_close(got, mh.attention(q, kk, v, mask=mask, backend="reference"))
    pairs = B * Hq * L * k
    groups = B * Hkv * (L // bs)  # (KV head, key block): at most one part-filled tile each, per kind
    assert pairs <= sum(rows) <= pairs + 2 * groups * key_major.TILE_ROWS
