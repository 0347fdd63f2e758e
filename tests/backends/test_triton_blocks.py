"""The ``triton_blocks`` backend's kernels against the fp64 oracle: forward, LSE and gradients, for
every mask kind it runs and their ``& | ~``, GQA, odd lengths, tile sizes that do not divide them,
fully masked rows, non-contiguous inputs.

Where there is no GPU the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, which tests/conftest.py sets on such a machine before anything imports
triton), and the module's fixture turns on the backend's test switch
(``triton_blocks._cpu_interpreter``), which lets it be forced on the CPU (``auto`` never chooses
it). Where there is a GPU the same tests run the compiled kernels on it. The interpreter runs a
kernel in Python, a tile at a time: a handful of cases run in the default tier, the full matrix in
the slow one. Without triton every test here is skipped, with the reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import multihead as mh
from helpers import STRUCTURED_KINDS, Case, assert_relative, make_inputs, naive_attention, optional
from multihead.backends import triton_blocks
from multihead.blocks import Extent
from multihead.validation import validate_call

NAME = "triton_blocks"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tiles much smaller than the defaults, so that lengths of tens cross several of them; queries !=
# keys per tile, and dK/dV's tiling other than the forward's (as the defaults are).
TILES = [
    triton_blocks.Tiles(forward=(32, 16), dkdv=(16, 32)),
    triton_blocks.Tiles(forward=(16, 32), dkdv=(32, 16)),
]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    optional("triton", "the triton_blocks backend's kernel tests")
    original = mh.get_backend(NAME)
    if DEVICE == "cpu":
        from multihead.backends import triton_kernels

        if not triton_kernels.INTERPRETED:
            pytest.skip(
                "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it on a "
                "machine without a GPU): its kernels cannot run on the CPU in this process"
            )
        _skip_overflow_checks()
    with triton_blocks._cpu_interpreter():
        yield
    mh.register_backend(original)


def _skip_overflow_checks() -> None:
    """The interpreter checks every integer multiply for overflow, which costs a fifth of its time
    here; the kernels' index arithmetic is int32 on lengths far below the limit. Speed only."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and hasattr(builder.options, "sanitize_overflow"):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _use_tiles(tiles: triton_blocks.Tiles) -> None:
    mh.register_backend(triton_blocks.TritonBlocksBackend(tiles))


# ----------------------------------------------------------------------------------- the cases
#: The mask kinds of tests/helpers.py that the backend runs (bands, key padding, documents, and
#: their & | ~, read at offsets); the others are refused (test_refusals).
KINDS = [*STRUCTURED_KINDS, "shifted_causal", "shifted_causal_br", "window_per_sequence", "document_causal"]
HEADS = [(1, 1), (4, 2), (3, 1), (2, 2)]
LENGTHS = [(1, 1), (1, 17), (17, 1), (13, 13), (33, 31), (47, 81), (81, 47), (64, 64)]
HEAD_DIMS = [(16, 16), (32, 32), (40, 24), (64, 64), (8, 8)]


def _cases() -> list[Case]:
    """Every kind with a rotation of heads, lengths and head dims, batch 1 and 2."""
    return [
        Case(
            1 + i % 2, *HEADS[i % len(HEADS)], *LENGTHS[(3 * i) % len(LENGTHS)], *HEAD_DIMS[i % len(HEAD_DIMS)], kind, i
        )
        for i, kind in enumerate(KINDS)
    ]


QUICK = [
    Case(2, 4, 2, 40, 33, 32, 32, "causal&padding", 7),
    Case(1, 2, 1, 33, 33, 16, 16, "document_causal", 8),
    Case(2, 1, 1, 17, 40, 40, 24, "window|prefix", 9),
]


def _factor(dtype: torch.dtype, gradients: bool = False) -> float:
    return mh.get_backend(NAME).capabilities.tolerance_factor(dtype, gradients)


