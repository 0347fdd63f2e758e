"""Rotary position embeddings: each scaling against its published formula written out plainly here
(and against Hugging Face's ``ROPE_INIT_FUNCTIONS`` when ``transformers`` is importable), the
relative-position property, the layer seam (shifted positions, per-row positions, packed documents,
cached decoding), the two layouts, partial rotary, precision, strides and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import DEVICES, assert_relative, optional
from multihead.caches import DynamicKVCache
from multihead.positions.rotary import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    RotaryEmbedding,
    YaRNScaling,
    apply_rotary,
)

DT = torch.float64


# ------------------------------------------------------------------ the independent formulas
def plain_frequencies(spec: dict | None, rotary_dim: int, base: float, seq_len: int) -> tuple[list[float], float]:
    """θ_i and the cos/sin factor of the published formulas, in Python floats, from a HF-style dict."""
    half = rotary_dim // 2
    theta = [1.0 / base ** (2 * i / rotary_dim) for i in range(half)]
    if spec is None:
        return theta, 1.0
    kind, f = spec.get("rope_type", spec.get("type")), spec["factor"]
    if kind == "linear":  # Chen et al.: positions / f
        return [t / f for t in theta], 1.0
    if kind == "dynamic":  # u/emozilla: a larger base once the sequence outgrows the original context
        m = spec["original_max_position_embeddings"]
        if seq_len <= m:
            return theta, 1.0
        new_base = base * (f * seq_len / m - (f - 1)) ** (rotary_dim / (rotary_dim - 2))
        return [1.0 / new_base ** (2 * i / rotary_dim) for i in range(half)], 1.0
    if kind == "llama3":  # Meta's apply_scaling, one frequency at a time
        m, low, high = spec["original_max_position_embeddings"], spec["low_freq_factor"], spec["high_freq_factor"]
        out = []
        for t in theta:
            wavelength = 2 * math.pi / t
            if wavelength < m / high:
                out.append(t)
            elif wavelength > m / low:
                out.append(t / f)
            else:
                smooth = (m / wavelength - low) / (high - low)
                out.append((1 - smooth) * t / f + smooth * t)
        return out, 1.0
    assert kind == "yarn"
    m = spec["original_max_position_embeddings"]
    fast, slow = spec.get("beta_fast", 32), spec.get("beta_slow", 1)

    def pair_index(turns):  # the (fractional) i with m·θ_i = 2π·turns, i.e. base^(2i/rd) = m / (2π·turns)
        return (rotary_dim / 2) * math.log(m / (2 * math.pi * turns), base)

    lo, hi = pair_index(fast), pair_index(slow)
    if spec.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    out = []
    for i, t in enumerate(theta):
        ramp = 0.0 if i <= lo else 1.0 if i >= hi else (i - lo) / (hi - lo)  # 0 extrapolate, 1 interpolate
        out.append(t * (1 - ramp) + (t / f) * ramp)
    if "attention_factor" in spec:
        return out, spec["attention_factor"]
    if "mscale" in spec:
        return out, (0.1 * spec["mscale"] * math.log(f) + 1) / (0.1 * spec["mscale_all_dim"] * math.log(f) + 1)
    return out, 0.1 * math.log(f) + 1


def plain_rotate(x, positions, theta, factor=1.0, *, interleaved=False, rotary_dim=None):
    """``x (B, H, L, D)`` rotated in fp64, one pair of features at a time."""
    D = x.shape[-1]
    rotary_dim = D if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    pos = positions.double().expand(x.shape[0], x.shape[2])  # (B, L)
    x = x.double()
    out = x.clone()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c = (torch.cos(pos * theta[i]) * factor)[:, None]  # (B, 1, L)
        s = (torch.sin(pos * theta[i]) * factor)[:, None]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


# Each case: the module's scaling object, the same as a HF dict (read by plain_frequencies), and the
# original context m, small enough that every band of the rule is exercised at D = 32.
M = 256
CASES = {
    "none": (None, None),
    "linear": (LinearScaling(4.0), {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (
        DynamicNTKScaling(2.0, M),
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": M},
    ),
    "yarn": (YaRNScaling(8.0, M), {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": M}),
    "yarn-mscale": (
        YaRNScaling(40.0, M, mscale=0.707, mscale_all_dim=1.0),
        {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": M,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    "yarn-untruncated": (
        YaRNScaling(32.0, M, beta_fast=16.0, beta_slow=2.0, truncate=False),
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": M,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
    ),
    "yarn-attention-factor": (
        YaRNScaling(4.0, M, attention_factor=1.5),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": M, "attention_factor": 1.5},
    ),
    "llama3": (
        Llama3Scaling(8.0, 1.0, 4.0, M),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": M,
        },
    ),
}
STATIC = [name for name in CASES if name != "dynamic"]  # frequencies that do not depend on the call
LAYOUTS = {"half": False, "interleaved": True}


def _x(*shape, dtype=DT, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------ the published formulas
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotary_dim", [32, 12], ids=["full", "partial12"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_rotation_equals_the_published_formula(case, layout, rotary_dim, device):
    """The rotation on ``device`` against the formula on CPU."""
    scaling, spec = CASES[case]
    rope = RotaryEmbedding(32, base=500.0, rotary_dim=rotary_dim, interleaved=LAYOUTS[layout], scaling=scaling)
    rope.to(device)
    x = _x(2, 3, 7, 32)
    # per-row positions; the second call reaches past m (dynamic NTK rescales there)
    for positions in (
        torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 9, 10, 11, 12]]),
        torch.tensor([[3, 50, 51, 52, 200, 255, 17], [700, 701, 702, 703, 704, 705, 1000]]),
    ):
        seq_len = int(positions.max()) + 1
        theta, factor = plain_frequencies(spec, rotary_dim, 500.0, seq_len)
        expected = plain_rotate(x, positions, theta, factor, interleaved=LAYOUTS[layout], rotary_dim=rotary_dim)
        got = rope(x.to(device), positions.to(device)).cpu()
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if c != "none"])
def test_each_scaling_changes_some_frequencies_and_keeps_the_fastest(case):
    """The cases above are not vacuous: at D = 32, m = 256 each rule moves some θ_i and (except
    linear) keeps the highest frequency, and the ramps/bands have interior points."""
    scaling, spec = CASES[case]
    rope = RotaryEmbedding(32, base=500.0, scaling=scaling)
    theta = torch.tensor(plain_frequencies(None, 32, 500.0, 1)[0], dtype=DT)
    scaled, _ = rope.frequencies(4 * M)
    ratio = theta / scaled  # 1: kept, factor: interpolated
    assert (ratio > 1 + 1e-9).any()
    if case == "linear":
        torch.testing.assert_close(ratio, torch.full_like(ratio, 4.0))
    else:
        assert ratio[0] == pytest.approx(1.0, rel=1e-12)  # θ_0 = 1 turns fastest and is never scaled
    if case in ("yarn", "llama3"):
        f = spec["factor"]
        assert ((ratio > 1 + 1e-9) & (ratio < f - 1e-9)).any()  # a smoothed band
        assert ratio[-1] == pytest.approx(f, rel=1e-12)  # the slowest pair fully interpolated


@pytest.mark.parametrize("case", [c for c in CASES if c != "none"])
def test_a_hugging_face_dict_equals_the_dataclass(case):
    scaling, spec = CASES[case]
    spec = dict(spec, rope_theta=500.0)
    if case == "dynamic":  # HF's dynamic dict has no original length: it is config.max_position_embeddings
        spec.pop("original_max_position_embeddings")
    rope = RotaryEmbedding(32, base=500.0, scaling=spec, max_position_embeddings=M)
    assert rope.scaling == scaling
    assert RotaryEmbedding(32, scaling={"rope_type": "default", "rope_theta": 10000.0}).scaling is None


class _HFConfig:
    """The attributes that ``ROPE_INIT_FUNCTIONS`` read from a model config, already standardized."""

    def __init__(self, head_dim, max_position_embeddings, rope_parameters):
        self.head_dim, self.hidden_size, self.num_attention_heads = head_dim, 4 * head_dim, 4
        self.max_position_embeddings, self.rope_parameters = max_position_embeddings, rope_parameters

    def standardize_rope_params(self):
        pass


HF_CASES = {  # (head_dim, base, max_position_embeddings, rope_scaling, partial_rotary_factor), after shipped configs
    "linear-factor8": (128, 10000.0, 16384, {"type": "linear", "factor": 8.0}, 1.0),
    "linear-partial": (64, 10000.0, 4096, {"rope_type": "linear", "factor": 2.0}, 0.25),
    "dynamic": (128, 10000.0, 4096, {"type": "dynamic", "factor": 2.0}, 1.0),
    "yarn-qwen2.5": (128, 1e6, 131072, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1.0),
    "yarn-deepseek-v3": (
        64,
        10000.0,
        163840,
        {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        1.0,
    ),
    "yarn-mscale-ratio": (
        64,
        10000.0,
        163840,
        {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.5,
        },
        1.0,
    ),
    "yarn-gpt-oss": (
        64,
        150000.0,
        131072,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        1.0,
    ),
    "llama3.1": (
        128,
        500000.0,
        131072,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        1.0,
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_frequencies_equal_hugging_face_rope_init_functions(case):
    rope_utils = optional("transformers.modeling_rope_utils", "the Hugging Face cross-check is skipped")
    head_dim, base, max_pos, scaling, partial = HF_CASES[case]
    kind = scaling.get("rope_type", scaling.get("type"))
    rope = RotaryEmbedding(
        head_dim, base=base, rotary_dim=int(head_dim * partial), scaling=dict(scaling), max_position_embeddings=max_pos
    )
    params = dict(scaling, rope_type=kind, rope_theta=base, partial_rotary_factor=partial)
    for seq_len in (None, max_pos // 2, 3 * max_pos):  # dynamic NTK: below and beyond the original length
        hf_inv_freq, hf_factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](
            _HFConfig(head_dim, max_pos, dict(params)), "cpu", seq_len=seq_len
        )
        inv_freq, factor = rope.frequencies(seq_len)
        # HF computes in fp32, we in fp64: a few fp32 ulps apart
        torch.testing.assert_close(inv_freq.float(), hf_inv_freq, rtol=1e-6, atol=0)
        assert factor == pytest.approx(hf_factor, rel=1e-12)
    if kind == "dynamic":
        assert not torch.allclose(rope.frequencies(3 * max_pos)[0], rope.frequencies(max_pos)[0])


def test_hugging_face_half_split_convention():
    """Half-split is HF's ``q·cos + rotate_half(q)·sin`` with ``cos = cat(cos(pθ), cos(pθ))·factor``."""
    rope = RotaryEmbedding(16, scaling=YaRNScaling(4.0, 64))
    q, positions = _x(2, 3, 5, 16), torch.tensor([[0, 1, 2, 3, 4], [90, 91, 92, 93, 94]])
    inv_freq, factor = rope.frequencies()
    freqs = positions.double()[..., None] * inv_freq  # (B, L, 8)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, 16)
    rotate_half = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    torch.testing.assert_close(rope(q, positions), q * emb.cos() * factor + rotate_half * emb.sin() * factor)


