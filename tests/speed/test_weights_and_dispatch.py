"""Weights on demand (``weights_heads`` / ``weights_rows``) and the ``auto`` decision table."""

import pytest
import torch

import multihead as mh
from helpers import LargestAllocation

SELECTIONS = [
    (3, None),
    ([1, 5], slice(10, 300, 7)),
    (None, torch.tensor([0, 299, 5])),
    (slice(None), [7]),
    (torch.tensor([7, 0]), 150),
]


@pytest.mark.parametrize(
    "mask",
    [None, mh.causal(), mh.sliding_window(40), mh.key_padding([200, 0]) & mh.causal()],
    ids=["none", "causal", "window", "padding&causal"],
)
@pytest.mark.parametrize("heads,rows", SELECTIONS, ids=[f"sel{i}" for i in range(len(SELECTIONS))])
def test_weights_slice_equals_reference(mask, heads, rows):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 300, 32, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 310, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = mh.reference_attention(q, k, v, mask=mask)
    got = mh.attention(q, k, v, mask=mask, return_weights=True, return_lse=True, weights_heads=heads, weights_rows=rows)
    h = (
        torch.arange(8)[heads]
        if isinstance(heads, slice)
        else torch.arange(8)
        if heads is None
        else torch.as_tensor(heads).reshape(-1)
    )
    r = (
        torch.arange(300)[rows]
        if isinstance(rows, slice)
        else torch.arange(300)
        if rows is None
        else torch.as_tensor(rows).reshape(-1)
    )
    torch.testing.assert_close(got.weights, ref.weights[:, h][:, :, r], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "bad,error",
    [
        (dict(weights_heads=8), ValueError),
        (dict(weights_rows=[-400]), ValueError),
        (dict(weights_heads=[0.5]), TypeError),
        (dict(weights_heads=[]), ValueError),
    ],
)
def test_weights_selection_errors(bad, error):
    q = torch.randn(1, 8, 300, 8)
    with pytest.raises(error, match="weights_"):
        mh.attention(q, q, q, return_weights=True, **bad)
    with pytest.raises(ValueError, match="return_weights=True"):
        mh.attention(q, q, q, weights_heads=0)


def test_one_head_of_weights_never_holds_all_heads():
    B, H, L, D = 1, 8, 2048, 16
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    with LargestAllocation() as probe:
        got = mh.attention(q, k, v, mask=mh.causal(), return_weights=True, weights_heads=2)
    assert got.weights.shape == (B, 1, L, L)
    assert probe.largest <= 2 * L * L < B * H * L * L


@pytest.mark.parametrize(
    "mask,L,expected",
    [
        (None, 1024, "sdpa"),
        (mh.causal(), 1024, "sdpa"),
        (mh.causal("top_left"), 2048, "sdpa"),
        (mh.sliding_window(128), 1024, "blocksparse"),
        (mh.causal() & mh.key_padding([900]), 1024, "blocksparse"),
        (mh.sliding_window(8), 64, "sdpa"),  # tiny: one SDPA call beats the per-block loop
    ],
)
def test_auto_follows_the_decision_table(mask, L, expected):
    q = torch.randn(1, 2, L, 16)
    report = mh.explain(q, q, q, mask=mask)
    assert report.backend == expected, str(report)
    assert "auto order" in str(report)


def test_auto_sends_tensor_masks_and_dropout_to_sdpa_with_reasons():
    q = torch.randn(1, 2, 512, 16)
    report = mh.explain(q, q, q, mask=torch.ones(512, 512, dtype=torch.bool).tril())
    assert report.backend == "sdpa" and "tensor" in "; ".join(report.refused["blocksparse"])
    report = mh.explain(q, q, q, mask=mh.sliding_window(16), dropout_p=0.1)
    assert report.backend == "sdpa" and "dropout" in "; ".join(report.refused["torch_blocks"])


@pytest.mark.parametrize(
    "L,mask,expected,reason",
    [
        (2048, mh.sliding_window(512), "torch_blocks", None),  # visits 33% of the scores
        (4096, mh.causal(), "torch_blocks", None),  # 53%
        (2048, mh.causal(), "sdpa", "visits 56% of the scores"),
        (1024, mh.sliding_window(512), "sdpa", "visits 56% of the scores"),
        (512, mh.sliding_window(16), "sdpa", "Lq*Lk = 262144"),  # 52%, but too small for per-block ops
    ],
)
def test_auto_takes_the_blockwise_dropout_path_where_it_visits_at_most_about_half_the_scores(L, mask, expected, reason):
    """With dropout the blockwise path costs 1.5-2x sdpa's math kernel per score, so auto takes it
    where it visits at most 55% of the square (docs/performance.md, "Dropout")."""
    q = torch.randn(1, 8, L, 64)
    report = mh.explain(q, q, q, mask=mask, dropout_p=0.1)
    assert report.backend == expected, str(report)
    if reason is not None:
        assert reason in "; ".join(report.refused["torch_blocks"])
