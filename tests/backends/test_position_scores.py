"""Position scores through every backend: ALiBi, T5's relative bias, softcap, attention sinks, a
user's ``score_mod`` closing over a trainable tensor, and chains of them, against the fp64
oracle: forward output, LSE, and the gradients of q, k, v and of the modifier's own tensors.

The oracle builds ALiBi and the T5 bias independently, as dense ``scores.bias`` tensors from the
aligned positions (query ``i`` at ``i + Lk - Lq`` bottom-right, at ``i`` top-left), and adds a
sink as what it is: one more logit in the softmax denominator with no value. The baseline of the
relative rule is the same computation done plainly in the test dtype.

The default tier runs a seeded covering subset of modifiers x masks x shapes x dtypes x backends;
the whole product is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from matrix import DEVICES, backend_params, factor, serve_or_skip

import multihead as mh
from helpers import LargestAllocation, aligned_distance, assert_relative, loop_bucket, paper_slopes
from multihead.blocks import Extent
from multihead.positions import ALiBi, BucketedBias, RelativePositionBias, alibi_slopes, relative_position_bucket
from multihead.scores import as_score_mod

BACKENDS = backend_params()
DT = torch.float64
DTYPES = [DT, torch.float32, torch.bfloat16]


# ------------------------------------------------------------------ independent dense biases
def dense_alibi(Hq: int, Lq: int, Lk: int, symmetric: bool, align: str) -> torch.Tensor:
    """``(1, Hq, Lq, Lk)`` fp64: ``m_h (j - i)`` or ``-m_h |j - i|``."""
    slopes = torch.tensor(paper_slopes(Hq), dtype=DT).view(-1, 1, 1)
    d = aligned_distance(Lq, Lk, align).to(DT)
    return (-slopes * d.abs() if symmetric else slopes * d).unsqueeze(0)


def dense_t5(
    table: torch.Tensor, Lq: int, Lk: int, bidirectional: bool, num_buckets: int, max_distance: int, align: str
) -> torch.Tensor:
    """``(1, Hq, Lq, Lk)``: ``table[bucket(j - i), h]`` by indexing (differentiable in ``table``)."""
    d = aligned_distance(Lq, Lk, align)
    lo = int(d.min())
    lookup = torch.tensor(
        [loop_bucket(x, bidirectional, num_buckets, max_distance) for x in range(lo, int(d.max()) + 1)]
    )
    return table[lookup[d - lo]].permute(2, 0, 1).unsqueeze(0)


# ------------------------------------------------------------------------ the modifier atoms
CAP = 2.0
T5_SETTINGS = {
    "t5": dict(bidirectional=True, num_buckets=16, max_distance=40, align="bottom_right"),
    "t5_causal_tl": dict(bidirectional=False, num_buckets=12, max_distance=30, align="top_left"),
}


def user_fn(w):
    """A user's modifier closing over ``w (Hq, 2)``: a per-head temperature and a term of the
    *absolute* positions (so a block evaluated at the wrong offset shows)."""

    def fn(score, b, h, q_idx, kv_idx):
        return score * (1 + 0.25 * torch.tanh(w[h, 0])) + w[h, 1] * ((q_idx * 3 + kv_idx) % 7 - 3).to(score.dtype) / 3

    return fn


class Built:
    """One case's modifiers, three times: for the backend under test (dtype T), for the fp64
    oracle (independent dense biases, fp64 leaves) and for the baseline (dtype T leaves)."""

    def __init__(self, atoms, Hq, Lq, Lk, dtype, seed, device="cpu"):
        gen = torch.Generator().manual_seed(seed)  # drawn on CPU, then moved to ``device``
        self.atoms, self.Hq, self.Lq, self.Lk = atoms, Hq, Lq, Lk
        self.mods, self.softcap, self.sinks, self.leaves, self.names = [], None, None, [], []
        for a in atoms:
            if a in T5_SETTINGS:
                s = T5_SETTINGS[a]
                rel = RelativePositionBias(
                    Hq,
                    num_buckets=s["num_buckets"],
                    max_distance=s["max_distance"],
                    bidirectional=s["bidirectional"],
                    align=s["align"],
                    dtype=dtype,
                ).to(device)
                with torch.no_grad():  # std 1 (not T5's 0.02): the bias matters
                    rel.weight.copy_(torch.randn(s["num_buckets"], Hq, generator=gen, dtype=DT))
                self.mods.append(rel())
                self._leaf(rel.weight, f"table[{a}]")
            elif a == "user":
                w = (torch.randn(Hq, 2, generator=gen, dtype=DT) * 0.5).to(dtype).to(device).requires_grad_()
                self.mods.append(user_fn(w))
                self._leaf(w, "user w")
            elif a == "sinks":
                self.sinks = torch.randn(Hq, generator=gen, dtype=DT).to(dtype).to(device).requires_grad_()
                self._leaf(self.sinks, "sinks")
            elif a == "softcap_kw":
                self.softcap = CAP
            else:
                self.mods.append(self._fixed(a)(Hq))

    def _leaf(self, t, name):
        self.leaves.append(t)
        self.names.append(name)

    @staticmethod
    def _fixed(a):
        return {
            "alibi": lambda H: ALiBi(H),
            "alibi_sym_tl": lambda H: ALiBi(H, symmetric=True, align="top_left"),
            "softcap": lambda H: mh.scores.softcap(CAP),
        }[a]

    def call_kwargs(self):
        """``mods`` (the score_mod list), softcap=, sinks= for mh.attention."""
        return dict(score_mod=self.mods or None, softcap=self.softcap, sinks=self.sinks)

    def declared_mods(self):
        """What a backend is asked to run (softcap= appended as attention() does), for serve_or_skip."""
        mods = list(self.mods) + ([mh.scores.softcap(self.softcap)] if self.softcap is not None else [])
        return mods or None

    def oracle_mods(self, leaves64):
        """fp64 modifiers with ALiBi and T5 as dense biases built here (leaves64 in self.leaves order)."""
        by_name = dict(zip(self.names, leaves64))
        out = []
        for a in self.atoms:
            if a == "alibi":
                out.append(mh.scores.bias(dense_alibi(self.Hq, self.Lq, self.Lk, False, "bottom_right")))
            elif a == "alibi_sym_tl":
                out.append(mh.scores.bias(dense_alibi(self.Hq, self.Lq, self.Lk, True, "top_left")))
            elif a in T5_SETTINGS:
                s = T5_SETTINGS[a]
                out.append(
                    mh.scores.bias(
                        dense_t5(
                            by_name[f"table[{a}]"],
                            self.Lq,
                            self.Lk,
                            s["bidirectional"],
                            s["num_buckets"],
                            s["max_distance"],
                            s["align"],
                        )
                    )
                )
            elif a == "user":
                out.append(user_fn(by_name["user w"]))
            elif a == "softcap":
                out.append(mh.scores.softcap(CAP))
        if "softcap_kw" in self.atoms:  # softcap= applies after every modifier
            out.append(mh.scores.softcap(CAP))
        return out or None, by_name.get("sinks")

    def baseline_mods(self, leaves_t):
        """The modifiers in dtype T on fresh leaves (ALiBi computed by the library: it is the same
        computation, done plainly)."""
        by_name = dict(zip(self.names, leaves_t))
        out = []
        for a in self.atoms:
            if a in T5_SETTINGS:
                s = T5_SETTINGS[a]
                out.append(
                    mh.scores.bias(
                        dense_t5(
                            by_name[f"table[{a}]"],
                            self.Lq,
                            self.Lk,
                            s["bidirectional"],
                            s["num_buckets"],
                            s["max_distance"],
                            s["align"],
                        )
                    )
                )
            elif a == "user":
                out.append(user_fn(by_name["user w"]))
            elif a in ("alibi", "alibi_sym_tl", "softcap"):
                out.append(self._fixed(a)(self.Hq))
        if "softcap_kw" in self.atoms:
            out.append(mh.scores.softcap(CAP))
        return out or None, by_name.get("sinks")


MODS = {
    "alibi": ["alibi"],
    "alibi_sym_tl": ["alibi_sym_tl"],
    "t5": ["t5"],
    "t5_causal_tl": ["t5_causal_tl"],
    "softcap": ["softcap_kw"],
    "sinks": ["sinks"],
    "user": ["user"],
    "[alibi,softcap]": ["alibi", "softcap"],
    "[user,alibi_sym_tl]": ["user", "alibi_sym_tl"],
    "[t5,softcap=]+sinks": ["t5", "softcap_kw", "sinks"],
}


# ------------------------------------------------------------------------------------ masks
def _mask(kind, B, Lq, Lk, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "causal_br":
        return mh.causal()
    if kind == "causal_tl":
        return mh.causal("top_left")
    if kind == "window&causal":
        return mh.sliding_window(37) & mh.causal()
    if kind == "padding_empty_batch":  # batch element 1 sees no key at all
        return mh.key_padding(torch.tensor([max(1, Lk - Lk // 3)] + [0] * (B - 1)))
    if kind == "document":  # 3 documents; a query document may be absent from the keys (empty rows)
        q_ids = torch.sort(torch.randint(0, 3, (B, Lq), generator=gen)).values
        kv_ids = torch.sort(torch.randint(0, 3, (B, Lk), generator=gen)).values
        return mh.document(q_ids, kv_ids)
    raise KeyError(kind)


MASKS = ["none", "causal_br", "causal_tl", "window&causal", "padding_empty_batch", "document"]
HEADS = [(8, 2), (6, 3)]
# Lq != Lk both ways; lengths across blocksparse's 256-row query blocks and 256-key grid.
LENGTHS = [(13, 29), (29, 13), (255, 257), (257, 255), (513, 257), (1, 513)]
SHAPES = [(Hq, Hkv, Lq, Lk, 16) for Hq, Hkv in HEADS for Lq, Lk in LENGTHS]  # (Hq, Hkv, Lq, Lk, D)
BATCH = 2  # key padding makes batch element 1 fully masked


def _shape_id(s):
    return "B{}-H{}x{}-L{}x{}-D{}".format(*s)


# --------------------------------------------------------------------------- the computations
def naive(q, k, v, mask, mods, sinks):
    """Attention done plainly in the inputs' dtype (the baseline): output and LSE, the sink as
    one more column of the softmax whose probability is dropped."""
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-2, -1)) * D**-0.5
    mod = as_score_mod(mods)
    if mod is not None:
        extent = Extent(B, Hq, Lq, Lk)
        s = mod.for_lengths(Lq, Lk).apply_block(extent, extent.whole(), s)
    if mask is not None:
        s = s.masked_fill(~mask.materialize(B, Hq, Lq, Lk), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)], dim=-1)
    has_key = ~torch.isneginf(s).all(-1, keepdim=True)
    s = s.masked_fill(~has_key, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(~has_key[..., 0], float("-inf"))
    p = torch.softmax(s, -1).masked_fill(~has_key, 0.0)
    return p[..., :Lk].to(v.dtype) @ v, lse


def oracle(q, k, v, mask, mods, sinks):
    """The fp64 reference, with a sink joined to each row's softmax denominator (no value):
    ``out' = out · exp(lse - lse')``, ``lse' = log(exp(lse) + exp(s_h))``."""
    ref = mh.reference_attention(q, k, v, mask=mask, score_mod=mods, compute_dtype=DT)
    if sinks is None:
        return ref.output, ref.lse
    s = sinks.view(1, -1, 1).expand_as(ref.lse)
    lse = torch.logaddexp(ref.lse, s)
    return ref.output * torch.exp(ref.lse - lse).unsqueeze(-1), lse