# ------------------------------------------------------------------ relative positions
def _scores(rope, q, k, q_pos, k_pos):
    return rope(q, q_pos) @ rope(k, k_pos).transpose(-2, -1)  # (B, H, Lq, Lk)


RELATIVE = [(case, layout, 32) for case in STATIC for layout in LAYOUTS] + [
    (case, layout, 10) for case in ("none", "yarn", "llama3") for layout in LAYOUTS
]  # partial rotary


@pytest.mark.parametrize("case, layout, rotary_dim", RELATIVE, ids=[f"{c}-{lay}-rd{rd}" for c, lay, rd in RELATIVE])
def test_scores_depend_only_on_the_relative_position(case, layout, rotary_dim):
    rope = RotaryEmbedding(32, base=500.0, rotary_dim=rotary_dim, interleaved=LAYOUTS[layout], scaling=CASES[case][0])
    q, k = _x(2, 2, 6, 32, seed=1), _x(2, 2, 9, 32, seed=2)
    q_pos, k_pos = torch.tensor([3, 4, 5, 9, 10, 20]), torch.arange(9) * 3
    base = _scores(rope, q, k, q_pos, k_pos)
    for shift in (1, 250, 1234):
        torch.testing.assert_close(_scores(rope, q, k, q_pos + shift, k_pos + shift), base, rtol=1e-9, atol=1e-9)
    # and the positions matter: a relative change does change the scores
    assert not torch.allclose(_scores(rope, q, k, q_pos + 1, k_pos), base)


