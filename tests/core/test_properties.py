"""Metamorphic properties that hold for every backend, and dropout."""

import pytest
import torch

import multihead as mh
from helpers import refuses

# every backend that runs on the CPU (triton_blocks declares CUDA only; flex compiles here too slowly)
BACKENDS = [b for b in mh.available_backends() if b != "flex" and "cpu" in mh.get_backend(b).capabilities.device_types]


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", [None, mh.causal(), mh.sliding_window(4), mh.key_padding([20, 9])], ids=str)
def test_gqa_equals_mha_with_kv_repeated_by_the_grouped_mapping(backend, mask):
    q, k, v = rand(2, 8, 17, 16, seed=1), rand(2, 2, 20, 16, seed=2), rand(2, 2, 20, 8, seed=3)
    gqa = mh.attention(q, k, v, mask=mask, backend=backend)
    # Query head h reads KV head h // 4: heads 0-3 read 0, heads 4-7 read 1 (not h % 2).
    k_rep, v_rep = k[:, [0, 0, 0, 0, 1, 1, 1, 1]], v[:, [0, 0, 0, 0, 1, 1, 1, 1]]
    torch.testing.assert_close(gqa, mh.attention(q, k_rep, v_rep, mask=mask, backend=backend))
    tiled = mh.attention(q, k[:, [0, 1] * 4], v[:, [0, 1] * 4], mask=mask, backend=backend)
    assert not torch.allclose(gqa, tiled), "the tiled mapping h % Hkv must not be what GQA means"