def run_case(backend, device, shape, mod_name, mask_kind, dtype):
    Hq, Hkv, Lq, Lk, D = shape
    B = BATCH
    seed = zlib.crc32(f"{shape}-{mod_name}-{mask_kind}".encode()) % 10_000  # stable across processes
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(B, h, L, D, generator=gen, dtype=DT).to(dtype).to(device).requires_grad_()
        for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    )
    mask = _mask(mask_kind, B, Lq, Lk, seed)
    built = Built(MODS[mod_name], Hq, Lq, Lk, dtype, seed, device)
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=built.declared_mods(), return_lse=True)

    res = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True, **built.call_kwargs())
    grad_out = torch.randn(res.output.shape, generator=gen, dtype=DT)
    tensors = [q, k, v] + built.leaves
    names = ["q", "k", "v"] + built.names
    g_got = [g.cpu() for g in torch.autograd.grad(res.output, tensors, grad_out.to(dtype).to(device))]
    got = mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu())  # compared on CPU
    tensors = [t.detach().cpu() for t in tensors]

    ref_t = [t.double().requires_grad_() for t in tensors]
    ref_mods, ref_sinks = built.oracle_mods(ref_t[3:])
    ref_out, ref_lse = oracle(*ref_t[:3], mask, ref_mods, ref_sinks)
    g_ref = torch.autograd.grad(ref_out, ref_t, grad_out)

    # Fully masked rows: output exactly 0; LSE -inf, or the sink logit itself with a sink.
    # (no modifier here blocks a key: the rows that see no key are the mask's)
    empty = torch.zeros(B, Hq, Lq, dtype=torch.bool)
    if mask is not None:
        empty = empty | ~mask.materialize(B, Hq, Lq, Lk).any(-1)  # (B, Hq, Lq)
    assert torch.equal(got.output[empty], torch.zeros_like(got.output[empty])), "fully masked rows must be 0"
    assert torch.equal(g_got[0][empty], torch.zeros_like(g_got[0][empty])), "dq of fully masked rows must be 0"
    if built.sinks is None:
        assert bool(torch.isneginf(got.lse[empty]).all()), "fully masked rows: LSE -inf"
        assert not bool(torch.isneginf(got.lse[~empty]).any())
    else:
        sink_rows = built.sinks.detach().cpu().to(got.lse.dtype).view(1, Hq, 1).expand_as(got.lse)
        assert torch.equal(got.lse[empty], sink_rows[empty]), "fully masked rows with a sink: LSE = sink logit"
    fin = ~empty

    if dtype == DT:
        torch.testing.assert_close(got.output, ref_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse[fin], ref_lse[fin], rtol=1e-10, atol=1e-10)
        for name, g, r in zip(names, g_got, g_ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad {name}: {m}")
        return
    base_t = [t.clone().requires_grad_() for t in tensors]
    base_mods, base_sinks = built.baseline_mods(base_t[3:])
    base_out, base_lse = naive(*base_t[:3], mask, base_mods, base_sinks)
    g_base = torch.autograd.grad(base_out, base_t, grad_out.to(dtype))
    F = factor(backend, dtype)
    assert_relative(got.output, ref_out, base_out, F)
    assert_relative(got.lse[fin], ref_lse[fin], base_lse[fin], F, "lse")
    magnitude = max(float(r.abs().max()) for r in g_ref[:3])
    # A T5 table's gradient sums dS = P * (dP - rowsum(dO * O)), which a fused backward rounds at
    # the scale of dP = dO . v (exactly 0 in the naive baseline where a row sees one key).
    dp = grad_out @ ref_t[2].detach().repeat_interleave(Hq // Hkv, 1).transpose(-2, -1)  # (B, Hq, Lq, Lk)
    for name, g, r, b in zip(names, g_got, g_ref, g_base):
        table = float(dp.abs().max()) if name.startswith("table") else 0.0
        assert_relative(
            g,
            r,
            b,
            factor(backend, dtype, gradients=True),
            f"grad {name}",
            magnitude=max(magnitude, float(r.abs().max()), table),
        )


# ----------------------------------------------------------------------- the matrix, two tiers
def _param(backend, device, shape, mod, mask, dtype, marks=()):
    dtype_name = str(dtype).replace("torch.", "")
    return pytest.param(
        backend,
        device,
        shape,
        mod,
        mask,
        dtype,
        marks=marks,
        id=f"{backend}-{device}-{_shape_id((BATCH,) + shape)}-{mod}-{mask}-{dtype_name}",
    )


def _covering(seed=0):
    """Every backend x modifier x mask once, with shape and dtype drawn so that each of them
    meets every backend and every modifier; about 180 cases. The draw is over the backends alone,
    and each case runs on every device (the CPU cases are the same with CUDA present or not)."""
    rng = random.Random(seed)
    cases = []
    backends = [p.values[0] for p in BACKENDS if p.values[1] == "cpu"]
    for bi, backend in enumerate(backends):
        shapes = []
        for mi, mod in enumerate(MODS):
            for ki, mask in enumerate(MASKS):
                if not shapes:
                    shapes = list(SHAPES)
                    rng.shuffle(shapes)
                dtype = DTYPES[(mi + ki + bi) % len(DTYPES)]
                cases.extend(_param(backend, device, shapes.pop(), mod, mask, dtype) for device in DEVICES)
    return cases


def _full():
    return [
        _param(*p.values, shape, mod, mask, dtype, marks=pytest.mark.slow)
        for p in BACKENDS
        for shape in SHAPES
        for mod in MODS
        for mask in MASKS
        for dtype in DTYPES
    ]


@pytest.mark.parametrize("backend,device,shape,mod,mask_kind,dtype", _covering())
def test_position_scores_match_the_oracle(backend, device, shape, mod, mask_kind, dtype):
    run_case(backend, device, shape, mod, mask_kind, dtype)


@pytest.mark.parametrize("backend,device,shape,mod,mask_kind,dtype", _full())
def test_position_scores_match_the_oracle_full_product(backend, device, shape, mod, mask_kind, dtype):
    run_case(backend, device, shape, mod, mask_kind, dtype)


# ----------------------------------------------------------- a sink is one more softmax column
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_a_sink_is_an_extra_softmax_column_with_no_value(backend, device):
    B, Hq, Lq, Lk, D = 2, 4, 6, 9, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, Hq, L, D, generator=gen, dtype=DT) for L in (Lq, Lk, Lk))
    sinks = torch.tensor([0.5, -1.0, 3.0, float("-inf")], dtype=DT)  # -inf: no sink for head 3
    mask = mh.key_padding(torch.tensor([Lk, 0]))
    qd, kd, vd, sinks_d = (t.to(device) for t in (q, k, v, sinks))  # the call runs on device, the checks on CPU
    serve_or_skip(backend, qd, kd, vd, mask=mask, return_lse=True)
    got = mh.attention(qd, kd, vd, mask=mask, sinks=sinks_d, backend=backend, return_lse=True)
    got = mh.AttentionResult(got.output.cpu(), None, got.lse.cpu())
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # (B, Hq, Lq, Lk)
    s = torch.cat([s, sinks.view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)], -1)  # the sink column
    p = torch.softmax(s[0], -1)  # batch element 0 sees every key
    torch.testing.assert_close(got.output[0], p[..., :Lk] @ v[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.lse[0], torch.logsumexp(s[0], -1), rtol=1e-12, atol=1e-12)
    # batch element 1 sees no key: output 0, LSE = the sink logit (-inf where there is none)
    assert torch.equal(got.output[1], torch.zeros_like(got.output[1]))
    assert torch.equal(got.lse[1], sinks.view(Hq, 1).expand(Hq, Lq).to(got.lse.dtype))
    # a row's weights sum to less than 1 (the sink took exp(s_h - lse)); a selection of heads and
    # rows gets its own heads' and rows' shares
    w = mh.attention(qd, kd, vd, mask=mask, sinks=sinks_d, backend=backend, return_weights=True).weights.cpu()
    torch.testing.assert_close(w[0], p[..., :Lk], rtol=1e-12, atol=1e-12)
    assert torch.equal(w[1], torch.zeros_like(w[1]))
    part = mh.attention(
        qd,
        kd,
        vd,
        mask=mask,
        sinks=sinks_d,
        backend=backend,
        return_weights=True,
        weights_heads=[2, 0],
        weights_rows=slice(1, 4),
    ).weights.cpu()
    torch.testing.assert_close(part, w[:, [2, 0], 1:4], rtol=1e-12, atol=1e-12)
    # gradients: finite everywhere (a -inf sink, a fully masked row), none for the absent sink
    sinks_leaf = sinks_d.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (qd, kd, vd)]
    out = mh.attention(*leaves, mask=mask, sinks=sinks_leaf, backend=backend)
    grads = [g.cpu() for g in torch.autograd.grad(out, leaves + [sinks_leaf], torch.ones_like(out))]
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert float(grads[3][3]) == 0.0 and bool((grads[3][:3] != 0).all())
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))  # dq of the batch element that sees nothing
    # d out / d s_h = -out · (1 - sigmoid(lse - s_h)) · sigmoid(lse - s_h)... checked against autograd
    # of the explicit softmax above
    ref_sinks = sinks.clone().requires_grad_()
    s_ref = torch.cat([(q @ k.transpose(-2, -1)) / math.sqrt(D), ref_sinks.view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)], -1)
    ref_out = torch.softmax(s_ref[:1], -1)[..., :Lk] @ v[:1]
    (g_ref,) = torch.autograd.grad(ref_out, ref_sinks, torch.ones_like(ref_out))
    torch.testing.assert_close(grads[3], g_ref, rtol=1e-10, atol=1e-12)


