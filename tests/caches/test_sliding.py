"""``SlidingWindowKVCache``'s one-token step: a full ring whose window covers every slot is read
with no mask at all (``CacheRead.mask`` gives ``None``, decided on the host from ``CacheRead.held``)
and equals the fp64 attention over the whole sequence; every other read keeps its row mask (from
two comparisons where the host can decide it) and gives the same result as before; the host
record of the positions held follows every update, rollback, crop, reorder and reset."""

from __future__ import annotations

import random

import pytest
import torch

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.caches import SlidingWindowKVCache
from multihead.caches.base import EMPTY_POSITION

# every test twice: multihead's CPU decode kernel and PyTorch's GEMMs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("decode_kernel")

B, HQ, HKV, D = 2, 4, 2, 16


def _masks(window: int, L: int) -> dict[str, object]:
    """The call masks of the matrix, at positions of a sequence of ``L`` tokens (``None``: the
    ring's own window); each is read by the ring with ``causal=True``."""
    ids = torch.tensor([[0] * (L // 2) + [1] * (L - L // 2)])  # two documents, every row alike
    return {
        "window": mh.sliding_window(window),
        "narrower window": mh.sliding_window(max(0, window - 2)),
        "window, every row padded past the end": mh.sliding_window(window) & mh.key_padding([L + 5, L + 9]),
        "window, row 0 sees nothing": mh.sliding_window(window) & mh.key_padding([0, L + 9]),
        "window, documents": mh.sliding_window(window) & mh.document(ids),
    }


def _whole(q_all, k_all, v_all, mask):
    """fp64 attention of every query over the whole sequence, ``mask & causal()`` (the oracle: no
    cache); row ``t`` is the step at position ``t``."""
    return mh.reference_attention(q_all.double(), k_all.double(), v_all.double(), mask=mask & mh.causal()).output


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("extra", [0, 2])
@pytest.mark.parametrize("window", [3, 8])
def test_a_full_ring_step_reads_no_mask_and_equals_the_whole_sequence(window, extra, dtype):
    L = window + extra + 8  # the ring fills, wraps, and goes on
    gen = torch.Generator().manual_seed(window * 10 + extra)
    q_all, k_all, v_all = (
        torch.randn(B, h, L, D, generator=gen, dtype=torch.float64).to(dtype) for h in (HQ, HKV, HKV)
    )
    cache = SlidingWindowKVCache(window, B, HKV, D, extra=extra, dtype=dtype)
    capacity = window + 1 + extra
    masks = _masks(window, L)
    refs = {name: _whole(q_all, k_all, v_all, mask) for name, mask in masks.items()}
    for t in range(L):
        read = cache.update(k_all[:, :, t : t + 1], v_all[:, :, t : t + 1])
        q = q_all[:, :, t : t + 1]
        assert read.held == range(max(0, t + 1 - capacity), t + 1)
        full_ring = t + 1 >= capacity and extra == 0  # every slot holds a position the window reaches
        for name, mask in masks.items():
            over_slots = read.mask(mask, True, HQ)
            if name in ("window", "window, every row padded past the end") and full_ring:
                assert over_slots is None, (name, t)  # decided on the host: no mask tensor
            elif name in ("narrower window", "window, row 0 sees nothing") or not full_ring:
                assert isinstance(over_slots, torch.Tensor), (name, t)
            got = mh.attention(q, read.keys, read.values, mask=over_slots)
            # the same read with its positions evaluated into a row mask (the path before)
            slow = _without_held(read).mask(mask, True, HQ)
            assert isinstance(slow, torch.Tensor)
            if over_slots is not None:  # from the host or evaluated: the same row mask
                assert torch.equal(over_slots.expand_as(slow), slow), (name, t)
            before = mh.attention(q, read.keys, read.values, mask=slow)
            ref = refs[name][:, :, t : t + 1]
            what = f"t={t} {name} window={window} extra={extra} {dtype}"
            if name == "window, row 0 sees nothing":
                assert torch.equal(got[0], torch.zeros_like(got[0])), what  # a fully masked row: 0
            if dtype == torch.float64:
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=what)
                torch.testing.assert_close(got, before, rtol=1e-12, atol=1e-12, msg=what)
            else:
                base = naive_attention(q, read.keys, read.values, slow)
                assert_relative(got, ref, base, factor=2, what=what)


def _without_held(read):
    """``read`` without its host record of the positions held: :meth:`CacheRead.mask` evaluates
    the slots' positions into a row mask, as it did for every ring read before."""
    return mh.caches.CacheRead(read.keys, read.values, read.query_positions, read.key_positions, read.window)


def test_a_slot_tensor_in_the_mask_is_evaluated_and_a_wider_window_refused():
    """A tensor part is over the slots (not at positions): the row mask is evaluated, fully masked
    rows included. A mask reaching further back than the ring holds is refused from the host
    position, with the message it had when the positions were read from the tensor."""
    window = 5
    cache = SlidingWindowKVCache(window, B, HKV, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(B, HKV, 12, D, generator=gen, dtype=torch.float64) for _ in range(2))
    cache.update(k[:, :, :11], v[:, :, :11])
    read = cache.update(k[:, :, 11:], v[:, :, 11:])
    hide = torch.ones(B, 1, 1, read.slots, dtype=torch.bool)
    hide[1] = False  # row 1 sees nothing
    over_slots = read.mask(mh.sliding_window(window) & hide, True, HQ)
    assert isinstance(over_slots, torch.Tensor) and not bool(over_slots[1].any()) and bool(over_slots[0].all())
    q = torch.randn(B, HQ, 1, D, generator=gen, dtype=torch.float64)
    out = mh.attention(q, read.keys, read.values, mask=over_slots)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for where in (lambda m: read.mask(m, True, HQ), lambda m: cache.check_mask(m, True, 1)):
        with pytest.raises(ValueError, match=r"lets a query see the 6 keys before it \(position 1[12] sees back to"):
            where(mh.sliding_window(window + 1))
        with pytest.raises(ValueError, match=r"no mask with causal=True lets a query see every earlier key"):
            where(None)


@pytest.mark.parametrize("seed", range(6))
def test_the_positions_held_follow_every_change(seed):
    """The ring's host record of the positions it holds (``CacheRead.held``) against its positions
    tensor, after random updates of 1 to capacity + 2 tokens (with and without autograd),
    rollbacks, crops (honoured or refused), reorders and resets."""
    rng = random.Random(seed)
    window, extra = rng.choice([(0, 0), (2, 0), (3, 2), (5, 1)])
    capacity = window + 1 + extra
    cache = SlidingWindowKVCache(window, B, HKV, D, extra=extra, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(60):
        action = rng.random()
        if action < 0.5:
            new = rng.randint(1, capacity + 2)
            k, v = (torch.randn(B, HKV, new, D, generator=gen, dtype=torch.float64) for _ in range(2))
            if rng.random() < 0.2:
                k.requires_grad_(True)
            cache.update(k, v)
        elif action < 0.65:
            try:
                cache.rollback()
            except RuntimeError:
                pass
        elif action < 0.85:
            try:
                cache.crop(rng.randint(0, cache.length))
            except ValueError:
                pass  # refused: nothing changed (tests/caches/test_caches.py)
        elif action < 0.95:
            cache.reorder(torch.tensor([rng.randrange(B) for _ in range(B)]))
        else:
            cache.reset()
        with torch.no_grad():  # a one-token read says what it holds; then undone
            read = cache.update(*(torch.zeros(B, HKV, 1, D, dtype=torch.float64) for _ in range(2)))
        stored = {p for p in read.key_positions.tolist() if p != EMPTY_POSITION}
        assert read.held is not None and set(read.held) == stored, (read.held, sorted(stored))
        assert read.held[-1] == cache.length - 1
        cache.rollback()
