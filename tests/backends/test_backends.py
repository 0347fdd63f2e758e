"""Every registered backend on every device present against the fp64 reference, generated from
the registry and the backends' declared capabilities (tests/backends/matrix.py): a backend
added later joins this matrix automatically, and a call it refuses is a skip with its reasons
after proving that forcing it raises, never a silent pass."""

import pytest
import torch
from matrix import backend_dtype_params, backend_params, factor, serve_or_skip

import multihead as mh
from helpers import Case, assert_relative, covering_cases, make_inputs, naive_attention
from multihead.blocks import Extent

BACKENDS = backend_params()
CASES = covering_cases(n_random=24)


def _matrix(items, item_id) -> list:
    """``(backend, device, item, dtype)`` for every item and every dtype of the device (fp16 on
    CUDA only, tests/backends/matrix.py), with the ids ``backend-device-item-dtype``."""
    return [
        pytest.param(backend, device, item, dtype, id=f"{backend}-{device}-{item_id(item)}-{dtype}")
        for p in backend_dtype_params()
        for backend, device, dtype in [p.values]
        for item in items
    ]


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


def _masked_scores(q, k, mask, case, dtype):
    """The naive baseline's scores in the input dtype (for its LSE error)."""
    from multihead.call import mask_and_score_mod

    scores = (q @ k.repeat_interleave(case.Hq // case.Hkv, 1).transpose(-2, -1)) * case.D**-0.5
    m, mod = mask_and_score_mod(mask, None, check_binary=False)
    if mod is not None:
        extent = Extent(case.B, case.Hq, case.Lq, case.Lk)
        scores = mod.apply_block(extent, extent.whole(), scores)
    if m is not None:
        scores = scores.masked_fill(~m.materialize(case.B, case.Hq, case.Lq, case.Lk), float("-inf"))
    return scores


@pytest.mark.parametrize("backend,device,case,dtype", _matrix(CASES, lambda c: c.id))
def test_forward_matches_reference(backend, device, case, dtype):
    q64, k64, v64, mask = make_inputs(case)
    q, k, v = _on(device, *(t.to(dtype) for t in (q64, k64, v64)))
    serve_or_skip(backend, q, k, v, mask=mask, return_lse=True)
    got = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    ref = mh.reference_attention(q64.to(dtype).double(), k64.to(dtype).double(), v64.to(dtype).double(), mask=mask)
    got_out, got_lse = got.output.cpu(), got.lse.cpu()
    assert got_out.dtype == dtype and got_out.shape == (case.B, case.Hq, case.Lq, case.Dv)
    if dtype == torch.float64:
        torch.testing.assert_close(got_out, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_lse, ref.lse, rtol=1e-10, atol=1e-10)
        return
    qc, kc, vc = (t.to(dtype) for t in (q64, k64, v64))
    base = naive_attention(qc, kc, vc, mask)
    assert_relative(got_out, ref.output, base, factor(backend, dtype))
    finite = torch.isfinite(ref.lse)
    assert torch.equal(torch.isneginf(got_lse), ~finite), "LSE must be -inf exactly on fully masked rows"
    base_lse = torch.logsumexp(_masked_scores(qc, kc, mask, case, dtype), -1)
    assert_relative(got_lse[finite].to(dtype), ref.lse[finite], base_lse[finite], factor(backend, dtype), "lse")


GRAD_CASES = [c for c in CASES if c.Lq * c.Lk <= 128 * 128][::2]


@pytest.mark.parametrize("backend,device,case,dtype", _matrix(GRAD_CASES, lambda c: c.id))
def test_gradients_match_reference(backend, device, case, dtype):
    q64, k64, v64, mask = make_inputs(case)
    grad_out = torch.randn(
        case.B, case.Hq, case.Lq, case.Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(case.seed + 1)
    )
    probe = [t.to(dtype).to(device).requires_grad_() for t in (q64, k64, v64)]
    serve_or_skip(backend, *probe, mask=mask)

    def grads(fn, dtype_, device_="cpu"):
        leaves = [t.to(dtype).to(dtype_).to(device_).detach().requires_grad_() for t in (q64, k64, v64)]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype).to(device_))
        return [t.grad.cpu() for t in leaves]

    got = grads(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend=backend), dtype, device)
    ref = grads(lambda q, k, v: mh.reference_attention(q, k, v, mask=mask).output, torch.float64)
    if dtype == torch.float64:
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
        return
    base = grads(lambda q, k, v: naive_attention(q, k, v, mask), dtype)
    magnitude = max(float(r.abs().max()) for r in ref)
    for name, g, r, b in zip("qkv", got, ref, base):
        assert_relative(g, r, b, factor(backend, dtype, gradients=True), f"grad {name}", magnitude=magnitude)