# --------------------------------------------------- rows that see only keys far in the past
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_rows_whose_every_key_is_far_in_the_past_keep_their_softmax(backend, device, dtype):
    """Top-left causal with Lq > Lk: query 500 sees keys 0..256, all 240+ positions back, so with
    ALiBi's slope 1/2 every score of the row is below -120. The softmax is shift-invariant: the row
    is an ordinary softmax of those scores, not something cut to zero as if it underflowed."""
    B, Hq, Hkv, Lq, Lk, D = 1, 2, 1, 513, 257, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, generator=gen, dtype=DT) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    mask, mod = mh.causal("top_left"), ALiBi(Hq, slopes=[0.5, 0.25], align="top_left")
    qt, kt, vt = (t.to(dtype).to(device).requires_grad_() for t in (q, k, v))
    serve_or_skip(backend, qt, kt, vt, mask=mask, score_mod=mod, return_lse=True)
    res = mh.attention(qt, kt, vt, mask=mask, score_mod=mod, backend=backend, return_lse=True)
    got = mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu())  # compared on CPU
    ref_t = [t.detach().cpu().double().requires_grad_() for t in (qt, kt, vt)]
    dense = torch.tensor([0.5, 0.25], dtype=DT).view(1, 2, 1, 1) * aligned_distance(Lq, Lk, "top_left").to(DT)
    ref = mh.reference_attention(*ref_t, mask=mask, score_mod=mh.scores.bias(dense))
    base_t = [t.detach().cpu().requires_grad_() for t in (qt, kt, vt)]
    base, base_lse = naive(*base_t, mask, [mh.scores.bias(dense.to(dtype))], None)
    assert_relative(got.output, ref.output, base, factor(backend, dtype))
    assert_relative(got.lse, ref.lse, base_lse, factor(backend, dtype), "lse")
    grad_out = torch.randn(got.output.shape, generator=gen, dtype=DT)
    g_got = [g.cpu() for g in torch.autograd.grad(res.output, (qt, kt, vt), grad_out.to(dtype).to(device))]
    g_ref = torch.autograd.grad(ref.output, ref_t, grad_out)
    g_base = torch.autograd.grad(base, base_t, grad_out.to(dtype))
    magnitude = max(float(r.abs().max()) for r in g_ref)
    for name, g, r, b in zip("qkv", g_got, g_ref, g_base):
        assert_relative(g, r, b, factor(backend, dtype, gradients=True), f"grad {name}", magnitude=magnitude)


