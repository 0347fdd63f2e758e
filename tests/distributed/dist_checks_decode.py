"""Context-parallel decoding (:class:`multihead.distributed.ShardedKVCache`) inside a spawned world,
against single-process :func:`multihead.attention` over the whole sequence (fp64,
``assert_close``); names start with ``decode-``.

Every rank builds the whole sequence from a seed: a prompt of :data:`PROMPT` tokens, prefilled
sharded, then decode steps of 1 and of 3 tokens. Each step's output must equal the rows of those
tokens in one causal attention over every token, on every rank; the ranks other than ``src``
pass random queries and keys (only ``src``'s count). The bad-input table checks that a refused
step raises on every rank and changes nothing.
"""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist
from dist_checks import check

import multihead as mh
from multihead import masks
from multihead.distributed import ShardedKVCache, shard_sequence

PROMPT = 24  # splits into whole zigzag chunks over 2, 3 and 4 ranks
STEPS = (1, 1, 3, 1, 2, 1)  # new tokens per step
TOTAL = PROMPT + sum(STEPS)
B, HQ, HKV, D, DV = 2, 4, 2, 8, 6


def decode_mask(kind: str):
    """A mask of the whole sequence (``TOTAL`` positions), besides the causal rule."""
    if kind == "causal":
        return None
    if kind == "window":
        return masks.sliding_window(5)
    if kind == "padding":  # row 1's keys end inside the prompt: its new tokens see only those
        return masks.key_padding(torch.tensor([TOTAL - 2, 17]))
    if kind == "documents":  # a document boundary inside the prompt and one inside the steps
        ids = torch.tensor([[0] * 10 + [1] * 20 + [2] * (TOTAL - 30), [0] * 3 + [1] * (TOTAL - 3)])
        return masks.document(ids)
    if kind == "window_documents":
        return decode_mask("window") & decode_mask("documents")
    raise ValueError(kind)


