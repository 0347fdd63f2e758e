"""``backends/band_runs``: the interior blocks of a band run as one kernel call, against a plain
fp64 softmax over masked scores written here (forward output, LSE, dq/dk/dv), for fp64, fp32 and bf16,
GQA, ``Lq == Lk`` and ``Lq < Lk`` (bottom-right), windows that are and are not multiples of the
block; plus the run finder and the refusals of non-interior runs."""

import pytest
import torch

import multihead as mh
from multihead.backends.band_runs import BandRun, interior_run, run_backward, run_forward

# (B, Hq, Hkv, Lq, Lk, D, block, left, right, align)
CASES = [
    (1, 2, 2, 64, 64, 16, 8, 16, 0, "bottom_right"),  # window a multiple of the block
    (2, 4, 2, 61, 61, 13, 8, 11, 0, "bottom_right"),  # GQA 4/2, window not a multiple, odd sizes
    (2, 3, 1, 45, 70, 8, 8, 5, 0, "bottom_right"),  # MQA, Lq < Lk, window smaller than a block
    (1, 4, 4, 40, 97, 16, 8, 20, 3, "bottom_right"),  # Lq < Lk, a right extent as well
    (2, 6, 2, 80, 90, 8, 16, 19, 2, "top_left"),  # top-left alignment, larger blocks
    (1, 2, 1, 72, 72, 32, 4, 0, 0, "bottom_right"),  # left = right = 0: the diagonal only
    (1, 2, 2, 48, 48, 8, 8, 9, 0, "bottom_right"),  # span 17: the last window chunk is one key wide
]


def _band(Lq, Lk, left, right, align):
    """``(lo, hi)`` of ``sliding_window(left, right, align)`` and its dense ``(Lq, Lk)`` mask."""
    offset = Lk - Lq if align == "bottom_right" else 0
    lo, hi = offset - left, offset + right
    i = torch.arange(Lq).unsqueeze(1)
    j = torch.arange(Lk).unsqueeze(0)
    return (lo, hi), (j >= i + lo) & (j <= i + hi)  # True = may attend