# ------------------------------------------------------ the sink logits' gradient in fp32
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sink_gradient_in_fp32_follows_the_relative_rule(backend, device):
    """The sink gradient sums the share of every row (here 4000 of them, a long prefill): the
    relative rule, with the floor at its own magnitude (the matrix above floors it at the q/k/v
    gradients', which is looser)."""
    B, Hq, Hkv, Lq, Lk, D = 1, 4, 2, 4000, 64, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, L, D, generator=gen, dtype=DT) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    sinks = torch.randn(Hq, generator=gen, dtype=DT)
    grad_out = torch.randn(B, Hq, Lq, D, generator=gen, dtype=DT)
    t32 = [t.float().to(device).requires_grad_() for t in (q, k, v, sinks)]
    serve_or_skip(backend, *t32[:3], return_lse=True)
    out = mh.attention(*t32[:3], sinks=t32[3], backend=backend)
    got = [g.cpu() for g in torch.autograd.grad(out, t32, grad_out.float().to(device))]
    t64 = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, _ = oracle(*t64[:3], None, None, t64[3])
    ref = torch.autograd.grad(ref_out, t64, grad_out)
    b32 = [t.detach().cpu().clone().requires_grad_() for t in t32]
    base_out, _ = naive(*b32[:3], None, None, b32[3])
    base = torch.autograd.grad(base_out, b32, grad_out.float())
    assert_relative(out.detach().cpu(), ref_out, base_out, factor(backend, torch.float32))
    for name, g, r, b in zip(["q", "k", "v", "sinks"], got, ref, base):
        assert_relative(g, r, b, factor(backend, torch.float32, gradients=True), f"grad {name}")