@pytest.mark.parametrize("case", list(CASES))
def test_within_one_call_scores_are_toeplitz(case):
    """One query vector and one key vector at L consecutive positions: score[i, j] depends on i - j
    only. This holds for dynamic NTK too, whose frequencies are those of the call's length."""
    rope = RotaryEmbedding(32, base=500.0, scaling=CASES[case][0])
    q, k = _x(1, 1, 1, 32, seed=3).expand(1, 1, 12, 32), _x(1, 1, 1, 32, seed=4).expand(1, 1, 12, 32)
    for offset in (0, 3 * M):
        positions = torch.arange(12) + offset
        s = _scores(rope, q, k, positions, positions)[0, 0]  # (12, 12)
        torch.testing.assert_close(s[1:, 1:], s[:-1, :-1], rtol=1e-9, atol=1e-9)


def test_dynamic_ntk_depends_on_the_call_length():
    rope = RotaryEmbedding(32, base=500.0, scaling=DynamicNTKScaling(2.0, M))
    q, k = _x(1, 2, 5, 32, seed=5), _x(1, 2, 5, 32, seed=6)
    pos = torch.arange(5)
    base = _scores(rope, q, k, pos, pos)
    # within the original context the plain RoPE: shift-invariant
    torch.testing.assert_close(_scores(rope, q, k, pos + M - 5, pos + M - 5), base, rtol=1e-9, atol=1e-9)
    # beyond it the base grows with max(positions) + 1, so the same offsets score differently
    assert not torch.allclose(_scores(rope, q, k, pos + 2 * M, pos + 2 * M), base, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ through the layer
E, H, D = 32, 4, 8


def _layer(rope, *, Hkv=2, dtype=DT, seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(E, H, num_kv_heads=Hkv, causal=True, rope=rope, dtype=dtype).eval()


ROPES = {
    "plain": lambda: RotaryEmbedding(D),
    "partial-interleaved": lambda: RotaryEmbedding(D, rotary_dim=4, interleaved=True),
    "yarn": lambda: RotaryEmbedding(
        D, base=1000.0, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ),
    "llama3": lambda: RotaryEmbedding(D, base=1000.0, scaling=Llama3Scaling(8.0, 1.0, 4.0, 64)),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_layer_output_is_unchanged_when_all_positions_shift(rope):
    layer = _layer(ROPES[rope]())
    x = _x(2, 7, E)
    positions = torch.arange(7)
    out = layer(x, positions=positions)
    for shifted in (positions + 5, positions + 1000, (positions + torch.tensor([[3], [77]]))):  # (L,) and (B, L)
        torch.testing.assert_close(layer(x, positions=shifted), out)
    assert not torch.allclose(layer(x, positions=positions.flip(0)), out)  # positions are used


def test_layer_per_row_positions_equal_running_each_row_alone():
    layer = _layer(RotaryEmbedding(D, base=1000.0))
    x = _x(3, 6, E, seed=7)
    positions = torch.tensor(
        [[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3], [40, 41, 42, 43, 44, 45]]
    )  # left padding in row 1
    out = layer(x, positions=positions)
    for b in range(3):
        torch.testing.assert_close(out[b : b + 1], layer(x[b : b + 1], positions=positions[b]))


def test_packed_documents_with_restarting_positions_equal_separate_documents():
    layer = _layer(RotaryEmbedding(D))
    lengths = [5, 3, 4]
    x = _x(1, sum(lengths), E, seed=8)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))  # (L,)
    positions = torch.cat([torch.arange(n) for n in lengths])  # 0..4, 0..2, 0..3
    packed = layer(x, positions=positions, mask=mh.document(ids))  # & causal() from the layer
    separate = torch.cat([layer(part) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, separate)


SCHEDULES = {"prefill+steps": [5, 1, 1, 1, 1], "chunked": [3, 4, 1, 2], "steps-only": [1] * 6}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 300])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("dtype", [torch.float32, DT], ids=["fp32", "fp64"])
@pytest.mark.parametrize("rope", ["plain", "partial-interleaved", "yarn"])
def test_cached_decoding_equals_the_full_forward(rope, dtype, schedule, offset, device):
    layer = _layer(ROPES[rope](), dtype=dtype).to(device)
    chunks = SCHEDULES[schedule]
    L = sum(chunks)
    x = _x(2, L, E, dtype=dtype, seed=9).to(device)
    positions = torch.arange(L, device=device) + offset
    with torch.no_grad():
        full = layer(x, positions=positions) if offset else layer(x)  # default positions: arange(L)
        cache, outs, t = DynamicKVCache(), [], 0
        for n in chunks:
            step = positions[t : t + n] if offset else None  # default with a cache: cache.length + arange(n)
            outs.append(layer(x[:, t : t + n], kv_cache=cache, positions=step))
            t += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full)
    assert layer.rope.cos_cached.shape[0] >= L + offset