def test_the_query_head_fold_follows_the_grouped_mapping():
    """conventions.fold_query_heads, the one fold sdpa and decode run: row g*Lq + i of KV head kv
    is query i of head kv*G + g, the head kv_head_of maps to kv; unfolding gives the heads back."""
    from multihead.conventions import fold_query_heads, group_query_heads, kv_head_of, unfold_query_heads

    B, Hq, Hkv, Lq, D = 2, 6, 2, 3, 4
    G = Hq // Hkv
    q = torch.randn(B, Hq, Lq, D)
    folded = fold_query_heads(q, Hkv, Hq)  # (B, Hkv, G*Lq, D)
    assert folded.shape == (B, Hkv, G * Lq, D) and folded.data_ptr() == q.data_ptr()  # a view
    for h in range(Hq):
        kv, g = kv_head_of(h, Hq, Hkv), h % G
        assert torch.equal(folded[:, kv, g * Lq : (g + 1) * Lq], q[:, h])
    assert torch.equal(unfold_query_heads(folded, Hq), q)
    lse = folded[..., 0]  # (B, Hkv, G*Lq): a per-row value unfolds the same way
    assert torch.equal(unfold_query_heads(lse, Hq), q[..., 0])
    shared = torch.rand(B, 1, Lq, 5) < 0.5  # a mask shared by every head: repeated for each of the G
    assert torch.equal(fold_query_heads(shared, Hkv, Hq), shared.repeat(1, 1, G, 1))
    assert group_query_heads(shared, Hkv).shape == (B, 1, 1, Lq, 5)
    assert torch.equal(group_query_heads(q, Hkv)[:, 1, 2], q[:, kv_head_of(5, Hq, Hkv) * G + 2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mqa_equals_gqa_with_one_group(backend):
    q, k, v = rand(1, 6, 9, 8, seed=4), rand(1, 1, 11, 8, seed=5), rand(1, 1, 11, 8, seed=6)
    mqa = mh.attention(q, k, v, mask=mh.causal(), backend=backend)
    torch.testing.assert_close(
        mqa, mh.attention(q, k.expand(1, 6, 11, 8), v.expand(1, 6, 11, 8), mask=mh.causal(), backend=backend)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_permuting_keys_and_values_together_changes_nothing_without_a_mask(backend):
    q, k, v = rand(2, 4, 13, 8, seed=7), rand(2, 4, 19, 8, seed=8), rand(2, 4, 19, 8, seed=9)
    perm = torch.randperm(19, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        mh.attention(q, k[:, :, perm], v[:, :, perm], backend=backend), mh.attention(q, k, v, backend=backend)
    )
    qperm = torch.randperm(13, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        mh.attention(q[:, :, qperm], k, v, backend=backend), mh.attention(q, k, v, backend=backend)[:, :, qperm]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_keys_can_hold_anything(backend):
    """Keys masked out by key_padding may be huge without changing the output, on every call; NaN
    too with ``check_finite=True`` (without it a NaN gives what the kernel gives: docs/conventions.md)."""
    q, k, v = rand(2, 4, 7, 8, seed=10), rand(2, 4, 12, 8, seed=11), rand(2, 4, 12, 8, seed=12)
    lengths = torch.tensor([12, 5])
    clean = mh.attention(q, k, v, mask=mh.key_padding(lengths), backend=backend)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 5:] = 1e30
    v2[1, :, 5:] = -1e30
    huge = mh.attention(q, k2, v2, mask=mh.key_padding(lengths), backend=backend)
    torch.testing.assert_close(huge, clean)
    v2[1, :, 5:] = float("nan")
    dirty = mh.attention(q, k2, v2, mask=mh.key_padding(lengths), backend=backend, check_finite=True)
    torch.testing.assert_close(dirty, clean)
    # Padding the key sequence with masked keys leaves the output unchanged.
    k3, v3 = torch.cat([k, rand(2, 4, 5, 8, seed=13)], 2), torch.cat([v, rand(2, 4, 5, 8, seed=14)], 2)
    padded = mh.attention(q, k3, v3, mask=mh.key_padding(lengths), backend=backend)
    torch.testing.assert_close(padded, clean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_reproducible_unbiased_and_training_only(backend):
    q, k, v = (
        rand(2, 4, 64, 16, seed=15, dtype=torch.float32),
        rand(2, 4, 64, 16, seed=16, dtype=torch.float32),
        torch.ones(2, 4, 64, 16),
    )
    if refuses(backend, q, k, v, dropout_p=0.3):
        return
    torch.manual_seed(123)
    a = mh.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(123)
    b = mh.attention(q, k, v, dropout_p=0.3, backend=backend)
    assert torch.equal(a, b), "same seed, same dropout"
    c = mh.attention(q, k, v, dropout_p=0.3, backend=backend)
    assert not torch.equal(a, c)
    # With v = 1, each output is (sum of kept probabilities) / (1 - p): its mean is 1 (unbiased).
    assert abs(float(a.mean()) - 1.0) < 0.05
    assert not torch.allclose(a, torch.ones_like(a))


def test_reference_dropout_keeps_about_one_minus_p_and_accepts_an_injected_mask():
    q, k, v = rand(1, 2, 40, 8, seed=17), rand(1, 2, 50, 8, seed=18), rand(1, 2, 50, 8, seed=19)
    keep = torch.rand(1, 2, 40, 50, generator=torch.Generator().manual_seed(2)) >= 0.25
    assert abs(float(keep.float().mean()) - 0.75) < 0.03
    got = mh.attention(q, k, v, dropout_p=0.25, dropout_mask=keep, backend="reference")
    probs = mh.reference_attention(q, k, v).weights
    torch.testing.assert_close(got, (probs * keep / 0.75) @ v)


def test_scale_is_applied():
    q, k, v = rand(1, 1, 5, 4, seed=20), rand(1, 1, 5, 4, seed=21), rand(1, 1, 5, 4, seed=22)
    torch.testing.assert_close(mh.attention(q, k, v, scale=0.5), mh.attention(q * 0.5 / 4**-0.5, k, v))


def test_output_dtype_follows_q_and_lse_is_fp32_for_half():
    q = rand(1, 2, 8, 16, dtype=torch.bfloat16)
    res = mh.attention(q, q, q, return_lse=True, return_weights=True)
    assert res.output.dtype == torch.bfloat16 and res.weights.dtype == torch.bfloat16
    assert res.lse.dtype == torch.float32 and res.lse.shape == (1, 2, 8)


def test_noncontiguous_inputs_packed_qkv_and_expanded_kv():
    qkv = rand(2, 10, 3, 4, 8, seed=23)  # (B, L, 3, H, D) as a fused projection produces
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # strided views (B, H, L, D)
    assert not q.is_contiguous()
    ref = mh.reference_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask=mh.causal()).output
    torch.testing.assert_close(mh.attention(q, k, v, mask=mh.causal()), ref)
    k1 = rand(2, 1, 10, 8, seed=24).expand(2, 4, 10, 8)  # stride-0 heads
    torch.testing.assert_close(
        mh.attention(q, k1, k1), mh.reference_attention(q, k1.contiguous(), k1.contiguous()).output
    )