def _check(case: Case, dtype: torch.dtype, tiles, score_mod=None) -> None:
    """Output, LSE and the gradients of q, k, v (through the output and the LSE) against the fp64
    oracle, by the relative rule against the naive computation in ``dtype``."""
    _use_tiles(tiles)
    q64, k64, v64, mask = make_inputs(case)
    mod = mh.scores.as_score_mod(score_mod)
    mod = None if mod is None else mod.for_lengths(case.Lq, case.Lk)  # as attention() binds it
    gen = torch.Generator().manual_seed(case.seed + 1)
    grad_out = torch.randn(case.B, case.Hq, case.Lq, case.Dv, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(case.B, case.Hq, case.Lq, generator=gen, dtype=torch.float64)

    def run(fn, compute, device):
        leaves = [t.to(dtype).to(compute).to(device).requires_grad_() for t in (q64, k64, v64)]
        out, lse = fn(*leaves)
        finite = torch.isfinite(lse)
        loss = (out * grad_out.to(device, out.dtype)).sum() + (lse.masked_fill(~finite, 0) * grad_lse.to(device)).sum()
        loss.backward()
        return out.detach().cpu(), lse.detach().cpu(), [t.grad.cpu() for t in leaves]

    def ours(q, k, v):
        got = mh.attention(q, k, v, mask=mask, score_mod=mod, backend=NAME, return_lse=True)
        return got.output, got.lse

    def oracle(q, k, v):
        ref = mh.reference_attention(q, k, v, mask=mask, score_mod=mod)
        return ref.output, ref.lse

    def naive(q, k, v):  # the baseline: the same computation in the input dtype
        scores = (q @ k.repeat_interleave(case.Hq // case.Hkv, 1).transpose(-2, -1)) * case.D**-0.5
        if mod is not None:
            extent = Extent(case.B, case.Hq, case.Lq, case.Lk)
            scores = mod.apply_block(extent, extent.whole(), scores)
        if mask is not None:
            scores = scores.masked_fill(~mask.materialize(case.B, case.Hq, case.Lq, case.Lk), float("-inf"))
        return naive_attention(q, k, v, mask, score_mod=mod), torch.logsumexp(scores, -1)

    out, lse, grads = run(ours, dtype, DEVICE)
    ref_out, ref_lse, ref_grads = run(oracle, torch.float64, "cpu")
    base_out, base_lse, base_grads = run(naive, dtype, "cpu")
    assert out.dtype == dtype and out.shape == (case.B, case.Hq, case.Lq, case.Dv)
    assert lse.dtype == torch.float32
    assert_relative(out, ref_out, base_out, _factor(dtype))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), "the LSE is -inf exactly on fully masked rows"
    assert_relative(lse[finite].to(dtype), ref_lse[finite], base_lse[finite], _factor(dtype), "lse")
    magnitude = max(float(g.abs().max()) for g in ref_grads)
    for name, g, r, b in zip("qkv", grads, ref_grads, base_grads):
        assert_relative(g, r, b, _factor(dtype, True), f"grad {name}", magnitude=magnitude)


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.id)
def test_quick_cases_forward_lse_and_gradients(case):
    _check(case, torch.float32, TILES[0])


#: Every case in fp32, bf16 and fp16 with the first tiles, and in fp32 and bf16 with the second
#: (fp16's arithmetic is bf16's with more mantissa bits: one tile configuration suffices).
MATRIX = [
    pytest.param(case, dtype, tiles, id=f"{case.id}-{dtype}-tiles{i}")
    for i, tiles in enumerate(TILES)
    for case in _cases()
    for dtype in [torch.float32, torch.bfloat16] + ([torch.float16] if tiles == TILES[0] else [])
]


@pytest.mark.slow
@pytest.mark.parametrize("case,dtype,tiles", MATRIX)
def test_every_mask_kind_forward_lse_and_gradients(case, dtype, tiles):
    _check(case, dtype, tiles)


def _score_mods(heads: int) -> dict:
    from multihead.positions import ALiBi
    from multihead.positions.relative_bias import BucketedBias

    weight = torch.randn(8, heads, generator=torch.Generator().manual_seed(12))
    t5 = BucketedBias(weight, bidirectional=True, num_buckets=8, max_distance=20)
    return {
        "softcap": mh.scores.softcap(5.0),
        "alibi": ALiBi(heads),
        "alibi then softcap": [ALiBi(heads), mh.scores.softcap(4.0)],
        "softcap then alibi": [mh.scores.softcap(4.0), ALiBi(heads, align="top_left")],
        "t5 bucketed + alibi": [t5, ALiBi(heads)],
    }


def test_quick_score_modifiers_in_the_kernel():
    mod = _score_mods(4)["alibi then softcap"]
    _check(Case(2, 4, 2, 33, 47, 16, 16, "causal&padding", 13), torch.float32, TILES[0], mod)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["none", "window_5_2_tl", "document_causal"])
