"""explain(): which backend runs, why others were refused, and which PyTorch kernel."""

import re
import sys

import pytest
import torch

import multihead as mh


def test_explain_reports_backend_mask_handling_and_kernel():
    q = torch.randn(1, 4, 64, 32)
    report = mh.explain(q, q, q, mask=mh.causal())
    text = str(report)
    assert report.backend in mh.available_backends()
    assert "causal(align='bottom_right')" in text and "B=1 Hq=4 Hkv=4 Lq=64 Lk=64 D=32" in text
    sdpa = mh.explain(q, q, q, mask=mh.causal(), backend="sdpa")
    assert "is_causal=True" in str(sdpa) and "PyTorch kernel: " in str(sdpa)
    assert sdpa.requested == "sdpa" and "(forced)" in str(sdpa)


def test_explain_says_when_a_mask_must_be_materialized_and_how_gqa_runs():
    q, kv = torch.randn(2, 8, 10, 16), torch.randn(2, 2, 12, 16)
    text = str(mh.explain(q, kv, kv, mask=torch.rand(10, 12) > 0.5, backend="sdpa"))
    assert "materialized as a bool tensor of shape (1, 1, 10, 12)" in text
    assert "GQA 8/2" in text
    text = str(mh.explain(q, kv[:, :1], kv[:, :1], backend="sdpa"))
    assert "GQA 8/1" in text or "MQA" in text


def test_explain_lists_refusals():
    q = torch.randn(1, 2, 4, 8)
    keep = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    report = mh.explain(q, q, q, dropout_p=0.5, dropout_mask=keep)
    assert report.backend == "reference"
    assert any("dropout_mask" in r for r in report.refused["sdpa"])
    assert "refused:" in str(report)


def test_lse_comes_from_the_kernel_call_for_inference_and_is_recomputed_for_training():
    q = torch.randn(1, 2, 32, 16)
    assert "from the same kernel call" in str(mh.explain(q, q, q, mask=mh.causal(), return_lse=True, backend="sdpa"))
    qg = q.clone().requires_grad_()
    assert "recomputed with the weights in one blockwise pass" in str(
        mh.explain(qg, qg, qg, mask=mh.causal(), return_lse=True, backend="sdpa")
    )


# ------------------------------------------------------------------ advice (issue 15, item 5)
def _band(L: int, w: int) -> torch.Tensor:
    i = torch.arange(L)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= w)  # (L, L) causal band of w + 1 keys


def test_a_dense_sliding_window_is_named_with_the_object_and_a_factor():
    """Regression: a dense bool sliding window got 'plain tensor masks are already Lq x Lk'."""
    q = torch.randn(1, 2, 1024, 16)
    estimated = mh.explain(q, q, q, mask=_band(1024, 128), probe=False)
    [line] = estimated.advice
    assert "is `sliding_window(128)`; pass that object instead" in line
    assert re.search(r"about \d+\.\dx less work \(estimated: .* 44% of the 256x256 blocks", line)
    assert "advice:\n  - this dense bool mask is `sliding_window(128)`" in str(estimated)
    small = torch.randn(1, 1, 64, 8)
    measured = mh.explain(small, small, small, mask=_band(64, 8), probe=True)
    factor = r"(\d+\.\dx faster here \(|no faster at this size \(\d\.\d\dx, )measured on these inputs"
    assert re.search(factor, measured.advice[0])


@pytest.mark.parametrize("factor", [0.7, 3.0])
def test_the_object_is_advised_only_when_the_probe_measures_it_faster(monkeypatch, factor):
    """Regression: a probe that measured the object slower (0.70x) still said 'pass that object instead'."""
    explain_module = sys.modules["multihead.explain"]  # the module (mh.explain is the function)
    monkeypatch.setattr(explain_module, "_probe", lambda *args: factor)
    small = torch.randn(1, 1, 64, 8)
    [line] = mh.explain(small, small, small, mask=_band(64, 8), probe=True).advice
    assert ("pass that object instead" in line) == (factor > 1.1), line
    assert ("the object is no faster at this size (0.70x" in line) == (factor < 1.1), line


