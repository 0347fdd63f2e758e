"""The ``flex`` backend (compiled FlexAttention) against the fp64 reference. Compiling takes
10-60 s per mask on a 2-core CPU, so these tests are in the slow tier (``make test-slow``)."""

import pytest
import torch
from matrix import factor

import multihead as mh
from helpers import assert_relative, naive_attention

pytestmark = pytest.mark.slow

MASKS = {
    "causal": lambda B, L: mh.causal(),
    "window": lambda B, L: mh.sliding_window(30),
    "padding_with_empty_batch": lambda B, L: mh.key_padding(torch.tensor([L, 0])),
    "documents&causal": lambda B, L: (
        mh.document(torch.sort(torch.randint(0, 3, (B, L), generator=torch.Generator().manual_seed(0))).values)
        & mh.causal()
    ),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_flex_forward_matches_reference(name):
    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, L, D = 2, 4, 2, 200, 32
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h in (Hq, Hkv, Hkv))
    mask = MASKS[name](B, L)
    got = mh.attention(q, k, v, mask=mask, backend="flex", return_lse=True)
    ref = mh.reference_attention(q.double(), k.double(), v.double(), mask=mask)
    assert_relative(got.output, ref.output, naive_attention(q, k, v, mask), factor("flex", torch.float32))
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref.lse))


def test_flex_is_never_chosen_by_auto_on_cpu_and_refuses_backward():
    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    report = mh.explain(q, q, q, mask=mh.sliding_window(8))
    assert report.backend != "flex"
    with pytest.raises(mh.BackendRefusedError, match="inference only"):
        mh.attention(q, q, q, mask=mh.causal(), backend="flex")


def test_flex_runs_score_modifiers_through_its_score_mod():
    gen = torch.Generator().manual_seed(2)
    B, Hq, Hkv, L, D = 1, 4, 2, 130, 16
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h in (Hq, Hkv, Hkv))
    bias = torch.randn(1, Hq, L, L, generator=gen)
    mods = [mh.scores.bias(bias), mh.scores.softcap(2.0)]
    got = mh.attention(q, k, v, mask=mh.causal(), score_mod=mods, backend="flex", return_lse=True)
    ref = mh.reference_attention(
        q.double(),
        k.double(),
        v.double(),
        mask=mh.causal(),
        score_mod=[mh.scores.bias(bias.double()), mh.scores.softcap(2.0)],
    )
    base = naive_attention(q, k, v, mh.causal(), score_mod=mods)
    assert_relative(got.output, ref.output, base, factor("flex", torch.float32))
    torch.testing.assert_close(got.lse.double(), ref.lse, rtol=1e-5, atol=1e-5)


@pytest.fixture
def more_compiles():
    """Each modifier is a new compile of flex_attention: after the other tests of this file the
    default recompile limit (8) is reached and the backend refuses, as it should. Raised here."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.mark.parametrize("kind", ["alibi", "t5", "user", "alibi+softcap+sinks"])
def test_flex_runs_position_biases_and_user_functions_bottom_right(kind, more_compiles):
    from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes

    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Lq, Lk, D = 1, 4, 2, 70, 150, 16  # Lq != Lk: the bias must use the bottom-right alignment
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    slopes = alibi_slopes(Hq).float()
    torch.manual_seed(0)
    rel = RelativePositionBias(Hq, bidirectional=False)
    mods, extra = {
        "alibi": ([ALiBi(Hq)], {}),
        "t5": ([rel()], {}),
        "user": ([lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi - (Lk - Lq))], {}),
        "alibi+softcap+sinks": ([ALiBi(Hq)], {"softcap": 3.0, "sinks": torch.linspace(-1.0, 1.0, Hq)}),
    }[kind]
    with torch.no_grad():
        got = mh.attention(q, k, v, mask=mh.causal(), score_mod=mods, backend="flex", return_lse=True, **extra)
        ref_extra = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in extra.items()}
        ref = mh.attention(
            q.double(),
            k.double(),
            v.double(),
            mask=mh.causal(),
            score_mod=mods,
            backend="reference",
            return_lse=True,
            **ref_extra,
        )
    torch.testing.assert_close(got.output.double(), ref.output, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.lse.double(), ref.lse, rtol=2e-5, atol=2e-5)