# ------------------------------------------------------------------ layouts and partial rotary
def _to_interleaved_order(rotary_dim: int, head_dim: int) -> list[int]:
    """Feature ``j`` of an interleaved head is feature ``order[j]`` of the half-split head:
    (0, R, 1, R+1, ...), then the pass-through features in place."""
    half = rotary_dim // 2
    return [i for pair in zip(range(half), range(half, rotary_dim)) for i in pair] + list(range(rotary_dim, head_dim))


@pytest.mark.parametrize("rotary_dim", [D, 4], ids=["full", "partial4"])
def test_half_split_equals_interleaved_after_permuting_q_and_k_projections(rotary_dim):
    """Meta's Llama checkpoints rotate (2i, 2i+1), HF's converted ones (i, i+R): the same model after
    permuting each head's output features of q_proj and k_proj (weights and biases)."""
    half = _layer(RotaryEmbedding(D, base=100.0, rotary_dim=rotary_dim))
    inter = _layer(RotaryEmbedding(D, base=100.0, rotary_dim=rotary_dim, interleaved=True))
    order = torch.tensor(_to_interleaved_order(rotary_dim, D))
    with torch.no_grad():
        inter.load_state_dict(half.state_dict())
        for proj, heads in ((inter.q_proj, H), (inter.k_proj, 2)):
            rows = (torch.arange(heads)[:, None] * D + order).flatten()  # per head: h·D + order
            proj.weight.copy_(proj.weight[rows])
            proj.bias.copy_(proj.bias[rows])
    x, positions = _x(2, 6, E, seed=10), torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    torch.testing.assert_close(inter(x, positions=positions), half(x, positions=positions))
    unpermuted = _layer(RotaryEmbedding(D, base=100.0, rotary_dim=rotary_dim, interleaved=True))
    assert not torch.allclose(unpermuted(x, positions=positions), half(x, positions=positions))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, DT], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_partial_rotary_passes_the_other_features_through_bit_identical(layout, dtype):
    rope = RotaryEmbedding(16, rotary_dim=6, interleaved=LAYOUTS[layout])
    x = _x(2, 5, 3, 16, dtype=dtype).transpose(1, 2)  # (B, H, L, D), non-contiguous
    out = rope(x, torch.arange(5) + 11)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out[..., 6:], x[..., 6:])
    assert not torch.equal(out[..., :6], x[..., :6])
    # the rotated part is the full rotation of a 6-dim head
    full6 = RotaryEmbedding(
        6, interleaved=LAYOUTS[layout]
    )  # θ_i = base^(-2i/rotary_dim), as HF's partial_rotary_factor
    torch.testing.assert_close(out[..., :6], full6(x[..., :6].contiguous(), torch.arange(5) + 11))


