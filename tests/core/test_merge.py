"""``merge_partials``: attention over any split of the keys, merged by log-sum-exp, equals the
unsplit attention (outputs, LSE, gradients), including parts a row cannot see at all."""

import pytest
import torch

import multihead as mh
from helpers import DEVICES


def _split_attention(q, k, v, mask, cuts):
    """Attention over keys [c0, c1) for each part, each with the mask's block at its positions."""
    Lq, Lk = q.shape[2], k.shape[2]
    outs, lses = [], []
    for k0, k1 in zip(cuts[:-1], cuts[1:]):
        part = None if mask is None else mask.shifted(0, k0, q_len=Lq, kv_len=Lk)
        r = mh.reference_attention(q, k[:, :, k0:k1], v[:, :, k0:k1], mask=part)
        outs.append(r.output)
        lses.append(r.lse)
    return mh.merge_partials(outs, lses)


CUTS = {"two": [0, 9, 23], "three_uneven": [0, 1, 20, 23], "every_key": list(range(24)), "one": [0, 23]}
MASKS = {
    "none": None,
    "causal": mh.causal(),
    "window": mh.sliding_window(3),
    # Batch element 1 sees only its first 2 keys: parts beyond them are fully masked for it;
    # with causal, the first rows see nothing of the later parts.
    "causal&padding": mh.causal() & mh.key_padding(torch.tensor([23, 2])),
    "empty_batch": mh.key_padding(torch.tensor([23, 0])),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cuts", list(CUTS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_any_split_of_the_keys_merges_to_the_unsplit_attention(mask, cuts, device):
    """The parts and their merge run on ``device``; the unsplit attention on CPU."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 23, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    m = MASKS[mask]
    whole = mh.reference_attention(q, k, v, mask=m)
    out, lse = _split_attention(*(t.to(device) for t in (q, k, v)), m, CUTS[cuts])
    out, lse = out.cpu(), lse.cpu()  # differentiable copies: the gradients reach q, k, v on CPU
    torch.testing.assert_close(out, whole.output, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, whole.lse, rtol=1e-12, atol=1e-12)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0)
    want = torch.autograd.grad((whole.output * g_out).sum() + (whole.lse.nan_to_num(0, 0, 0) * g_lse).sum(), (q, k, v))
    got = torch.autograd.grad((out * g_out).sum() + (lse.nan_to_num(0, 0, 0) * g_lse).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_all_parts_masked_gives_zero_output_and_minus_inf_lse_without_nan():
    outs = [torch.zeros(1, 1, 3, 4, requires_grad=True) for _ in range(2)]
    lses = [torch.full((1, 1, 3), float("-inf"), requires_grad=True) for _ in range(2)]
    out, lse = mh.merge_partials(outs, lses)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    for t in outs + lses:
        assert torch.isfinite(t.grad).all() and torch.equal(t.grad, torch.zeros_like(t.grad))


def test_low_precision_outputs_merge_in_fp32_and_keep_their_dtype():
    gen = torch.Generator().manual_seed(1)
    outs = [torch.randn(1, 2, 5, 8, generator=gen).to(torch.bfloat16) for _ in range(3)]
    lses = [torch.randn(1, 2, 5, generator=gen) * 30 for _ in range(3)]
    out, lse = mh.merge_partials(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    w = torch.softmax(torch.stack(lses), 0)
    want = sum(wi.unsqueeze(-1) * o.float() for wi, o in zip(w, outs))
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "outs,lses,exc,pattern",
    [
        ([], [], ValueError, r"as many outputs as lses \(at least one\), got 0 outputs and 0 lses"),
        (
            [torch.zeros(1, 1, 2, 3)],
            [torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)],
            ValueError,
            r"got 1 outputs and 2 lses",
        ),
        (
            [torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 4)],
            [torch.zeros(1, 1, 2)] * 2,
            ValueError,
            r"outputs\[1\] has shape \(1, 1, 2, 4\); expected \(B, H, Lq, Dv\) = \(1, 1, 2, 3\)",
        ),
        (
            [torch.zeros(1, 1, 2, 3)],
            [torch.zeros(1, 2)],
            ValueError,
            r"lses\[0\] has shape \(1, 2\); expected \(B, H, Lq\)",
        ),
        (torch.zeros(1, 1, 2, 3), [torch.zeros(1, 1, 2)], TypeError, r"sequences of tensors, got Tensor and list"),
        (
            [torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3, dtype=torch.float16)],
            [torch.zeros(1, 1, 2)] * 2,
            TypeError,
            r"outputs\[1\] is torch.float16 on cpu but outputs\[0\] is torch.float32",
        ),
    ],
)
def test_bad_input_names_the_argument(outs, lses, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mh.merge_partials(outs, lses)
