"""multihead's CPU kernel for block-selected attention (``backends/cpu_sparse.c``, bound by
``cpu_sparse.py``): what ``blocksparse`` runs for a ``block_select`` mask (alone or ``& causal()``)
on fp32 CPU tensors.

* outputs, LSE and the gradients of q, k, v and of the LSE against the fp64 reference by the
  relative rule of shared/TESTING.md (fp32: factor 10 of plain fp32 attention's error), over
  rows per query head, per KV group and one for all heads (GQA), selections per token (MoBA,
  NSA) and per block, block sizes of one to several register tiles and with a tail (48, 80),
  lengths at a block size ±1 and odd, ``Lq != Lk`` in both causal alignments, ``D != Dv``;
* ``-1`` entries, a block named twice (counts once, as the mask), rows that see nothing (output 0,
  LSE -inf, zero gradients), keys of blocks no row chose holding NaN, non-contiguous inputs;
* the backward's two ways of sharing out the work (a thread per (batch, KV head), or per-thread
  buffers summed after) agree; ``explain()`` names the kernel, and says why when it is not used.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.backends import cpu_sparse
from multihead.backends.block_gather import selection_of
from multihead.masks import block_select, causal, sliding_window

pytestmark = pytest.mark.skipif(
    cpu_sparse.kernel() is None, reason=f"the CPU sparse kernel is unavailable: {cpu_sparse.unavailable()}"
)


def _indices(B, H, nQ, nK, k, gen):
    """Random key blocks: ``-1`` sprinkled in, a block twice in a row, a row with none at all."""
    idx = torch.randint(-1, nK, (B, H, nQ, k), generator=gen)
    idx[0, 0, 0] = -1  # a query block with no key block: its rows see nothing
    if k > 1 and nQ > 1:
        idx[-1, -1, -1, 1] = idx[-1, -1, -1, 0]  # the same block twice counts once
    return idx


CASES = [
    # B, Hq, Hkv, rows of heads (H, num_heads), Lq, Lk, D, Dv, qbs, bs, k, rest
    (1, 4, 2, (4, None), 65, 65, 16, 16, 1, 16, 3, "causal"),  # MoBA: per token, per query head
    (2, 6, 2, (2, 6), 63, 63, 32, 32, 1, 16, 3, "causal"),  # NSA: per token, per KV group
    (2, 4, 4, (4, None), 64, 64, 16, 16, 16, 16, 2, "causal"),  # per block, one grid
    (1, 4, 2, (1, None), 129, 129, 16, 16, 64, 64, 2, "causal"),  # one row for all heads; 2·64 + 1
    (1, 2, 2, (2, None), 127, 127, 16, 16, 1, 64, 2, "causal"),  # 2·64 - 1
    (1, 4, 2, (2, 4), 37, 80, 16, 32, 1, 16, 3, "causal"),  # Lq < Lk bottom-right, D != Dv
    (1, 2, 1, (1, None), 50, 33, 16, 16, 4, 16, 2, "causal_tl"),  # Lq > Lk top-left
    (2, 4, 2, (2, 4), 45, 45, 48, 48, 8, 32, 2, "none"),  # no other mask
    (1, 2, 2, (2, None), 101, 101, 16, 16, 1, 80, 2, "causal"),  # a tile of 64 keys and one of 16
    (1, 2, 2, (2, None), 99, 99, 16, 16, 3, 48, 2, "causal"),  # 48 keys: three vectors
    (1, 2, 1, (1, None), 310, 310, 16, 16, 300, 16, 3, "causal"),  # query blocks longer than a tile
    (1, 1, 1, (1, None), 1, 40, 16, 16, 1, 16, 2, "causal"),  # one query
]


def _case_id(c):
    B, Hq, Hkv, (H, _), Lq, Lk, D, Dv, qbs, bs, k, rest = c
    return f"B{B}-H{Hq}x{Hkv}r{H}-L{Lq}x{Lk}-D{D}v{Dv}-q{qbs}k{bs}x{k}-{rest}"


def _rest(kind):
    return {"none": None, "causal": causal(), "causal_tl": causal(align="top_left")}[kind]


def _call(case, seed=0):
    B, Hq, Hkv, (H, num_heads), Lq, Lk, D, Dv, qbs, bs, k, rest = case
    gen = torch.Generator().manual_seed(seed)
    idx = _indices(B, H, math.ceil(Lq / qbs), math.ceil(Lk / bs), k, gen)
    mask = block_select(idx, bs, num_heads=num_heads, query_block_size=qbs)
    other = _rest(rest)
    mask = mask if other is None else mask & other
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64)
    kk = torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=gen, dtype=torch.float64)
    return mask, q, kk, v


@pytest.fixture
def calls(monkeypatch):
    """How many times the kernel's forward and backward ran."""
    seen = {"forward": 0, "backward": 0}
    forward, backward = cpu_sparse._forward, cpu_sparse._backward

    def spy_forward(*args, **kwargs):
        seen["forward"] += 1
        return forward(*args, **kwargs)

    def spy_backward(*args, **kwargs):
        seen["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(cpu_sparse, "_forward", spy_forward)
    monkeypatch.setattr(cpu_sparse, "_backward", spy_backward)
    return seen


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_the_kernel_equals_the_reference(case, calls):
    mask, q, k, v = _call(case)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ins = [t.float().requires_grad_() for t in (q, k, v)]
    naive_in = [t.float().requires_grad_() for t in (q, k, v)]
    got = mh.attention(*ins, mask=mask, backend="blocksparse", return_lse=True)
    want = mh.attention(*ref_in, mask=mask, backend="reference", return_lse=True)
    base = naive_attention(*naive_in, mask)
    assert calls["forward"] == 1
    assert_relative(got.output, want.output, base, factor=10)
    # the LSE: -inf exactly where the reference's is (rows that see nothing), close elsewhere
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(want.lse))
    finite = torch.isfinite(want.lse)
    torch.testing.assert_close(got.lse[finite].double(), want.lse[finite], rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(1)
    g_out = torch.randn(want.output.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(want.lse.shape, generator=gen, dtype=torch.float64).masked_fill(~finite, 0.0)

    def loss(r, dtype):
        return (r.output * g_out.to(dtype)).sum() + (r.lse.masked_fill(~finite, 0.0) * g_lse.to(dtype)).sum()

    grads = torch.autograd.grad(loss(got, torch.float32), ins)
    assert calls["backward"] == 1
    wanted = torch.autograd.grad(loss(want, torch.float64), ref_in)
    baseline = torch.autograd.grad((base * g_out.float()).sum(), naive_in)  # the LSE has no naive form
    for a, r, b, name in zip(grads, wanted, baseline, "qkv"):
        assert_relative(a, r, b, factor=10, what=f"d{name}", magnitude=1.0)


def test_rows_that_see_nothing_give_zero_and_no_gradient():
    B, Hq, L, D, bs = 1, 2, 40, 16, 16
    idx = torch.tensor([[[[0, 1]] * 40, [[-1, -1]] * 40]])  # head 1 reads nothing
    idx[0, 0, 3] = torch.tensor([2, 2])  # query 3 of head 0: a block after it, twice
    mask = block_select(idx, bs, query_block_size=1) & causal()
    q, k, v = (torch.randn(B, Hq, L, D, requires_grad=True) for _ in range(3))
    r = mh.attention(q, k, v, mask=mask, backend="blocksparse", return_lse=True)
    assert torch.equal(r.output[0, 1], torch.zeros(L, D)) and bool(torch.isneginf(r.lse[0, 1]).all())
    assert torch.equal(r.output[0, 0, 3], torch.zeros(D)) and bool(torch.isneginf(r.lse[0, 0, 3]))
    r.output.sum().backward()
    assert q.grad is not None and torch.equal(q.grad[0, 1], torch.zeros(L, D))
    assert torch.equal(q.grad[0, 0, 3], torch.zeros(D))


def test_a_block_named_twice_counts_once_and_unchosen_keys_may_hold_nan():
    gen = torch.Generator().manual_seed(0)
    B, H, L, D, bs = 1, 2, 96, 16, 16
    once = torch.randint(0, 6, (B, H, L, 1), generator=gen).expand(B, H, L, 3).clone()
    once[..., 1:] = -1
    twice = once.clone()
    twice[..., 1] = once[..., 0]  # the same block again, in place of a -1
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    chosen = torch.zeros(L // bs, dtype=torch.bool)
    chosen[once[..., 0].unique()] = True
    keys_chosen = chosen.repeat_interleave(bs)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, ~keys_chosen], v2[:, :, ~keys_chosen] = float("nan"), float("nan")
    a = mh.attention(q, k, v, mask=block_select(once, bs, query_block_size=1), backend="blocksparse")
    b = mh.attention(q, k2, v2, mask=block_select(twice, bs, query_block_size=1), backend="blocksparse")
    assert torch.equal(a, b)


def test_non_contiguous_inputs():
    """q as a transposed view with features strided, k and v expanded over the batch (stride 0)."""
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D, bs = 2, 4, 2, 70, 32, 16
    q = torch.randn(B, Hq, D, L, generator=gen).transpose(-1, -2)  # features not contiguous
    k = torch.randn(1, L, Hkv, D, generator=gen).transpose(1, 2).expand(B, -1, -1, -1)
    v = torch.randn(1, Hkv, L, D, generator=gen).expand(B, -1, -1, -1)
    idx = torch.randint(-1, 5, (B, Hkv, L, 3), generator=gen)
    mask = block_select(idx, bs, num_heads=Hq, query_block_size=1) & causal()
    sel = selection_of(mask.for_heads(Hq))
    assert sel is not None and cpu_sparse.supports(q, k, v, sel)
    got = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    want = mh.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert_relative(got, want, naive_attention(q, k, v, mask), factor=10)


def test_the_backward_shares_out_work_either_way():
    """Threads per (batch row, KV head) and per-thread buffers summed after give the same gradients."""
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D, bs = 1, 4, 2, 150, 16, 16
    q, k, v, dout = (torch.randn(B, h, L, D, generator=gen) for h in (Hq, Hkv, Hkv, Hq))
    idx = torch.randint(-1, 10, (B, Hq, L, 4), generator=gen)
    sel = selection_of(block_select(idx, bs, query_block_size=1) & causal())
    assert sel is not None
    lib = cpu_sparse.kernel()
    call = cpu_sparse._Call(q, k, v, sel, 0.25, backward=True)
    out, lse = cpu_sparse._forward(lib, call, 1)
    out3, lse3 = cpu_sparse._forward(lib, call, 3)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)  # each row computed by one thread alone
    one = cpu_sparse._backward(lib, call, out, lse, dout, None, 1)  # 2 pairs >= 1 thread
    three = cpu_sparse._backward(lib, call, out, lse, dout, None, 3)  # 2 pairs < 3 threads: buffers
    for a, b in zip(one, three):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_explain_names_the_kernel_or_why_not():
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 4, (1, 2, 64, 2), generator=gen)
    mask = block_select(idx, 16, query_block_size=1) & causal()
    q = torch.randn(1, 2, 64, 16, generator=gen)
    assert "kernel: multihead's CPU sparse kernel (cpu_sparse.c" in str(
        mh.explain(q, q, q, mask=mask, backend="blocksparse")
    )
    qb = q.to(torch.bfloat16)
    text = str(mh.explain(qb, qb, qb, mask=mask, backend="blocksparse"))
    assert "PyTorch kernel" in text and "the CPU sparse kernel: it takes fp32" in text
    windowed = block_select(idx, 16, query_block_size=1) & causal() & sliding_window(8)
    sel = selection_of(windowed)
    assert sel is not None and not cpu_sparse.supports(q, q, q, sel)  # another mask: the PyTorch paths


