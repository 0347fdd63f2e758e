"""Bad input at layer level: one table of (call, exception type, message regex).

Every message names the argument, the value received and what would be valid; every check runs
before any computation, and nothing is silently broadcast.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.layers.compat import MultiheadAttention

MHA = mh.MultiHeadAttention


def _layer(**kw):
    return MHA(16, 4, **kw)


x = torch.randn(2, 5, 16)
memory = torch.randn(2, 7, 16)

CASES = [
    # constructor
    (
        "d_model not divisible",
        lambda: MHA(10, 4),
        ValueError,
        r"d_model=10 is not divisible by num_heads=4.*\[1, 2, 5, 10\].*head_dim",
    ),
    (
        "heads not divisible by kv",
        lambda: MHA(24, 6, num_kv_heads=4),
        ValueError,
        r"num_heads=6 is not divisible by num_kv_heads=4.*\[1, 2, 3, 6\]",
    ),
    ("zero d_model", lambda: MHA(0, 4), ValueError, r"d_model must be a positive int, got 0"),
    ("negative heads", lambda: MHA(16, -2), ValueError, r"num_heads must be a positive int, got -2"),
    ("zero kv heads", lambda: MHA(16, 4, num_kv_heads=0), ValueError, r"num_kv_heads must be a positive int, got 0"),
    ("zero head_dim", lambda: MHA(16, 4, head_dim=0), ValueError, r"head_dim must be a positive int, got 0"),
    ("negative kdim", lambda: MHA(16, 4, kdim=-1), ValueError, r"kdim must be a positive int, got -1"),
    ("float size", lambda: MHA(16.0, 4), TypeError, r"d_model must be a positive int, got float 16.0"),
    ("bool heads", lambda: MHA(16, True), TypeError, r"num_heads must be a positive int, got bool"),
    (
        "dropout out of range",
        lambda: MHA(16, 4, dropout=1.0),
        ValueError,
        r"dropout must be a probability in \[0, 1\), got 1.0",
    ),
    (
        "qkv_bias wrong",
        lambda: MHA(16, 4, qkv_bias=(True, False)),
        TypeError,
        r"qkv_bias must be a bool or a tuple of three bools",
    ),
    ("causal not bool", lambda: MHA(16, 4, causal="yes"), TypeError, r"causal must be a bool, got str"),
    ("unknown backend", lambda: MHA(16, 4, backend="flash9"), ValueError, r"unknown backend 'flash9'"),
    ("mqa with kv heads", lambda: mh.MultiQueryAttention(16, 4, num_kv_heads=2), TypeError, r"exactly one K/V head"),
    # forward: inputs
    (
        "rank 2 input",
        lambda: _layer()(torch.randn(5, 16)),
        ValueError,
        r"query must have 3 dims \(B, L, E\), got shape \(5, 16\).*unsqueeze\(0\)",
    ),
    ("rank 4 input", lambda: _layer()(torch.randn(1, 2, 5, 16)), ValueError, r"query must have 3 dims"),
    ("seq-first rank", lambda: _layer(batch_first=False)(torch.randn(5, 16)), ValueError, r"\(L, B, E\)"),
    ("feature size", lambda: _layer()(torch.randn(2, 5, 12)), ValueError, r"query has 12 features .* expects E=16"),
    ("kdim size", lambda: _layer(kdim=8)(x, memory), ValueError, r"key has 16 features .* expects kdim=8"),
    (
        "batch mismatch",
        lambda: _layer()(x, torch.randn(3, 7, 16)),
        ValueError,
        r"batch sizes differ: query has B=2, key 3, value 3",
    ),
    (
        "seq-first batch",
        lambda: _layer(batch_first=False)(torch.randn(5, 2, 16), torch.randn(7, 3, 16)),
        ValueError,
        r"batch sizes differ.*dim 1",
    ),
    (
        "kv length mismatch",
        lambda: _layer()(x, memory, torch.randn(2, 6, 16)),
        ValueError,
        r"key has Lk=7, value has 6",
    ),
    (
        "integer input",
        lambda: _layer()(torch.ones(2, 5, 16, dtype=torch.long)),
        TypeError,
        r"query must be a floating-point tensor, got dtype torch.int64",
    ),
    ("not a tensor", lambda: _layer()([[1.0]]), TypeError, r"query must be a torch.Tensor, got list"),
    (
        "sparse input",
        lambda: _layer()(x.to_sparse()),
        TypeError,
        r"MultiHeadAttention: query must be a dense \(strided\) tensor, got layout torch.sparse_coo; "
        r"hint: query.to_dense\(\)",
    ),
    ("dtype mismatch", lambda: _layer()(x, memory.double()), TypeError, r"must share a dtype"),
    ("empty input", lambda: _layer()(torch.randn(2, 0, 16)), ValueError, r"zero-size dimension"),
    # forward: masks
    (
        "mask shape",
        lambda: _layer()(x, mask=torch.ones(5, 6, dtype=torch.bool)),
        ValueError,
        r"shape \(1, 1, 5, 6\) is not broadcastable to \(B, H, Lq, Lk\) = \(2, 4, 5, 5\)",
    ),
    (
        "mask batch",
        lambda: _layer()(x, mask=torch.ones(3, 1, 5, 5, dtype=torch.bool)),
        ValueError,
        r"not broadcastable",
    ),
    (
        "integer mask",
        lambda: _layer()(x, mask=torch.ones(5, 5, dtype=torch.int64)),
        TypeError,
        r"Integer masks are refused",
    ),
    (
        "padding batch",
        lambda: _layer()(x, mask=mh.key_padding(torch.tensor([5, 4, 3]))),
        ValueError,
        r"3 batch elements but the input has B=2",
    ),
    ("need_weights type", lambda: _layer()(x, need_weights=1), TypeError, r"need_weights must be a bool"),
    # the nn.MultiheadAttention drop-in
    (
        "compat divisibility",
        lambda: MultiheadAttention(10, 4),
        ValueError,
        r"embed_dim=10 is not divisible by num_heads=4",
    ),
    (
        "compat kpm shape",
        lambda: MultiheadAttention(16, 4, batch_first=True)(
            x, x, x, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool)
        ),
        ValueError,
        r"key_padding_mask must have shape \(B, S\) = \(2, 5\), got \(5, 2\)",
    ),
    (
        "compat attn 2d",
        lambda: MultiheadAttention(16, 4, batch_first=True)(
            x, memory, memory, attn_mask=torch.zeros(5, 5, dtype=torch.bool)
        ),
        ValueError,
        r"2-D attn_mask must have shape \(L, S\) = \(5, 7\), got \(5, 5\)",
    ),
    (
        "compat attn 3d",
        lambda: MultiheadAttention(16, 4, batch_first=True)(x, x, x, attn_mask=torch.zeros(4, 5, 5, dtype=torch.bool)),
        ValueError,
        r"\(B\*num_heads, L, S\) = \(8, 5, 5\), got \(4, 5, 5\)",
    ),
    (
        "compat int mask",
        lambda: MultiheadAttention(16, 4)(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.int32)),
        TypeError,
        r"attn_mask must be a bool .* got dtype torch.int32",
    ),
    (
        "compat rank",
        lambda: MultiheadAttention(16, 4)(torch.randn(16), x, x),
        ValueError,
        r"query must have 2 or 3 dims",
    ),
    # conversions
    (
        "to_torch gqa",
        lambda: mh.GroupedQueryAttention(16, 4, 2).to_torch(),
        ValueError,
        r"num_kv_heads=2 != num_heads=4",
    ),
    ("to_torch causal", lambda: _layer(causal=True).to_torch(), ValueError, r"causal=True .* is_causal=True"),
    (
        "from_torch bias_kv",
        lambda: MHA.from_torch(torch.nn.MultiheadAttention(16, 4, add_bias_kv=True)),
        ValueError,
        r"add_bias_kv/add_zero_attn.*multihead.compat",
    ),
    (
        "from_torch type",
        lambda: MHA.from_torch(torch.nn.Linear(2, 2)),
        TypeError,
        r"expects a torch.nn.MultiheadAttention .* got Linear",
    ),
]


@pytest.mark.parametrize("call, error, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_validation_runs_before_any_computation(monkeypatch):
    """A bad mask is reported before the projections run."""
    layer = _layer()
    ran = []
    layer.q_proj.register_forward_pre_hook(lambda *a: ran.append(True))
    with pytest.raises(ValueError):
        layer(x, memory, mask=torch.ones(5, 5, dtype=torch.bool))
    assert not ran
