"""The batched paths that keep ``blocksparse`` fast on a busy machine, against the fp64 reference:
packed documents as one kernel call per document (``backends/document_runs.py``) and a band's
interior with dropout as batched chunks (``torch_blocks``, ``band_runs`` folds). Lengths at the
block size +- 1, uneven documents, GQA, fully masked rows, fp64/fp32/bf16, gradients of the output
and of the LSE. The relative rule against the plain computation in the same dtype (helpers)."""

import pytest
import torch
import torch.nn.functional as F
from matrix import factor

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.backends import torch_blocks
from multihead.backends.band_runs import interior_run
from multihead.backends.block_plan import band_run
from multihead.backends.blocksparse import BlockSparseBackend
from multihead.backends.document_runs import Segment, document_segments
from multihead.backends.torch_blocks_backend import TorchBlocksBackend
from multihead.blocks import Block, Extent
from multihead.validation import validate_call

BLOCK = 32  # small blocks: every case crosses several of them


def _call(q, k, v, mask, dropout_p=0.0):
    return validate_call(
        q, k, v, mask=mask, scale=None, dropout_p=dropout_p, dropout_mask=None, return_weights=False, return_lse=True
    )


def _ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _inputs(B, Hq, Hkv, Lq, Lk, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, h, L, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    ]


def _check_against_reference(got, q, k, v, mask, dtype, grad_seed=1):
    """Output, LSE and the gradients of ``sum(out * g) + sum(lse * h)`` against the fp64 reference."""
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mh.reference_attention(qr, kr, vr, mask=mask)
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref.lse))
    gen = torch.Generator().manual_seed(grad_seed)
    g = torch.randn(ref.output.shape, generator=gen, dtype=torch.float64)
    h = torch.randn(ref.lse.shape, generator=gen, dtype=torch.float64)
    seen = torch.isfinite(ref.lse)

    def loss(out, lse):
        return (out * g.to(out.dtype)).sum() + (lse.masked_fill(~seen, 0) * h.to(lse.dtype)).sum()

    grads = torch.autograd.grad(loss(got.output, got.lse), (q, k, v))
    grads_ref = torch.autograd.grad(loss(ref.output, ref.lse), (qr, kr, vr))
    if dtype == torch.float64:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse[seen], ref.lse[seen], rtol=1e-10, atol=1e-10)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        return
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    base = naive_attention(qn, kn, vn, mask)
    grads_base = torch.autograd.grad((base * g.to(dtype)).sum(), (qn, kn, vn))
    assert_relative(got.output, ref.output, base, factor("blocksparse", dtype))
    magnitude = max(float(r.abs().max()) for r in grads_ref)
    # The baseline's gradients carry no LSE term; its error is of the same kind (one softmax).
    for name, a, b, c in zip("qkv", grads, grads_ref, grads_base):
        assert_relative(a, b, c, 2 * factor("blocksparse", dtype, gradients=True), f"d{name}", magnitude=magnitude)


