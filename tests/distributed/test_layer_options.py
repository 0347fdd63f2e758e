"""``MultiHeadAttention(context_parallel=...)`` refuses what sharded attention cannot do, before any
process group is touched (the layer's sharded run itself is the ``context-parallel-layer`` check)."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.caches import DynamicKVCache
from multihead.distributed import ContextParallel

CP = ContextParallel(layout="zigzag")


@pytest.mark.parametrize(
    "options, error, pattern",
    [
        (
            dict(context_parallel="ring"),
            TypeError,
            r"context_parallel must be None or a multihead.distributed.ContextParallel, got str",
        ),
        (dict(dropout=0.1), ValueError, r"context_parallel attention has no dropout yet; got dropout=0.1"),
    ],
)
def test_constructor_refuses_what_sharded_attention_cannot_do(options, error, pattern):
    options = {"context_parallel": CP, **options}
    with pytest.raises(error, match=pattern):
        mh.MultiHeadAttention(16, 4, causal=True, **options)


@pytest.mark.parametrize(
    "call, what",
    [
        (lambda m, x: m(x, kv_cache=DynamicKVCache()), "kv_cache"),
        (lambda m, x: m(x, need_weights=True), r"need_weights=True"),
        (lambda m, x: m(x, torch.randn(2, 3, 16)), r"a separate key \(cross-attention\)"),
    ],
)
def test_a_sharded_call_refuses_caches_weights_and_cross_attention(call, what):
    layer = mh.MultiHeadAttention(16, 4, causal=True, context_parallel=CP)
    with pytest.raises(
        ValueError, match=rf"a context_parallel layer attends over a sharded sequence; it takes no {what}"
    ):
        call(layer, torch.randn(2, 4, 16))