def test_a_float_causal_mask_from_torch_is_recognised_as_causal():
    """Regression: nn.Transformer.generate_square_subsequent_mask was not recognised as causal."""
    q = torch.randn(1, 2, 300, 8)
    fm = torch.nn.Transformer.generate_square_subsequent_mask(300)
    [line] = mh.explain(q, q, q, mask=fm, probe=False).advice
    assert "dense float (additive) mask is `causal()`" in line and "finite entries are all 0" in line
    lq = torch.randn(1, 2, 200, 8)  # Lq != Lk: the alignment is named
    [line] = mh.explain(lq, q, q, mask=torch.ones(200, 300, dtype=torch.bool).tril(), probe=False).advice
    assert "`causal('top_left')`" in line


def test_a_float_mask_writing_a_large_negative_for_blocked_is_recognised():
    """Regression: -1e9 (tutorials) or finfo.min (Hugging Face) in place of -inf was advised as
    'lets every query see every key: pass mask=None' with a bias, 'skipping the blocks the object blocks'."""
    q = torch.randn(1, 2, 300, 8)
    causal = torch.ones(300, 300, dtype=torch.bool).tril()
    for blocked in (-1e9, -1e4):  # a bias by the one rule (masks.additive_blocked), which underflows
        fm = torch.zeros(300, 300).masked_fill(~causal, blocked)
        [line] = mh.explain(q, q, q, mask=fm, probe=False).advice
        assert "dense float (additive) mask is `causal()`; pass that object instead" in line, line
        assert f"it writes {blocked:g} where -inf blocks" in line and "except in rows" not in line
    lowest = torch.finfo(torch.float32).min  # blocks, as -inf does
    fm = torch.zeros(300, 300).masked_fill(~causal, lowest)
    [line] = mh.explain(q, q, q, mask=fm, probe=False).advice
    assert "dense float (additive) mask is `causal()`; pass that object instead" in line, line
    assert f"it writes {lowest:g} where it blocks, read as -inf" in line and "except in rows" not in line
    # Lq=300 > Lk=200, bottom-right: queries 0..99 see no key; the tensor gives them a uniform
    # average, the object zeros
    k = torch.randn(1, 2, 200, 8)
    late = torch.zeros(300, 200).masked_fill(torch.arange(300)[:, None] - 100 < torch.arange(200), -1e9)
    [line] = mh.explain(q, k, k, mask=late, probe=False).advice
    assert "is `causal()`" in line and "except in rows that block every key" in line
    assert (
        mh.explain(q, q, q, mask=torch.zeros(300, 300).masked_fill(~causal, -100.0), probe=False)
        .advice[0]
        .endswith("(they add a bias, not only 0)")
    )  # -100 is a bias a softmax still feels: no object, no skipping


def test_the_advice_names_the_shape_of_the_tensor_it_was_given():
    """Regression: a (B, 1, 1, Lk) padding mask was said to be a 512x512 tensor."""
    q = torch.randn(1, 2, 512, 16)
    padding = (torch.arange(512) < 400).reshape(1, 1, 1, 512)
    [line] = mh.explain(q, q, q, mask=padding, probe=False).advice
    assert "is `key_padding(torch.tensor([400]))`" in line and "needs no 1x1x1x512 tensor" in line