# ------------------------------------------------------------------ precision and strides
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_half_precision_error_is_within_the_relative_rule(layout, dtype, device):
    """``err(out) <= 2 · err(naive in dtype) + floor`` against fp64 from the same rounded input
    (the rotation on ``device``, the reference and the baseline on CPU)."""
    rope = RotaryEmbedding(64, interleaved=LAYOUTS[layout]).to(device)
    x = _x(2, 3, 33, 64, dtype=dtype, seed=11)
    positions = torch.randint(0, 4000, (2, 33), generator=torch.Generator().manual_seed(12))
    theta, _ = plain_frequencies(None, 64, 10000.0, 1)
    ref = plain_rotate(x, positions, theta, interleaved=LAYOUTS[layout])
    # the naive baseline: tables rounded to dtype, every product and sum in dtype
    angle = positions.double()[:, None, :, None] * torch.tensor(theta, dtype=DT)  # (B, 1, L, 32)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    a, b = (x[..., 0::2], x[..., 1::2]) if LAYOUTS[layout] else (x[..., :32], x[..., 32:])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    naive = torch.stack((ra, rb), -1).flatten(-2) if LAYOUTS[layout] else torch.cat((ra, rb), -1)
    out = rope(x.to(device), positions.to(device)).cpu()
    assert out.dtype == dtype
    assert_relative(out, ref, naive, factor=2.0)