FULLY_MASKED = {
    "bool_rows": lambda B, H, Lq, Lk: torch.arange(Lq).view(-1, 1).expand(Lq, Lk) % 3 != 1,
    "every_row": lambda B, H, Lq, Lk: torch.zeros(Lq, Lk, dtype=torch.bool),
    "batch_element": lambda B, H, Lq, Lk: mh.key_padding([Lk, 0]),
    "causal_lq_gt_lk": lambda B, H, Lq, Lk: mh.causal(),
    "additive_rows": lambda B, H, Lq, Lk: torch.zeros(Lq, Lk).masked_fill(
        torch.arange(Lq).view(-1, 1) == 0, float("-inf")
    ),
}


@pytest.mark.parametrize("backend,device,kind,dtype", _matrix(list(FULLY_MASKED), str))
def test_fully_masked_rows_are_exact_zeros_with_zero_grads(backend, device, kind, dtype):
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 9, 6, 16
    mask = FULLY_MASKED[kind](B, Hq, Lq, Lk)
    q, k, v = (
        torch.randn(B, h, L, D, dtype=dtype, device=device, requires_grad=True)
        for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    )
    serve_or_skip(backend, q, k, v, mask=mask, return_weights=True, return_lse=True)
    res = mh.attention(q, k, v, mask=mask, backend=backend, return_weights=True, return_lse=True)
    ref = mh.reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask=mask)
    empty = torch.isneginf(ref.lse).to(device)
    assert empty.any()
    assert torch.equal(res.output[empty], torch.zeros_like(res.output[empty]))
    assert torch.equal(res.weights[empty], torch.zeros_like(res.weights[empty]))
    assert torch.isneginf(res.lse[empty]).all() and torch.isfinite(res.lse[~empty]).all()
    (res.output.float().square().sum() + res.weights.float().sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all(), "NaN or inf in a gradient"
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_weights_are_the_reference_probabilities(backend, device):
    case = Case(2, 6, 3, 33, 47, 16, 16, "causal&padding", seed=3)
    q, k, v, mask = make_inputs(case, dtype=torch.float32)
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask)
    q, k, v = _on(device, q, k, v)
    serve_or_skip(backend, q, k, v, mask=mask, return_weights=True)
    res = mh.attention(q, k, v, mask=mask, backend=backend, return_weights=True)
    assert res.weights.shape == (2, 6, 33, 47) and res.lse is None
    torch.testing.assert_close(res.weights.double().cpu(), ref.weights, rtol=0, atol=2e-6)


def test_auto_picks_sdpa_for_dense_work_and_reference_is_last():
    q = torch.randn(1, 2, 16, 8)
    assert mh.explain(q, q, q).backend == "sdpa"
    assert mh.backends.AUTO_ORDER[-1] == "reference"


class _CudaOnly(mh.backends.Backend):
    """A backend that declares CUDA only, as a GPU kernel would."""

    name = "cuda_only_probe"
    capabilities = mh.backends.Capabilities(device_types=frozenset({"cuda"}))

    def forward(self, call):  # pragma: no cover - must never run on CPU
        raise AssertionError("a CUDA-only backend ran on a CPU call")


def test_a_backend_declaring_cuda_only_is_skipped_on_cpu_not_passed():
    mh.register_backend(_CudaOnly())  # no priority: never chosen by auto
    try:
        assert "cuda_only_probe" not in mh.backends.AUTO_ORDER
        params = [p.values for p in backend_params()]
        assert ("cuda_only_probe", "cpu") in params  # registered backends join the matrix by themselves
        q = torch.randn(1, 2, 4, 8)
        with pytest.raises(pytest.skip.Exception, match=r"cuda_only_probe refuses: device type 'cpu' not supported"):
            serve_or_skip("cuda_only_probe", q, q, q)
    finally:
        mh.unregister_backend("cuda_only_probe")
    assert "cuda_only_probe" not in mh.available_backends()


