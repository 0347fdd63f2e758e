"""``auto`` on CUDA: large structured masks go to ``flex`` (cost in proportion to the visible
blocks), everything else to ``sdpa`` (flash/cuDNN without a mask tensor, or the dense mask for
small calls): the table measured by benchmarks/gpu_dispatch.py. On CPU flex stays out of auto;
the CUDA choice, its results and its freedom from host synchronisation run on a CUDA device."""

import pytest
import torch

import multihead as mh
from helpers import assert_relative, naive_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU tier)")


def test_flex_stays_out_of_auto_on_cpu():
    from multihead.validation import validate_call

    q = torch.randn(1, 2, 4096, 16)
    call = validate_call(
        q,
        q,
        q,
        mask=mh.sliding_window(64),
        scale=None,
        dropout_p=0.0,
        dropout_mask=None,
        return_weights=False,
        return_lse=False,
    )
    assert not mh.get_backend("flex").refusals(call)
    assert "on CPU" in mh.get_backend("flex").auto_refusals(call)[0]
    assert mh.explain(q, q, q, mask=mh.sliding_window(64)).backend == "blocksparse"


def _inputs(L, dtype, requires_grad=False, Hq=4, Hkv=2, D=64):
    gen = torch.Generator().manual_seed(L)
    return [
        torch.randn(1, h, L, D, generator=gen).to("cuda", dtype).requires_grad_(requires_grad) for h in (Hq, Hkv, Hkv)
    ]


@cuda
@pytest.mark.parametrize(
    "mask,backend",
    [
        (mh.sliding_window(256), "flex"),
        (mh.document_causal(torch.arange(4096) // 512), "flex"),
        (mh.causal(), "sdpa"),
        (None, "sdpa"),
        (mh.key_padding(torch.tensor([4000])), "flex"),  # mostly visible: still faster than a dense mask
    ],
    ids=["window", "documents", "causal", "none", "padding"],
)
def test_auto_on_cuda_picks_by_the_measured_table(mask, backend):
    q, k, v = _inputs(4096, torch.bfloat16)
    assert mh.explain(q, k, v, mask=mask).backend == backend


@cuda
def test_auto_on_cuda_leaves_short_windows_to_sdpa_and_takes_short_documents():
    """At 2048, flex's fixed cost loses to sdpa for a band, not for documents (measured)."""
    q, k, v = _inputs(2048, torch.bfloat16)
    assert mh.explain(q, k, v, mask=mh.sliding_window(1024)).backend == "sdpa"
    assert mh.explain(q, k, v, mask=mh.document_causal(torch.arange(2048) // 512)).backend == "flex"


@cuda
def test_auto_on_cuda_leaves_small_calls_to_sdpa():
    q, k, v = _inputs(512, torch.bfloat16)
    report = mh.explain(q, k, v, mask=mh.sliding_window(16))
    assert report.backend == "sdpa" and "fixed cost per call" in report.refused["flex"][0]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_on_cuda_with_flex_matches_the_reference_forward_and_backward(dtype):
    L = 2048 + 1
    mask = mh.sliding_window(100) & mh.key_padding(torch.tensor([L - 7]))
    q, k, v = _inputs(L, dtype, requires_grad=True)
    assert mh.explain(q, k, v, mask=mask).backend == "flex"
    out = mh.attention(q, k, v, mask=mask)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    out.backward(grad)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = mh.reference_attention(*leaves, mask=mask).output
    ref.backward(grad.cpu().double())
    lows = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
    base = naive_attention(*lows, mask)
    base.backward(grad.cpu())
    factor = mh.get_backend("flex").capabilities.tolerance_factor(dtype, False)
    assert_relative(out.detach().cpu(), ref, base.detach(), factor)
    gfactor = mh.get_backend("flex").capabilities.tolerance_factor(dtype, True)
    for name, got, want, low in zip("qkv", (q, k, v), leaves, lows):
        assert_relative(got.grad.cpu(), want.grad, low.grad, gfactor, f"grad {name}")


@cuda
@pytest.mark.parametrize(
    "mask",
    [None, mh.causal(), mh.sliding_window(256), mh.key_padding(torch.tensor([3000]))],
    ids=["none", "causal", "window", "padding"],
)
def test_repeated_calls_on_cuda_never_synchronise_with_the_host(mask):
    """A host synchronisation per call leaves the GPU idle while Python prepares the next one:
    once a call's plan is made (first calls), repeating it queues kernels only."""
    q, k, v = _inputs(4096, torch.bfloat16)
    for _ in range(3):
        mh.attention(q, k, v, mask=mask)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mh.attention(q, k, v, mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == q.shape