def test_non_contiguous_inputs_give_the_contiguous_result():
    rope = RotaryEmbedding(16, rotary_dim=10)
    positions = torch.tensor([4, 5, 6, 7, 100])
    expected = lambda t: rope(t.contiguous(), positions)  # noqa: E731
    transposed = _x(2, 5, 3, 16).transpose(1, 2)  # (B, H, L, D) from (B, L, H, D)
    expanded = _x(2, 1, 5, 16).expand(2, 3, 5, 16)  # stride 0 over heads (MQA keys repeated)
    sliced = _x(2, 3, 5, 40)[..., 7:23]  # a packed-QKV-like slice of the features
    strided_l = _x(2, 3, 10, 16)[:, :, ::2]
    for x in (transposed, expanded, sliced, strided_l):
        assert not x.is_contiguous()
        assert torch.equal(rope(x, positions), expected(x))
    # per-row positions as an expanded view, and tables as views
    rows = positions.expand(2, 5)
    assert torch.equal(rope(transposed, rows), expected(transposed))
    cos, sin = torch.rand(5, 8, dtype=DT).t().contiguous().t(), torch.rand(5, 8, dtype=DT)
    torch.testing.assert_close(
        apply_rotary(transposed, cos.expand(2, 5, 8), sin.expand(2, 5, 8)),
        apply_rotary(transposed.contiguous(), cos.contiguous(), sin),
    )


def test_apply_rotary_matches_the_plain_formula_with_either_table_shape():
    x = _x(2, 3, 5, 8)
    positions = torch.tensor([[1, 2, 3, 4, 5], [9, 9, 10, 11, 12]])
    theta = [0.9, 0.3, 0.1]
    angle = positions.double()[..., None] * torch.tensor(theta, dtype=DT)  # (B, L, 3)
    for interleaved in (False, True):
        out = apply_rotary(x, angle.cos(), angle.sin(), interleaved=interleaved, rotary_dim=6)
        torch.testing.assert_close(out, plain_rotate(x, positions, theta, interleaved=interleaved, rotary_dim=6))
        shared = apply_rotary(x, angle[0].cos(), angle[0].sin(), interleaved=interleaved, rotary_dim=6)  # (L, R)
        torch.testing.assert_close(shared, plain_rotate(x, positions[0], theta, interleaved=interleaved, rotary_dim=6))
    y = _x(7, 5, 8)  # any leading dims with an (L, R) table
    torch.testing.assert_close(
        apply_rotary(y, angle[0].cos(), angle[0].sin(), rotary_dim=6),
        plain_rotate(y[:, None], positions[0], theta, rotary_dim=6)[:, 0],
    )


def test_gradients_flow_through_the_rotation():
    rope = RotaryEmbedding(8, rotary_dim=6)
    x = _x(1, 2, 3, 8).requires_grad_()
    torch.autograd.gradcheck(lambda t: rope(t, torch.tensor([0, 5, 9])), (x,))


def test_tables_built_under_inference_mode_serve_training():
    rope = RotaryEmbedding(8)
    with torch.inference_mode():
        rope(_x(1, 2, 3, 8, dtype=torch.float32), torch.arange(3))  # builds the tables
    x = _x(1, 2, 3, 8, dtype=torch.float32).requires_grad_()
    rope(x, torch.arange(3)).square().sum().backward()  # saves the tables for backward
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ------------------------------------------------------------------ the cached tables
def test_tables_grow_by_doubling_and_are_reused():
    rope = RotaryEmbedding(8)
    x1 = _x(1, 1, 1, 8, dtype=torch.float32)
    sizes = []
    for p in range(40):  # step-by-step decoding
        rope(x1, torch.tensor([p]))
        sizes.append(rope.cos_cached.shape[0])
    assert sorted(set(sizes)) == [1, 2, 4, 8, 16, 32, 64]
    table = rope.cos_cached
    rope(x1, torch.tensor([63]))
    assert rope.cos_cached is table  # long enough: not rebuilt
    assert rope.cos_cached.dtype == torch.float32
    sized = RotaryEmbedding(8, max_position_embeddings=128)
    sized(x1, torch.tensor([3]))
    assert sized.cos_cached.shape == (128, 4)