# ------------------------------------------------------------------------------ documents
DOCUMENT_LENGTHS = {
    "block+-1": [BLOCK - 1, BLOCK + 1, BLOCK, 1, 2 * BLOCK + 1],
    "uneven": [70, 3, 41, 17, 1, 100],
    "one": [3 * BLOCK + 5],
}
DOCUMENT_MASKS = {
    "document&causal": lambda ids: mh.document(ids) & mh.causal(),
    "causal&document": lambda ids: mh.causal("top_left") & mh.document(ids),
    "document": lambda ids: mh.document(ids),
    "document_causal": lambda ids: mh.document_causal(ids),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths", list(DOCUMENT_LENGTHS), ids=str)
@pytest.mark.parametrize("kind", list(DOCUMENT_MASKS), ids=str)
def test_documents_run_one_call_each_and_match_the_reference(kind, lengths, dtype):
    lengths = DOCUMENT_LENGTHS[lengths]
    L = sum(lengths)
    mask = DOCUMENT_MASKS[kind](_ids(lengths))
    q, k, v = _inputs(2, 4, 2, L, L, 16, dtype, seed=L)  # GQA 4/2
    backend = BlockSparseBackend(BLOCK)
    call = _call(q, k, v, mask)
    plan = backend._plan(call)
    assert plan.documents and plan.run is None
    ends = torch.tensor(lengths).cumsum(0).tolist()
    assert [(b.q0, b.q1) for b in plan.blocks] == list(zip([0, *ends[:-1]], ends))  # one block per document
    assert all(len(b.pieces) == 1 for b in plan.blocks)
    assert any("documents, each one kernel call" in line for line in backend.plan(call))
    _check_against_reference(backend.forward(call), q, k, v, mask, dtype)


def test_documents_with_queries_that_see_no_key_give_zero_output_and_grads():
    """Cross-attention by documents: query documents 1 and 3 have no keys of their id."""
    q_ids, kv_ids = _ids([40, 30, 25, 10]), torch.tensor([0] * 33 + [2] * 50)
    mask = mh.document(q_ids, kv_ids)
    segments = document_segments(mask, 105, 83, max_segments=8)
    assert segments == (
        Segment(0, 40, 0, 33, False),
        Segment(40, 70, 0, 0, False),
        Segment(70, 95, 33, 83, False),
        Segment(95, 105, 0, 0, False),
    )
    q, k, v = _inputs(1, 2, 2, 105, 83, 8, torch.float64)
    got = BlockSparseBackend(BLOCK).forward(_call(q, k, v, mask))
    empty = torch.zeros(105, dtype=torch.bool)
    empty[40:70] = empty[95:] = True
    assert bool(torch.isneginf(got.lse[..., empty]).all()) and bool((got.output[..., empty, :] == 0).all())
    _check_against_reference(got, q, k, v, mask, torch.float64)


@pytest.mark.parametrize(
    "mask",
    [
        mh.document(torch.tensor([0, 0, 1, 1, 0, 0] * 8)),  # unsorted: a document comes back
        mh.document(torch.stack([_ids([20, 28]), _ids([30, 18])])),  # other documents per batch row
        mh.document(_ids([6] * 8)) & mh.sliding_window(3),  # a window inside the documents
        mh.document(_ids([24, 24])) & mh.key_padding(torch.tensor([40])),
        mh.document(_ids([1] * 48)),  # more documents than query blocks
    ],
    ids=["unsorted", "per-row", "window", "padding", "many"],
)
def test_other_document_masks_keep_the_block_grid(mask):
    assert document_segments(mask, 48, 48, max_segments=48 // 16) is None
    q, k, v = _inputs(2, 2, 2, 48, 48, 8, torch.float64)
    backend = BlockSparseBackend(16)
    call = _call(q, k, v, mask)
    assert not backend._plan(call).documents
    _check_against_reference(backend.forward(call), q, k, v, mask, torch.float64)


def test_bottom_right_causal_with_other_lengths_keeps_the_block_grid():
    """``document & causal()`` with ``Lq != Lk`` is aligned to the whole attention, not per document."""
    mask = mh.document(_ids([20, 20]), _ids([30, 30])) & mh.causal()
    assert document_segments(mask, 40, 60, max_segments=8) is None


# ------------------------------------------------------------------------------ dropout on a band
def _replayed_keep(seed, mask, run, B, Hq, Lq, Lk, block, p):
    """The keep mask the dropout path draws, replayed: one draw per query block over its key
    range, except the band's interior, drawn one chunk at a time as ``(n, B*Hq, block, span)``
    (block ``t``'s window starts at key ``q0 + lo + t*block``), all in row order."""
    torch.manual_seed(seed)
    keep = torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    chunks = {c.q0: c for c in torch_blocks.band_chunks(run, B, Hq)}
    for q0 in range(0, Lq, block):
        if run.q0 <= q0 < run.q1:
            chunk = chunks.get(q0)
            if chunk is not None:
                n, span = chunk.blocks, chunk.span
                drawn = F.dropout(torch.ones(n, B * Hq, block, span, dtype=torch.float64), p) != 0
                for t in range(n):
                    r, c = chunk.q0 + t * block, chunk.k0 + t * block
                    keep[:, :, r : r + block, c : c + span] = drawn[t].view(B, Hq, block, span)
            continue
        q1 = min(q0 + block, Lq)
        k0, k1 = mask.key_range(Extent(B, Hq, Lq, Lk), Block(q0, q1, 0, Lk))
        if k0 < k1:
            keep[:, :, q0:q1, k0:k1] = F.dropout(torch.ones(B, Hq, q1 - q0, k1 - k0, dtype=torch.float64), p) != 0
    return keep


@pytest.mark.parametrize(
    "Lq,Lk,left,right,align",
    [
        (7 * BLOCK + 1, 7 * BLOCK + 1, BLOCK - 1, 0, "bottom_right"),
        (7 * BLOCK - 1, 7 * BLOCK - 1, BLOCK + 1, 0, "bottom_right"),
        (6 * BLOCK, 8 * BLOCK + 3, 2 * BLOCK, 5, "top_left"),
    ],
    ids=["block+1", "block-1", "two-sided"],
)
def test_dropout_on_a_band_runs_in_chunks_and_equals_the_reference_with_the_same_draw(
    monkeypatch, Lq, Lk, left, right, align
):
    B, Hq, Hkv, D, p = 2, 4, 2, 8, 0.3
    monkeypatch.setattr(torch_blocks, "RUN_CHUNK_SCORES", 2 * B * Hq * BLOCK * (BLOCK + left + right))  # 2 blocks
    mask = mh.sliding_window(left, right, align=align)
    q, k, v = _inputs(B, Hq, Hkv, Lq, Lk, D, torch.float64, seed=Lq)
    backend = TorchBlocksBackend(BLOCK)  # dropout runs in the torch_blocks backend
    call = _call(q, k, v, mask, dropout_p=p)
    run = band_run(mask, Lq, Lk, BLOCK)
    assert run is not None and len(torch_blocks.band_chunks(run, B, Hq)) >= 2, run
    torch.manual_seed(5)
    got = backend.forward(call)
    keep = _replayed_keep(5, mask, run, B, Hq, Lq, Lk, BLOCK, p)
    ref = mh.reference_attention(q, k, v, mask=mask, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(got.output.square().sum() + got.lse.sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.output.square().sum() + ref.lse.sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dropout_band_chunks_in_low_precision(dtype):
    """A dropout too small to drop anything (odds ~1e-8 here): the same numbers as no dropout."""
    B, Hq, Hkv, L, D = 1, 4, 1, 9 * BLOCK + 1, 16
    mask = mh.sliding_window(BLOCK + 3)
    q, k, v = _inputs(B, Hq, Hkv, L, L, D, dtype, seed=3)
    backend = TorchBlocksBackend(BLOCK)
    call = _call(q, k, v, mask, dropout_p=1e-12)
    assert band_run(mask, L, L, BLOCK) is not None
    _check_against_reference(backend.forward(call), q, k, v, mask, dtype)


def test_a_sum_loss_gives_the_same_gradients_as_a_dense_one():
    """``out.sum()`` hands an expanded gradient to the backward (torch_blocks._DenseGrad)."""
    q, k, v = _inputs(1, 2, 2, 5 * BLOCK, 5 * BLOCK, 8, torch.float64)
    mask = mh.sliding_window(BLOCK)
    backend = TorchBlocksBackend(BLOCK)
    torch.manual_seed(0)
    a = torch.autograd.grad(backend.forward(_call(q, k, v, mask, 0.2)).output.sum(), (q, k, v))
    torch.manual_seed(0)
    out = backend.forward(_call(q, k, v, mask, 0.2)).output
    b = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_interior_run_chunks_cover_the_run_in_order():
    run = interior_run(4096, 4096, block=256, lo=-512, hi=0)
    chunks = torch_blocks.band_chunks(run, 1, 8)
    assert chunks[0].q0 == run.q0 and chunks[-1].q1 == run.q1
    assert all(a.q1 == b.q0 for a, b in zip(chunks, chunks[1:]))
    assert all(1 * 8 * c.block * c.span * c.blocks <= torch_blocks.RUN_CHUNK_SCORES for c in chunks)