def test_compiling_and_other_operands_take_the_pytorch_paths(monkeypatch, calls):
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 4, (1, 2, 64, 2), generator=gen)
    mask = block_select(idx, 16, query_block_size=1) & causal()
    q = torch.randn(1, 2, 64, 16, generator=gen)
    sel = selection_of(mask)
    assert sel is not None and cpu_sparse.supports(q, q, q, sel)
    assert not cpu_sparse.supports(q[..., :8], q[..., :8], q[..., :8], sel)  # head size 8
    assert not cpu_sparse.supports(q.double(), q.double(), q.double(), sel)
    fast = mh.attention(q, q, q, mask=mask, backend="blocksparse")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not cpu_sparse.supports(q, q, q, sel)
    slow = mh.attention(q, q, q, mask=mask, backend="blocksparse")
    assert calls["forward"] == 1  # the first call only
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["moba", "nsa"])
def test_the_layers_run_the_kernel(layer, calls):
    """MoBA's and NSA's selected attention in fp32 with head size 16: through the kernel, and equal
    to the reference on the same mask."""
    from multihead.layers.moba import MobaCore
    from multihead.layers.nsa import NsaCore

    gen = torch.Generator().manual_seed(0)
    Hq, Hkv, L, D = 4, 2, 300, 16  # past the size where one SDPA call with the mask runs instead
    q = torch.randn(1, Hq, L, D, generator=gen)
    k, v = torch.randn(1, Hkv, L, D, generator=gen), torch.randn(1, Hkv, L, D, generator=gen)
    if layer == "moba":
        core = MobaCore(16, 3)
        mask = core._mask(q, k, None)
    else:
        nsa = mh.NativeSparseAttention(
            Hq * D,
            Hq,
            num_kv_heads=Hkv,
            compress_block=16,
            compress_stride=8,
            select_block=16,
            select_count=3,
            window=32,
        )
        gates = torch.sigmoid(torch.randn(1, L, 3 * Hq, generator=gen))
        core = NsaCore(nsa, gates, None)
        with torch.no_grad():
            _, idx = core.compressed_and_chosen(q, k, v)
        mask = core._selected(idx, Hq)
    got = mh.attention(q, k, v, mask=mask)
    assert calls["forward"] == 1
    want = mh.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert_relative(got, want, naive_attention(q, k, v, mask), factor=10)


def test_the_self_test_runs_under_no_grad():
    """The kernel is built on its first use, which may come inside ``torch.no_grad()``: its
    self-test (a backward) must pass there too, or the kernel would be refused for the process."""
    lib = cpu_sparse.kernel()
    assert lib is not None
    with torch.no_grad():
        cpu_sparse._self_test(lib)
