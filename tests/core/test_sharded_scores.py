"""Score modifiers read on part of an attention: at a block's absolute positions
(:func:`multihead.scores.shifted`, what a ring step needs) and at a range of heads
(:func:`multihead.scores.head_range`, what an all-to-all rank needs).

The oracle is one call over the whole attention in fp64: a row block attended with the shifted
modifier, merged over key blocks by log-sum-exp, must equal those rows of it, outputs, LSE and
the gradients of the modifier's own tensors; a range of heads must equal those heads.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import masks, scores
from multihead.positions import ALiBi, RelativePositionBias

B, H, LQ, LK, D = 2, 4, 13, 17, 8


def _modifiers():
    g = torch.Generator().manual_seed(5)
    table = torch.randn(B, H, LQ, LK, generator=g, dtype=torch.float64)
    per_pos = torch.randn(LK, generator=g, dtype=torch.float64)
    rel = RelativePositionBias(H, num_buckets=8, max_distance=16, dtype=torch.float64)
    return {
        "alibi": lambda: ALiBi(H),
        "alibi_top_left": lambda: ALiBi(H, align="top_left"),
        "t5": lambda: rel(),
        "bias_tensor": lambda: scores.bias(table),
        "softcap": lambda: scores.softcap(2.0),
        "user_positions": lambda: lambda s, b, h, qi, ki: s + 0.1 * (qi % 3) - 0.05 * ki + 0.2 * h + per_pos[ki],
        "chain": lambda: [ALiBi(H), scores.softcap(3.0)],
    }


MODS = _modifiers()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (LQ, LK, LK))


@pytest.mark.parametrize("mask_kind", ["none", "causal"])
@pytest.mark.parametrize("name", sorted(MODS))
def test_shifted_blocks_merge_to_the_whole(name, mask_kind):
    q, k, v = _inputs()
    mod = scores.as_score_mod(MODS[name]())
    mask = None if mask_kind == "none" else masks.causal()
    whole = mh.attention(q, k, v, mask=mask, score_mod=mod, return_lse=True)
    for q0, q1 in ((0, 5), (5, 13)):
        parts, lses = [], []
        for k0, k1 in ((0, 6), (6, 11), (11, 17)):
            block_mask = None if mask is None else mask.shifted(q0, k0, q_len=LQ, kv_len=LK)
            block_mod = scores.shifted(mod, q0, k0, q_len=LQ, kv_len=LK)
            res = mh.attention(
                q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask=block_mask, score_mod=block_mod, return_lse=True
            )
            parts.append(res.output)
            lses.append(res.lse)
        out, lse = mh.merge_partials(parts, lses)
        torch.testing.assert_close(out, whole.output[:, :, q0:q1])
        torch.testing.assert_close(lse, whole.lse[:, :, q0:q1])


def test_shifted_gradient_of_a_trainable_bias():
    q, k, v = _inputs(1)
    rel = RelativePositionBias(H, num_buckets=8, max_distance=16, dtype=torch.float64)
    (g_whole,) = torch.autograd.grad(mh.attention(q, k, v, score_mod=rel()).sum(), rel.weight)
    total = torch.zeros_like(rel.weight)
    for q0, q1 in ((0, 7), (7, 13)):
        block = scores.shifted(rel(), q0, 0, q_len=LQ, kv_len=LK)
        (g,) = torch.autograd.grad(mh.attention(q[:, :, q0:q1], k, v, score_mod=block).sum(), rel.weight)
        total += g
    torch.testing.assert_close(total, g_whole)


@pytest.mark.parametrize("name", sorted(MODS))
def test_head_range_equals_those_heads(name):
    q, k, v = _inputs(2)
    k, v = k[:, :, :LQ], v[:, :, :LQ]
    mod = scores.as_score_mod(MODS[name]())
    if name == "bias_tensor":
        mod = scores.bias(mod.tensor[:, :, :, :LQ])
    whole = mh.attention(q, k, v, mask=masks.causal(), score_mod=mod, return_lse=True)
    sinks = torch.linspace(-1.0, 1.0, H, dtype=torch.float64)
    with_sinks = mh.attention(q, k, v, score_mod=mod, sinks=sinks)
    for first, count in ((0, 2), (2, 2), (1, 3)):
        heads = slice(first, first + count)
        local = scores.head_range(mod, first, count, H)
        res = mh.attention(q[:, heads], k[:, heads], v[:, heads], mask=masks.causal(), score_mod=local, return_lse=True)
        torch.testing.assert_close(res.output, whole.output[:, heads])
        torch.testing.assert_close(res.lse, whole.lse[:, heads])
        local_sinks = scores.sinks_range(sinks, first, count, H)
        out = mh.attention(q[:, heads], k[:, heads], v[:, heads], score_mod=local, sinks=local_sinks)
        torch.testing.assert_close(out, with_sinks[:, heads])


def test_head_range_keeps_what_reads_no_head():
    cap = scores.softcap(5.0)
    assert scores.head_range(cap, 1, 2, 4) is cap
    shared = scores.bias(torch.zeros(1, 1, 3, 3))
    assert scores.head_range(shared, 1, 2, 4) is shared
    assert scores.shifted(cap, 3, 4, q_len=10, kv_len=10) is cap


@pytest.mark.parametrize(
    "call, exc, pattern",
    [
        (lambda: scores.head_range(ALiBi(4), 3, 2, 4), ValueError, r"heads \[3, 5\) are not a range of the 4"),
        (lambda: scores.head_range(ALiBi(4), 1.0, 2, 4), TypeError, r"first must be an int"),
        (lambda: scores.shifted(ALiBi(4), -1, 0, q_len=4, kv_len=4), TypeError, r"q_offset must be a non-negative"),
        (lambda: scores.shifted(torch.zeros(3), 0, 0, q_len=4, kv_len=4), TypeError, r"expected a multihead.scores"),
    ],
)
def test_bad_arguments(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_shifted_block_past_the_whole_is_refused():
    q, k, v = _inputs()
    block = scores.shifted(ALiBi(H), 10, 0, q_len=LQ, kv_len=LK)
    with pytest.raises(ValueError, match=r"reaches past the whole attention's Lq=13"):
        mh.attention(q[:, :, :5], k, v, score_mod=block)
