"""Checks that ranks which disagree on a call are refused on every rank, quickly, and that the
world works afterwards (``tests/distributed/test_agreement.py``; names start with ``agree-``).

Each check makes rank 1 differ from rank 0 in one thing only, where the difference used to pass
unseen: a mask of 10^5 elements (a bool tensor, a key padding table, document ids) that differs
in one element, or which of q, k, v need gradients (``requires_grad``, or the grad mode). Every
rank must raise the same ``ValueError`` within :data:`LIMIT` seconds, naming the argument and the
ranks; then a good call with the same large mask on every rank must equal single-process
attention, in the same world.
"""

from __future__ import annotations

import contextlib
import re
import time

import torch
import torch.distributed as dist
from dist_checks import check, compare_fp64, expected_run, inputs, sharded_run

from multihead import masks
from multihead.distributed import ring_attention, ulysses_attention

#: Seconds a refusal may take on a rank (it costs one small all_gather; a hang is a failure).
LIMIT = 10.0
FUNCTIONS = {"ring": ring_attention, "ulysses": ulysses_attention}


def refused(call, pattern: str) -> None:
    """``call()`` on every rank raises a ``ValueError`` matching ``pattern`` within ``LIMIT``
    seconds, the same message on every rank."""
    start = time.perf_counter()
    try:
        call()
        message = None
    except ValueError as e:
        message = str(e)
    seconds = time.perf_counter() - start
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (message, seconds))
    for r, (m, s) in enumerate(everyone):
        assert m is not None, f"rank {r}: no ValueError raised (ranks {everyone})"
        assert s < LIMIT, f"rank {r}: the refusal took {s:.1f} s, expected < {LIMIT} s"
    assert all(m == message for m, _ in everyone), f"ranks raised different messages: {everyone}"
    assert re.search(pattern, message, re.S), f"{message!r} does not match {pattern!r}"


def forward_backward(fn, q, k, v, **kw) -> None:
    """A training step's use of the call: the forward, then the backward if there is a graph."""
    out = fn(q, k, v, **kw)
    if out.requires_grad:
        out.sum().backward()


