"""The oracle itself: against a brute-force loop, against SDPA's math kernel in fp64, gradcheck."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import multihead as mh
from helpers import covering_cases, make_inputs
from multihead.blocks import Block, Extent

CASES = [c for c in covering_cases(n_random=0) if c.Lq * c.Lk <= 128 * 128]


def brute_force(q, k, v, mask, scale=None):
    """Attention by explicit loops over every (b, h, i): the definition, nothing vectorized."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(D) if scale is None else scale
    from multihead.call import mask_and_score_mod

    mask, bias = mask_and_score_mod(mask, None, check_binary=False)  # a float mask: its -inf pattern + a bias
    dense = None if mask is None else mask.materialize(B, Hq, Lq, Lk)
    added = None if bias is None else bias.bias_block(Extent(B, Hq, Lq, Lk), Block(0, Lq, 0, Lk), dtype=torch.float64)
    out = torch.zeros(B, Hq, Lq, Dv, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(Lq):
                logits = []
                for j in range(Lk):
                    s = float(q[b, h, i] @ k[b, g, j]) * scale
                    if added is not None:
                        s = s + float(
                            added[b % added.shape[0], h % added.shape[1], i % added.shape[2], j % added.shape[3]]
                        )
                    if dense is not None and not bool(dense[b % dense.shape[0], h % dense.shape[1], i, j]):
                        s = -math.inf
                    logits.append(s)
                if all(x == -math.inf for x in logits):
                    continue
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                total = sum(w)
                lse[b, h, i] = top + math.log(total)
                for j in range(Lk):
                    out[b, h, i] += w[j] / total * v[b, g, j]
    return out, lse


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.Lq * c.Lk <= 17 * 17 or c.mask in ("document", "custom")][:10], ids=lambda c: c.id
)
def test_reference_equals_brute_force_loop(case):
    q, k, v, mask = make_inputs(case)
    if case.Lq * case.Lk > 400:  # keep the Python loop small
        q, k, v = q[..., :9, :], k[..., :11, :], v[..., :11, :]
        case_mask = None if mask is None or isinstance(mask, torch.Tensor) else mask
        if isinstance(case_mask, mh.masks.Document):
            case_mask = mh.document(case_mask.q_ids[:, :9], case_mask.kv_ids[:, :11])
        mask = case_mask
    out, weights, lse = mh.reference_attention(q, k, v, mask=mask)
    want_out, want_lse = brute_force(q, k, v, mask)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert torch.all((weights.sum(-1) - 1).abs().lt(1e-12) | (weights.sum(-1) == 0))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_equals_sdpa_math_fp64(case):
    """Where SDPA shares the feature (bool/additive masks, GQA via enable_gqa), fp64 agrees."""
    q, k, v, mask = make_inputs(case)
    from multihead.call import mask_and_score_mod

    m, _ = mask_and_score_mod(mask, None, check_binary=False)
    dense = (
        mask
        if isinstance(mask, torch.Tensor)
        else None
        if m is None
        else m.materialize(case.B, case.Hq, case.Lq, case.Lk)
    )
    empty = None if m is None else m.empty_rows(Extent(case.B, case.Hq, case.Lq, case.Lk))
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=case.Hq != case.Hkv)
    got = mh.reference_attention(q, k, v, mask=mask).output
    if empty is not None:  # SDPA's own answer for rows with no key is not part of the comparison
        keep = ~empty.unsqueeze(-1).expand_as(got)
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask_kind", ["none", "causal_br", "key_padding", "additive_tensor", "shifted_causal"])
def test_reference_gradcheck(mask_kind):
    from helpers import Case

    case = Case(2, 4, 2, 5, 6, 3, 2, mask_kind, seed=7)
    q, k, v, mask = make_inputs(case, requires_grad=True)
    fn = lambda q, k, v: mh.reference_attention(q, k, v, mask=mask)  # noqa: E731
    assert torch.autograd.gradcheck(lambda q, k, v: fn(q, k, v).output, (q, k, v))
    assert torch.autograd.gradgradcheck(lambda q, k, v: fn(q, k, v).output, (q, k, v))
    # The LSE is differentiable too (ring attention merges partial results with it).
    assert torch.autograd.gradcheck(lambda q, k, v: fn(q, k, v).lse.masked_fill(fn(q, k, v).lse.isinf(), 0), (q, k, v))


def test_reference_fully_masked_rows_give_zeros_and_zero_grads():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    allowed = torch.ones(4, 5, dtype=torch.bool)
    allowed[1] = False
    out, weights, lse = mh.reference_attention(q, k, v, mask=allowed)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.equal(weights[:, :, 1], torch.zeros_like(weights[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, [0, 2, 3]]).all()
    (out.sum() + weights.sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))


def test_reference_upcasts_half_inputs_and_returns_input_dtype():
    q = torch.randn(1, 1, 4, 8).bfloat16()
    out, weights, lse = mh.reference_attention(q, q, q)
    assert out.dtype == torch.bfloat16
    assert weights.dtype == torch.float32 and lse.dtype == torch.float32  # softmax accumulated in fp32
