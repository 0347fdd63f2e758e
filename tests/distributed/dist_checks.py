"""The checks that run inside a spawned world (``dist_world.run_world``), by name.

Every rank builds the same whole-sequence inputs from a seed, computes single-process
:func:`multihead.attention` on them (the expected result), takes its shard, runs the sharded
function and compares its rows of the output, the LSE and the gradients of ``q``, ``k``, ``v``.
The loss reads the output and the LSE (random weights), so the LSE's gradient path is checked too.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist

import multihead as mh
from multihead import masks
from multihead.distributed import ring_attention, shard_positions, shard_sequence, ulysses_attention, unshard_sequence
from multihead.positions import RotaryEmbedding

CHECKS: dict = {}
NOTES: list[str] = []  # lines a check wants in the test log, passed or failed (dist_world, conftest)

L = 24  # splits into whole zigzag chunks over 2, 3 and 4 ranks


def note(line: str) -> None:
    """Keep ``line`` (a measurement) for the test log: ``tests/distributed/conftest.py`` prints
    every check's notes at the end of the session, whether it passed or not."""
    NOTES.append(line)


def check(name):
    def register(fn):
        CHECKS[name] = fn
        return fn

    return register


# ------------------------------------------------------------------------------------ masks
def make_mask(kind: str, B: int, Lq: int, Lk: int):
    """The global mask of a case (the same on every rank: built from fixed values)."""
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "causal_top_left":
        return masks.causal("top_left")
    if kind == "window_small":  # 3 keys back: less than a shard (and than a zigzag chunk at P <= 2)
        return masks.sliding_window(2)
    if kind == "window_large":  # reaches back more than a shard
        return masks.sliding_window(Lk // 2 + 1)
    if kind == "window_two_sided":
        return masks.sliding_window(3, 2)
    if kind in ("documents", "document_causal"):
        ids = _document_ids(B, Lq)
        return masks.document(ids) if kind == "documents" else masks.document_causal(ids)
    if kind == "padding":  # batch element 1 has no key at all: every row of it is fully masked
        return masks.key_padding(torch.tensor([Lk - 5, 0][:B] + [Lk] * max(0, B - 2)))
    if kind == "causal_padding":
        return masks.causal() & masks.key_padding(torch.tensor([Lk - 7] + [Lk // 2] * (B - 1)))
    if kind == "window_documents":
        return masks.sliding_window(4) & masks.document(_document_ids(B, Lq))
    if kind == "bool_tensor":
        g = torch.Generator().manual_seed(7)
        t = torch.rand(B, 1, Lq, Lk, generator=g) < 0.6
        t[:, :, 1] = False  # one fully masked row
        return t
    raise ValueError(kind)


def _document_ids(B: int, L: int) -> torch.Tensor:
    """Documents of odd lengths that cross shard and chunk boundaries, different per batch row."""
    rows = []
    for b in range(B):
        lengths = [5, 9, 3, 7, 11, 2, 13][b % 2 :]
        ids, doc = [], 0
        while len(ids) < L:
            ids += [doc] * lengths[doc % len(lengths)]
            doc += 1
        rows.append(ids[:L])
    return torch.tensor(rows)


# ------------------------------------------------------------------------------------ comparison
def inputs(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64).to(dtype)
    gout = torch.randn(B, Hq, Lq, Dv, generator=g, dtype=torch.float64).to(dtype)
    glse = torch.randn(B, Hq, Lq, generator=g, dtype=torch.float64)
    return q, k, v, gout, glse


def assert_sharded_layer(module, out, cp, want, want_grads, label: str = "") -> None:
    """A sharded layer's output ``out`` (this rank's rows) equals ``cp.shard(want)``, the layer on
    the whole sequence, and the gradients of ``(out * out).sum()`` on ``module``'s parameters,
    summed over the ranks, equal ``want_grads``; ``label`` starts a failing gradient's message."""
    torch.testing.assert_close(out, cp.shard(want.detach(), dim=1))
    grads = torch.autograd.grad((out * out).sum(), list(module.parameters()))
    for (name, _), g, w in zip(module.named_parameters(), grads, want_grads):
        g = g.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{label}{name}: {m}")


def loss_of(out, lse, gout, glse):
    # fully masked rows have LSE -inf: read as 0 there (masked_fill passes no gradient to them)
    return (out * gout).sum() + (lse.masked_fill(torch.isneginf(lse), 0).to(glse.dtype) * glse).sum()


def sharded_run(fn, q, k, v, gout, glse, *, mask, layout, group=None, lse=True, **kw):
    """The sharded function on this rank's shards: ``(out, lse, dq, dk, dv)`` of this rank.
    ``lse=False``: called without ``return_lse`` (the loss reads the output only; lse is None)."""
    shard = lambda t: shard_sequence(t, layout=layout, dim=2, group=group)  # noqa: E731
    qs, ks, vs = (shard(t).detach().requires_grad_() for t in (q, k, v))
    if not lse:
        out = fn(qs, ks, vs, mask=mask, layout=layout, group=group, **kw)
        return (out, None) + torch.autograd.grad((out * shard(gout)).sum(), (qs, ks, vs))
    res = fn(qs, ks, vs, mask=mask, layout=layout, return_lse=True, group=group, **kw)
    grads = torch.autograd.grad(loss_of(res.output, res.lse, shard(gout), shard(glse)), (qs, ks, vs))
    return (res.output, res.lse) + tuple(grads)


def expected_run(q, k, v, gout, glse, *, mask, layout, group=None, lse=True):
    """Single-process attention over the whole sequence, cut into this rank's shard."""
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    res = mh.attention(qf, kf, vf, mask=mask, return_lse=True)
    loss = loss_of(res.output, res.lse, gout, glse) if lse else (res.output * gout).sum()
    grads = torch.autograd.grad(loss, (qf, kf, vf))
    shard = lambda t: shard_sequence(t, layout=layout, dim=2, group=group)  # noqa: E731
    return tuple(shard(t) for t in (res.output, res.lse) + tuple(grads))


NAMES = ("output", "lse", "dq", "dk", "dv")


def compare_fp64(
    fn, *, mask_kind, layout, B=2, Hq=4, Hkv=2, Lq=L, Lk=None, D=8, Dv=6, world=None, lse=True, seed=0, **kw
):
    Lk = Lq if Lk is None else Lk
    q, k, v, gout, glse = inputs(B, Hq, Hkv, Lq, Lk, D, Dv, torch.float64, seed=seed)
    mask = make_mask(mask_kind, B, Lq, Lk)
    got = sharded_run(fn, q, k, v, gout, glse, mask=mask, layout=layout, lse=lse, **kw)
    want = expected_run(q, k, v, gout, glse, mask=mask, layout=layout, lse=lse)
    for name, x, y in zip(NAMES, got, want):
        if x is None:  # the LSE of a call without return_lse
            continue
        assert torch.isfinite(x).all() or name == "lse", f"{name}: non-finite values"
        assert not torch.isnan(x).any(), f"{name}: NaN"
        torch.testing.assert_close(x, y, msg=lambda m: f"{name} ({mask_kind}, {layout}): {m}")


# ------------------------------------------------------------------------------------ ring, fp64
RING_MASKS = (
    "none",
    "causal",
    "window_small",
    "window_large",
    "window_two_sided",
    "documents",
    "document_causal",
    "padding",
    "causal_padding",
    "window_documents",
    "bool_tensor",
)

for _layout in ("zigzag", "contiguous"):
    for _kind in RING_MASKS:

        def _ring(rank, world, kind=_kind, layout=_layout):
            compare_fp64(ring_attention, mask_kind=kind, layout=layout)

        check(f"ring-{_layout}-{_kind}")(_ring)

    # Lq != Lk: causal in both alignments (bottom-right with Lq > Lk leaves rows with no key)
    for _kind, _lq, _lk in (
        ("causal", L, 2 * L),
        ("causal", 2 * L, L),
        ("causal_top_left", L, 2 * L),
        ("causal_top_left", 2 * L, L),
        ("window_small", 2 * L, L),
    ):

        def _ring_lengths(rank, world, kind=_kind, layout=_layout, lq=_lq, lk=_lk):
            compare_fp64(ring_attention, mask_kind=kind, layout=layout, Lq=lq, Lk=lk)

        check(f"ring-{_layout}-{_kind}-Lq{_lq}-Lk{_lk}")(_ring_lengths)

    # Another backend: the block backward through autograd (the CPU flash backward serves "auto")
    for _kind in ("causal", "documents", "padding", "window_small", "bool_tensor"):

        def _ring_reference(rank, world, kind=_kind, layout=_layout):
            compare_fp64(ring_attention, mask_kind=kind, layout=layout, backend="reference")

        check(f"ring-{_layout}-{_kind}-autograd-backward")(_ring_reference)

    def _ring_mqa(rank, world, layout=_layout):
        compare_fp64(ring_attention, mask_kind="causal", layout=layout, Hq=4, Hkv=1, D=16, Dv=16)

    check(f"ring-{_layout}-mqa-causal")(_ring_mqa)

    def _ring_mha(rank, world, layout=_layout):
        compare_fp64(ring_attention, mask_kind="window_small", layout=layout, B=1, Hq=3, Hkv=3)

    check(f"ring-{_layout}-mha-window")(_ring_mha)

    # No LSE in the loss: its gradient reaches the backward as None, and with D == Dv the flash
    # backward runs on the blocks as they are (no padded copies); D != Dv pads without the column.
    for _kind, _d, _dv in (
        ("causal", 8, 8),
        ("window_small", 8, 8),
        ("documents", 8, 6),
        ("padding", 8, 8),
        ("bool_tensor", 6, 8),
    ):

        def _ring_no_lse(rank, world, kind=_kind, layout=_layout, d=_d, dv=_dv):
            compare_fp64(ring_attention, mask_kind=kind, layout=layout, D=d, Dv=dv, lse=False)

        check(f"ring-{_layout}-{_kind}-D{_d}-Dv{_dv}-no-lse")(_ring_no_lse)

    # A masked block's backward runs tile by tile of query rows (flash_pieces.TILE, 512): tiles of 5 rows
    # here, so blocks split into several tiles, some fully visible, some hidden, a last short one.
    for _kind in ("window_small", "window_two_sided", "documents", "causal_padding", "padding", "bool_tensor"):

        def _ring_tiles(rank, world, kind=_kind, layout=_layout):
            with small_tiles(5):
                compare_fp64(ring_attention, mask_kind=kind, layout=layout, Lq=2 * L, Lk=2 * L)
                compare_fp64(ring_attention, mask_kind=kind, layout=layout, Lq=2 * L, Lk=2 * L, lse=False, D=8, Dv=8)

        check(f"ring-{_layout}-{_kind}-backward-tiles")(_ring_tiles)


@contextlib.contextmanager
def small_tiles(rows: int):
    from multihead.backends import flash_pieces

    saved, flash_pieces.TILE = flash_pieces.TILE, rows
    try:
        yield
    finally:
        flash_pieces.TILE = saved


# ------------------------------------------------------------------------------------ ulysses, fp64
ULYSSES_MASKS = ("none", "causal", "window_small", "documents", "padding", "causal_padding", "bool_tensor")

for _layout in ("zigzag", "contiguous"):
    for _kind in ULYSSES_MASKS:

        def _ulysses(rank, world, kind=_kind, layout=_layout):
            compare_fp64(ulysses_attention, mask_kind=kind, layout=layout, Hq=2 * world, Hkv=world)

        check(f"ulysses-{_layout}-{_kind}")(_ulysses)

    def _ulysses_replicated(rank, world, layout=_layout):  # Hkv = 1 < P: the KV head is replicated
        compare_fp64(ulysses_attention, mask_kind="causal", layout=layout, Hq=2 * world, Hkv=1)

    check(f"ulysses-{_layout}-mqa-replicated")(_ulysses_replicated)

    def _ulysses_no_lse(rank, world, layout=_layout):  # the local call without return_lse
        for kind in ("causal", "documents", "padding"):
            compare_fp64(ulysses_attention, mask_kind=kind, layout=layout, Hq=2 * world, Hkv=world, lse=False)

    check(f"ulysses-{_layout}-no-lse")(_ulysses_no_lse)


@check("ulysses-head-dependent-masks")
def _ulysses_heads(rank, world):
    """Masks that differ per head: each rank must read the rows of its own heads."""
    B, Hq, Lq = 2, 2 * world, L
    q, k, v, gout, glse = inputs(B, Hq, world, Lq, Lq, 8, 8, torch.float64)
    g = torch.Generator().manual_seed(3)
    per_head = torch.rand(B, Hq, Lq, Lq, generator=g) < 0.5
    by_head = masks.custom(lambda b, h, qi, ki: (ki <= qi) | (ki % (h + 2) == 0))
    for mask in (per_head, by_head):
        got = sharded_run(ulysses_attention, q, k, v, gout, glse, mask=mask, layout="zigzag")
        want = expected_run(q, k, v, gout, glse, mask=mask, layout="zigzag")
        for name, x, y in zip(NAMES, got, want):
            torch.testing.assert_close(x, y, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------ helpers
@check("layout-helpers")
def _layout_helpers(rank, world):
    x = torch.arange(2 * 4 * world * 3).view(2, 4 * world * 3)  # (B, L) with L = 12P
    for layout in ("zigzag", "contiguous"):
        shard = shard_sequence(x, layout=layout, dim=1)
        pos = shard_positions(shard.shape[1], layout=layout)
        assert torch.equal(shard, x[:, pos]), (layout, shard, pos)
        assert torch.equal(unshard_sequence(shard, layout=layout, dim=1), x), layout
    # zigzag rank r holds chunks r and 2P-1-r
    c = x.shape[1] // (2 * world)
    pos = shard_positions(2 * c, layout="zigzag")
    assert pos.tolist() == list(range(rank * c, rank * c + c)) + list(
        range((2 * world - 1 - rank) * c, (2 * world - rank) * c)
    )


@check("ring-rope-global-positions")
def _ring_rope(rank, world):
    """RoPE applied to each shard at its global positions, then ring attention, equals RoPE and
    attention over the whole sequence (what a context-parallel layer must do)."""
    rope = RotaryEmbedding(8)
    q, k, v, gout, glse = inputs(2, 4, 2, L, L, 8, 8, torch.float64)
    mask = masks.causal()
    want = mh.attention(rope(q, torch.arange(L)), rope(k, torch.arange(L)), v, mask=mask)
    for layout in ("zigzag", "contiguous"):
        pos = shard_positions(L // world, layout=layout)
        qs, ks, vs = (shard_sequence(t, layout=layout, dim=2) for t in (q, k, v))
        got = ring_attention(rope(qs, pos), rope(ks, pos), vs, mask=mask, layout=layout)
        torch.testing.assert_close(got, shard_sequence(want, layout=layout, dim=2))
        # the shard's local positions (arange) would be wrong: the check can fail
        wrong = ring_attention(
            rope(qs, torch.arange(L // world)), rope(ks, torch.arange(L // world)), vs, mask=mask, layout=layout
        )
        assert (
            not torch.allclose(wrong, shard_sequence(want, layout=layout, dim=2))
            or rank == 0
            and layout == "contiguous"
        )


@check("fully-masked-rows")
def _fully_masked(rank, world):
    """Rows that see no key anywhere: output exactly 0, LSE -inf, zero gradients, no NaN."""
    B, Lq, Lk = 2, 2 * L, L
    q, k, v, gout, glse = inputs(B, 4, 2, Lq, Lk, 8, 8, torch.float64)
    mask = masks.causal() & masks.key_padding(torch.tensor([Lk, 0]))  # bottom-right: first L rows empty
    for fn in (ring_attention, ulysses_attention if Lq == Lk else None):
        if fn is None:
            continue
        out, lse, dq, dk, dv = sharded_run(fn, q, k, v, gout, glse, mask=mask, layout="zigzag")
        pos = shard_positions(Lq // world, layout="zigzag")
        empty = (pos.view(1, 1, -1) < Lq - Lk) | (torch.arange(B).view(-1, 1, 1) == 1)  # (B, 1, Sq)
        empty = empty.expand(B, 4, -1)
        assert torch.equal(out[empty], torch.zeros_like(out[empty])), "fully masked rows must be exactly 0"
        assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
        assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
        assert not any(torch.isnan(t).any() for t in (out, dq, dk, dv))
        assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))


# ------------------------------------------------------------------------------------ fp32: the relative rule
def naive_fp32(q, k, v, mask):
    """Attention computed plainly in fp32 (no upcast), with its LSE: the baseline of the rule."""
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    k, v = (t.repeat_interleave(Hq // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * D**-0.5  # (B, Hq, Lq, Lk)
    if mask is not None:
        allowed = masks.as_mask(mask).materialize(B, Hq, Lq, Lk)
        scores = scores.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    scores = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    probs = torch.exp(scores - lse).masked_fill(empty, 0.0)
    return probs @ v, lse.squeeze(-1).masked_fill(empty.squeeze(-1), float("-inf"))


def _fp32_errors(fn, mask_kind, layout, group=None, Hq=4, Hkv=2):
    """The sharded fp32 run, the fp64 result from the same rounded inputs, and the plain fp32
    baseline, each as this rank's rows of (output, lse, dq, dk, dv)."""
    B, Lq = 2, 48
    q, k, v, gout, glse = inputs(B, Hq, Hkv, Lq, Lq, 16, 16, torch.float32, seed=5)
    glse = glse.float()
    mask = make_mask(mask_kind, B, Lq, Lq)
    got = sharded_run(fn, q, k, v, gout, glse, mask=mask, layout=layout, group=group)
    want = expected_run(*(t.double() for t in (q, k, v, gout, glse)), mask=mask, layout=layout, group=group)
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    out_b, lse_b = naive_fp32(qb, kb, vb, mask)
    grads_b = torch.autograd.grad(loss_of(out_b, lse_b, gout, glse), (qb, kb, vb))
    shard = lambda t: shard_sequence(t, layout=layout, dim=2, group=group)  # noqa: E731
    baseline = tuple(shard(t) for t in (out_b, lse_b) + tuple(grads_b))
    return got, want, baseline


@check("ring-fp32-relative-rule")
def _ring_fp32(rank, world):
    from helpers import assert_relative

    for fn, layout, kind in (
        (ring_attention, "zigzag", "causal"),
        (ring_attention, "contiguous", "window_documents"),
        (ring_attention, "zigzag", "documents"),
        (ulysses_attention, "zigzag", "causal_padding"),
    ):
        kw = {"Hq": 2 * world, "Hkv": world} if fn is ulysses_attention else {}
        got, want, baseline = _fp32_errors(fn, kind, layout, **kw)
        # F = 10 for fp32 (TESTING.md: an online softmax reorders sums)
        for name, x, y, b in zip(NAMES, got, want, baseline):
            finite = torch.isfinite(y)
            if name == "lse":
                assert torch.equal(torch.isneginf(x), torch.isneginf(y)), "LSE -inf rows differ"
            assert_relative(x[finite], y[finite], b[finite], 10.0, what=f"{fn.__name__} {layout} {kind} {name}")


@check("ring-error-does-not-grow")
def _error_growth(rank, world):
    """The same fp32 attention on the whole world and on halves of it: the error of P ranks is
    within 2x the error of P/2 ranks (plus a rounding floor), and within the relative rule."""
    halves = [dist.new_group(list(range(world // 2))), dist.new_group(list(range(world // 2, world)))]
    mine = halves[rank // (world // 2)]
    errors = {}
    for label, group in (("all", None), ("half", mine)):
        got, want, _ = _fp32_errors(ring_attention, "causal", "zigzag", group=group)
        errors[label] = [float((x.double() - y).abs().nan_to_num(0, 0, 0).max()) for x, y in zip(got, want)]
    for name, e_all, e_half in zip(NAMES, errors["all"], errors["half"]):
        floor = 8 * torch.finfo(torch.float32).eps
        assert e_all <= 2 * e_half + floor, (
            f"{name}: error {e_all:.2e} over {world} ranks vs {e_half:.2e} over {world // 2}"
        )


# ------------------------------------------------------------------------------------ bad input
def _q(world, Sq=None, **kw):
    Sq = (L // world) if Sq is None else Sq
    return torch.randn(2, 4, Sq, 8, **kw), torch.randn(2, 2, Sq, 8, **kw), torch.randn(2, 2, Sq, 8, **kw)


def _bad_rank1_shape(rank, world):
    q, k, v = _q(world, Sq=L // world + (4 if rank == 1 else 0))
    ring_attention(q, k, v, layout="contiguous")


def _bad_rank1_dims(rank, world):
    q, k, v = _q(world)
    ring_attention(q[0] if rank == 1 else q, k, v)


def _bad_layout(rank, world):
    ring_attention(*_q(world), layout="diagonal")


def _bad_odd(rank, world):
    ring_attention(*_q(world, Sq=5), layout="zigzag")


def _bad_mask_length(rank, world):
    ring_attention(*_q(world), mask=masks.document(torch.zeros(2, 7, dtype=torch.long)))


def _bad_float_mask(rank, world):
    ring_attention(*_q(world), mask=torch.zeros(L, L))


def _bad_mask_differs(rank, world):
    ring_attention(*_q(world), mask=masks.sliding_window(3 + rank))


def _bad_ulysses_heads(rank, world):
    q, k, v = _q(world)
    ulysses_attention(q[:, :1], k[:, :1], v[:, :1])


def _bad_ulysses_lengths(rank, world):
    q, k, v = _q(world)
    ulysses_attention(q, torch.cat([k, k], 2), torch.cat([v, v], 2))


def _bad_shard_length(rank, world):
    shard_sequence(torch.randn(2, 4, 4 * world + 1, 8), layout="zigzag", dim=2)


def _bad_dtype_rank1(rank, world):
    q, k, v = _q(world, dtype=torch.float64 if rank == 1 else torch.float32)
    ring_attention(q, k, v)


#: id: (function, exception, regex on rank 0, regex on rank 1)
BAD_INPUTS = {
    "shapes-differ-across-ranks": (
        _bad_rank1_shape,
        ValueError,
        r"ranks disagree on q: rank 1 has \(2, 4, 1[0-9]?, 8\)",
    ),
    "one-rank-wrong-dims": (
        _bad_rank1_dims,
        ValueError,
        r"q must have 4 dims \(B, Hq, Sq, D\).*got shape \(4, \d+, 8\)",
    ),
    "dtype-differs-across-ranks": (
        _bad_dtype_rank1,
        ValueError,
        r"ranks disagree on dtype: rank 1 has 'torch.float64'",
    ),
    "unknown-layout": (
        _bad_layout,
        ValueError,
        r"layout must be one of \('zigzag', 'contiguous'\) or a multihead.distributed Layout object, got 'diagonal'",
    ),
    "odd-zigzag-shard": (_bad_odd, ValueError, r"q holds 5 positions on this rank, an odd number.*multiple of"),
    "mask-does-not-fit": (_bad_mask_length, ValueError, r"mask does not fit the whole attention \(B, Hq, Lq, Lk\)"),
    "float-mask": (_bad_float_mask, TypeError, r"mask must be a multihead mask or a bool tensor.*torch.float32"),
    "mask-differs-across-ranks": (_bad_mask_differs, ValueError, r"ranks disagree on mask"),
    "ulysses-heads": (_bad_ulysses_heads, ValueError, r"Hq=1 query heads do not split over \d ranks"),
    "ulysses-lengths": (_bad_ulysses_lengths, ValueError, r"q holds \d+ positions but k holds \d+"),
    "shard-not-divisible": (_bad_shard_length, ValueError, r"x.shape\[2\]=\d+ does not split over \d ranks"),
}


for _name, (_fn, _exc, _pattern) in BAD_INPUTS.items():

    def _bad(rank, world, fn=_fn, exc=_exc, pattern=_pattern):
        try:
            fn(rank, world)
        except exc as e:
            message = str(e)
            # the rank that received the bad input sees its own message; the others see it named
            if not re.search(pattern, message, re.S):
                assert re.search(r"rank \d received bad input", message), message
                assert re.search(pattern, message, re.S), message
        else:
            raise AssertionError(f"no {exc.__name__} raised")

    check(f"bad-{_name}")(_bad)


@check("world-still-works")
def _still_works(rank, world):
    """After every bad input above, the world is still in step: a correct call succeeds."""
    compare_fp64(ring_attention, mask_kind="causal", layout="zigzag")


# ------------------------------------------------------------------------------------ a layer's pieces
@check("context-parallel-layer")
def _layer(rank, world):
    """A MultiHeadAttention layer (GQA, RoPE, causal) run on a sequence-sharded input: its own
    projections on the shard, RoPE at the shard's global positions, ContextParallel.attention,
    its output projection; the output rows and the weight gradients (summed over ranks) equal the
    layer on the whole sequence. Then the same through ``MultiHeadAttention(context_parallel=cp)``."""
    from multihead.distributed import ContextParallel
    from multihead.layers.heads import merge_heads, split_heads

    torch.manual_seed(0)
    E, H, Hkv = 16, 4, 2
    layer = mh.MultiHeadAttention(E, H, num_kv_heads=Hkv, rope=RotaryEmbedding(E // H), causal=True).double()
    x = torch.randn(2, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = layer(x)
    want_grads = torch.autograd.grad((want * want).sum(), list(layer.parameters()))
    ulysses_fits = H % world == 0 and (Hkv % world == 0 or world % Hkv == 0)
    for method in ("ring", "ulysses") if ulysses_fits else ("ring",):
        cp = ContextParallel(layout="zigzag", method=method)
        xs = cp.shard(x, dim=1)  # (B, L/P, E)
        pos = cp.positions(xs.shape[1])
        q = layer.rope(split_heads(layer.q_proj(xs), H, E // H, True), pos)  # (B, H, L/P, D)
        k = layer.rope(split_heads(layer.k_proj(xs), Hkv, E // H, True), pos)
        v = split_heads(layer.v_proj(xs), Hkv, E // H, True)
        out = layer.out_proj(merge_heads(cp.attention(q, k, v, mask=masks.causal())))  # (B, L/P, E)
        assert_sharded_layer(layer, out, cp, want, want_grads, f"{method} ")
        sharded = mh.MultiHeadAttention(
            E, H, num_kv_heads=Hkv, rope=RotaryEmbedding(E // H), causal=True, context_parallel=cp
        ).double()
        sharded.load_state_dict(layer.state_dict())
        out = sharded(xs)  # the layer itself, on the shard
        assert_sharded_layer(sharded, out, cp, want, want_grads, f"layer {method} ")
        window = masks.sliding_window(5)  # a call mask: the whole sequence's, combined with causal
        torch.testing.assert_close(sharded(xs, mask=window), cp.shard(layer(x, mask=window).detach(), dim=1))


# ------------------------------------------------------------------------------------ memory
@check("ring-memory-per-rank")
def _ring_memory(rank, world):
    """What one rank allocates scales with its shard, not with the whole sequence: in units of one
    shard of q (``u = B·H·S·D`` elements), the forward holds at most its output (1), two K/V
    shards in flight (4: the one computed on and the next arriving) and one block's output (1);
    forward+backward at most the output (1), dq, dk, dv (3), two K/V shards (4), the gradients of
    the keys held now, of those sent one step ago and of this rank's keys arriving (6) and one
    block's kernel gradients (3). A copy of a whole shard (packing K/V, padded copies, a merge
    out of place) breaks these bounds; so do sent gradients kept until the end of the ring, from
    eight ranks on (the slow tier)."""
    from multihead.distributed.memory import TensorMemory

    B, H, D, Lw = 1, 4, 32, 384  # 384 splits into zigzag chunks over 2, 3 and 4 ranks
    q, k, v, gout, _ = inputs(B, H, H, Lw, Lw, D, D, torch.float64, seed=2)
    unit = B * H * (Lw // world) * D * 8  # bytes of one shard of q
    small = 0.5 * unit  # LSE-sized tensors (u / D each) and the merge's row weights
    for layout in ("zigzag", "contiguous"):
        # contiguous shards: a strided k or v costs one more copy of it, to send
        qs, ks, vs = (shard_sequence(t, layout=layout, dim=2).contiguous().requires_grad_() for t in (q, k, v))
        grad = shard_sequence(gout, layout=layout, dim=2)
        with TensorMemory() as memory:
            out = ring_attention(qs, ks, vs, mask=masks.causal(), layout=layout)
            forward = memory.peak
            out.backward(grad)
        note(
            f"ring {layout} peaks: forward {forward / unit:.2f} (bound 6.5), forward+backward "
            f"{memory.peak / unit:.2f} (bound 17.5) shards of q"
        )
        assert forward <= 6 * unit + small, f"{layout}: forward peak {forward / unit:.2f} shards of q, expected <= 6.5"
        assert memory.peak <= 17 * unit + small, (
            f"{layout}: forward+backward peak {memory.peak / unit:.2f} shards of q, expected <= 17.5; "
            f"alive then: {memory.at_peak(12)}"
        )
        assert forward >= unit, "the meter saw less than the output itself: it measures nothing"


@check("ulysses-memory-per-rank")
def _ulysses_memory(rank, world):
    """Ulysses' forward keeps its head shards of q, k, v and the local output (4 shards of q:
    ``u = B·H·S·D`` elements), one scratch buffer that every exchange of the call receives into
    or sends from (a batch row: ``u/B``) and the result (u): at most ``5u + u/B``, 6u when B = 1.
    The bound is exact, not a margin for noise: the scratch is freed only after the last exchange,
    so the peak does not depend on when gloo's worker thread drops its reference to a finished
    collective's buffers (``distributed/exchange.py``; freeing them right after the call made the
    peak one buffer higher in about 1% of runs under load). One run, printed in the test log."""
    from multihead.distributed.memory import TensorMemory

    H, D, Lw = 2 * world, 16, 24 * world
    for B in (1, 2):
        q, k, v, gout, _ = inputs(B, H, H, Lw, Lw, D, D, torch.float64, seed=2)
        unit = B * H * (Lw // world) * D * 8
        bound = 5 + 1 / B
        qs, ks, vs = (shard_sequence(t, layout="zigzag", dim=2).contiguous().requires_grad_() for t in (q, k, v))
        with TensorMemory() as memory:
            out = ulysses_attention(qs, ks, vs, mask=masks.causal())
            forward, alive = memory.peak, memory.at_peak(10)
            out.backward(shard_sequence(gout, layout="zigzag", dim=2))
        small = unit / 4  # LSE-sized tensors (u / D each)
        note(f"ulysses forward peak B={B}: {forward / unit:.2f} shards of q (bound {bound:.2f} + 0.25)")
        assert unit <= forward <= bound * unit + small, (
            f"B={B}: forward peak {forward / unit:.2f} shards of q, expected <= {bound:.2f} + 0.25; "
            f"alive then (bytes, op, shape): {alive}"
        )
