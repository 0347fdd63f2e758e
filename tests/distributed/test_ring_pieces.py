"""Pieces of the ring checked without processes: the in-place merge against
``merge_partials``, and the tiled block backward against one whole-block kernel call."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.backends import flash_pieces
from multihead.distributed import ring_steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_into_equals_merge_partials(dtype):
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 3, 6, 5, generator=g, dtype=dtype)
    part = torch.randn(2, 3, 6, 5, generator=g, dtype=dtype)
    lse = torch.randn(2, 3, 6, generator=g, dtype=dtype)
    part_lse = torch.randn(2, 3, 6, generator=g, dtype=dtype)
    lse[:, :, 0] = part_lse[:, :, 0] = float("-inf")  # a row that sees neither part
    lse[:, :, 1] = float("-inf")  # only the new part
    part_lse[:, :, 2] = float("-inf")  # only the merged so far
    out[:, :, 0] = 0  # what the ring holds for a row that has seen nothing yet
    out[:, :, 1] = 0
    want_out, want_lse = mh.merge_partials([out, part], [lse, part_lse])
    merged, merged_lse = out.clone(), lse.clone()
    ring_steps.merge_into(merged, merged_lse, part, part_lse)
    torch.testing.assert_close(merged, want_out)
    torch.testing.assert_close(merged_lse, want_lse)
    assert torch.equal(merged[:, :, 0], torch.zeros_like(merged[:, :, 0]))
    assert torch.isneginf(merged_lse[:, :, 0]).all() and not torch.isnan(merged).any()


@pytest.mark.parametrize(
    "mask",
    [
        mh.sliding_window(5),
        mh.sliding_window(3, 4),
        mh.causal() & mh.key_padding(torch.tensor([20, 0])),
        mh.document(torch.tensor([[0] * 7 + [1] * 13 + [2] * 10] * 2)),
    ],
    ids=["window", "two-sided-window", "causal-padding", "documents"],
)
@pytest.mark.parametrize("tile", [1, 4, 7])
def test_tiled_block_backward_equals_one_call(mask, tile, monkeypatch):
    """Tiles skip hidden keys and hidden tiles; the gradients are those of one masked call."""
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, rows, keys, D, Dv = 2, 4, 2, 23, 30, 8, 6
    q = torch.randn(B, Hq, rows, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, keys, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, keys, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, Hq, rows, Dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, rows, generator=g, dtype=torch.float64)
    block = mask.shifted(7, 0, q_len=keys, kv_len=keys) if mask.depends_on_lengths() else mask.shifted(7, 0)
    res = mh.attention(q, k, v, mask=block, return_lse=True)
    args = (q, k, v, block, D**-0.5, res.output, res.lse, dout, dlse)
    monkeypatch.setattr(flash_pieces, "TILE", 10_000)
    whole = flash_pieces.backward_from_lse(*args)
    monkeypatch.setattr(flash_pieces, "TILE", tile)
    tiled = flash_pieces.backward_from_lse(*args)
    for name, a, b in zip(("dq", "dk", "dv"), tiled, whole):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    # and both are the gradient of the block's own attention (output and LSE)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    r = mh.attention(qq, kk, vv, mask=block, return_lse=True)
    loss = (r.output * dout).sum() + (r.lse.masked_fill(torch.isneginf(r.lse), 0) * dlse).sum()
    for name, a, b in zip(("dq", "dk", "dv"), tiled, torch.autograd.grad(loss, (qq, kk, vv))):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name} vs autograd: {m}")


@pytest.mark.parametrize("backend", ["auto", "sdpa", "blocksparse", "reference"])
def test_a_block_backward_comes_from_the_backend_that_runs_it(backend, monkeypatch):
    """The ring asks the backend that runs a block for ``backward_from_lse`` (sdpa and blocksparse
    offer it on CPU: the flash piece); one that does not (reference) is differentiated through
    its forward. Either way the result is the block's gradient."""
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, rows, keys, D = 1, 4, 2, 300, 280, 8
    q = torch.randn(B, Hq, rows, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, keys, D, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, Hq, rows, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, rows, generator=g, dtype=torch.float64)
    block = mh.sliding_window(40).shifted(20, 0, q_len=400, kv_len=400)  # rows 20.., keys 0.. of 400
    res = mh.attention(q, k, v, mask=block, return_lse=True)
    asked = []
    real = flash_pieces.backward_from_lse
    monkeypatch.setattr(flash_pieces, "backward_from_lse", lambda *a: asked.append(1) or real(*a))
    got = ring_steps.block_backward(q, k, v, block, D**-0.5, backend, res.output, res.lse, dout, dlse)
    assert bool(asked) == (backend != "reference")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    r = mh.attention(qq, kk, vv, mask=block, return_lse=True)
    loss = (r.output * dout).sum() + (r.lse.masked_fill(torch.isneginf(r.lse), 0) * dlse).sum()
    for name, a, b in zip(("dq", "dk", "dv"), got, torch.autograd.grad(loss, (qq, kk, vv))):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