@pytest.mark.parametrize("mod", list(_score_mods(4)))
def test_score_modifiers_with_masks(mod, kind, dtype):
    _check(Case(2, 4, 2, 47, 40, 32, 32, kind, 14), dtype, TILES[1], _score_mods(4)[mod])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D,Dv", [(128, 128), (96, 64), (256, 256)], ids=lambda d: str(d))
def test_large_and_padded_head_dims(D, Dv, dtype):
    # 128 and 256 as they are; 96 padded to a 128-wide tile and Dv = 64 beside it.
    _check(Case(1, 2, 1, 40, 37, D, Dv, "causal&padding", 15), dtype, TILES[0])


def test_head_dims_past_256_are_refused():
    q = torch.randn(1, 1, 8, 320, device=DEVICE)
    with pytest.raises(mh.BackendRefusedError, match="head dim 320 > 256"):
        mh.attention(q, q, q, backend=NAME)


def _combinations(B: int, Lq: int, Lk: int) -> dict:
    ids = torch.tensor([0] * 20 + [1] * 25 + [2] * (Lq - 45))
    lengths = torch.tensor([Lk, Lk - 30])
    pad = torch.rand(B, Lk, generator=torch.Generator().manual_seed(2)) > 0.7
    return {
        "five leaves": (mh.causal() & mh.sliding_window(20))
        | (mh.document(ids) & ~mh.key_padding(lengths))
        | mh.key_padding([3, 0]),
        "pad table & window": mh.key_padding(pad=pad) & mh.sliding_window(9, 4),
        "unsorted documents": mh.document(ids[torch.randperm(Lq, generator=torch.Generator().manual_seed(3))]),
        "per-sequence causal | prefix": mh.causal(q_lengths=[Lq, 50], kv_lengths=lengths) | mh.prefix_lm([4, 9]),
        "document_causal & window, shifted": (
            mh.document_causal(torch.cat([ids, ids[-3:]]), torch.cat([ids, ids[-5:]])) & mh.sliding_window(7)
        ).shifted(3, 5, q_len=Lq + 3, kv_len=Lk + 5),
        "not (window | padding)": ~(mh.sliding_window(5) | ~mh.key_padding(lengths)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_combinations(2, 70, 70)))
def test_combinations_of_every_leaf_kind(kind):
    B, Lq, Lk = 2, 70, 70
    mask = _combinations(B, Lq, Lk)[kind]
    case = Case(B, 4, 2, Lq, Lk, 32, 32, "none", 11)
    _use_tiles(TILES[0])
    q, k, v, _ = make_inputs(case, dtype=torch.float32)
    got = mh.attention(*(t.to(DEVICE) for t in (q, k, v)), mask=mask, backend=NAME, return_lse=True)
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask)
    base = naive_attention(q, k, v, mask)
    assert_relative(got.output.cpu(), ref.output, base, _factor(torch.float32))
    assert torch.equal(torch.isneginf(got.lse.cpu()), torch.isneginf(ref.lse))


def test_fully_masked_rows_and_unseen_keys_have_zero_output_and_zero_gradients():
    # Batch element 1 sees no key at all; in element 0, rows 0..3 of the shifted window see no key
    # (theirs would be negative) and rows from 27 on none (theirs are past the padding length 20).
    # Keys past the padding length are seen by nobody: their gradients are exactly zero.
    _use_tiles(TILES[0])
    B, Hq, Hkv, Lq, Lk, D = 2, 2, 1, 37, 29, 16
    mask = mh.sliding_window(3, 0, align="top_left").shifted(-4, 0) & mh.key_padding([20, 0])
    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(B, h, L, D, generator=gen).to(DEVICE).requires_grad_() for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    )
    got = mh.attention(q, k, v, mask=mask, backend=NAME, return_lse=True)
    ref = mh.reference_attention(
        q.detach().double().cpu(), k.detach().double().cpu(), v.detach().double().cpu(), mask=mask
    )
    empty = torch.isneginf(ref.lse)
    assert empty[1].all() and empty[0, :, :4].all() and empty[0, :, 27:].all() and not empty[0, :, 4:27].any()
    out, lse = got.output.cpu(), got.lse.cpu()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    (got.output.square().sum() + got.lse.masked_fill(torch.isneginf(got.lse), 0).sum()).backward()
    dq, dk, dv = (t.grad.cpu() for t in (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    assert torch.equal(dk[0, :, 20:], torch.zeros_like(dk[0, :, 20:])) and torch.equal(dk[1], torch.zeros_like(dk[1]))
    assert torch.equal(dv[0, :, 20:], torch.zeros_like(dv[0, :, 20:])) and torch.equal(dv[1], torch.zeros_like(dv[1]))


def test_gqa_equals_mha_on_repeated_keys_and_values():
    _use_tiles(TILES[0])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 45, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 50, 16, generator=gen).to(DEVICE) for _ in range(2))
    mask = mh.causal() & mh.sliding_window(11)
    grouped = mh.attention(q, k, v, mask=mask, backend=NAME)
    repeated = mh.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask=mask, backend=NAME)
    assert torch.equal(grouped, repeated)  # the same tiles in the same order: the same bits