# ------------------------------------------- band interiors with a relative bias (no gradient)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["alibi_sym", "t5"])
@pytest.mark.parametrize("mask_kind", ["window&causal", "window_both_sides_tl"])
def test_band_interiors_with_a_relative_bias_and_no_gradient(mask_kind, kind, dtype):
    """Without gradients blocksparse folds a band's interior blocks into one call with one
    bias for all of them (band_runs); the matrix above always asks for gradients."""
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 1100, 1300, 16
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, h, L, D, generator=gen, dtype=DT) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    if mask_kind == "window&causal":
        mask, align = mh.sliding_window(100) & mh.causal(), "bottom_right"
    else:
        mask, align = mh.sliding_window(60, 40, align="top_left"), "top_left"
    rel = RelativePositionBias(Hq, num_buckets=16, max_distance=64, align=align, dtype=dtype)
    with torch.no_grad():
        rel.weight.normal_(generator=gen)
    if kind == "alibi_sym":
        mod, dense = ALiBi(Hq, symmetric=True, align=align), dense_alibi(Hq, Lq, Lk, True, align)
    else:
        mod = rel()
        dense = dense_t5(rel.weight.detach().double(), Lq, Lk, True, 16, 64, align)
    qt, kt, vt = (t.to(dtype) for t in (q, k, v))
    with torch.no_grad():  # (a table that requires grad under autograd runs per piece instead)
        assert "band interior" in str(mh.explain(qt, kt, vt, mask=mask, score_mod=mod, backend="blocksparse"))
        got = mh.attention(qt, kt, vt, mask=mask, score_mod=mod, backend="blocksparse", return_lse=True)
    ref = mh.reference_attention(*(t.double() for t in (qt, kt, vt)), mask=mask, score_mod=mh.scores.bias(dense))
    if dtype == DT:
        torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
        return
    base_mods = [mh.scores.bias(dense.to(dtype))]
    base, base_lse = naive(qt, kt, vt, mask, base_mods, None)
    assert_relative(got.output, ref.output, base, factor("blocksparse", dtype))
    assert_relative(got.lse, ref.lse, base_lse, factor("blocksparse", dtype), "lse")


