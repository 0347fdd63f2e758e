"""The reproducers of issue 9 ("every wrong number, NaN and silent acceptance"), one test each,
named by item. Every backend is asked (a refusal is skipped with its reasons); answers are
compared with the fp64 reference. The non-finite rules are asked for with ``check_finite=True``
(they are opt-in, the same on every device: docs/conventions.md)."""

import pytest
import torch
from matrix import SLOW_BACKENDS as SLOW_BACKEND_NAMES
from matrix import backend_params, serve_or_skip

import multihead as mh

BACKENDS = backend_params()
# The backends the default tier leaves out (flex compiles for a minute), for the tests that must
# cover every backend: in the slow tier.
SLOW_BACKENDS = [
    pytest.param(*p.values, marks=pytest.mark.slow, id=p.id)
    for p in backend_params(include_slow=True)
    if p.values[0] in SLOW_BACKEND_NAMES
]


def _ref(q, k, v, **kw):
    return mh.reference_attention(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item1_inputs_whose_last_dim_is_not_contiguous(backend, device, layout):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2, 16, 600, generator=gen)
    make = {
        "transposed": lambda t: t.transpose(-1, -2),  # (1, 2, 600, 16), stride 1 on the length
        "strided": lambda t: t.transpose(-1, -2).contiguous()[..., ::2].repeat_interleave(2, -1)[..., ::2],
        "expanded": lambda t: t[:, :, :1].transpose(-1, -2).expand(1, 2, 600, 16),
    }[layout]
    x = make(base).to(device)
    mask = mh.sliding_window(40) & mh.causal()
    serve_or_skip(backend, x, x, x, mask=mask, return_weights=True, return_lse=True)
    got = mh.attention(x, x, x, mask=mask, backend=backend, return_weights=True, return_lse=True)
    want = _ref(x.cpu(), x.cpu(), x.cpu(), mask=mask)
    torch.testing.assert_close(got.output.double().cpu(), want.output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double().cpu(), want.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.weights.double().cpu(), want.weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["padding", "top-left causal, Lq < Lk", "GQA top-left causal"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item2_nan_in_keys_no_query_may_see(backend, device, case):
    # "top-left causal, Lq < Lk": sdpa passed is_causal=True with all Lk keys, and its backward
    # computed 0 * key for the keys past the last query (found by a differential fuzzer): NaN dq.
    gen = torch.Generator().manual_seed(1)
    Hkv, Lq, Lk, bad, mask = {
        "padding": (2, 6, 4, 3, mh.causal() & mh.key_padding([3])),
        "top-left causal, Lq < Lk": (2, 3, 64, 8, mh.causal("top_left")),
        "GQA top-left causal": (1, 5, 9, 7, mh.causal("top_left")),
    }[case]
    q = torch.randn(1, 2, Lq, 8, generator=gen).to(device).requires_grad_()  # drawn on CPU, then moved
    k, v = (torch.randn(1, Hkv, Lk, 8, generator=gen).to(device) for _ in range(2))
    k[0, :, bad] = float("nan")
    if case == "padding":
        v[0, :, bad] = float("nan")
    k, v = k.requires_grad_(), v.requires_grad_()
    serve_or_skip(backend, q, k, v, mask=mask)
    out = mh.attention(q, k, v, mask=mask, backend=backend, check_finite=True)
    assert torch.isfinite(out).all()
    for g in torch.autograd.grad(out.sum(), (q, k, v)):
        assert torch.isfinite(g).all()


def _unseen_case(mask_kind: str, Lq: int, device: str):
    """``(q, k, v, poisoned_k, poisoned_v, mask)``: GQA 4/2 over 12 keys, NaN in every key and value
    that no query row of its batch row may see (keys some other batch row sees included)."""
    gen = torch.Generator().manual_seed(7)
    B, Lk = 3, 12
    q = torch.randn(B, 4, Lq, 8, generator=gen)
    k, v = torch.randn(B, 2, Lk, 8, generator=gen), torch.randn(B, 2, Lk, 8, generator=gen)
    if mask_kind == "per-row padding":  # row 1's keys 5..8 are seen by row 2's queries
        mask = mh.key_padding(torch.tensor([Lk, 5, 9]))
    elif mask_kind == "hole":  # keys 4..6 seen by no row, between keys every row sees
        hole = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)
        hole[..., 4:7] = False
        mask = hole
    else:  # keys left of every row's window
        mask = mh.causal() & mh.sliding_window(3)
    seen = mh.masks.as_mask(mask).materialize(B, 4, Lq, Lk).any(2).any(1).expand(B, Lk)  # some row of b sees it
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b in range(B):
        poisoned_k[b, :, ~seen[b]] = float("nan")
        poisoned_v[b, :, ~seen[b]] = float("nan")
    assert not seen.all()
    moved = (t.to(device) for t in (q, k, v, poisoned_k, poisoned_v))
    return (*moved, mask if not isinstance(mask, torch.Tensor) else mask.to(device))


@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("mask_kind", ["per-row padding", "hole", "window"])
@pytest.mark.parametrize("backend,device", BACKENDS + SLOW_BACKENDS)
def test_item2_keys_no_row_may_see_hold_anything_by_default(backend, device, mask_kind, Lq):
    """Without ``check_finite`` too (docs/conventions.md, "Non-finite inputs"): a key or value that
    no row of a call may see can hold anything, NaN included, on every backend as on ``sdpa`` and
    the reference. ``decode`` and ``flex`` computed ``0 · NaN`` in ``P V`` for such a value inside
    the keys they read (a cache's unused slot of a shorter row, a hole in a mask): every row NaN."""
    q, k, v, bad_k, bad_v, mask = _unseen_case(mask_kind, Lq, device)
    serve_or_skip(backend, q, bad_k, bad_v, mask=mask)
    want = _ref(q.cpu(), k.cpu(), v.cpu(), mask=mask if not isinstance(mask, torch.Tensor) else mask.cpu()).output
    with torch.no_grad():
        got = mh.attention(q, bad_k, bad_v, mask=mask, backend=backend)
    assert torch.isfinite(got).all(), "a NaN in a key or value no row may see reached the output"
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    leaves = [t.clone().requires_grad_() for t in (q, bad_k, bad_v)]
    try:
        serve_or_skip(backend, *leaves, mask=mask)
    except pytest.skip.Exception:
        return  # an inference-only backend (flex on CPU): its forward is checked above
    got = mh.attention(*leaves, mask=mask, backend=backend)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    for name, g in zip("qkv", torch.autograd.grad(got.sum(), leaves)):
        assert torch.isfinite(g).all(), f"d{name} read the NaN of a key no row may see"


def test_item3_the_oracle_with_every_visible_score_below_minus_88():
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    b = torch.zeros(1, 1, 4, 4)
    b[..., 0, :] = -1e4
    res = mh.reference_attention(q, k, v, mask=mh.causal(), score_mod=mh.scores.bias(b))
    want = mh.reference_attention(q, k, v, mask=mh.causal())  # the softmax is shift-invariant per row
    assert torch.isfinite(res.output).all()
    torch.testing.assert_close(res.output[..., 0, :], want.output[..., 0, :])


@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item4_scale_at_most_zero_with_causal(backend, device, scale):
    q = torch.randn(1, 2, 300, 8, device=device)
    serve_or_skip(backend, q, q, q, mask=mh.causal(), scale=scale)
    got = mh.attention(q, q, q, mask=mh.causal(), scale=scale, backend=backend)
    torch.testing.assert_close(
        got.double().cpu(), _ref(q.cpu(), q.cpu(), q.cpu(), mask=mh.causal(), scale=scale).output, rtol=1e-5, atol=1e-5
    )
    assert "folded into q" in str(mh.explain(q, q, q, mask=mh.causal(), scale=scale))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item5_fp16_inputs_with_a_large_negative_fp32_bias(backend, device):
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 1, 300, 8, generator=gen).half().to(device) for _ in range(2))
    bias = torch.zeros(300, 300, device=device)
    bias[0] = -1e5  # a whole row shifted: the softmax ignores it
    bias[7, :5] = -7e4  # beyond fp16's range, relative to the rest of the row: blocked in effect
    mods = mh.scores.bias(bias)
    serve_or_skip(backend, q, k, k, mask=mh.sliding_window(40), score_mod=mods, return_lse=True)
    got = mh.attention(q, k, k, mask=mh.sliding_window(40), score_mod=mods, backend=backend, return_lse=True)
    want = _ref(q.cpu(), k.cpu(), k.cpu(), mask=mh.sliding_window(40), score_mod=mh.scores.bias(bias.cpu().double()))
    torch.testing.assert_close(got.output.double().cpu(), want.output, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got.lse.double().cpu(), want.lse, rtol=1e-6, atol=1e-2)


