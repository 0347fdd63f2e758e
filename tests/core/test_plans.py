"""Plans of repeated calls (multihead.plans): a call that differs from a cached one in anything
the key holds (dtype, shape, strides, device, autograd, mask value, scale, backend) gets its own
right answer or its own error, never the cached decision."""

import pytest
import torch

import multihead as mh
from multihead import plans
from multihead.backends import Backend, Capabilities
from multihead.call import AttentionResult
from multihead.guards import tensor_guard
from multihead.nonfinite import all_finite


def _ref(q, k, v, **kw):
    return mh.reference_attention(q.double(), k.double(), v.double(), **kw).output


def _qkv(B=1, H=2, L=16, D=16, dtype=torch.float32, Hkv=None, Lk=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, Hkv or H, Lk or L, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _cached(q, k, v, **kw):
    """Run a call three times (the second stores its plan, the third runs it) and check that the
    plan was stored."""
    plans.clear()
    key = plans.signature(q, k, v, kw.get("mask"), kw.get("scale"), kw.get("backend", "auto"))
    first = mh.attention(q, k, v, **kw)
    assert plans.lookup(key) is None, "a signature met once has no plan yet"
    assert torch.equal(mh.attention(q, k, v, **kw), first)
    assert plans.lookup(key) is not None, "a plain call met twice stores its plan"
    third = mh.attention(q, k, v, **kw)
    assert torch.equal(first, third)
    if tensor_guard(q, k, v) is not None:  # the plan found last runs on its guard, no key
        assert plans._last is not None and plans._last[-1] is plans.lookup(key)
        assert torch.equal(mh.attention(q, k, v, **kw), first)
    return third


BAND = mh.causal() & mh.sliding_window(4)


@pytest.mark.parametrize(
    "mask", [None, mh.causal(), BAND, mh.key_padding(torch.tensor([9]))], ids=["none", "causal", "band", "key_padding"]
)
def test_a_repeated_call_runs_its_plan_and_gives_the_reference(mask):
    q, k, v = _qkv()
    torch.testing.assert_close(_cached(q, k, v, mask=mask).double(), _ref(q, k, v, mask=mask), rtol=1e-5, atol=1e-5)
    q2, k2, v2 = _qkv(seed=1)  # other values, same signature: the plan serves them
    torch.testing.assert_close(
        mh.attention(q2, k2, v2, mask=mask).double(), _ref(q2, k2, v2, mask=mask), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("D", [8, 40, 59, 64, 128])
@pytest.mark.parametrize("mask", [None, mh.causal("top_left"), BAND], ids=["none", "is_causal", "band"])
def test_a_plan_gives_the_whole_paths_output_bit_for_bit(D, mask):
    """The sdpa runner leaves out arguments equal to SDPA's defaults (the scale 1/sqrt(D))."""
    q, k, v = _qkv(L=7, D=D, Lk=9, H=4, Hkv=4)
    _cached(q, k, v, mask=mask)  # asserts the plan's output equals the first call's
    _cached(q, k, v, mask=mask, scale=0.3)


def test_a_value_equal_mask_built_again_finds_the_plan():
    q, k, v = _qkv()
    _cached(q, k, v, mask=BAND)
    stored = len(plans._PLANS)
    mh.attention(q, k, v, mask=mh.causal() & mh.sliding_window(4))
    assert len(plans._PLANS) == stored
    for _ in range(2):
        mh.attention(q, k, v, mask=mh.causal() & mh.sliding_window(2))  # another value: another plan
    assert len(plans._PLANS) == stored + 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_another_dtype_after_a_cached_call(dtype):
    q, k, v = _qkv()
    _cached(q, k, v, mask=BAND)
    q2, k2, v2 = (t.to(dtype) for t in (q, k, v))
    out = mh.attention(q2, k2, v2, mask=BAND)
    assert out.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(out.double(), _ref(q2, k2, v2, mask=BAND), rtol=tol, atol=tol)
    with pytest.raises(TypeError, match=r"q, k and v must share a dtype, got q torch.float32, k torch.float64"):
        mh.attention(q, k2 if dtype == torch.float64 else k.double(), v, mask=BAND)


def test_another_shape_after_a_cached_call_gets_its_result_or_its_error():
    q, k, v = _qkv(H=4, Hkv=2, Lk=20)
    _cached(q, k, v, mask=BAND)
    q2, k2, v2 = _qkv(H=4, Hkv=2, Lk=23, seed=3)
    torch.testing.assert_close(
        mh.attention(q2, k2, v2, mask=BAND).double(), _ref(q2, k2, v2, mask=BAND), rtol=1e-5, atol=1e-5
    )
    q3 = torch.randn(1, 3, 16, 16)
    with pytest.raises(ValueError, match=r"q has Hq=3 heads, not divisible by Hkv=2"):
        mh.attention(q3, k, v, mask=BAND)
    with pytest.raises(ValueError, match=r"q must have 4 dims"):
        mh.attention(q[0], k, v, mask=BAND)
    with pytest.raises(ValueError, match=r"head dims differ"):
        mh.attention(q, k[..., :8], v, mask=BAND)
    with pytest.raises(ValueError, match=r"mask .* not broadcastable|mask of shape"):
        mh.attention(q, k, v, mask=torch.ones(1, 1, 16, 7, dtype=torch.bool))


@pytest.mark.parametrize("layout", ["transposed view", "last dim strided"])
def test_other_strides_after_a_cached_call(layout):
    q, k, v = _qkv(L=12, D=8)
    _cached(q, k, v, mask=BAND)
    if layout == "transposed view":  # (B, L, H, D) memory seen as (B, H, L, D): unit last stride
        q2, k2, v2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    else:  # a last dimension that is not contiguous: validation copies it (and no plan is kept)
        q2, k2, v2 = (torch.randn(1, 2, 8, 12).transpose(-1, -2) for _ in range(3))
    for _ in range(3):
        torch.testing.assert_close(
            mh.attention(q2, k2, v2, mask=BAND).double(), _ref(q2, k2, v2, mask=BAND), rtol=1e-5, atol=1e-5
        )
    key = plans.signature(q2, k2, v2, BAND, None, "auto")
    assert (plans.lookup(key) is None) == (layout == "last dim strided")


def test_a_device_mismatch_after_a_cached_call_names_the_devices():
    q, k, v = _qkv()
    _cached(q, k, v)
    with pytest.raises(ValueError, match=r"q, k and v must be on one device, got q cpu, k meta"):
        mh.attention(q, k.to("meta"), v)


def test_other_scales_and_bad_arguments_after_a_cached_call():
    q, k, v = _qkv()
    _cached(q, k, v, mask=BAND, scale=0.5)
    for scale in (None, 0.25, -1.0, 0.0):
        torch.testing.assert_close(
            mh.attention(q, k, v, mask=BAND, scale=scale).double(),
            _ref(q, k, v, mask=BAND, scale=scale),
            rtol=1e-5,
            atol=1e-5,
        )
    for scale in (float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match=r"scale must be a finite number"):
            mh.attention(q, k, v, mask=BAND, scale=scale)
    for p in (False, 1.0, -0.1):
        with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
            mh.attention(q, k, v, mask=BAND, dropout_p=p)
    with pytest.raises(TypeError, match=r"return_lse must be a bool"):
        mh.attention(q, k, v, mask=BAND, return_lse=0)
    with pytest.raises(TypeError, match=r"mask must be a multihead mask"):
        mh.attention(q, k, v, mask=[1, 2])
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        mh.attention(q, k, v, mask=BAND, backend="nope")


def test_autograd_after_a_cached_call_without_it():
    q, k, v = _qkv(dtype=torch.float64)
    with torch.no_grad():
        _cached(q, k, v, mask=BAND)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    mh.reference_attention(qr, kr, vr, mask=BAND).output.sum().backward()
    for _ in range(3):  # the whole path, the call that stores the plan, the plan
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = mh.attention(qg, kg, vg, mask=BAND)
        assert out.requires_grad
        out.sum().backward()
        for got, want in ((qg, qr), (kg, kr), (vg, vr)):
            torch.testing.assert_close(got.grad, want.grad)


def test_non_finite_inputs_after_a_cached_call_follow_the_policy():
    """A call asking for the non-finite rules is never served by the plan of a plain call."""
    q, k, v = _qkv(L=8)
    mask = mh.causal() & mh.sliding_window(2)
    _cached(q, k, v, mask=mask)
    q2 = q.clone()
    q2[0, 1, 3, 0] = float("nan")  # that row only
    out = mh.attention(q2, k, v, mask=mask, check_finite=True)
    assert torch.equal(out.isnan().any(-1), _ref(q2, k, v, mask=mask).isnan().any(-1))
    assert int(out.isnan().any(-1).sum()) == 1
    v2 = v.clone()
    v2[0, 0, 2, 0] = float("inf")  # value 2: seen by rows 2, 3 and 4 of head 0
    want = _ref(q, k, v2, mask=mask)
    out = mh.attention(q, k, v2, mask=mask, check_finite=True)
    assert torch.equal(out.isnan().any(-1), want.isnan().any(-1)) and int(want.isnan().any(-1).sum()) == 3
    finite = ~want.isnan()
    torch.testing.assert_close(out.double()[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_all_finite_sees_every_non_finite_entry_and_huge_values_only_cost_time():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        q, out = torch.randn(1, 2, 5, 4, dtype=dtype), torch.randn(1, 2, 5, 4, dtype=dtype)
        k = torch.randn(1, 1, 7, 4, dtype=dtype)
        assert all_finite(q, k, out) and all_finite(q, k, out[..., :3])
        for bad in (float("nan"), float("inf"), float("-inf")):
            for which in (0, 1):
                a, b = q.clone(), out.clone()
                (a, b)[which][0, 1, 2, 3] = bad
                assert not all_finite(a, k, b), (dtype, bad, which)
        a, b = q.clone(), out.clone()
        a[0, 0, 0, 0], b[0, 0, 0, 0] = float("inf"), float("inf")  # inf - inf = NaN: still seen
        assert not all_finite(a, k, b)
        # The keys are read from KEYS_CHECKED_FROM query rows per KV head: not for these 10 rows
        # (a decoding step's cost is its read of the keys), for 64 rows of 2 heads on 1 KV head.
        bad_k = k.clone()
        bad_k[0, 0, 3, 1] = float("nan")
        assert all_finite(q, bad_k, out)
        long_q = torch.randn(1, 2, 32, 4, dtype=dtype)
        long_out = torch.randn(1, 2, 32, 4, dtype=dtype)
        assert all_finite(long_q, k, long_out) and not all_finite(long_q, bad_k, long_out)
        assert all_finite(long_q, torch.full_like(k, 60000.0), long_out)  # a half sum would overflow: fp32
    q, huge = torch.full((1, 1, 4, 4), 2.0), torch.full((1, 1, 4, 4), 5e37)  # finite through the kernel
    assert not all_finite(q, q, huge)  # sum q · out overflows (4 · 2 · 5e37): the policy looks and finds nothing
    for _ in range(2):
        out = mh.attention(q, q, huge)
        torch.testing.assert_close(out, huge)


def test_a_mask_holding_a_tensor_by_identity_is_never_cached():
    q, k, v = _qkv(L=6)
    table = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask = mh.masks.as_mask(table)
    assert not mask.by_value() and not (mh.causal() & mask).by_value()
    plans.clear()
    before = mh.attention(q, k, v, mask=mask)
    assert torch.equal(mh.attention(q, k, v, mask=mask), before) and not plans._PLANS
    table[:, :, :, 0] = False  # the mask views this tensor: its meaning changes
    table[:, :, 0, 0] = True
    torch.testing.assert_close(
        mh.attention(q, k, v, mask=mh.masks.as_mask(table)).double(), _ref(q, k, v, mask=table), rtol=1e-5, atol=1e-5
    )
    assert not torch.equal(before, mh.attention(q, k, v, mask=mh.masks.as_mask(table)))


def test_a_mask_keeps_its_own_lengths_so_its_plan_stays_right():
    q, k, v = _qkv(L=10)
    lengths = torch.tensor([4])
    mask = mh.key_padding(lengths) & mh.causal()
    assert mask.by_value()
    before = _cached(q, k, v, mask=mask)
    lengths.fill_(9)  # the caller's tensor, not the mask's copy
    assert torch.equal(mh.attention(q, k, v, mask=mask), before)
    other = mh.key_padding(lengths) & mh.causal()  # built from the changed tensor: another value
    torch.testing.assert_close(
        mh.attention(q, k, v, mask=other).double(), _ref(q, k, v, mask=other), rtol=1e-5, atol=1e-5
    )
    assert not torch.equal(mh.attention(q, k, v, mask=other), before)


@pytest.mark.parametrize("first", ["view of k", "separate"])
def test_a_value_viewing_the_keys_and_a_separate_value_have_plans_of_their_own(first):
    """MLA passes V as the first Dv features of K, and sdpa may run such a V as K itself (no copy).
    A separate V of the same shape and strides must never inherit that decision, nor the reverse:
    the key holds which inputs share an address (``plans.aliasing``), so each has its own plan, and
    a plan of inputs that share one gets no guard (a guard compares each tensor alone)."""
    gen = torch.Generator().manual_seed(5)
    q, k, elsewhere = (torch.randn(1, 2, 12, 16, generator=gen) for _ in range(3))
    views = {"view of k": k[..., :8], "separate": elsewhere[..., :8]}  # (1, 2, 12, 8), equal strides
    order = [first] + [name for name in views if name != first]
    plans.clear()
    for name in order:
        v = views[name]
        for _ in range(3):
            torch.testing.assert_close(
                mh.attention(q, k, v, mask=BAND).double(), _ref(q, k, v, mask=BAND), rtol=1e-5, atol=1e-5
            )
    keys = {name: plans.signature(q, k, v, BAND, None, "auto") for name, v in views.items()}
    assert keys["view of k"] != keys["separate"]
    assert plans.lookup(keys["separate"]) is not None  # (its guard may serve the view as well: it runs either)
    if first == "view of k":  # planned before any guard could serve it: a plan of its own, without a guard
        assert plans.lookup(keys["view of k"]) is not None and plans._GUARDS.get(keys["view of k"]) is None
    for name in order:  # each served by its own plan, again and again
        v = views[name]
        for _ in range(2):
            torch.testing.assert_close(
                mh.attention(q, k, v, mask=BAND).double(), _ref(q, k, v, mask=BAND), rtol=1e-5, atol=1e-5
            )
    plans.clear()
    x = torch.randn(1, 2, 12, 16, generator=gen)
    for _ in range(3):  # self-attention on one tensor: a plan of its own, not the separate inputs' one
        torch.testing.assert_close(mh.attention(x, x, x).double(), _ref(x, x, x), rtol=1e-5, atol=1e-5)
    assert plans.signature(x, x, x, None, None, "auto") != plans.signature(x, k, elsewhere, None, None, "auto")
    assert plans.lookup(plans.signature(x, x, x, None, None, "auto")) is not None


class _Doubling(Backend):
    """Serves everything, returning twice the sdpa output: shows which backend ran."""

    name = "doubling"
    capabilities = Capabilities()

    def forward(self, call):
        return AttentionResult(2 * mh.attention(call.q, call.k, call.v, mask=call.mask, backend="sdpa"), None, None)


def test_registering_a_backend_forgets_every_plan():
    q, k, v = _qkv()
    want = _cached(q, k, v, mask=BAND)
    mh.register_backend(_Doubling(), priority=0)
    try:
        assert not plans._PLANS
        for _ in range(3):  # the last from its own plan
            torch.testing.assert_close(mh.attention(q, k, v, mask=BAND), 2 * want)
        assert plans._PLANS
    finally:
        mh.unregister_backend("doubling")
    assert torch.equal(mh.attention(q, k, v, mask=BAND), want)


def test_a_forced_backend_that_refuses_is_never_cached():
    q, k, v = _qkv()
    _cached(q, k, v, mask=BAND)
    mask = mh.masks.as_mask(torch.ones(16, 16, dtype=torch.bool))
    for _ in range(2):
        with pytest.raises(mh.BackendRefusedError, match=r"backend 'blocksparse' cannot serve this call"):
            mh.attention(q, k, v, mask=mask, backend="blocksparse")


def test_tensor_subclasses_and_the_bound_on_plans():
    q, k, v = _qkv()
    param = torch.nn.Parameter(q.clone())
    torch.testing.assert_close(mh.attention(param, k, v).detach().double(), _ref(q, k, v), rtol=1e-5, atol=1e-5)
    assert plans.signature(param, k, v, None, None, "auto") is None
    plans.clear()
    for L in range(1, plans.MAX_PLANS + 10):
        for _ in range(2):
            mh.attention(q[:, :, :1], k[:, :, : L % 16 + 1], v[:, :, : L % 16 + 1], scale=0.1 + L / 1000)
    assert len(plans._PLANS) == len(plans._SEEN) == plans.MAX_PLANS


def test_signatures_met_once_build_no_plan_but_their_length_buckets_do():
    """A growing KV cache gives every step a new Lk: no runner is built for any one signature;
    one is built per power-of-two bucket of Lk met twice (1: once; 2-3, 4-7, 8-15, 16-31, 32-40)."""
    q, k, v = _qkv(L=1, Lk=40)
    plans.clear()
    for n in range(1, 41):
        torch.testing.assert_close(
            mh.attention(q, k[:, :, :n], v[:, :, :n], mask=mh.causal()).double(),
            _ref(q, k[:, :, :n], v[:, :, :n], mask=mh.causal()),
            rtol=1e-5,
            atol=1e-5,
        )
    assert [key[0] for key in plans._PLANS] == ["growing"] * 5
    assert sorted(key[4] for key in plans._PLANS) == [2, 3, 4, 5, 6]  # the buckets' bit lengths


def test_compiled_attention_after_plans_exist_is_one_graph():
    torch._dynamo.reset()
    q, k, v = _qkv()
    want = _cached(q, k, v, mask=BAND)
    compiled = torch.compile(lambda q, k, v: mh.attention(q, k, v, mask=BAND), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-6, atol=1e-6)


def _growing_steps(lengths, *, Hq=8, Hkv=2, D=64, seed=0):
    """One query against K/V of each length in turn, as a growing KV cache gives them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, 1, D, generator=gen)
    return q, [(torch.randn(1, Hkv, n, D, generator=gen), torch.randn(1, Hkv, n, D, generator=gen), n) for n in lengths]


def _counting_validation(monkeypatch):
    import sys

    attention_module = sys.modules["multihead.attention"]  # (mh.attention is the function)
    calls = []
    real = attention_module.validate_call

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "validate_call", counting)
    return calls


def test_steps_of_a_growing_cache_run_the_plan_of_their_length_bucket(monkeypatch):
    """Each decoding step has a new Lk, so a new signature; one query under bottom-right causal
    (or no mask) masks nothing at any Lk, and the plan stored for Lk's power-of-two bucket serves
    the bucket's other steps: after two steps of a bucket, no more whole paths until the next."""
    plans.clear()
    calls = _counting_validation(monkeypatch)
    q, steps = _growing_steps(range(1020, 1100))  # buckets [512, 1023] and [1024, 2047]
    for k, v, _ in steps:
        got = mh.attention(q, k, v, mask=mh.causal())
        torch.testing.assert_close(got, _ref(q, k, v, mask=mh.causal()).float(), rtol=1e-5, atol=1e-5)
    assert len(calls) == 4, "two whole paths per bucket (the second stores the plan), then none"
    growing = plans.growing_signature(q, steps[-1][0], steps[-1][1], mh.causal(), None, "auto")
    assert growing is not None and plans.lookup(growing) is not None


def test_no_growing_plan_where_dispatch_changes_inside_the_bucket(monkeypatch):
    """With Hq = Hkv = 6, D=64, the decode backend takes over from Lk = 2^20 / 384 = 2731, inside
    the bucket [2048, 4095]: no plan may serve the bucket (every step takes the whole path and runs
    the backend explain names)."""
    plans.clear()
    calls = _counting_validation(monkeypatch)
    q, steps = _growing_steps([2700, 2701, 2702, 2800, 2801], Hq=6, Hkv=6)
    for k, v, _ in steps:
        got = mh.attention(q, k, v, mask=mh.causal())
        torch.testing.assert_close(got, _ref(q, k, v, mask=mh.causal()).float(), rtol=1e-5, atol=1e-5)
    assert len(calls) == 5  # (before explain, which validates too)
    assert [mh.explain(q, k, v, mask=mh.causal()).backend for k, v, _ in steps[::3]] == ["sdpa", "decode"]
    assert not any(key[0] == "growing" for key in plans._PLANS)


@pytest.mark.parametrize(
    "mask,Lq",
    [
        (mh.sliding_window(100), 1),  # blocks keys once the cache is longer than the window
        (mh.causal("top_left"), 1),  # one query sees key 0 only
        (mh.key_padding(torch.tensor([50])), 1),  # blocks past its length
        (mh.causal(), 2),  # two queries: the diagonal moves with Lk
        (mh.causal().at(torch.tensor([5]), torch.arange(6), q_len=6, kv_len=6), 1),  # fixed positions
    ],
    ids=["window", "top_left", "padding", "two_queries", "positioned"],
)
def test_a_mask_that_blocks_something_at_some_length_gets_no_growing_key(mask, Lq):
    q, k, v = _qkv(L=Lq, Lk=6)
    assert plans.growing_signature(q, k, v, mask, None, "auto") is None


def test_a_growing_plan_serves_only_its_own_bucket_and_signature():
    q, steps = _growing_steps([1000, 1023, 1024, 2047, 2048])
    keys = [plans.growing_signature(q, k, v, None, None, "auto") for k, v, _ in steps]
    assert keys[0] == keys[1] != keys[2] == keys[3] != keys[4]
    assert plans.kv_len_bucket(1024) == (1024, 2047) and plans.kv_len_bucket(1) == (1, 1)
    k, v, _ = steps[0]
    assert plans.growing_signature(q, k, v, None, 0.5, "auto") != keys[0]
    assert plans.growing_signature(q.double(), k.double(), v.double(), None, None, "auto") != keys[0]
    assert plans.growing_signature(torch.randn(1, 8, 2, 64), k, v, None, None, "auto") is not None  # no mask: any Lq


# ------------------------------------------------------------------ plans the caller holds
def test_a_held_plan_computes_what_attention_computes_on_other_values_of_its_signature():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=gen) for _ in range(3))
    held = mh.plan(q, k, v, mask=BAND)
    assert "Plan(q (2, 4, 33, 16)" in repr(held)
    for _ in range(3):
        q2, k2, v2 = (torch.randn(2, 4, 33, 16, generator=gen) for _ in range(3))
        torch.testing.assert_close(held(q2, k2, v2), mh.attention(q2, k2, v2, mask=BAND), rtol=0, atol=0)


def test_a_held_plan_refuses_inputs_of_another_signature_naming_what_differs():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    held = mh.plan(q, k, v, mask=mh.causal())
    with pytest.raises(ValueError, match=r"q shape \(1, 2, 9, 16\) \(planned: \(1, 2, 8, 16\)\)"):
        held(torch.randn(1, 2, 9, 16), k, v)
    with pytest.raises(ValueError, match=r"q dtype torch.float64 \(planned: torch.float32\)"):
        held(q.double(), k, v)
    with pytest.raises(ValueError, match=r"autograd .* True \(planned: False\)"):
        held(q.clone().requires_grad_(), k, v)
    with pytest.raises(ValueError, match=r"not three dense tensors"):
        held(q, k, "v")
    with pytest.raises(ValueError, match=r"start at one address"):
        held(q, q, v)


def test_calls_that_cannot_be_planned_are_refused_with_the_reason():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(TypeError, match=r"plan: mask must be a multihead mask object or None, got Tensor"):
        mh.plan(q, k, v, mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"strided last dimension"):
        mh.plan(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)
    with pytest.raises(ValueError, match=r"empty call"):
        mh.plan(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match=r"starting at one address"):
        mh.plan(q, q, v)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        mh.plan(q, k, v, backend="nope")


def test_the_plan_found_last_runs_on_its_guard_and_every_changed_fact_takes_the_key():
    """After a plan is found, the next call of the same signature runs it on one C-level check of
    q, k, v (multihead.guards); a call that changes any fact the key holds (dtype, shape, strides,
    device, requires_grad, grad mode, mask object, scale, backend) must not: it gets its own right
    answer or its own error."""
    q, k, v = _qkv()
    _cached(q, k, v, mask=BAND)
    if plans._last is None:
        pytest.skip("this PyTorch has no trusted tensor guard (multihead.guards): the key serves every call")
    for name, (q2, k2, v2, kw) in {
        "dtype": (q.double(), k.double(), v.double(), {"mask": BAND}),
        "shape": (*_qkv(L=17), {"mask": BAND}),
        "strides": (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, {"mask": BAND}),
        "mask object": (q, k, v, {"mask": mh.causal()}),
        "scale": (q, k, v, {"mask": BAND, "scale": 0.5}),
        "backend": (q, k, v, {"mask": BAND, "backend": "reference"}),
    }.items():
        got = mh.attention(q2, k2, v2, **kw)
        assert got.dtype == q2.dtype, name
        want = _ref(q2, k2, v2, **{key: value for key, value in kw.items() if key != "backend"})
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=name)
    mh.attention(q, k, v, mask=BAND)  # the plan is the last found again
    with pytest.raises(ValueError, match=r"q, k and v must be on one device"):
        mh.attention(q, k.to("meta"), v, mask=BAND)
    qg = q.clone().requires_grad_()
    mh.attention(qg, k, v, mask=BAND).sum().backward()  # requires_grad: a plan with a backward
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    mh.attention(q, k, v, mask=BAND)
    with torch.no_grad():  # grad mode changed, the same tensors: the plan without autograd
        got = mh.attention(q, k, v, mask=BAND)
    torch.testing.assert_close(got.double(), _ref(q, k, v, mask=BAND), rtol=1e-5, atol=1e-5)
    mh.attention(q, k, v, mask=BAND)
    plans.clear()
    assert plans._last is None, "clearing the plans (a backend registered) forgets the last one too"