def test_buffers_are_not_persistent_and_survive_half():
    rope = RotaryEmbedding(8, scaling=YaRNScaling(4.0, 16))
    x32 = _x(1, 2, 4, 8, dtype=torch.float32)
    positions = torch.tensor([0, 7, 30, 200])
    reference32 = rope(x32, positions)
    assert rope.state_dict() == {}  # derived from the arguments: loads into any checkpoint
    layer = _layer(RotaryEmbedding(D))
    assert not any(key.startswith("rope.") for key in layer.state_dict())
    rope.half()
    assert rope.inv_freq.dtype == torch.float64  # not rounded to fp16
    fresh = RotaryEmbedding(8, scaling=YaRNScaling(4.0, 16))
    assert torch.equal(rope(x32.half(), positions), fresh(x32.half(), positions))
    assert torch.equal(rope(x32, positions), reference32)
    # an fp64 input after fp32 ones: the tables are rebuilt in fp64
    theta, factor = plain_frequencies(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 8, 10000.0, 1
    )
    torch.testing.assert_close(
        rope(x32.double(), positions), plain_rotate(x32, positions, theta, factor), rtol=1e-13, atol=1e-13
    )
    assert rope.cos_cached.dtype == torch.float64


# ------------------------------------------------------------------ bad input
def _rope8(**kw):
    return RotaryEmbedding(8, **kw)