# -------------------------------------------------- a three-line function equals each built-in
def _t5_fn(rel, Lq, Lk):
    off = Lk - Lq  # bottom-right: query i sits at key position i + Lk - Lq

    def fn(score, b, h, q_idx, kv_idx):
        bucket = relative_position_bucket(
            kv_idx - q_idx - off,
            bidirectional=rel.bidirectional,
            num_buckets=rel.num_buckets,
            max_distance=rel.max_distance,
        )
        return score + rel.weight[bucket, h]

    return fn


def _alibi_fn(Hq, Lq, Lk, device="cpu"):
    slopes, off = alibi_slopes(Hq).to(device), Lk - Lq  # a closed-over tensor lives where the scores do

    def fn(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx - off)

    return fn


def _softcap_fn(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


@pytest.mark.parametrize("builtin", ["alibi", "t5", "softcap"])
@pytest.mark.parametrize("shape", [(2, 6, 3, 29, 300, 8), (1, 8, 2, 257, 40, 16)], ids=_shape_id)
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_a_user_function_equals_each_builtin(backend, device, shape, builtin):
    B, Hq, Hkv, Lq, Lk, D = shape
    gen = torch.Generator().manual_seed(Lq)
    q, k, v = (
        torch.randn(B, h, L, D, generator=gen, dtype=DT).to(device).requires_grad_()
        for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))
    )
    rel = RelativePositionBias(Hq, num_buckets=16, max_distance=50, dtype=DT)
    with torch.no_grad():
        rel.weight.normal_(generator=gen)
    rel.to(device)
    builtin_mod, fn = {
        "alibi": (ALiBi(Hq), _alibi_fn(Hq, Lq, Lk, device)),
        "t5": (rel(), _t5_fn(rel, Lq, Lk)),
        "softcap": (mh.scores.softcap(CAP), _softcap_fn),
    }[builtin]
    mask = mh.causal()
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=fn, return_lse=True)
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=builtin_mod, return_lse=True)
    tensors = (q, k, v, rel.weight)
    grad_out = torch.randn(B, Hq, Lq, D, generator=gen, dtype=DT).to(device)
    results = []
    for mod in (builtin_mod, fn):
        res = mh.attention(q, k, v, mask=mask, score_mod=mod, backend=backend, return_lse=True)
        grads = torch.autograd.grad(res.output, tensors, grad_out, allow_unused=True)
        results.append((res, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.output, b.output, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a.lse, b.lse, rtol=1e-10, atol=1e-10)
    for name, x, y in zip(["q", "k", "v", "table"], ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad {name}: {m}")
    if builtin == "t5":
        assert bool(ga[3].abs().sum() > 0)


# --------------------------------------------------------- no Lq x Lk tensor on the blocked path
@pytest.mark.parametrize("kind", ["alibi", "t5"])
def test_the_blocked_path_never_allocates_lq_by_lk_with_a_relative_bias(kind):
    # One head: the blocked path holds a block of 256 rows x the keys it sees (Lq*Lk/8 elements
    # here, counting the strided bias views); a dense bias or dS would be Lq*Lk.
    Lq = Lk = 2048
    B, Hq, Hkv, D = 1, 1, 1, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, generator=gen).requires_grad_() for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    rel = RelativePositionBias(Hq, bidirectional=False)
    with torch.no_grad():
        rel.weight.normal_(generator=gen)
    mod = ALiBi(Hq) if kind == "alibi" else rel()
    mask = mh.causal()
    assert mh.explain(q, k, v, mask=mask, score_mod=mod).backend == "blocksparse"
    with LargestAllocation() as fwd:
        out = mh.attention(q, k, v, mask=mask, score_mod=mod)
    grad_out = torch.randn(out.shape, generator=gen)
    leaves = (q, k, v) + ((rel.weight,) if kind == "t5" else ())
    with LargestAllocation() as bwd:
        grads = torch.autograd.grad(out, leaves, grad_out)
    # the backward ran under the mode (dq, dk, dv were recorded there)
    assert bwd.largest >= q.numel()
    # well under one Lq x Lk tensor
    assert fwd.largest < Lq * Lk // 4, fwd.largest
    assert bwd.largest < Lq * Lk // 4, bwd.largest
    # and the answer is right
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_mod = (
        ALiBi(Hq)
        if kind == "alibi"
        else BucketedBias(ref_leaves[3], bidirectional=False, num_buckets=32, max_distance=128)
    )
    ref = mh.attention(*ref_leaves[:3], mask=mask, score_mod=ref_mod, backend="reference")
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-3, atol=1e-3 * float(r.abs().max()))