def test_non_contiguous_and_expanded_inputs():
    _use_tiles(TILES[1])
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 41, 3, 2, 16, generator=gen).to(DEVICE)  # packed (B, L, 3, H, D)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    v = torch.randn(2, 1, 41, 16, generator=gen).to(DEVICE).expand(2, 2, 41, 16)  # stride 0 over heads
    mask = mh.causal() & mh.key_padding([41, 30])
    got = mh.attention(q, k, v, mask=mask, backend=NAME)
    ref = mh.reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask=mask)
    torch.testing.assert_close(got.double().cpu(), ref.output, rtol=1e-5, atol=1e-5)


def _alibi(heads: int):
    from multihead.positions import ALiBi

    return ALiBi(heads)


def _trainable_t5(heads: int):
    from multihead.positions.relative_bias import BucketedBias

    weight = torch.randn(8, heads, requires_grad=True)
    return BucketedBias(weight, bidirectional=True, num_buckets=8, max_distance=20)


@pytest.mark.parametrize(
    "why,kwargs",
    [
        ("custom", dict(mask=mh.custom(lambda b, h, q, kv: (q + kv) % 3 != 0))),
        ("tensor", dict(mask=torch.ones(9, 9, dtype=torch.bool).tril())),
        ("position tensors", dict(mask=mh.causal().at(torch.arange(9), torch.arange(9), q_len=9, kv_len=9))),
        ("tensor bias", dict(score_mod=mh.scores.bias(torch.randn(9, 9)))),
        ("a user function", dict(score_mod=lambda s, b, h, q, kv: s * 2)),
        ("two softcaps", dict(score_mod=[mh.scores.softcap(2.0), mh.scores.softcap(3.0)])),
        ("bias around a softcap", dict(score_mod=[_alibi(2), mh.scores.softcap(3.0), _alibi(2)])),
        ("trainable bias", dict(score_mod=_trainable_t5(2))),
        ("dropout", dict(dropout_p=0.1)),
        ("float64", dict(dtype=torch.float64)),
        (
            "six leaves",
            dict(
                mask=mh.causal()
                & mh.key_padding([5])
                & mh.sliding_window(2)
                & mh.causal("top_left")
                & mh.key_padding([7])
                & mh.sliding_window(4, 1)
            ),
        ),
    ],
)
def test_refusals_name_the_reason(why, kwargs):
    dtype = kwargs.pop("dtype", torch.float32)
    q = torch.randn(1, 2, 9, 16, dtype=dtype, device=DEVICE)
    call = validate_call(
        q, q, q, mask=kwargs.get("mask"), score_mod=kwargs.get("score_mod"), scale=None,
        dropout_p=kwargs.get("dropout_p", 0.0), dropout_mask=None, return_weights=False, return_lse=False,
    )  # fmt: skip
    reasons = mh.get_backend(NAME).refusals(call)
    assert reasons, why
    with pytest.raises(mh.BackendRefusedError, match=NAME):
        mh.attention(q, q, q, backend=NAME, **kwargs)


def test_on_the_cpu_it_refuses_outside_the_test_switch_and_auto_never_takes_it():
    if DEVICE != "cpu":
        pytest.skip("the CPU switch matters where the kernels run in the interpreter")
    q = torch.randn(1, 1, 8, 16)
    with triton_blocks._cpu_interpreter():
        pass  # leaving the switch restores what was before (on, inside this module's fixture)
    assert triton_blocks._CPU_INTERPRETER
    triton_blocks._CPU_INTERPRETER = False
    try:
        with pytest.raises(mh.BackendRefusedError, match="device type 'cpu'"):
            mh.attention(q, q, q, backend=NAME)
    finally:
        triton_blocks._CPU_INTERPRETER = True
    assert NAME not in mh.backends.AUTO_ORDER