def compare_mask(fn, mask, *, B: int, L: int, layout: str, Hq: int = 2, Hkv: int = 1) -> None:
    """``fn`` with ``mask`` on every rank equals single-process attention (fp64: outputs, LSE and
    the gradients of q, k, v)."""
    q, k, v, gout, glse = inputs(B, Hq, Hkv, L, L, 8, 8, torch.float64, seed=3)
    got = sharded_run(fn, q, k, v, gout, glse, mask=mask, layout=layout)
    want = expected_run(q, k, v, gout, glse, mask=mask, layout=layout)
    for name, x, y in zip(("output", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, y, msg=lambda m: f"{name}: {m}")


def _shards(B: int, L: int, world: int, Hq: int = 2, Hkv: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    S = L // world
    return tuple(torch.randn(B, h, S, 8, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))


# ------------------------------------------------------------------------------------ masks of 10^5 elements
MASK_PATTERN = r"ranks disagree on mask: rank 1 has '.*\[content [0-9a-f]{16}\]' but rank 0 has '.*\[content"


def _bool_tensor(rank: int) -> torch.Tensor:
    L = 320  # (1, 1, 320, 320): 102400 elements
    t = torch.rand(1, 1, L, L, generator=torch.Generator().manual_seed(11)) < 0.6
    t[..., 0] = True  # no empty row
    if rank == 1:
        t[0, 0, L - 1, 1] = ~t[0, 0, L - 1, 1]  # one element differs
    return t


def _padding_table(rank: int) -> masks.Mask:
    B, L = 400, 256  # a (400, 256) bool table: 102400 elements
    valid = torch.arange(L).expand(B, L) < torch.arange(L - B // 2, L + B // 2).clamp(max=L)[:, None]
    if rank == 1:
        valid = valid.clone()
        valid[B - 1, 3] = False  # one key of one row differs
    return masks.key_padding(valid)


def _document_ids(rank: int) -> masks.Mask:
    B, L = 400, 256  # (400, 256) ids: 102400 elements
    # Documents that end where a contiguous shard does over two ranks: no rank needs another's
    # keys. On rank 1 the last row is one document across both shards: in the ring, rank 1 then
    # waits for keys that rank 0 (by its own mask) never sends.
    ids = (torch.arange(L) >= L // 2).long().expand(B, L).clone()
    if rank == 1:
        ids[B - 1] = 0
    return masks.document(ids)


for _method in FUNCTIONS:

    @check(f"agree-{_method}-bool-mask-differs")
    def _bool_differs(rank, world, method=_method):
        fn = FUNCTIONS[method]
        refused(lambda: fn(*_shards(1, 320, world), mask=_bool_tensor(rank), layout="zigzag"), MASK_PATTERN)
        compare_mask(fn, _bool_tensor(0), B=1, L=320, layout="zigzag")  # large, equal: no false refusal

    @check(f"agree-{_method}-padding-table-differs")
    def _padding_differs(rank, world, method=_method):
        fn = FUNCTIONS[method]
        refused(lambda: fn(*_shards(400, 256, world), mask=_padding_table(rank), layout="zigzag"), MASK_PATTERN)
        compare_mask(fn, _padding_table(0), B=400, L=256, layout="zigzag")


# ------------------------------------------------------------------------------------ requires_grad
def _requires_grad_differs(rank, world, method):
    fn = FUNCTIONS[method]
    # every tensor needs a gradient, but rank 1 runs under torch.no_grad(): no graph, no backward
    q, k, v = (t.requires_grad_() for t in _shards(2, 24, world, Hq=4, Hkv=2))
    with torch.no_grad() if rank == 1 else contextlib.nullcontext():
        refused(
            lambda: forward_backward(fn, q, k, v, mask=masks.causal()),
            r"ranks disagree on requires_grad: rank 1 has 'none \(grad mode is off.*' but rank 0 has 'q, k, v'",
        )
    # rank 1's q needs no gradient: its backward would never join rank 0's
    q, k, v = _shards(2, 24, world, Hq=4, Hkv=2)
    q.requires_grad_(rank == 0)
    refused(
        lambda: forward_backward(fn, q, k, v, mask=masks.causal()),
        r"ranks disagree on requires_grad: rank 1 has 'none' but rank 0 has 'q'",
    )
    compare_fp64(fn, mask_kind="causal", layout="zigzag")  # the world still works


for _method in FUNCTIONS:
    check(f"agree-{_method}-requires-grad-differs")(
        lambda rank, world, method=_method: _requires_grad_differs(rank, world, method)
    )


# ------------------------------------------------------------------------------------ return_lse
# A rank that asks for the LSE runs one more exchange in hybrid_attention (the LSE back to the
# sequence): the ranks must agree on it before anything moves.
for _method in FUNCTIONS:

    @check(f"agree-{_method}-return-lse-differs")
    def _return_lse_differs(rank, world, method=_method):
        fn = FUNCTIONS[method]
        refused(
            lambda: fn(*_shards(2, 24, world, Hq=4, Hkv=2), mask=masks.causal(), return_lse=rank == 1),
            r"ranks disagree on return_lse: rank 1 has True but rank 0 has False",
        )
        compare_fp64(fn, mask_kind="causal", layout="zigzag")  # the world still works


# Last: before the fix the ring hung here (rank 1 waiting for keys rank 0 never sent), which
# breaks the world for any check after it.
for _method in ("ulysses", "ring"):

    @check(f"agree-{_method}-document-ids-differ")
    def _documents_differ(rank, world, method=_method):
        fn = FUNCTIONS[method]
        refused(lambda: fn(*_shards(400, 256, world), mask=_document_ids(rank), layout="contiguous"), MASK_PATTERN)
        compare_mask(fn, _document_ids(0), B=400, L=256, layout="contiguous")