def whole(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, TOTAL, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, HKV, TOTAL, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, HKV, TOTAL, DV, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def decode_and_compare(rank: int, world: int, *, layout: str, kind: str, src: int = 0, prefill: bool = True) -> None:
    q, k, v = whole()
    mask = decode_mask(kind)
    rule = masks.causal() if mask is None else masks.causal() & mask
    want = mh.attention(q, k, v, mask=rule)  # (B, HQ, TOTAL, DV): one process, every token
    cache = ShardedKVCache(layout=layout)
    start = 0
    with torch.no_grad():
        if prefill:
            shard = lambda t: shard_sequence(t[:, :, :PROMPT], layout=layout, dim=2)  # noqa: E731
            out = cache.prefill(shard(q), shard(k), shard(v), mask=mask)
            torch.testing.assert_close(out, shard(want), msg=lambda m: f"prefill ({kind}, {layout}): {m}")
            start = PROMPT
        noise = torch.Generator().manual_seed(100 + rank)
        for n in STEPS:
            new = [t[:, :, start : start + n] for t in (q, k, v)]
            if rank != src:  # only src's tensors count: the others' are noise of the same shape
                new = [torch.randn(t.shape, generator=noise, dtype=t.dtype) for t in new]
            y = cache.step(*new, mask=mask, src=src)
            torch.testing.assert_close(
                y, want[:, :, start : start + n], msg=lambda m: f"step at {start} ({kind}, {layout}): {m}"
            )
            traffic = cache.last_traffic
            assert traffic is not None and traffic.query == B * HQ * n * D * 8
            assert traffic.partial == B * HQ * n * (DV + 1) * 8  # output and LSE, fp64
            start += n
    # memory per rank ∝ L/P: every rank within one step of the mean, and holding just its own
    counts = cache.counts
    assert sum(counts) == cache.length == start, counts
    assert max(counts) - min(counts) <= max(STEPS), counts
    assert cache.positions is not None and cache.positions.numel() == cache.local_length
    held = torch.tensor(counts)
    everyone = [None] * world
    dist.all_gather_object(everyone, cache.positions.tolist())
    assert sorted(p for ps in everyone for p in ps) == list(range(start)), "positions held twice or not at all"
    assert held.max() <= -(-start // world) + max(STEPS)


for _layout in ("zigzag", "contiguous"):
    for _kind in ("causal", "window", "padding", "documents", "window_documents"):
        check(f"decode-{_layout}-{_kind}")(
            lambda rank, world, layout=_layout, kind=_kind: decode_and_compare(rank, world, layout=layout, kind=kind)
        )


@check("decode-src-last-rank")
def _decode_src(rank, world):
    """Another rank's query counts; the new tokens then travel from it to their owner."""
    decode_and_compare(rank, world, layout="zigzag", kind="causal", src=world - 1)


@check("decode-without-prefill")
def _decode_no_prefill(rank, world):
    """Steps from an empty cache: ranks without keys contribute LSE -inf."""
    decode_and_compare(rank, world, layout="zigzag", kind="window_documents", prefill=False)


@check("decode-low-precision-relative")
def _decode_low_precision(rank, world):
    """fp32, bf16 and fp16 by the relative rule (TESTING.md): the error against fp64 from the same
    rounded inputs at most F times plain attention's in that dtype plus a few ulps (F = 10 in
    fp32, where an LSE merge reorders the sums; 2 in bf16/fp16, whose rounding of the output
    dominates). The step's q is a transposed view ((B, n, Hq, D) memory), as a layer makes it."""
    for dtype, factor in ((torch.float32, 10), (torch.bfloat16, 2), (torch.float16, 2)):
        q, k, v = (t.to(dtype) for t in whole(seed=4))
        rule = masks.causal()
        ref = mh.attention(q.double(), k.double(), v.double(), mask=rule)
        base = mh.attention(q, k, v, mask=rule)  # plain attention in dtype: the baseline
        cache = ShardedKVCache(layout="zigzag")
        with torch.no_grad():
            shard = lambda t: shard_sequence(t[:, :, :PROMPT], layout="zigzag", dim=2)  # noqa: E731
            cache.prefill(shard(q), shard(k), shard(v))
            start = PROMPT
            for n in STEPS:
                q_new = q[:, :, start : start + n].transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous
                got = cache.step(q_new, k[:, :, start : start + n], v[:, :, start : start + n])
                assert got.dtype == dtype
                want = ref[:, :, start : start + n]
                err = (got.double() - want).abs().max().item()
                err_base = (base[:, :, start : start + n].double() - want).abs().max().item()
                floor = 4 * torch.finfo(dtype).eps * want.abs().max().item()
                assert err <= factor * err_base + floor, (
                    f"{dtype}, step at {start}: error {err:.2e}, plain {dtype} {err_base:.2e}, floor {floor:.1e}"
                )
                start += n


# ------------------------------------------------------------------------------------ bad input
LIMIT = 10.0  # seconds a refusal may take on a rank


def refused_everywhere(call, exc: type, pattern: str) -> None:
    """``call()`` raises ``exc`` on every rank within ``LIMIT`` seconds; the message matches
    ``pattern`` on the rank that received the bad input and names it on the others."""
    start = time.perf_counter()
    try:
        call()
        message = None
    except exc as e:
        message = str(e)
    seconds = time.perf_counter() - start
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (message, seconds))
    for r, (m, s) in enumerate(everyone):
        assert m is not None, f"rank {r}: no {exc.__name__} raised ({everyone})"
        assert s < LIMIT, f"rank {r}: the refusal took {s:.1f} s, expected < {LIMIT} s"
        assert re.search(pattern, m, re.S), f"rank {r}: {m!r} does not match {pattern!r}"


def _step_inputs(n: int = 1, dtype=torch.float64, **kw):
    g = torch.Generator().manual_seed(9)
    return (
        torch.randn(B, HQ, n, D, generator=g, dtype=dtype, **kw),
        torch.randn(B, HKV, n, D, generator=g, dtype=dtype),
        torch.randn(B, HKV, n, DV, generator=g, dtype=dtype),
    )


@check("decode-bad-inputs")
def _decode_bad(rank, world):
    cache = ShardedKVCache(layout="contiguous")
    q, k, v = whole()
    with torch.no_grad():
        shard = lambda t: shard_sequence(t[:, :, :PROMPT], layout="contiguous", dim=2)  # noqa: E731
        cache.prefill(shard(q), shard(k), shard(v))
        cache.step(*(t[:, :, PROMPT : PROMPT + 1] for t in (q, k, v)))
    before = (cache.counts, cache.nbytes, cache.positions.clone())
    bad_step = {
        # rank 1's query holds two tokens, the others' one
        "shapes differ": (
            lambda: cache.step(*_step_inputs(2 if rank == 1 else 1)),
            ValueError,
            r"ranks disagree on q: rank 1 has \(2, 4, 2, 8\)",
        ),
        "requires grad": (
            lambda: cache.step(*_step_inputs(requires_grad=rank == 1)),
            ValueError,
            r"requires grad, but a sharded decode is inference only",
        ),
        "tensor mask": (
            lambda: cache.step(*_step_inputs(), mask=torch.ones(1, 1, 1, PROMPT + 2, dtype=torch.bool)),
            TypeError,
            r"mask must be None or a multihead mask object.*got Tensor",
        ),
        "mask too short": (
            lambda: cache.step(*_step_inputs(), mask=masks.document(torch.zeros(B, PROMPT, dtype=torch.long))),
            ValueError,
            rf"covers {PROMPT} positions, but the new tokens reach position {PROMPT + 1}",
        ),
        "masks differ": (
            lambda: cache.step(*_step_inputs(), mask=masks.sliding_window(3 + rank)),
            ValueError,
            r"ranks disagree on mask",
        ),
        "src out of range": (
            lambda: cache.step(*_step_inputs(), src=world),
            ValueError,
            rf"src must be a rank in \[0, {world}\), got {world}",
        ),
        "dtype of the cache": (
            lambda: cache.step(*_step_inputs(dtype=torch.float32)),
            ValueError,
            r"do not continue the cache's \(B, Hkv, ·, D\)",
        ),
        "value dim of the cache": (
            lambda: cache.step(*_step_inputs()[:2], torch.zeros(B, HKV, 1, DV + 1, dtype=torch.float64)),
            ValueError,
            rf"do not continue the cache's .* Dv = {DV}",
        ),
        "prefill twice": (
            lambda: cache.prefill(shard(q), shard(k), shard(v)),
            ValueError,
            r"the cache already holds \d+ tokens; expected an empty cache",
        ),
    }
    for name, (call, exc, pattern) in bad_step.items():
        with torch.no_grad() if name != "requires grad" else torch.enable_grad():
            refused_everywhere(call, exc, f"({pattern})|(rank \\d received bad input.*({pattern}))")
        after = (cache.counts, cache.nbytes, cache.positions)
        assert after[:2] == before[:2] and torch.equal(after[2], before[2]), f"{name}: the cache changed"
    with torch.no_grad():  # the world and the cache still work: the next token, exactly
        y = cache.step(*(t[:, :, PROMPT + 1 : PROMPT + 2] for t in (q, k, v)))
    want = mh.attention(q, k, v, mask=masks.causal())[:, :, PROMPT + 1 : PROMPT + 2]
    torch.testing.assert_close(y, want)