X = torch.zeros(2, 3, 5, 8)
C = torch.zeros(5, 4)
BAD = [
    ("dim odd", lambda: RotaryEmbedding(7), ValueError, r"dim must be an even int >= 2.*got 7"),
    ("dim float", lambda: RotaryEmbedding(8.0), TypeError, r"dim must be an int .*got float"),
    (
        "rotary_dim too large",
        lambda: _rope8(rotary_dim=10),
        ValueError,
        r"rotary_dim must be even and in \[2, D=8\].*got 10",
    ),
    (
        "rotary_dim odd",
        lambda: _rope8(rotary_dim=5),
        ValueError,
        r"rotary_dim must be even.*got 5.*partial_rotary_factor",
    ),
    ("base 1", lambda: _rope8(base=1.0), ValueError, r"base must be a finite number > 1.*got 1.0"),
    ("interleaved str", lambda: _rope8(interleaved="gptj"), TypeError, r"interleaved must be a bool"),
    ("scaling str", lambda: _rope8(scaling="yarn"), TypeError, r"scaling must be None, a LinearScaling.*got str"),
    (
        "scaling unknown type",
        lambda: _rope8(scaling={"rope_type": "longrope", "factor": 2.0}),
        ValueError,
        r"unknown scaling rope_type 'longrope'.*expected one of \['default', 'linear', 'dynamic', 'yarn', 'llama3'\]",
    ),
    (
        "scaling without type",
        lambda: _rope8(scaling={"factor": 2.0}),
        ValueError,
        r"unknown scaling rope_type None.*hint",
    ),
    (
        "scaling typo key",
        lambda: _rope8(scaling={"type": "linear", "factor": 2.0, "fator": 3}),
        ValueError,
        r"unknown keys \['fator'\] in a 'linear' scaling",
    ),
    (
        "yarn without length",
        lambda: _rope8(scaling={"rope_type": "yarn", "factor": 4.0}),
        ValueError,
        r"needs original_max_position_embeddings.*hint: pass max_position_embeddings=",
    ),
    (
        "rope_theta disagrees",
        lambda: _rope8(scaling={"rope_type": "default", "rope_theta": 5e5}),
        ValueError,
        r"rope_theta=500000.0 but base=10000.0.*hint: pass base=500000.0",
    ),
    (
        "partial factor disagrees",
        lambda: _rope8(scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
        ValueError,
        r"partial_rotary_factor=0.5.*rotates int\(8 \* 0.5\) = 4 features, but rotary_dim=8.*rotary_dim=4",
    ),
    (
        "both type keys",
        lambda: _rope8(scaling={"rope_type": "yarn", "type": "linear", "factor": 2.0}),
        ValueError,
        r"rope_type='yarn' and type='linear'",
    ),
    (
        "dynamic with one pair",
        lambda: _rope8(rotary_dim=2, scaling=DynamicNTKScaling(2.0, 64)),
        ValueError,
        r"dynamic NTK scaling needs rotary_dim >= 4.*got rotary_dim=2",
    ),
    (
        "max positions 0",
        lambda: _rope8(max_position_embeddings=0),
        ValueError,
        r"max_position_embeddings must be a positive int",
    ),
    (
        "linear factor 0",
        lambda: LinearScaling(0.0),
        ValueError,
        r"LinearScaling: factor must be a finite number > 0, got 0.0",
    ),
    ("linear factor str", lambda: LinearScaling("2"), TypeError, r"LinearScaling: factor must be a number, got str"),
    (
        "dynamic length float",
        lambda: DynamicNTKScaling(2.0, 4096.0),
        TypeError,
        r"original_max_position_embeddings must be an int",
    ),
    (
        "yarn betas swapped",
        lambda: YaRNScaling(4.0, 4096, beta_fast=1, beta_slow=32),
        ValueError,
        r"beta_fast must be greater than beta_slow.*32 and 1",
    ),
    ("yarn lone mscale", lambda: YaRNScaling(4.0, 4096, mscale=0.7), ValueError, r"mscale needs mscale_all_dim"),
    (
        "llama3 bands swapped",
        lambda: Llama3Scaling(low_freq_factor=4.0, high_freq_factor=1.0),
        ValueError,
        r"high_freq_factor must be greater than low_freq_factor",
    ),
    (
        "x head dim",
        lambda: _rope8()(torch.zeros(2, 3, 5, 32), torch.arange(5)),
        ValueError,
        r"x must have the head dim D=8 as its last dim, got shape \(2, 3, 5, 32\).*RotaryEmbedding\(head_dim\)",
    ),
    (
        "x integer",
        lambda: _rope8()(torch.zeros(2, 3, 5, 8, dtype=torch.int64), torch.arange(5)),
        TypeError,
        r"x must be a floating-point tensor",
    ),
    (
        "positions float",
        lambda: _rope8()(X, torch.arange(5.0)),
        TypeError,
        r"positions must be an integer tensor \(L,\) = \(5,\) .*\(torch.int64\), got dtype torch.float32",
    ),
    (
        "positions bool",
        lambda: _rope8()(X, torch.ones(5, dtype=torch.bool)),
        TypeError,
        r"integer tensor.*got dtype torch.bool",
    ),
    (
        "positions list",
        lambda: _rope8()(X, [0, 1, 2, 3, 4]),
        TypeError,
        r"positions must be an integer tensor.*got list",
    ),
    (
        "positions shape",
        lambda: _rope8()(X, torch.arange(6)),
        ValueError,
        r"positions must have shape \(L,\) = \(5,\) or \(B, L\) = \(2, 5\).*got \(6,\)",
    ),
    (
        "positions (B, L) batch",
        lambda: _rope8()(X, torch.zeros(3, 5, dtype=torch.int64)),
        ValueError,
        r"positions must have shape.*got \(3, 5\)",
    ),
    (
        "positions negative",
        lambda: _rope8()(X, torch.tensor([-1, 0, 1, 2, 3])),
        ValueError,
        r"positions must be >= 0.*minimum of -1",
    ),
    (
        "table shape",
        lambda: apply_rotary(X, torch.zeros(5, 3), torch.zeros(5, 3)),
        ValueError,
        r"cos must have shape \(L, R\) = \(5, 4\) or \(B, L, R\) = \(2, 5, 4\).*got \(5, 3\).*rotary_dim=",
    ),
    (
        "table for 3-D x",
        lambda: apply_rotary(torch.zeros(3, 5, 8), torch.zeros(3, 5, 4), torch.zeros(3, 5, 4)),
        ValueError,
        r"cos must have shape \(L, R\) = \(5, 4\) for x of shape \(3, 5, 8\).*needs a 4-D",
    ),
    ("tables differ", lambda: apply_rotary(X, C, C.expand(2, 5, 4)), ValueError, r"cos and sin must have one shape"),
    ("apply rotary_dim odd", lambda: apply_rotary(X, C, C, rotary_dim=7), ValueError, r"rotary_dim must be even"),
    ("apply x 1-D", lambda: apply_rotary(torch.zeros(8), C, C), ValueError, r"x must have at least 2 dims"),
    ("apply integer table", lambda: apply_rotary(X, C.long(), C), TypeError, r"cos must be a floating-point tensor"),
]


@pytest.mark.parametrize("call, error, pattern", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_refused_with_a_clear_message(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_the_layer_reports_a_rope_for_the_wrong_head_dim():
    layer = mh.MultiHeadAttention(E, H, causal=True, rope=RotaryEmbedding(E))  # d_model instead of head_dim
    with pytest.raises(ValueError, match=r"head dim D=32 .*got shape \(2, 4, 3, 8\)"):
        layer(torch.zeros(2, 3, E))