@pytest.mark.parametrize("where", ["query row", "visible key", "visible value", "unseen value"])
@pytest.mark.parametrize("mask", [None, "causal", "window"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item6_non_finite_inputs_go_exactly_where_the_math_puts_them(backend, device, mask, where):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 300, 8, generator=gen)
    k, v = torch.randn(1, 2, 310, 8, generator=gen), torch.randn(1, 2, 310, 8, generator=gen)
    m = {None: None, "causal": mh.causal(), "window": mh.sliding_window(3)}[mask]
    if where == "query row":
        q[0, 1, 100] = float("nan")
    elif where == "visible key":
        k[0, 0, 150] = float("inf")
    elif where == "visible value":
        v[0, 1, 200] = float("nan")
    else:  # key 0 is seen by no query of a window: it may hold anything
        v[0, :, 0] = float("nan")
    q, k, v = (t.to(device) for t in (q, k, v))
    serve_or_skip(backend, q, k, v, mask=m, return_lse=True)
    got = mh.attention(q, k, v, mask=m, backend=backend, return_lse=True, check_finite=True)
    want = _ref(q.cpu(), k.cpu(), v.cpu(), mask=m)
    if where == "unseen value" and mask != "window":
        pass  # with every key visible to some row, the value is visible: covered by "visible value"
    assert torch.equal(torch.isnan(got.output).any(-1).cpu(), torch.isnan(want.output).any(-1))
    assert torch.equal(torch.isnan(got.lse).cpu(), torch.isnan(want.lse))
    finite = ~torch.isnan(want.output)
    torch.testing.assert_close(got.output.double().cpu()[finite], want.output[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["nan key seen alone", "-inf key entry", "every key nan"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item6_bad_keys_that_leave_the_kernels_output_finite_are_found(backend, device, case):
    # Two cases the output alone cannot reveal: a row whose visible keys are all bad (the fused
    # kernels treat it as fully masked: 0), and an infinite key entry whose score is -inf for every
    # row (weighed 0). From nonfinite.KEYS_CHECKED_FROM query rows per KV head the check reads the
    # keys too, so every backend gives NaN exactly where the reference does. GQA 4/2, 64 queries.
    from multihead.nonfinite import KEYS_CHECKED_FROM

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 64, 8, generator=gen)
    k, v = torch.randn(1, 2, 70, 8, generator=gen), torch.randn(1, 2, 70, 8, generator=gen)
    assert 64 * 2 >= KEYS_CHECKED_FROM
    m = mh.sliding_window(0)  # query i sees key i + 6 only
    if case == "nan key seen alone":
        k[0, 1, 30] = float("nan")  # rows 24 of heads 2, 3 see only it
    elif case == "-inf key entry":
        m = mh.causal()
        q[..., 0] = q[..., 0].abs() + 0.1  # every score with key 40 is -inf
        k[0, 0, 40, 0] = float("-inf")
    else:
        k.fill_(float("nan"))
    q, k, v = (t.to(device) for t in (q, k, v))
    serve_or_skip(backend, q, k, v, mask=m, return_lse=True)
    got = mh.attention(q, k, v, mask=m, backend=backend, return_lse=True, check_finite=True)
    want = _ref(q.cpu(), k.cpu(), v.cpu(), mask=m)
    nan_rows = torch.isnan(want.output).any(-1)
    assert nan_rows.any()
    assert torch.equal(torch.isnan(got.output).any(-1).cpu(), nan_rows)
    assert torch.equal(torch.isnan(got.lse).cpu(), torch.isnan(want.lse))
    finite = ~torch.isnan(want.output)
    torch.testing.assert_close(got.output.double().cpu()[finite], want.output[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item6_bad_keys_next_to_good_ones_are_nan_on_every_backend_whatever_the_size(backend, device):
    # blocksparse merges pieces of a row's keys by LSE: a piece whose keys were all bad came back
    # from the kernel as empty and merged with weight 0, a finite row from the good key alone (a
    # differential fuzzer, 2 queries). Its capability keys_in_pieces makes every call check keys.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=gen, dtype=torch.float64) for n in (2, 3, 3))
    k[0, 0, 1, 5], k[0, 0, 2, 4] = float("nan"), float("nan")  # row 0 sees keys 0-1, row 1 keys 0-2
    q, k, v = (t.to(device) for t in (q, k, v))
    serve_or_skip(backend, q, k, v, mask=mh.causal(), return_lse=True)
    got = mh.attention(q, k, v, mask=mh.causal(), backend=backend, return_lse=True, check_finite=True)
    assert torch.isnan(got.output).all() and torch.isnan(got.lse).all()


@pytest.mark.parametrize("check_finite", [False, True])
def test_item6_the_policy_is_written_down_and_rows_that_see_nothing_stay_zero(check_finite):
    q = torch.full((1, 1, 3, 4), float("nan"))
    k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    out = mh.attention(q, k, v, mask=mh.key_padding([0]), check_finite=check_finite)
    assert torch.equal(out, torch.zeros_like(out))  # fully masked: 0 whatever the query holds


def test_item7_a_mask_does_not_follow_its_callers_tensor():
    q = torch.randn(1, 2, 600, 8)
    lengths = torch.tensor([100])
    mask = mh.key_padding(lengths) & mh.causal()
    before = mh.attention(q, q, q, mask=mask, backend="blocksparse")
    lengths.fill_(500)
    torch.testing.assert_close(mh.attention(q, q, q, mask=mask, backend="blocksparse"), before)
    torch.testing.assert_close(mh.attention(q, q, q, mask=mask, backend="sdpa"), before, rtol=1e-5, atol=1e-5)


def test_item8_weights_rows_with_a_negative_step_slice():
    q = torch.randn(1, 2, 7, 8)
    got = mh.attention(q, q, q, return_weights=True, weights_rows=slice(None, None, -1))
    want = mh.attention(q, q, q, return_weights=True).weights.flip(2)
    torch.testing.assert_close(got.weights, want)


def test_item8_a_layer_input_of_another_dtype_names_it():
    layer = mh.MultiHeadAttention(16, 4)
    with pytest.raises(TypeError, match=r"query has dtype torch.float64 but the layer's weights are torch.float32"):
        layer(torch.randn(1, 3, 16, dtype=torch.float64))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_item10_empty_lengths_are_accepted(backend, device):
    q = torch.randn(2, 4, 5, 8, device=device, requires_grad=True)
    none = torch.randn(2, 2, 0, 8, device=device, requires_grad=True)
    res = mh.attention(q, none, none, backend=backend, return_lse=True, return_weights=True)
    assert res.output.shape == (2, 4, 5, 8) and torch.equal(res.output, torch.zeros_like(res.output))
    assert torch.isneginf(res.lse).all() and res.weights.shape == (2, 4, 5, 0)
    res.output.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q.grad))
    empty_q = torch.randn(2, 4, 0, 8, device=device)
    assert mh.attention(empty_q, q[:, :2].detach(), q[:, :2].detach(), mask=mh.causal(), backend=backend).shape == (
        2,
        4,
        0,
        8,
    )
    assert mh.explain(q, none, none).backend == "none"


def test_item12_flex_refuses_a_call_past_the_recompile_limit_and_explain_says_why():
    import torch._dynamo

    flex = mh.get_backend("flex")
    saved = set(flex._compiled)
    limit = int(getattr(torch._dynamo.config, "recompile_limit", 8))
    try:
        flex._compiled.update(("an earlier compile", i) for i in range(limit))  # as if compiled already
        q = torch.randn(1, 2, 64, 16)
        with pytest.raises(mh.BackendRefusedError, match=r"past torch.compile's recompile limit"):
            mh.attention(q, q, q, mask=mh.sliding_window(8), backend="flex")
        assert "unfused path that materializes the full score matrix" in str(
            mh.explain(q, q, q, mask=mh.sliding_window(8), backend="auto")
        )
    finally:
        flex._compiled.clear()
        flex._compiled.update(saved)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_unchecked_calls_are_exact_on_finite_inputs_and_zero_on_rows_that_see_nothing(backend, device):
    """Without ``check_finite`` (the default, every device): finite inputs give the reference's
    answer, and a row that sees no key gives output 0 and LSE -inf, known from the mask alone."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 70, 16, generator=gen).to(device)
    k, v = (torch.randn(2, 2, 90, 16, generator=gen).to(device) for _ in range(2))
    mask = mh.causal() & mh.key_padding([90, 0])  # batch row 1 sees no key at all
    serve_or_skip(backend, q, k, v, mask=mask, return_lse=True)
    got = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    want = _ref(q.cpu(), k.cpu(), v.cpu(), mask=mask)
    torch.testing.assert_close(got.output.double().cpu(), want.output, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.output[1], torch.zeros_like(got.output[1]))
    assert torch.isneginf(got.lse[1]).all() and torch.isfinite(got.lse[0]).all()


def test_unchecked_calls_give_what_the_kernel_gives_and_checked_ones_the_rules():
    """A NaN query row: without ``check_finite`` the call gives exactly what PyTorch's SDPA gives
    (its flash kernel: 0 on CPU), first call and stored plan alike; with it, the row is NaN as the
    rules say and the other rows are untouched. A flag that is not a bool is refused by name."""
    import torch.nn.functional as F

    q = torch.randn(1, 2, 8, 16)
    q[0, 0, 3] = float("nan")
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    raw = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = mh.causal()
    for _ in range(3):  # the first call takes the whole path; the later ones a stored plan
        got = mh.attention(q, k, v, mask=mask, backend="sdpa")
        torch.testing.assert_close(got, raw, rtol=0, atol=0, equal_nan=True)
    checked = mh.attention(q, k, v, mask=mask, backend="sdpa", check_finite=True)
    assert torch.isnan(checked[0, 0, 3]).all() and torch.isfinite(checked[0, 1]).all()
    torch.testing.assert_close(checked[0, 1], raw[0, 1], rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"attention: check_finite must be a bool, got str 'yes'"):
        mh.attention(q, k, v, check_finite="yes")


def test_the_former_switches_say_the_new_spelling():
    """``set_nonfinite_check`` and ``skip_nonfinite_check`` (per-device and per-block switches)
    are gone: turning the check off warns (it is off already), turning it on raises; both name
    ``check_finite=True``."""
    with pytest.raises(TypeError, match=r"set_nonfinite_check\('cuda', True\) was removed: .*check_finite=True"):
        mh.set_nonfinite_check("cuda", True)
    with pytest.warns(DeprecationWarning, match=r"check_finite=True"):
        assert mh.set_nonfinite_check("cpu", False) is False
    q = torch.randn(1, 1, 4, 8)
    with pytest.warns(DeprecationWarning, match=r"unchecked by default.*check_finite=True"):
        with mh.skip_nonfinite_check():
            torch.testing.assert_close(mh.attention(q, q, q), mh.attention(q, q, q))