def test_auto_order_comes_from_priorities_not_import_order():
    assert mh.backends.AUTO_ORDER == ["decode", "blocksparse", "torch_blocks", "flex", "sdpa", "reference"]
    probe = _CudaOnly()
    mh.register_backend(probe, priority=12)
    try:
        assert mh.backends.AUTO_ORDER == [
            "decode",
            "blocksparse",
            "torch_blocks",
            "cuda_only_probe",
            "flex",
            "sdpa",
            "reference",
        ]
        q = torch.randn(1, 2, 4, 8)
        refused = mh.explain(q, q, q).refused
        assert "cuda_only_probe" in refused and "device type 'cpu'" in refused["cuda_only_probe"][0]
    finally:
        mh.unregister_backend("cuda_only_probe")
    assert mh.backends.AUTO_ORDER == ["decode", "blocksparse", "torch_blocks", "flex", "sdpa", "reference"]


@pytest.mark.parametrize("backend", mh.available_backends())
def test_capabilities_are_data_the_dispatcher_reads(backend):
    caps = mh.get_backend(backend).capabilities
    assert caps.mask_kinds <= mh.backends.MASK_KINDS and caps.score_mods <= mh.backends.SCORE_MOD_KINDS
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert caps.tolerance_factor(dtype) >= 2.0
    q = torch.randn(1, 2, 8, 8)
    undeclared = {
        "tensor": torch.ones(8, 8, dtype=torch.bool),
        "custom": mh.custom(lambda b, h, q, kv: q >= kv),
        "positions": mh.causal().at(torch.arange(8), torch.arange(8), q_len=8, kv_len=8),
    }
    for kind in sorted(mh.backends.MASK_KINDS - caps.mask_kinds):  # an undeclared mask kind is refused
        mask = undeclared[kind]
        with pytest.raises(mh.BackendRefusedError, match=rf"mask kinds \['{kind}'\] not supported"):
            mh.attention(q, q, q, mask=mask, backend=backend)
    if "elementwise" not in caps.score_mods:
        with pytest.raises(mh.BackendRefusedError, match=r"softcap\(5.0\) is elementwise"):
            mh.attention(q, q, q, score_mod=mh.scores.softcap(5.0), backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "Hq,Hkv,Lq,mask",
    [
        (8, 2, 1, None),
        (8, 2, 1, mh.causal()),  # one query sees every key: no mask at all
        (8, 2, 4, mh.causal()),  # the (Lq, Lk) mask repeated for each folded head
        (8, 1, 3, mh.causal()),  # MQA
        (6, 3, 8, None),
        (4, 2, 2, mh.key_padding(torch.tensor([37, 37]))),  # blocks the same keys for every row
    ],
    ids=["gqa-none", "gqa-causal-1", "gqa-causal-4", "mqa-causal-3", "gqa-none-8", "gqa-padding"],
)
def test_sdpa_folds_the_query_heads_of_a_few_tokens_exactly(Hq, Hkv, Lq, mask, dtype):
    """A few query tokens with GQA/MQA on CPU: sdpa runs each KV head's query heads as rows of one
    call (explain says so), with the reference's result and the same output whether the plan
    was stored or not."""
    gen = torch.Generator().manual_seed(Lq)
    B, Lk, D = 2, 37, 32
    q = torch.randn(B, Hq, Lq, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, Hkv, Lk, D, generator=gen).to(dtype) for _ in range(2))
    report = mh.explain(q, k, v, mask=mask, backend="sdpa")
    assert any("folded into the rows of one call" in line for line in report.plan), report.plan
    got = [mh.attention(q, k, v, mask=mask, backend="sdpa") for _ in range(3)]  # the third runs the plan
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask).output
    base = naive_attention(q, k, v, mask)
    assert_relative(got[0], ref, base, factor("sdpa", dtype))
    assert torch.equal(got[0], got[2])
