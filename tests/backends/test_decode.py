"""The ``decode`` backend (a few query tokens, each KV head's query heads folded into one matmul)
against the fp64 reference, by the relative rule of shared/TESTING.md: Lq 1..4, MHA/GQA/MQA,
fp64/fp32/bf16/fp16, every mask a decode step meets, NaN in keys nobody sees, fully masked rows,
non-contiguous and expanded inputs, chunk boundaries, and the ``auto`` decision."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import DEVICES, LargestAllocation, assert_relative, naive_attention
from multihead.backends.decode import AUTO_MAX_QUERIES, MAX_QUERIES
from multihead.blocks import Block, Extent
from multihead.call import mask_and_score_mod

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


# every test twice: multihead's CPU decode kernel and PyTorch's GEMMs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("decode_kernel")


HEADS = [(4, 4), (8, 2), (6, 3), (8, 1)]
CHUNK = 16  # a small chunk for the split-K tests: lengths around it cross chunk boundaries


def _mask(kind: str, B: int, Hq: int, Lq: int, Lk: int, gen: torch.Generator):
    """A mask of a decode step; several leave some rows (or a batch element) fully masked."""
    lengths = torch.randint(1, Lk + 1, (B,), generator=gen)
    lengths[0] = Lk
    table = {
        "none": lambda: None,
        "causal": lambda: mh.causal(),
        "causal_top_left": lambda: mh.causal("top_left"),
        "window": lambda: mh.sliding_window(5),
        "window_top_left": lambda: mh.sliding_window(3, 1, align="top_left"),
        "window_per_sequence": lambda: mh.sliding_window(4, kv_lengths=lengths) & mh.key_padding(lengths),
        "causal_per_sequence": lambda: mh.causal(kv_lengths=lengths) & mh.key_padding(lengths),
        "key_padding": lambda: mh.key_padding(lengths),
        "key_padding_empty_batch": lambda: mh.key_padding([Lk] + [0] * (B - 1)),
        # the first Lq queries of a longer attention, read shifted (short caches: first rows fully masked)
        "shifted_causal": lambda: mh.causal().shifted(0, 0, q_len=Lq + 5, kv_len=Lk),
        "shifted_top_left": lambda: mh.causal("top_left").shifted(-2, 0),  # rows before key 0: fully masked
        # a static cache's mask: (B, 1, Lq, S) bool, True = may attend; slots past each row's length unused
        "static_cache": lambda: (torch.arange(Lk).view(1, 1, 1, Lk) < lengths.view(B, 1, 1, 1)).expand(B, 1, Lq, Lk),
        "bool_per_head": lambda: torch.rand(B, Hq, Lq, Lk, generator=gen) > 0.3,
        "bool_rows": lambda: torch.rand(1, 1, Lq, Lk, generator=gen) > 0.5,
        "document": lambda: mh.document(
            torch.zeros(B, Lq, dtype=torch.long) + 1, (torch.arange(Lk) >= Lk // 3).long().expand(B, Lk)
        ),
    }
    return table[kind]()


MASKS = [
    "none",
    "causal",
    "causal_top_left",
    "window",
    "window_top_left",
    "window_per_sequence",
    "causal_per_sequence",
    "key_padding",
    "key_padding_empty_batch",
    "shifted_causal",
    "shifted_top_left",
    "static_cache",
    "bool_per_head",
    "bool_rows",
    "document",
]
LENGTHS = [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 300]


def _cases():
    """Each mask with every Lq in 1..4, heads and lengths rotated through, plus every dtype."""
    cases = []
    i = 0
    for mask in MASKS:
        for Lq in (1, 2, 3, 4):
            Hq, Hkv = HEADS[i % len(HEADS)]
            Lk = max(LENGTHS[i % len(LENGTHS)], Lq if "top_left" in mask else 1)
            cases.append((mask, 1 + 2 * (i % 2), Hq, Hkv, Lq, Lk, i))
            i += 1
    return cases


CASES = _cases()


def _inputs(B, Hq, Hkv, Lq, Lk, seed, D=16, Dv=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv or D, generator=gen, dtype=torch.float64)
    return q, k, v, gen


def _baseline_lse(q, k, mask, scale=None):
    """The naive LSE in the input dtype (the baseline of the rule for the LSE)."""
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    scores = (q @ k.repeat_interleave(Hq // k.shape[1], 1).transpose(-2, -1)) * (D**-0.5 if scale is None else scale)
    m, mod = mask_and_score_mod(mask, None, check_binary=False)
    if mod is not None:
        scores = mod.apply_block(Extent(B, Hq, Lq, Lk), Block(0, Lq, 0, Lk), scores)
    if m is not None:
        scores = scores.masked_fill(~m.materialize(B, Hq, Lq, Lk), float("-inf"))
    return torch.logsumexp(scores, -1)


@pytest.fixture
def small_chunks(monkeypatch):
    """The registered decode backend with chunks of CHUNK keys: long ranges run split-K."""
    monkeypatch.setattr(mh.get_backend("decode"), "chunk_size", CHUNK)


def _check(q64, k64, v64, mask, dtype, scale=None, what="", device="cpu"):
    """The decode backend on ``device`` against the fp64 reference, compared on CPU."""
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    got = mh.attention(*(t.to(device) for t in (q, k, v)), mask=mask, scale=scale, backend="decode", return_lse=True)
    got = mh.AttentionResult(got.output.cpu(), None, got.lse.cpu())
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask, scale=scale)
    assert got.output.dtype == dtype and got.output.shape == ref.output.shape
    assert got.lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    empty = torch.isneginf(ref.lse)
    assert torch.equal(torch.isneginf(got.lse), empty), f"{what}: LSE must be -inf exactly on fully masked rows"
    assert torch.equal(got.output[empty], torch.zeros_like(got.output[empty])), f"{what}: fully masked rows give 0"
    if dtype == torch.float64:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
        return
    F = mh.get_backend("decode").capabilities.tolerance_factor(dtype)
    assert_relative(got.output, ref.output, naive_attention(q, k, v, mask, scale=scale), F, f"{what} output")
    seen = ~empty
    base_lse = _baseline_lse(q, k, mask, scale)
    assert_relative(got.lse[seen].to(dtype), ref.lse[seen], base_lse[seen], F, f"{what} lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}-H{c[2]}x{c[3]}-L{c[4]}x{c[5]}")
def test_matches_reference(case, dtype, device, small_chunks):
    mask_kind, B, Hq, Hkv, Lq, Lk, seed = case
    q, k, v, gen = _inputs(B, Hq, Hkv, Lq, Lk, seed)
    mask = _mask(mask_kind, B, Hq, Lq, Lk, gen)
    assert mh.explain(*(t.to(device) for t in (q, k, v)), mask=mask, backend="decode").backend == "decode"
    _check(q, k, v, mask, dtype, what=mask_kind, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Lk", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1])
@pytest.mark.parametrize("mask_kind", ["none", "window", "static_cache", "key_padding_empty_batch"])
def test_chunk_boundaries(Lk, mask_kind, device, small_chunks):
    """Key ranges of a chunk size ± 1 (one chunk, a chunk and one key, ...), merged by LSE."""
    q, k, v, gen = _inputs(3, 8, 2, 2, Lk, Lk)
    mask = _mask(mask_kind, 3, 8, 2, Lk, gen)
    for dtype in (torch.float64, torch.float32):
        _check(q, k, v, mask, dtype, what=f"{mask_kind} Lk={Lk}", device=device)


@pytest.mark.parametrize("Lk", [19, 20, 21, 41])
def test_default_chunks_bound_the_scores(Lk, monkeypatch):
    """Without a chunk_size, a chunk holds at most SCORES_PER_CHUNK scores (B·Hq·Lq rows x keys)."""
    import multihead.backends.decode as decode

    B, Hq, Lq = 2, 4, 3
    monkeypatch.setattr(decode, "SCORES_PER_CHUNK", B * Hq * Lq * 20)
    monkeypatch.setattr(decode, "_MIN_CHUNK", 1)
    q, k, v, _ = _inputs(B, Hq, 1, Lq, Lk, 5)
    chunks = -(-Lk // 20)
    report = str(mh.explain(q, k, v, mask=mh.causal(), backend="decode"))
    assert (f"in {chunks} chunks of <= 20" in report) == (chunks > 1), report
    _check(q, k, v, mh.causal(), torch.float32, what=f"Lk={Lk}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs_get_an_lse_from_fp32_scores_so_the_weights_sum_to_one(dtype):
    # decode's half GEMM rounds each score to the input dtype (fast, and as exact as a naive
    # computation in that dtype). Its LSE was 0.02 off (bf16, scores of a few units) where sdpa's
    # was 3e-5, and weights recomputed in fp32 and normalised by it summed to 0.987..1.024 (found
    # by a differential fuzzer): the LSE now comes from fp32 scores, as the weights do.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 128, generator=gen).to(dtype) for n in (1, 1000, 1000))
    s = 0.3 * q.double() @ k.double().transpose(-1, -2)
    lse64 = torch.logsumexp(s, -1)
    got = {
        be: mh.attention(q, k, v, scale=0.3, return_weights=True, return_lse=True, backend=be)
        for be in ("decode", "sdpa")
    }
    lse_error = {be: float((r.lse.double() - lse64).abs().max()) for be, r in got.items()}
    assert lse_error["decode"] <= 2 * lse_error["sdpa"] + 1e-6, lse_error
    sums = got["decode"].weights.float().sum(-1)
    assert float((sums - 1).abs().max()) < 4e-3


@pytest.mark.parametrize("scale", [None, 0.37, 0.0, -0.5])
def test_scale_and_head_dims(scale):
    q, k, v, gen = _inputs(2, 6, 3, 3, 41, 7, D=40, Dv=24)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        _check(q, k, v, mh.causal(), dtype, scale=scale, what=f"scale={scale}")


@pytest.mark.parametrize("mask_kind", ["key_padding", "static_cache", "window_per_sequence", "window"])
def test_nan_in_keys_no_query_may_see_does_not_leak(mask_kind, small_chunks):
    """Keys and values no query may see hold NaN (a cache's unused slots, padding, keys left of a
    window): with ``check_finite=True`` outputs and gradients equal those with finite values there."""
    B, Hq, Hkv, Lq, Lk = 3, 8, 2, 2, 3 * CHUNK + 3
    q, k, v, gen = _inputs(B, Hq, Hkv, Lq, Lk, 11)
    mask = _mask(mask_kind, B, Hq, Lq, Lk, gen)
    if mask_kind == "window":
        lengths = torch.full((B,), Lk)
    else:
        lengths = torch.tensor([Lk, 5, CHUNK + 2])  # rows 1, 2: keys past 5 and CHUNK + 2 unseen
        mask = {
            "key_padding": mh.key_padding(lengths),
            "static_cache": (torch.arange(Lk).view(1, 1, 1, Lk) < lengths.view(B, 1, 1, 1)).expand(B, 1, Lq, Lk),
            "window_per_sequence": mh.sliding_window(4, kv_lengths=lengths) & mh.key_padding(lengths),
        }[mask_kind]
    visible = mh.masks.as_mask(mask).materialize(B, Hq, Lq, Lk).any(2).any(1).expand(B, Lk)  # keys some row sees
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b in range(B):
        poisoned_k[b, :, ~visible[b]] = float("nan")
        poisoned_v[b, :, ~visible[b]] = float("nan")
    want = mh.attention(q, k, v, mask=mask, backend="reference")
    for dtype in (torch.float64, torch.float32):
        leaves = [t.to(dtype).requires_grad_() for t in (q, poisoned_k, poisoned_v)]
        got = mh.attention(*leaves, mask=mask, backend="decode", check_finite=True)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        for name, g in zip("qkv", torch.autograd.grad(got.sum(), leaves)):
            assert torch.isfinite(g).all(), f"d{name} read the NaN of a key nobody sees"
        with torch.no_grad():  # the path without autograd (fused softmax) as well
            torch.testing.assert_close(
                mh.attention(*leaves, mask=mask, backend="decode", check_finite=True).double(),
                want,
                rtol=1e-5,
                atol=1e-5,
            )


def test_nan_in_a_seen_key_reaches_exactly_the_rows_that_see_it():
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 1, 20
    q, k, v, _ = _inputs(B, Hq, Hkv, Lq, Lk, 12)
    v = v.clone()
    v[1, 0, 3] = float("nan")  # batch 1, KV head 0: seen by query heads 0 and 1 of batch 1 only
    out = mh.attention(q, k, v, mask=mh.key_padding([20, 10]), backend="decode", check_finite=True)
    bad = torch.zeros(B, Hq, dtype=torch.bool)
    bad[1, :2] = True
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["key_padding_empty_batch", "shifted_top_left", "bool_per_head", "window"])
def test_gradients_match_reference_and_are_zero_on_fully_masked_rows(mask_kind, dtype, device, small_chunks):
    B, Hq, Hkv, Lq, Lk = 2, 6, 3, 3, 2 * CHUNK + 3
    q64, k64, v64, gen = _inputs(B, Hq, Hkv, Lq, Lk, 13)
    mask = _mask(mask_kind, B, Hq, Lq, Lk, gen)
    grad_out = torch.randn(B, Hq, Lq, 16, generator=gen, dtype=torch.float64)

    def grads(fn, dt, device_="cpu"):
        leaves = [t.to(dtype).to(dt).to(device_).requires_grad_() for t in (q64, k64, v64)]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype).to(device_))
        return out.detach().cpu(), [t.grad.cpu() for t in leaves]

    out, got = grads(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend="decode"), dtype, device)
    ref_out, ref = grads(lambda q, k, v: mh.reference_attention(q, k, v, mask=mask).output, torch.float64)
    for g in got:
        assert torch.isfinite(g).all()
    empty = (ref_out == 0).all(-1)
    assert torch.equal(got[0][empty], torch.zeros_like(got[0][empty])), "dQ of fully masked rows is exactly 0"
    if dtype == torch.float64:
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
        return
    _, base = grads(lambda q, k, v: naive_attention(q, k, v, mask), dtype)
    magnitude = max(float(r.abs().max()) for r in ref)
    F = mh.get_backend("decode").capabilities.tolerance_factor(dtype, gradients=True)
    for name, g, r, b in zip("qkv", got, ref, base):
        assert_relative(g, r, b, F, f"grad {name}", magnitude=magnitude)


def test_fully_masked_everywhere_gives_zeros_minus_inf_and_zero_grads():
    q, k, v, _ = _inputs(2, 4, 2, 2, 9, 14)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    for mask in (torch.zeros(2, 9, dtype=torch.bool), mh.key_padding([0, 0])):
        res = mh.attention(q, k, v, mask=mask, backend="decode", return_lse=True)
        assert torch.equal(res.output, torch.zeros_like(res.output)) and torch.isneginf(res.lse).all()
        assert "no query sees any key" in str(mh.explain(q, k, v, mask=mask, backend="decode"))
        for g in torch.autograd.grad(res.output.sum(), (q, k, v)):
            assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("layout", ["transposed_q", "packed_kv", "expanded_heads", "expanded_batch", "strided_len"])
def test_non_contiguous_and_expanded_inputs(layout):
    B, Hq, Hkv, Lq, Lk, D = 2, 8, 2, 3, 37, 16

    def make(dtype):
        gen = torch.Generator().manual_seed(15)
        q = torch.randn(B, Lq, Hq, D, generator=gen, dtype=dtype).transpose(1, 2)  # (B, Hq, Lq, D) view
        packed = torch.randn(B, Lk, 2, Hkv, D, generator=gen, dtype=dtype)  # a fused KV projection
        k, v = packed[:, :, 0].transpose(1, 2), packed[:, :, 1].transpose(1, 2)
        if layout == "expanded_heads":  # one KV head expanded with stride 0: read once, as MQA
            k, v = k[:, :1].expand(B, Hkv, Lk, D), v[:, :1].expand(B, Hkv, Lk, D)
        elif layout == "expanded_batch":  # a shared prefix for every sequence
            k, v = k[:1].expand(B, Hkv, Lk, D), v[:1].expand(B, Hkv, Lk, D)
        elif layout == "strided_len":  # every other slot of a longer buffer
            k, v = torch.cat([k, k], 2)[:, :, ::2], torch.cat([v, v], 2)[:, :, ::2]
        elif layout == "transposed_q":  # last dim of stride Lq: copied by validation
            q = q.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
        return q, k, v

    mask = mh.sliding_window(20)
    for dtype in (torch.float64, torch.float32):
        q, k, v = make(dtype)
        _check(q, k, v, mask, dtype, what=layout)
        report = str(mh.explain(q, k, v, mask=mask, backend="decode"))
        assert ("read once as MQA" in report) == (layout == "expanded_heads"), report


def test_band_masks_read_only_their_key_range_and_structure_needs_no_mask():
    q, k, v, _ = _inputs(1, 8, 2, 1, 2048, 16, D=64)  # B·Hq·Lk·D = 2^20: AUTO_MIN_WORK
    report = str(mh.explain(q, k, v, mask=mh.sliding_window(63)))
    assert "backend: decode" in report and "keys read: 64 of 2048 ([1984, 2048))" in report
    assert "no mask" in report  # every key in the window is visible to the one query
    report = str(mh.explain(q, k, v, mask=mh.causal(), backend="decode"))
    assert "keys read: 2048 of 2048" in report and "no mask" in report


def test_a_static_cache_mask_reads_only_up_to_the_last_visible_slot():
    S, lengths = 4096, torch.tensor([700, 1200])
    q = torch.randn(2, 8, 1, 16)
    k, v = torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16)
    k[:, :, 1200:] = float("nan")  # unused slots: never read
    mask = torch.arange(S).view(1, 1, 1, S) < lengths.view(2, 1, 1, 1)  # (B, 1, Lq, S)
    report = str(mh.explain(q, k, v, mask=mask))
    assert "backend: decode" in report and "keys read: 1200 of 4096 ([0, 1200))" in report
    got = mh.attention(q, k, v, mask=mask)
    want = mh.reference_attention(
        q.double(), k[:, :, :1200].double(), v[:, :, :1200].double(), mask=mask[..., :1200]
    ).output
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_scores_stay_within_one_chunk_and_no_dense_mask_is_built(small_chunks):
    """The largest tensor any op returns is a view of K/V, a chunk of scores or one row mask,
    never the B x Hq x Lq x Lk scores or mask of the whole call (4x the size of K here)."""
    B, Hq, Hkv, Lq, Lk, D = 2, 16, 2, 4, 4096, 16
    q, k, v = torch.randn(B, Hq, Lq, D), torch.randn(B, Hkv, Lk, D), torch.randn(B, Hkv, Lk, D)
    for mask in (
        None,
        mh.causal(),
        mh.sliding_window(1000) & mh.key_padding([4000, 3000]),
        torch.ones(B, 1, Lq, Lk, dtype=torch.bool),
    ):
        with torch.no_grad(), LargestAllocation() as probe:
            mh.attention(q, k, v, mask=mask)
        assert probe.largest <= max(k.numel(), B * Lq * Lk) < B * Hq * Lq * Lk, (mask, probe.largest)


def test_auto_takes_decode_shaped_calls_and_explain_names_it(decode_kernel):
    k, v = torch.randn(2, 2, 1024, 64), torch.randn(2, 2, 1024, 64)  # B·Hq·Lk·D = 2^20: AUTO_MIN_WORK
    for Lq in range(1, AUTO_MAX_QUERIES + 1):
        q = torch.randn(2, 8, Lq, 64)
        for mask in (
            None,
            mh.causal(),
            mh.sliding_window(64),
            mh.key_padding([1024, 300]),
            torch.ones(2, 1, Lq, 1024, dtype=torch.bool),
        ):
            report = mh.explain(q, k, v, mask=mask)
            if decode_kernel == "torch_gemms" and (
                mask is None
                or (
                    Lq == 1
                    and isinstance(mask, mh.masks.Mask)
                    and "band" in mask.kinds()
                    and mask.causal_offset(1, 1024) == 1023
                )
            ):
                # every query sees every key and no CPU kernel: sdpa folds the query heads into rows
                # itself, faster than this path's GEMMs (the kernel reads K/V faster than both)
                assert report.backend == "sdpa" and "every query sees every key" in report.refused["decode"][0]
                assert "folded into the rows of one call" in str(report)
                continue
            assert report.backend == "decode", str(report)
            assert "backend: decode (chosen by auto)" in str(report) and "folded into the rows" in str(report)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_auto_takes_decode_for_half_steps_that_see_every_key(dtype):
    """fp16/bf16: the decode path's K Qᵀ read beat SDPA's fold (docs/performance.md), so a GQA step
    that sees every key runs here, and is as exact as the relative rule asks."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 1024, 64, generator=g).to(dtype) for _ in range(2))
    for mask in (None, mh.causal()):
        report = mh.explain(q, k, v, mask=mask)
        assert report.backend == "decode", str(report)
        out = mh.attention(q, k, v, mask=mask)
        ref = mh.reference_attention(q.double(), k.double(), v.double()).output
        assert_relative(out, ref, naive_attention(q, k, v, None), factor=2)