# ----------------------------------------------------------------- hidden keys cannot leak
@pytest.mark.parametrize("kind", ["alibi", "user"])
@pytest.mark.parametrize("mask_kind", ["padding", "padding&causal"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_nan_and_huge_keys_beyond_the_padding_do_not_leak(backend, device, mask_kind, kind):
    B, Hq, Hkv, Lq, Lk, D = 3, 4, 2, 19, 300, 8
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, h, L, D, generator=gen, dtype=DT) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    lengths = torch.tensor([Lk, 260, 0])
    hidden = torch.arange(Lk).view(1, 1, -1, 1) >= lengths.view(-1, 1, 1, 1)  # (B, 1, Lk, 1)
    k_bad = torch.where(hidden, torch.tensor(float("nan"), dtype=DT), k)
    v_bad = torch.where(
        hidden & (torch.arange(D) % 2 == 0),
        torch.tensor(1e30, dtype=DT),
        torch.where(hidden, torch.tensor(float("nan"), dtype=DT), v),
    )
    w = torch.randn(Hq, 2, generator=gen, dtype=DT).to(device).requires_grad_()
    mod = ALiBi(Hq) if kind == "alibi" else user_fn(w)
    mask = mh.key_padding(lengths) & mh.causal() if mask_kind == "padding&causal" else mh.key_padding(lengths)
    q, k, v, k_bad, v_bad = (t.to(device) for t in (q, k, v, k_bad, v_bad))
    serve_or_skip(backend, q, k, v, mask=mask, score_mod=mod, return_lse=True)

    def run(kk, vv):  # on device; the answer comes back to CPU
        leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
        res = mh.attention(*leaves, mask=mask, score_mod=mod, backend=backend, return_lse=True, check_finite=True)
        grads = torch.autograd.grad(res.output, leaves + ([w] if kind == "user" else []), torch.ones_like(res.output))
        return mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu()), [g.cpu() for g in grads]

    clean, g_clean = run(k.masked_fill(hidden.to(device), 0.0), v.masked_fill(hidden.to(device), 0.0))
    bad, g_bad = run(k_bad, v_bad)
    assert bool(torch.isfinite(bad.output).all()) and not bool(torch.isnan(bad.lse).any())
    torch.testing.assert_close(bad.output, clean.output, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bad.lse, clean.lse, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["q", "k", "v", "w"], g_bad, g_clean):
        assert bool(torch.isfinite(a).all()), f"grad {name} holds non-finite values"
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad {name}: {m}")
    hidden_kv = hidden.expand(B, Hkv, Lk, 1)[..., 0]
    assert torch.equal(g_bad[1][hidden_kv], torch.zeros_like(g_bad[1][hidden_kv]))  # hidden keys: zero gradient
    assert torch.equal(g_bad[2][hidden_kv], torch.zeros_like(g_bad[2][hidden_kv]))
    assert torch.equal(bad.output[2], torch.zeros_like(bad.output[2]))  # batch element 2 sees nothing


