"""explain(): which backend runs, why others were refused, and which PyTorch kernel."""

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
        mh.explain(qg, qg, qg, mask=mh.causal(), return_lse=True, backend="sdpa"))