@pytest.mark.parametrize("view", [True, False], ids=["v_in_k", "own_v"])
def test_auto_takes_decode_for_fp32_steps_with_two_head_sizes(view, decode_kernel):
    """fp32, D != Dv (MLA's absorbed step: V the first Dv features of K; or a V of its own): sdpa
    first makes the head sizes one and is 2.9-5x slower than the fold (benchmarks/decode_head_sizes.py),
    so auto takes decode, exact by the relative rule; with D == Dv it still leaves the step to sdpa."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, 1, 96, generator=g)
    k = torch.randn(1, 1, 1024, 96, generator=g)
    v = k[..., :64] if view else torch.randn(1, 1, 1024, 64, generator=g)
    for mask in (None, mh.causal()):
        report = mh.explain(q, k, v, mask=mask)
        assert report.backend == "decode", str(report)
        ref = mh.reference_attention(q.double(), k.double(), v.double()).output
        assert_relative(mh.attention(q, k, v, mask=mask), ref, naive_attention(q, k, v, None), factor=2)
    same = torch.randn(1, 1, 1024, 96, generator=g)
    # D == Dv: sdpa's fold beats this path's GEMMs; the CPU kernel beats both (docs/inference.md)
    assert mh.explain(q, k, same).backend == ("decode" if decode_kernel == "cpu_kernel" else "sdpa")


def test_auto_leaves_prefill_shaped_and_tiny_calls_to_the_fused_kernels():
    tiny = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 64, 16)
    report = mh.explain(tiny[0], tiny[1], tiny[1], mask=mh.causal())
    assert report.backend != "decode" and "a tiny call" in "; ".join(report.refused["decode"])
    q = torch.randn(1, 8, AUTO_MAX_QUERIES + 1, 64)
    k = v = torch.randn(1, 2, 500, 64)
    report = mh.explain(q, k, v, mask=mh.causal())
    assert report.backend != "decode" and "prefill-shaped" in "; ".join(report.refused["decode"])
    square = torch.randn(1, 8, 128, 16)
    assert mh.explain(square, square, square, mask=mh.causal()).backend != "decode"
    # forcing still serves it up to MAX_QUERIES, and refuses past it with the reason
    q = torch.randn(1, 8, MAX_QUERIES, 64)
    _check(q.double(), k.double(), v.double(), mh.causal(), torch.float32, what="Lq=MAX_QUERIES")
    q = torch.randn(1, 8, MAX_QUERIES + 1, 64)
    with pytest.raises(mh.BackendRefusedError, match=rf"decode.*Lq={MAX_QUERIES + 1} > {MAX_QUERIES}"):
        mh.attention(q, k, v, backend="decode")


def test_refusals_name_their_reason_and_auto_goes_on():
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 50, 16)
    with pytest.raises(mh.BackendRefusedError, match=r"decode.*softcap\(5.0\).*runs none"):
        mh.attention(q, k, k, softcap=5.0, backend="decode")
    with pytest.raises(mh.BackendRefusedError, match=r"decode.*dropout not supported"):
        mh.attention(q, k, k, dropout_p=0.1, backend="decode")
    report = mh.explain(q, k, k, score_mod=mh.scores.softcap(5.0))
    assert report.backend != "decode" and "decode" in report.refused


def test_prefill_then_steps_equal_the_full_causal_forward():
    """Steps of 1 to 3 tokens against the growing cache (bottom-right causal) equal the rows of
    one causal attention over the whole sequence."""
    B, Hq, Hkv, L, D = 2, 8, 2, 40, 16
    q, k, v, _ = _inputs(B, Hq, Hkv, L, L, 17, D=D)
    q, k, v = q.float(), k.float(), v.float()
    full = mh.attention(q, k, v, mask=mh.causal(), backend="reference")
    t, steps = 10, []
    while t < L:
        n = min(1 + len(steps) % 3, L - t)
        steps.append(
            mh.attention(q[:, :, t : t + n], k[:, :, : t + n], v[:, :, : t + n], mask=mh.causal(), backend="decode")
        )
        t += n
    torch.testing.assert_close(torch.cat(steps, 2), full[:, :, 10:], rtol=1e-5, atol=1e-5)


def test_compiles_without_graph_breaks():
    """Under torch.compile the plan asks no data-dependent question: one graph, and the same answer."""
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    mask = torch.arange(64).view(1, 1, 1, 64) < torch.tensor([64, 40]).view(2, 1, 1, 1)

    def step(q, k, v, mask):
        return mh.attention(q, k, v, mask=mask, backend="decode")

    torch._dynamo.reset()
    report = torch._dynamo.explain(step)(q, k, v, mask)
    assert report.graph_break_count == 0, [(r.reason, [str(f) for f in r.user_stack]) for r in report.break_reasons]
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), step(q, k, v, mask))


@pytest.mark.parametrize(
    "mask",
    [
        None,
        mh.causal(),
        mh.sliding_window(40) & mh.key_padding([1500, 900]),
        torch.arange(1500).view(1, 1, 1, 1500) < 1200,
    ],
    ids=["none", "causal", "window&padding", "bool"],
)
def test_a_repeated_decode_call_runs_its_plan(mask):
    """multihead.plans keeps the decode runner for a repeated signature (key range, row mask and
    padding decided once); other values of the same signature get their own right answer."""
    from multihead import plans

    q, k, v, _ = _inputs(2, 8, 2, 1, 1500, 18)
    q, k, v = q.float(), k.float(), v.float()
    plans.clear()
    first = mh.attention(q, k, v, mask=mask)
    assert torch.equal(mh.attention(q, k, v, mask=mask), first)
    key = plans.signature(q, k, v, mh.masks.as_mask(mask) if isinstance(mask, torch.Tensor) else mask, None, "auto")
    assert isinstance(mask, torch.Tensor) or plans.lookup(key) is not None, "the plan was stored"
    assert torch.equal(mh.attention(q, k, v, mask=mask), first)
    q2, k2, v2, _ = _inputs(2, 8, 2, 1, 1500, 19)
    q2, k2, v2 = q2.float(), k2.float(), v2.float()
    want = mh.reference_attention(q2.double(), k2.double(), v2.double(), mask=mask).output
    torch.testing.assert_close(mh.attention(q2, k2, v2, mask=mask).double(), want, rtol=1e-5, atol=1e-5)
    q2.requires_grad_()  # autograd is part of the signature: its own plan, gradients that flow
    mh.attention(q2, k2, v2, mask=mask).sum().backward()
    assert torch.isfinite(q2.grad).all()


@pytest.mark.parametrize(
    "heads,Lq",
    [((6, 2), 1), ((8, 2), 1), ((10, 2), 1), ((4, 2), 2), ((8, 8), 4)],
    ids=["rows3", "rows4", "rows5", "rows4_two_tokens", "rows4_mha"],
)
def test_padded_query_rows_change_nothing(heads, Lq, monkeypatch, decode_kernel):
    """3 to 5 fp32 query rows per KV head run padded to 6 on large K/V (forced here on small ones):
    outputs, LSE, fully masked rows and gradients as without."""
    import multihead.backends.decode as decode

    if decode_kernel == "cpu_kernel":
        pytest.skip("padding is for PyTorch's fp32 GEMM; the CPU kernel takes any number of rows")
    monkeypatch.setattr(decode, "_PAD_MIN_BYTES", 0)
    (Hq, Hkv), B, Lk = heads, 2, 37
    q, k, v, gen = _inputs(B, Hq, Hkv, Lq, Lk, 20)
    for kind in ("none", "key_padding_empty_batch", "bool_per_head", "window"):
        mask = _mask(kind, B, Hq, Lq, Lk, gen)
        assert "zero rows for q Kᵀ" in str(mh.explain(q.float(), k.float(), v.float(), mask=mask, backend="decode"))
        _check(q, k, v, mask, torch.float32, what=f"padded {kind}")
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        mh.attention(*leaves, mask=mask, backend="decode").sum().backward()
        ref = [t.detach().requires_grad_() for t in (q, k, v)]
        mh.reference_attention(*ref, mask=mask).output.sum().backward()
        for got, want in zip(leaves, ref):
            torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_explain_names_the_amx_tiles_where_the_kernel_runs_a_call_on_them(decode_kernel):
    """MLA's absorbed step (16 query heads over one latent head, bf16) runs on the kernel's AMX tiles
    where the CPU has them: ``explain()`` says so, and says the FMA path for fp32 and for a row mask
    (a window is a key range, not a row mask: tiles); the output agrees with the reference."""
    from multihead.backends import cpu_kernels

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 1, 64, generator=gen).bfloat16()
    rows = torch.randn(1, 1, 300, 64, generator=gen).bfloat16()
    tiles = decode_kernel == "cpu_kernel" and cpu_kernels.tiles(torch.bfloat16, 16, 64, 32, False)
    report = str(mh.explain(q, rows, rows[..., :32], backend="decode"))
    assert ("AMX tiles" in report) == tiles, report
    window = str(mh.explain(q, rows, rows[..., :32], mask=mh.sliding_window(100), backend="decode"))
    assert ("AMX tiles" in window) == tiles, window
    assert "AMX tiles" not in str(mh.explain(q.float(), rows.float(), rows[..., :32].float(), backend="decode"))
    q4 = torch.randn(1, 16, 4, 64, generator=gen).bfloat16()  # a causal four-token step: one range of keys per row
    steps = str(mh.explain(q4, rows, rows[..., :32], mask=mh.causal(), backend="decode"))
    assert ("AMX tiles" in steps and "one range of keys per row" in steps) == tiles, steps
    want4 = mh.attention(q4.double(), rows.double(), rows[..., :32].double(), mask=mh.causal(), backend="reference")
    got4 = mh.attention(q4, rows, rows[..., :32], mask=mh.causal(), backend="decode")
    torch.testing.assert_close(got4.double(), want4, rtol=1e-2, atol=1e-2)
    holes = torch.rand(1, 1, 1, 300, generator=gen) < 0.9
    masked = str(mh.explain(q, rows, rows[..., :32], mask=holes, backend="decode"))
    assert "AMX tiles" not in masked and ("cpu_decode.c" in masked) == (decode_kernel == "cpu_kernel"), masked
    want = mh.attention(q.double(), rows.double(), rows[..., :32].double(), backend="reference")
    got = mh.attention(q, rows, rows[..., :32], backend="decode")
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