def _reference(q, k, v, visible, scale):
    """Softmax over masked scores, every row, in the inputs' dtype; GQA by repeating K/V heads."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, Hq, Lk, D)
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))  # (B, Hq, Lq, Lk)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _inputs(case, dtype, seed=0):
    B, Hq, Hkv, Lq, Lk, D, *_ = case
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        for shape in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))
    ]


# The relative rule: error against the fp64 reference at most FACTOR times that of the same math
# done plainly in the input dtype (fp32: fused kernels reorder sums; bf16: 2 for outputs and LSE,
# 3 for gradients), plus a few ulps.
FACTOR = {torch.float32: (10.0, 10.0), torch.bfloat16: (2.0, 3.0)}


def _assert_accurate(got, ref64, naive, what, magnitude=None):
    """fp64: equal to rounding. Otherwise the relative rule (``FACTOR``), with the ulps of ``magnitude``
    (default: of the reference; a gradient that is 0 in theory, e.g. dq when each row sees one
    key, is computed from terms the size of the other gradients)."""
    ref64 = ref64.detach()
    if got.dtype == torch.float64:
        torch.testing.assert_close(got.detach(), ref64, rtol=1e-10, atol=1e-10, msg=what)
        return
    factor = FACTOR[naive.dtype][0 if what in ("output", "lse") else 1]
    err = float((got.detach().double() - ref64).abs().max())
    base = float((naive.detach().double() - ref64).abs().max())
    floor = 4 * torch.finfo(naive.dtype).eps * max(1.0, float(ref64.abs().max()) if magnitude is None else magnitude)
    assert err <= factor * base + floor, f"{what}: max err {err:.3e}, plain {naive.dtype} {base:.3e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}x{}-L{}x{}-D{}-blk{}-l{}r{}-{}".format(*c))
def test_forward_and_backward_match_reference(case, dtype):
    B, Hq, Hkv, Lq, Lk, D, block, left, right, align = case
    (lo, hi), visible = _band(Lq, Lk, left, right, align)
    run = interior_run(Lq, Lk, block=block, lo=lo, hi=hi)
    assert run is not None and run.blocks >= 3, run  # the case must exercise several folded blocks
    rows = slice(run.q0, run.q1)
    scale = D**-0.5
    q, k, v = _inputs(case, dtype)

    out, lse = run_forward(q, k, v, run, scale)
    assert out.shape == (B, Hq, run.q1 - run.q0, D) and lse.shape == (B, Hq, run.q1 - run.q0)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _reference(q64, k64, v64, visible, scale)
    plain = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    plain_out, plain_lse = _reference(*plain, visible, scale)
    _assert_accurate(out, ref_out[:, :, rows], plain_out[:, :, rows], "output")
    _assert_accurate(lse, ref_lse[:, :, rows], plain_lse[:, :, rows], "lse")

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dq, dk, dv = run_backward(grad_out.to(dtype), q.detach(), k.detach(), v.detach(), out, lse, run, scale)
    assert dq.shape == out.shape and dk.shape == k.shape and dv.shape == v.shape
    ref_grads = torch.autograd.grad(ref_out[:, :, rows], (q64, k64, v64), grad_out)
    plain_grads = torch.autograd.grad(plain_out[:, :, rows], plain, grad_out.to(dtype))
    magnitude = max(float(g.abs().max()) for g in ref_grads)
    _assert_accurate(dq, ref_grads[0][:, :, rows], plain_grads[0][:, :, rows], "dq", magnitude)
    _assert_accurate(dk, ref_grads[1], plain_grads[1], "dk", magnitude)
    _assert_accurate(dv, ref_grads[2], plain_grads[2], "dv", magnitude)
    outside = torch.ones(Lk, dtype=torch.bool)
    outside[run.k0 : run.k1] = False
    assert not dk[:, :, outside].any() and not dv[:, :, outside].any()  # keys the run never reads


def test_backward_adds_into_accumulators():
    case = CASES[1]
    B, Hq, Hkv, Lq, Lk, D, block, left, right, align = case
    (lo, hi), _ = _band(Lq, Lk, left, right, align)
    run = interior_run(Lq, Lk, block=block, lo=lo, hi=hi)
    q, k, v = (t.detach() for t in _inputs(case, torch.float32))
    out, lse = run_forward(q, k, v, run, 0.5)
    grad_out = torch.randn_like(out)
    _, dk, dv = run_backward(grad_out, q, k, v, out, lse, run, 0.5)
    acc_k, acc_v = torch.ones(k.shape, dtype=torch.float64), torch.full(v.shape, 2.0, dtype=torch.float64)
    _, got_k, got_v = run_backward(grad_out, q, k, v, out, lse, run, 0.5, dk=acc_k, dv=acc_v)
    assert got_k is acc_k and got_v is acc_v
    torch.testing.assert_close(acc_k, dk.double() + 1, rtol=0, atol=1e-6)
    torch.testing.assert_close(acc_v, dv.double() + 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "Lq,Lk,block,left,right,align",
    [
        (64, 64, 8, 16, 0, "bottom_right"),
        (61, 61, 8, 11, 0, "bottom_right"),
        (45, 70, 8, 5, 0, "bottom_right"),
        (40, 97, 8, 20, 3, "bottom_right"),
        (80, 90, 16, 19, 2, "top_left"),
        (300, 40, 8, 3, 0, "bottom_right"),
        (70, 70, 8, 7, 70, "top_left"),
    ],
)
def test_interior_run_is_the_longest_interior_run_on_the_grid(Lq, Lk, block, left, right, align):
    (lo, hi), _ = _band(Lq, Lk, left, right, align)

    def interior(r):  # block [r, r + block) reads keys [r + lo, r + block + hi)
        return r + block <= Lq and r + lo >= 0 and r + block + hi <= Lk

    want = [r for r in range(0, Lq, block) if interior(r)]
    run = interior_run(Lq, Lk, block=block, lo=lo, hi=hi)
    if not want:
        assert run is None
        return
    assert want == list(range(want[0], want[-1] + 1, block))  # contiguous on a band
    assert (run.q0, run.q1) == (want[0], want[-1] + block)
    assert run.k0 == run.q0 + lo and run.k1 == run.q1 + hi


@pytest.mark.parametrize(
    "run,why",
    [  # BandRun(q0, q1, block, lo, hi) at Lq = Lk = 32
        (BandRun(0, 24, 8, -4, 0), "not interior"),  # block 0 reads key -4
        (BandRun(8, 40, 8, -4, 0), "inside \\[0, Lq=32\\)"),  # 40 > Lq
        (BandRun(8, 20, 8, -4, 0), "multiple of block"),  # 12 rows
        (BandRun(8, 24, 8, -4, 20), "not interior"),  # reads keys up to 44 > Lk
        (BandRun(8, 24, 0, -4, 0), "block must be"),
        (BandRun(8, 24, 8, 1, 0), "without keys"),  # lo > hi
    ],
)
def test_refuses_runs_that_are_not_interior(run, why):
    q = torch.randn(1, 2, 32, 8)
    with pytest.raises(ValueError, match=why):
        run_forward(q, q, q, run, 1.0)


def test_refuses_mismatched_shapes():
    q, k = torch.randn(1, 3, 32, 8), torch.randn(1, 2, 32, 8)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        run_forward(q, k, k, BandRun(8, 24, 8, -4, 0), 1.0)


def _count_backward_paths(monkeypatch) -> dict[str, int]:
    import multihead.backends.band_runs as band_runs

    calls = {"kernel": 0, "torch": 0}
    kernel, torch_path = band_runs._flash_backward, band_runs.bias_backward

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(band_runs, "_flash_backward", count("kernel", kernel))
    monkeypatch.setattr(band_runs, "bias_backward", count("torch", torch_path))
    return calls


def _check_alibi_band(alibi, q, k, v, mask, gen):
    from multihead.positions import ALiBi

    assert isinstance(alibi, ALiBi)
    out = mh.attention(q, k, v, mask=mask, score_mod=alibi, backend="blocksparse")
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = mh.reference_attention(*ref_in, mask=mask, score_mod=alibi).output
    want = torch.autograd.grad(ref, ref_in, grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_a_relative_bias_on_a_band_splits_its_backward_by_head_and_stays_exact(monkeypatch):
    """ALiBi on a band: heads whose bias spans little over the window keep the kernel's backward,
    the others (steep slopes on large scores: fp32 denormals in the kernel) run in bias_backward;
    both at once here."""
    from multihead.positions import ALiBi

    calls = _count_backward_paths(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, L, D = 2, 4, 2, 1100, 16
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h in (Hq, Hkv, Hkv))
    # Scores up to scale·|q|·|k| ~ 36: after the cut at e^-50 a slope of 1 or 1/2 over a window of
    # 300 still spans more than 87.3 (KV group 0: bias_backward), 1/64 and 1/256 far less (group 1).
    q, k, v = (t.mul(s).requires_grad_() for t, s in ((q, 2.0), (k, 2.0), (v, 1.0)))
    alibi = ALiBi(Hq, slopes=[1.0, 0.5, 1 / 64, 1 / 256])
    _check_alibi_band(alibi, q, k, v, mh.causal() & mh.sliding_window(300), gen)
    assert calls["kernel"] >= 1 and calls["torch"] >= 1  # both halves of the split ran


def test_alibi_on_a_band_keeps_every_head_on_the_kernel_and_stays_exact(monkeypatch):
    """ALiBi's default slopes on unit-scale scores: after the cut at e^-50 every head spans less than
    87.3 over a window of 300, so the whole backward is one kernel call (no head picked out and
    copied, no bias_backward): the fast path of window + ALiBi (benchmarks/positions.py)."""
    from multihead.positions import ALiBi

    calls = _count_backward_paths(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, L, D = 2, 4, 2, 1100, 16  # slopes 1/4 .. 1/256: 1/4 spans 75 over the window
    q, k, v = (torch.randn(B, h, L, D, generator=gen, requires_grad=True) for h in (Hq, Hkv, Hkv))
    _check_alibi_band(ALiBi(Hq), q, k, v, mh.causal() & mh.sliding_window(300), gen)
    assert calls["kernel"] >= 1 and calls["torch"] == 0