def test_dropout_and_other_slow_paths_are_flagged_with_their_fix():
    """Regression: dropout's fall to the math kernel was not flagged."""
    q = torch.randn(1, 2, 64, 16)
    advice = mh.explain(q, q, q, mask=mh.causal(), dropout_p=0.1, backend="sdpa").advice
    assert any(
        "dropout_p=0.1: no fused CPU kernel applies dropout, so this call runs PyTorch's math kernel" in a
        and "fix: dropout only while training" in a
        for a in advice
    )
    bias = torch.randn(1, 2, 64, 64)
    advice = mh.explain(q, q, q, score_mod=mh.scores.bias(bias)).advice
    assert any("dense additive bias (1, 2, 64, 64)" in a and "scores.RelativeBias" in a for a in advice)
    keep = torch.ones(1, 2, 64, 64, dtype=torch.bool)
    advice = mh.explain(q, q, q, dropout_p=0.5, dropout_mask=keep).advice
    assert any("reference backend runs" in a and "drop dropout_mask" in a for a in advice)
    big = torch.randn(1, 8, 2048, 8)
    advice = mh.explain(big, big, big, mask=mh.causal(), return_weights=True).advice
    assert any("weights_heads=/weights_rows=" in a for a in advice)
    assert mh.explain(big, big, big, mask=mh.causal(), return_weights=True, weights_heads=0).advice == ()
    assert mh.explain(q, q, q, mask=mh.causal()).advice == ()  # nothing to say: no advice


def test_a_random_or_per_head_mask_gets_no_object_advice():
    q = torch.randn(1, 2, 32, 8)
    torch.manual_seed(0)
    assert mh.explain(q, q, q, mask=torch.rand(32, 32) > 0.5).advice == ()
    per_head = torch.stack([torch.ones(32, 32, dtype=torch.bool).tril(), torch.ones(32, 32, dtype=torch.bool)])
    assert mh.explain(q, q, q, mask=per_head.unsqueeze(0)).advice == ()


def test_a_broadcast_mask_tensor_is_read_over_the_whole_square():
    """Regression (the fuzz suite): a (1, 1, Lq, 1) bool mask with Lk=100 was recognised as a
    document mask of one key, and the probe's call raised 'kv_ids has length 1 but Lk=100'."""
    q, k = torch.randn(2, 1, 256, 8), torch.randn(2, 1, 100, 8)
    rows = torch.rand(1, 1, 256, 1, generator=torch.Generator().manual_seed(0)) > 0.5  # query rows that see all
    report = mh.explain(q, k, k, mask=rows, probe=True)  # raised before
    [line] = report.advice  # rows that see every key or none: one document, and rows outside it
    assert "`document(q_ids, kv_ids)`" in line and ("faster here" in line or "no faster" in line), line
    padding = torch.arange(100).view(1, 1, 1, 100) < torch.tensor([60, 100]).view(2, 1, 1, 1)  # (B, 1, 1, Lk)
    [line] = mh.explain(q, k, k, mask=padding, probe=False).advice
    assert "key_padding" in line and "2x1x1x100" in line, line


def test_explain_takes_what_attention_takes_and_chooses_what_attention_runs():
    """explain() reads its arguments through attention's own prepare step: softcap and sinks are
    explained (not refused as unknown), the backend it names is the one attention() dispatches to,
    and a bad argument is refused with attention's message."""
    q = torch.randn(1, 4, 16, 8)
    sinks = torch.zeros(4)
    report = mh.explain(q, q, q, mask=mh.causal(), softcap=30.0, sinks=sinks)
    assert "softcap(30" in report.mask and any(line.startswith("sinks:") for line in report.plan)
    got = mh.attention(q, q, q, mask=mh.causal(), softcap=30.0, sinks=sinks, return_lse=True)
    assert got.lse is not None and report.backend in mh.available_backends()
    for bad, message in (({"sinks": torch.zeros(3)}, r"sinks"), ({"softcap": -1.0}, r"softcap")):
        with pytest.raises((TypeError, ValueError), match=message) as explained:
            mh.explain(q, q, q, **bad)
        with pytest.raises((TypeError, ValueError), match=message) as attended:
            mh.attention(q, q, q, **bad)
        assert str(explained.value) == str(attended.value)
    big = mh.explain(q, q, q, return_weights=True)  # the size is reported, never refused by explain
    assert any("MiB" in line and "max_weights_bytes" in line for line in big.plan)