# ---------------------------------------------------------------- non-contiguous inputs
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_non_contiguous_inputs_with_alibi(backend, device):
    B, Hq, Hkv, Lq, Lk, D = 2, 6, 3, 37, 290, 8
    gen = torch.Generator().manual_seed(5)
    q_base = torch.randn(B, Lq, Hq, D, generator=gen, dtype=DT)  # (B, L, H, D) layout
    k_base = torch.randn(B, 1, Lk, D, generator=gen, dtype=DT)  # one head, expanded
    v_base = torch.randn(B, Lk, Hkv, 2 * D, generator=gen, dtype=DT)
    bases = [t.to(device).requires_grad_() for t in (q_base, k_base, v_base)]
    cpu_bases = [t.requires_grad_() for t in (q_base, k_base, v_base)]  # the reference's leaves

    def views_of(q_base, k_base, v_base):
        return q_base.transpose(1, 2), k_base.expand(B, Hkv, Lk, D), v_base.transpose(1, 2)[..., ::2]

    views = views_of(*bases)
    assert not any(t.is_contiguous() for t in views) and views[1].stride(1) == 0
    mask = mh.causal() & mh.sliding_window(100)
    mod = ALiBi(Hq)
    serve_or_skip(backend, *views, mask=mask, score_mod=mod, return_lse=True)
    res = mh.attention(*views, mask=mask, score_mod=mod, backend=backend, return_lse=True)
    grad_out = torch.randn(res.output.shape, generator=gen, dtype=DT)
    g_got = [g.cpu() for g in torch.autograd.grad(res.output, bases, grad_out.to(device))]
    got = mh.AttentionResult(res.output.detach().cpu(), None, res.lse.cpu())  # compared on CPU
    ref_views = [t.contiguous() for t in views_of(*cpu_bases)]
    dense = dense_alibi(Hq, Lq, Lk, False, "bottom_right")
    ref = mh.reference_attention(*ref_views, mask=mask, score_mod=mh.scores.bias(dense))
    g_ref = torch.autograd.grad(ref.output, cpu_bases, grad_out)
    torch.testing.assert_close(got.output, ref.output, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-10, atol=1e-10)
    for name, g, r in zip("qkv", g_got, g_ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad {name}: {m}")
    assert torch.equal(g_got[2][..., 1::2], torch.zeros_like(g_got[2][..., 1::2]))  # the skipped value columns
