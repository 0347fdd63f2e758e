"""Seeded differential fuzzing of ``multihead.attention`` against an independent fp64 oracle.

Each seed is one random call (``fuzz_cases.make_case``): shapes with GQA and ``Lq != Lk`` (1, and
lengths around blocksparse's 256-row blocks), head dims with ``Dv != D``, fp64/fp32/bf16/fp16,
non-contiguous and expanded inputs, random compositions of mask objects (``& | ~``, ``.shifted``,
``.at``), bool and additive tensor masks of every broadcast shape, score modifiers (a bias,
trainable or not, large enough for scores ~300; softcap; ALiBi in both forms and T5 tables,
trainable, short-range and on short key ranges), calls where no query sees a key, the LSE,
weights with head/row selections, and gradients (of k and v alone, too). Every seed
runs on every backend forced (``reference``, ``sdpa``, ``blocksparse``; not ``flex``, which
compiles for minutes) and on ``auto``. A backend that declares it cannot serve the call raises
``BackendRefusedError``: the case is a skip with its reasons.

What is checked, against the oracle of ``fuzz_oracle.py`` (fp64, written without multihead's
reference):

* the relative rule of shared/TESTING.md on the output, LSE, weights and every gradient:
  ``err(x) <= F * err(baseline) + floor``, max and mean, ``F`` from the backend's declared
  capabilities (``auto``: the backend it chose); fp64 with ``assert_close``. The baseline is the
  naive computation in the input dtype, as the rule says, taken element by element at the worse
  of two arrangements of it: the autograd softmax, and the fused-kernel one (P recomputed from a
  kept LSE, ``dS = P (dP - rowsum(dO O))``), whose rounding differs exactly where a result is 0
  or 1 in theory (``fuzz_oracle.attend_flash``);
* the conventions exactly: fully masked rows give output 0, LSE ``-inf``, weights 0 and ``dq``
  0; keys no query sees get ``dk = dv = 0``; everything finite where the inputs a row reads
  are (NaN in keys nobody sees, NaN in the memory between strided elements); rows that read a
  NaN input are NaN in output, LSE and weights (docs/conventions.md, "Non-finite inputs");
  dtypes and shapes of what comes back;
* ``test_mask_meaning``: each generated mask's ``mask_mod`` against its meaning stated from the
  conventions (the oracle reads masks through ``mask_mod``, so that is checked too).

Tiers: ``test_fuzz`` (default run, seeds ``DEFAULT_SEEDS``), ``test_fuzz_slow`` (``make
test-slow``, ``SLOW_SEEDS``). A case id names the whole case, e.g.
``seed17-sdpa-fp16-B2-H8x2-L1x513-D64v64-k:lastT-(causal()&key_padding([3,0]))-lse-grad``.
Reproduce one case::

    python -m pytest tests/fuzz -k "[seed17-sdpa-"       # (the "[" keeps seed117 out)
    python tests/fuzz/test_fuzz.py 17 sdpa               # the same, printing every error
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # also when run as a script

from fuzz_cases import Case, layout, make_case, resolve_index  # noqa: E402
from fuzz_oracle import alibi_bias, attend, attend_flash, mods_of, t5_bias, t5_buckets, visible  # noqa: E402

import multihead as mh  # noqa: E402

BACKENDS = ["reference", "sdpa", "blocksparse", "torch_blocks", "auto"]
# With two slow-tier seeds in the default run: the first to find issue 28's items 11 (bf16 ALiBi
# in the paper's form, no causal mask) and 12 (weights with scores ~300 in fp16).
DEFAULT_SEEDS = [*range(0, 60), 1354, 2084]
SLOW_SEEDS = range(1000, 3000)

# Known failures, each one of the items of issue 9, as strict xfails: once fixed, the case passes,
# the xfail fails, and its entry goes with the fix. Failures that are none of issue 9's items are
# never listed: they fail. Empty since the fixes of items 2, 5 (bf16), 6 and 10 that this fuzzer
# found (seeds 1592, 1162, 1308, 1314, 1517, 1796, 1945, 2070, 2134, 2156, 2389, 2550, 2953) and of
# the shifted .at() masks (seeds 1288, 1570, 1702, 1934, 1961, 2740).
KNOWN: dict[tuple[int, str], str] = {}


# ============================================================================ expectations
@functools.lru_cache(maxsize=2)
def expected(seed: int) -> dict:
    """One seed's oracle (fp64) and its two baselines in the input dtype (the naive autograd
    softmax, and the same arranged as fused kernels arrange it), with gradients."""
    case = make_case(seed)
    built = case.build()
    B, Hq, Hkv, Lq, Lk = case.B, case.Hq, case.Hkv, case.Lq, case.Lk
    allowed = visible(built.mask, B, Hq, Lq, Lk)
    # A position bias is the first modifier: the oracle builds it dense from the case (fuzz_oracle).
    pos = case.position
    mods = mods_of(built.mask, (built.score_mod[1:] or None) if pos is not None else built.score_mod)
    pos_at = len(mods) - len(case.mods)  # after a float mask's entry, before the case's modifiers
    buckets = None
    if pos is not None and pos[0] == "alibi":
        mods.insert(pos_at, ("bias", alibi_bias(Hq, Lq, Lk, *pos[1:])))
    elif pos is not None:
        buckets = t5_buckets(Lq, Lk, pos[1], pos[2], pos[3], pos[4])
        mods.insert(pos_at, ("bias", t5_bias(built.leaves["t5"].detach().double(), buckets)))
    bias_at = {n: n + (len(mods) - len(case.mods)) for n, m in enumerate(case.mods) if m[0] == "bias"}
    sizes = {"q": (B, Hq, Lq, case.D), "k": (B, Hkv, Lk, case.D), "v": (B, Hkv, Lk, case.Dv)}

    result = {"allowed": allowed}
    for which, dtype in (("oracle", torch.float64), ("baseline", case.torch_dtype)):
        leaves = {
            n: (t.detach().to(dtype) if n in "qkv" else t.detach()).requires_grad_(t.requires_grad)
            for n, t in built.leaves.items()
        }
        views = [layout(leaves[n], kind, sizes[n]) for n, kind in zip("qkv", case.layouts)]
        run_mods = list(mods)
        for n, i in bias_at.items():  # the modifiers' tensors, as this run's leaves
            run_mods[i] = ("bias", leaves[f"bias{n}"].reshape(mods[i][1].shape))
        if buckets is not None:  # T5: the table, indexed (its gradient lands on the table)
            run_mods[pos_at] = ("bias", t5_bias(leaves["t5"].to(dtype), buckets))
        elif pos is not None:  # ALiBi as plain code computes it: in fp32 (fp64 for the oracle); an
            # fp32 bias promotes the scores, as a bias tensor in fp32 does. (In bf16 its values at
            # long distances lose the differences the softmax needs: a baseline that excuses anything.)
            run_mods[pos_at] = ("bias", mods[pos_at][1].to(torch.promote_types(dtype, torch.float32)))
        scale = case.scale if case.scale is not None else case.D**-0.5
        res = attend(*views, allowed, run_mods, scale, dtype=dtype)
        grads = {}
        if built.dout is not None:
            res.out.backward(built.dout.to(dtype))
            grads = {n: t.grad for n, t in leaves.items() if t.requires_grad}
        result[which] = (res.out.detach(), res.lse.detach(), res.weights.detach(), grads)

    # The second baseline: the naive computation arranged as fused kernels arrange it.
    leaves = {n: built.leaves[n].detach().requires_grad_(built.dout is not None) for n in "qkv"}
    views = [layout(leaves[n], kind, sizes[n]) for n, kind in zip("qkv", case.layouts)]
    scale = case.scale if case.scale is not None else case.D**-0.5
    fwd, g = attend_flash(*views, allowed, mods, scale, case.torch_dtype, built.dout)
    grads = {}
    if built.dout is not None:
        wanted = [n for n in "qkv" if built.leaves[n].requires_grad]
        found = torch.autograd.grad(
            [views["qkv".index(n)] for n in wanted], [leaves[n] for n in wanted], [g[n] for n in wanted]
        )
        grads = dict(zip(wanted, found))
        for n, i in bias_at.items():
            if built.leaves[f"bias{n}"].requires_grad:
                grads[f"bias{n}"] = g[i].reshape(built.leaves[f"bias{n}"].shape)
        if buckets is not None and built.leaves["t5"].requires_grad:  # summed into the table's entries
            table = built.leaves["t5"]
            per_entry = g[pos_at][0].permute(1, 2, 0).reshape(-1, Hq)  # (Lq * Lk, Hq)
            grads["t5"] = torch.zeros(table.shape, dtype=per_entry.dtype).index_add_(0, buckets.flatten(), per_entry)
    result["flash"] = (fwd.out, fwd.lse, fwd.weights, grads)
    return result


# ============================================================================ comparison
def _rule(
    what: str,
    x: torch.Tensor,
    r: torch.Tensor,
    baselines: tuple,
    F: float | None,
    errors: list,
    magnitude: float = 0.0,
    floor: float | None = None,
) -> None:
    """The relative rule of shared/TESTING.md on one result (``F is None``: fp64, assert_close),
    against the worse of the ``baselines`` element by element. ``magnitude``: the size of the
    terms a result adds up, when larger than the result itself."""
    x, r = x.detach(), r.detach()
    if tuple(x.shape) != tuple(r.shape):
        errors.append(f"{what}: shape {tuple(x.shape)}, expected {tuple(r.shape)}")
        return
    finite, nan = torch.isfinite(r), torch.isnan(r)
    if not bool(torch.isfinite(x[finite]).all()):
        bad = (~torch.isfinite(x) & finite).nonzero()[:4].tolist()
        errors.append(f"{what}: non-finite values where the oracle is finite (first at {bad})")
        return
    # NaN where a row reads a NaN (the math propagates it); -inf LSE of rows that see nothing.
    if not bool(torch.isnan(x[nan]).all()):
        bad = (nan & ~torch.isnan(x)).nonzero()[:4].tolist()
        errors.append(f"{what}: not NaN where the oracle is (a row that reads a NaN input), first at {bad}")
    inf = ~finite & ~nan
    if not bool((x[inf] == r[inf]).all()):
        errors.append(f"{what}: {x[inf][:4].tolist()} where the oracle has {r[inf][:4].tolist()}")
    if r.numel() == 0 or not bool(finite.any()):
        return
    xd, rd = x.double()[finite], r.double()[finite]
    mag = max(1.0, float(rd.abs().max()), magnitude)
    if F is None:
        try:
            torch.testing.assert_close(xd, rd, rtol=1e-10, atol=1e-10 * mag)
        except AssertionError as exc:
            errors.append(f"{what} (fp64): " + str(exc).replace("\n", " "))
        return
    err_x = (xd - rd).abs()
    # A baseline that is not finite where the oracle is (fp16 overflow) says nothing there: the
    # other one is used; where neither is finite, the rule is only the finiteness check above.
    errs = torch.stack([(b.detach().double()[finite] - rd).abs() for b in baselines])
    err_b = errs.nan_to_num(nan=-1.0, posinf=-1.0).amax(0)
    err_b = torch.where(err_b < 0, torch.tensor(float("inf"), dtype=err_b.dtype), err_b)
    floor = 4 * torch.finfo(x.dtype).eps * mag if floor is None else floor
    ok = float(err_x.max()) <= F * float(err_b.max()) + floor and float(err_x.mean()) <= F * float(err_b.mean()) + floor
    if not ok:
        errors.append(
            f"{what}: max err {float(err_x.max()):.3e}, baseline max err {float(err_b.max()):.3e}, "
            f"mean err {float(err_x.mean()):.3e} vs baseline mean {float(err_b.mean()):.3e}, "
            f"F {F}, floor {floor:.1e}"
        )


def _exact(what: str, x: torch.Tensor, where: torch.Tensor, value: float, errors: list) -> None:
    """``x`` equals ``value`` exactly wherever ``where`` (broadcast over trailing dims) holds."""
    if where is None or not bool(where.any()):
        return
    sel = x.detach()[where]
    ok = bool((sel == value).all())
    if not ok:
        bad = sel[sel != value]
        errors.append(
            f"{what}: expected exactly {value} on {int(where.sum())} rows, got e.g. {bad.flatten()[:4].tolist()}"
        )


def run_case(seed: int, backend: str) -> dict:
    """Run one case; returns a report. Raises ``AssertionError`` listing every failed check, and
    ``mh.BackendRefusedError`` if a forced backend refuses."""
    case = make_case(seed)
    exp = expected(seed)
    built = case.build()
    T = case.torch_dtype
    B, Hq, Hkv, Lq, Lk = case.B, case.Hq, case.Hkv, case.Lq, case.Lk
    kwargs = dict(built.kwargs, mask=built.mask, score_mod=built.score_mod)
    chosen = mh.explain(built.q, built.k, built.v, backend=backend, **kwargs).backend if backend == "auto" else backend
    # An empty call (Lq or Lk = 0) runs no kernel ("none"): its zeros need no factor of their own.
    rule_backend = chosen if chosen in mh.available_backends() else "reference"

    # NaN inputs (seen or not) ask for the non-finite rules the oracle follows (opt-in: docs/conventions.md).
    checked = bool(case.nan_input or case.nan_unseen)
    result = mh.attention(built.q, built.k, built.v, backend=backend, check_finite=checked, **kwargs)
    out, weights, lse = (
        (result.output, result.weights, result.lse) if isinstance(result, tuple) else (result, None, None)
    )
    if built.dout is not None:
        out.backward(built.dout)

    ro, rl, rw, rg = exp["oracle"]
    bo, bl, bw, bg = (tuple(z) for z in zip(exp["baseline"], exp["flash"]))
    bg = {n: tuple(g[n] for g in bg) for n in rg}
    allowed = exp["allowed"]
    empty = ~allowed.any(-1)  # (B, Hq, Lq): rows that see nothing
    unseen = ~allowed.reshape(B, Hkv, Hq // Hkv, Lq, Lk).any(2).any(2)  # (B, Hkv, Lk): keys nobody sees
    F = (
        (lambda grads: None)
        if T == torch.float64
        else (lambda grads: mh.get_backend(rule_backend).capabilities.tolerance_factor(T, grads))
    )
    errors: list[str] = []

    if out.dtype != T or tuple(out.shape) != (B, Hq, Lq, case.Dv):
        errors.append(f"output: dtype {out.dtype} shape {tuple(out.shape)}, expected {T} {(B, Hq, Lq, case.Dv)}")
    _rule("output", out, ro, bo, F(False), errors)
    _exact("output of fully masked rows", out, empty, 0.0, errors)
    if case.return_lse:
        want = torch.float64 if T == torch.float64 else torch.float32
        if lse is None or lse.dtype != want:
            errors.append(f"lse: {None if lse is None else lse.dtype}, expected {want}")
        else:
            _rule("lse", lse, rl, bl, F(False), errors)
            _exact("lse of fully masked rows", lse, empty, float("-inf"), errors)
    elif lse is not None:
        errors.append("lse returned although return_lse=False")
    if case.return_weights:
        # Weights on demand are exp(s - lse), the scores recomputed in another pass than the one
        # the LSE came from: exact to a few ulps of the LSE's dtype at |lse|, not at |weight| <= 1
        # (seen: a weight of exactly 1 returned as 1 - 6e-7 in fp32 where both baselines are
        # exact). Their floor: a few ulps of the weights' dtype at 1, plus of the LSE's at |lse|
        # (ulps of fp16/bf16 at |lse| ~ 300 would excuse rows summing to 0.8, issue 28, item 12).
        finite_lse = rl[torch.isfinite(rl)]
        lse_size = max(1.0, float(finite_lse.abs().max())) if finite_lse.numel() else 1.0
        heads, rows = resolve_index(case.weights_heads, Hq), resolve_index(case.weights_rows, Lq)
        pick = lambda w: w[:, heads][:, :, rows]  # noqa: E731
        if weights is None or weights.dtype != T:
            errors.append(f"weights: {None if weights is None else weights.dtype}, expected {T}")
        else:
            lse_eps = torch.finfo(torch.float64 if T == torch.float64 else torch.float32).eps
            floor = 4 * torch.finfo(T).eps + 4 * lse_eps * lse_size
            _rule("weights", weights, pick(rw), tuple(pick(w) for w in bw), F(False), errors, floor=floor)
            _exact("weights of fully masked rows", weights, pick(empty.unsqueeze(-1).expand_as(rw)), 0.0, errors)
    elif weights is not None:
        errors.append("weights returned although return_weights=False")
    # A gradient that is 0 in theory (a bias constant along keys, by shift invariance) is a sum
    # of terms the size of the other gradients: the floor is taken at that size for every
    # gradient, as tests/backends/test_scores.py does.
    grad_size = max([float(g.abs().max()) for g in rg.values() if g.numel()] + [0.0])
    for name, leaf in built.leaves.items():
        if name not in rg:
            continue
        if leaf.grad is None:  # PyTorch's "zero": right only where the gradient is 0 (an empty bias)
            if name in "qkv":  # a result must stay connected to its inputs (issue 28, item 13)
                errors.append(f"d{name}: None, expected a gradient (zeros where nothing is seen)")
            elif bool((rg[name] != 0).any()):
                errors.append(f"d{name}: no gradient")
            continue
        _rule(f"d{name}", leaf.grad, rg[name], bg[name], F(True), errors, grad_size)
        if name == "q":
            _exact("dq of fully masked rows", leaf.grad, empty, 0.0, errors)
        elif name in "kv":
            keys = unseen if leaf.shape[1] == Hkv else unseen.all(1, keepdim=True)
            _exact(f"d{name} of keys no query sees", leaf.grad, keys, 0.0, errors)

    report = {"id": case.id(backend), "chosen": chosen, "errors": errors}
    if errors:
        raise AssertionError(_message(case, backend, chosen, errors))
    return report


def _message(case: Case, backend: str, chosen: str, errors: list) -> str:
    lines = [f"case {case.id(backend)}" + (f" (auto chose {chosen})" if backend == "auto" else "")]
    lines += [f"  - {e}" for e in errors]
    lines.append(f"reproduce: python tests/fuzz/test_fuzz.py {case.seed} {backend}")
    return "\n".join(lines)


# ============================================================================ tests
def _params(seeds) -> list:
    out = []
    for seed in seeds:
        case = make_case(seed)
        for backend in BACKENDS:
            item = KNOWN.get((seed, backend))
            marks = [pytest.mark.xfail(strict=True, reason=item)] if item else []
            out.append(pytest.param(seed, backend, id=case.id(backend), marks=marks))
    return out


def _run_or_skip(seed: int, backend: str) -> None:
    try:
        run_case(seed, backend)
    except mh.BackendRefusedError as exc:
        assert backend != "auto", f"auto found no backend: {exc}"
        pytest.skip(f"{backend} refuses: {exc}")


@pytest.mark.parametrize("seed,backend", _params(DEFAULT_SEEDS))
def test_fuzz(seed, backend):
    _run_or_skip(seed, backend)


@pytest.mark.slow
@pytest.mark.parametrize("seed,backend", _params(SLOW_SEEDS))
def test_fuzz_slow(seed, backend):
    _run_or_skip(seed, backend)


def _mask_meaning(seed: int) -> None:
    case = make_case(seed)
    if case.node is None:
        pytest.skip("no mask object in this case")
    mask = case.node.build()
    B, Hq, Lq, Lk = case.B, case.Hq, case.Lq, case.Lk
    grid = (
        torch.arange(B).view(-1, 1, 1, 1),
        torch.arange(Hq).view(1, -1, 1, 1),
        torch.arange(Lq).view(1, 1, -1, 1),
        torch.arange(Lk).view(1, 1, 1, -1),
    )
    meant = case.node.allowed(*grid, Lq, Lk).expand(B, Hq, Lq, Lk)
    got = visible(mask, B, Hq, Lq, Lk)
    diff = (meant != got).nonzero()
    assert diff.numel() == 0, (
        f"{case.node.expr()}: mask_mod differs from the conventions at "
        f"{diff.shape[0]} of {meant.numel()} positions (b, h, i, j), first {diff[:4].tolist()}"
    )


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in DEFAULT_SEEDS])
def test_mask_meaning(seed):
    _mask_meaning(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in SLOW_SEEDS])
def test_mask_meaning_slow(seed):
    _mask_meaning(seed)


def test_oracle_brute_force():
    """The oracle against a plain loop over (b, h, i) with Python floats: GQA, a bias, softcap,
    scale, a fully masked row, Dv != D."""
    import math

    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Lq, Lk, D, Dv, scale, cap = 2, 4, 2, 3, 5, 3, 2, 0.7, 2.0
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=gen, dtype=torch.float64)
    allowed = torch.rand(B, Hq, Lq, Lk, generator=gen) > 0.4
    allowed[1, 2, 0] = False
    bias = torch.randn(B, Hq, Lq, Lk, generator=gen, dtype=torch.float64)
    res = attend(q, k, v, allowed, [("bias", bias), ("softcap", cap)], scale)
    for b in range(B):
        for h in range(Hq):
            for i in range(Lq):
                js = [j for j in range(Lk) if allowed[b, h, i, j]]
                if not js:
                    assert float(res.out[b, h, i].abs().max()) == 0 and res.lse[b, h, i] == float("-inf")
                    continue
                s = {
                    j: cap * math.tanh((scale * float(q[b, h, i] @ k[b, h // 2, j]) + float(bias[b, h, i, j])) / cap)
                    for j in js
                }
                lse = math.log(sum(math.exp(x) for x in s.values()))
                o = sum(math.exp(s[j] - lse) * v[b, h // 2, j] for j in js)
                assert abs(float(res.lse[b, h, i]) - lse) < 1e-12
                assert float((res.out[b, h, i] - o).abs().max()) < 1e-12
                for j in range(Lk):
                    assert abs(float(res.weights[b, h, i, j]) - (math.exp(s[j] - lse) if j in js else 0.0)) < 1e-12


def test_oracle_gradients_and_extremes():
    """gradcheck on a small case with a fully masked row; rows whose visible scores are all far
    below -88 (fp32's exp underflow) stay exact; NaN in keys nobody sees changes nothing."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    allowed = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool).expand(1, 2, 3, 4)

    def f(q, k, v, bias):
        r = attend(q, k, v, allowed, [("bias", bias), ("softcap", 3.0)], 0.5)
        return r.out, r.lse.nan_to_num(neginf=0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    r = attend(q, k, v, allowed, [("bias", bias - 1e4)], 0.5)
    r0 = attend(q, k, v, allowed, [("bias", bias)], 0.5)
    assert torch.allclose(r.out, r0.out, atol=1e-12) and torch.isfinite(r.out).all()
    k2 = k.detach().clone()
    k2[0, 0, 3] = float("nan")  # key 3 is visible to no query
    r2 = attend(q, k2, v, allowed, [], 0.5)
    assert torch.isfinite(r2.out).all()
    r2.out.sum().backward()
    assert torch.isfinite(q.grad).all()


# ============================================================================ command line
def main(argv: list[str]) -> int:
    """``python tests/fuzz/test_fuzz.py SEED [BACKEND ...]``: run one seed, print every error."""
    seed = int(argv[0])
    backends = argv[1:] or BACKENDS
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    failed = 0
    for backend in backends:
        case = make_case(seed)
        try:
            report = run_case(seed, backend)
            print(f"PASS {report['id']}" + (f" (auto chose {report['chosen']})" if backend == "auto" else ""))
        except mh.BackendRefusedError as exc:
            print(f"SKIP {case.id(backend)}: {exc}")
        except AssertionError as exc:
            failed += 1
            print(f"FAIL {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
