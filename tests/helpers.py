"""Shared test helpers: the relative error rule of ``shared/TESTING.md``, a naive same-dtype
baseline, and the seeded case matrix (mask kind x Lq != Lk x GQA x head dims)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import random
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh

# The devices every device-parametrized test runs on: CPU always, CUDA when there is one. A CUDA
# case exists only where CUDA does (a CPU-only run has no skipped CUDA cases). Tensors drawn from
# a CPU ``torch.Generator`` are drawn on CPU, then moved; results come back with ``.cpu()``.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# The relative factor F of the rule "err(x) <= F * err(naive) + floor" lives with each backend:
# mh.get_backend(name).capabilities.tolerance_factor(dtype, gradients) (tests/backends/matrix.py).


def optional(module: str, reason: str, minversion: str | None = None) -> ModuleType:
    """``module`` of an optional extra, imported; the test skipped with ``reason`` when its package
    is not installed (or older than ``minversion``). Unlike ``pytest.importorskip``, an installed
    package that fails to import fails the test: a broken dependency (a range that admits a
    release which cannot import, as ``make test-compat`` finds) is an error, never a skip."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{reason}: {module.split('.')[0]} is not installed")
    imported = importlib.import_module(module)
    if minversion is not None:
        from packaging.version import Version

        top = importlib.import_module(module.split(".")[0])
        if Version(top.__version__) < Version(minversion):
            pytest.skip(f"{reason}: {module} {top.__version__} < {minversion}")
    return imported


def naive_attention(q, k, v, mask, scale=None, score_mod=None):
    """Attention computed plainly *in the input dtype* (no upcast): the error baseline."""
    from multihead.blocks import Extent
    from multihead.call import mask_and_score_mod

    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    mask, score_mod = mask_and_score_mod(mask, score_mod, check_binary=False)
    if score_mod is not None:
        extent = Extent(B, Hq, Lq, Lk)
        scores = score_mod.apply_block(extent, extent.whole(), scores)
    if mask is not None:
        scores = scores.masked_fill(~mask.materialize(B, Hq, Lq, Lk), float("-inf"))
    # Rows with no visible key get finite scores (so no NaN reaches autograd), then probability 0.
    row_has_key = ~torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~row_has_key, 0.0), dim=-1).masked_fill(~row_has_key, 0.0)
    return probs @ v


def ulp_floor(dtype: torch.dtype, magnitude: float) -> float:
    """A few ulps of ``dtype`` at ``magnitude``: the rounding floor of the rule."""
    return 4 * torch.finfo(dtype).eps * max(1.0, magnitude)


def assert_relative(
    x: Tensor, ref: Tensor, baseline: Tensor, factor: float, what: str = "output", magnitude: float | None = None
) -> None:
    """``max|x - ref| <= factor * max|baseline - ref| + floor``, plus the same on the mean error.

    ``magnitude`` sets the floor's scale when ``ref`` alone understates it (a gradient that is
    exactly 0 in theory is computed from terms of the size of the other gradients)."""
    x, ref, baseline = x.detach(), ref.detach().double(), baseline.detach()
    assert torch.isfinite(x).all(), f"{what}: non-finite values"
    if ref.numel() == 0:
        return
    err_x = (x.double() - ref).abs()
    err_b = (baseline.double() - ref).abs()
    floor = ulp_floor(x.dtype, float(ref.abs().max()) if magnitude is None else magnitude)
    msg = (
        f"{what}: max err {float(err_x.max()):.3e}, baseline max err {float(err_b.max()):.3e}, "
        f"mean err {float(err_x.mean()):.3e} vs baseline mean {float(err_b.mean()):.3e}, floor {floor:.1e}"
    )
    assert float(err_x.max()) <= factor * float(err_b.max()) + floor, msg
    assert float(err_x.mean()) <= factor * float(err_b.mean()) + floor, msg


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    mask: str
    seed: int

    @property
    def id(self) -> str:
        return f"B{self.B}-H{self.Hq}x{self.Hkv}-L{self.Lq}x{self.Lk}-D{self.D}v{self.Dv}-{self.mask}"


#: The kinds made of bands, key padding and documents and their ``& | ~``: what the
#: block-sparse backends read from the mask's structure (test_blocksparse, test_tile_plan,
#: test_triton_blocks add the kinds each also runs).
STRUCTURED_KINDS = [
    "none",
    "causal_br",
    "causal_tl",
    "window_3",
    "window_5_2_tl",
    "key_padding",
    "document",
    "prefix_lm",
    "causal&padding",
    "document&causal",
    "window|prefix",
    "~causal",
]
MASK_KINDS = [
    *STRUCTURED_KINDS,
    "custom",
    "bool_tensor",
    "bool_keys_only",
    "additive_tensor",
    "additive&causal",
    "shifted_causal",
    "shifted_causal_br",
    "positions_window",
    "window_per_sequence",
    "document_causal",
]


HEADS = [(1, 1), (4, 4), (8, 2), (6, 3), (8, 1)]
LENGTHS = [(1, 1), (1, 17), (17, 1), (13, 13), (113, 203), (203, 113), (127, 128)]
HEAD_DIMS = [(8, 8), (40, 40), (59, 59), (64, 64), (128, 128), (16, 24)]


def covering_cases(n_random: int = 24, seed: int = 0) -> list[Case]:
    """Every mask kind, head pair, length pair and head dim at least once, plus seeded randoms."""
    rng = random.Random(seed)
    cases = []
    n = max(len(MASK_KINDS), len(HEADS), len(LENGTHS), len(HEAD_DIMS))
    for i in range(n):
        Hq, Hkv = HEADS[i % len(HEADS)]
        Lq, Lk = LENGTHS[i % len(LENGTHS)]
        D, Dv = HEAD_DIMS[i % len(HEAD_DIMS)]
        cases.append(Case(1 + 2 * (i % 2), Hq, Hkv, Lq, Lk, D, Dv, MASK_KINDS[i % len(MASK_KINDS)], i))
    for i in range(n_random):
        Hq, Hkv = rng.choice(HEADS)
        Lq, Lk = rng.choice(LENGTHS)
        D, Dv = rng.choice(HEAD_DIMS)
        cases.append(Case(rng.choice([1, 3]), Hq, Hkv, Lq, Lk, D, Dv, rng.choice(MASK_KINDS), 1000 + i))
    return cases


def make_mask(kind: str, B: int, Hq: int, Lq: int, Lk: int, gen: torch.Generator):
    """A mask of the named kind for these sizes; several kinds include fully masked rows."""
    lengths = torch.randint(0, Lk + 1, (B,), generator=gen)
    lengths[0] = Lk  # at least one full row of keys; others may be 0 (a fully masked batch element)
    q_ids = torch.sort(torch.randint(0, 3, (B, Lq), generator=gen)).values
    kv_ids = torch.sort(torch.randint(0, 3, (B, Lk), generator=gen)).values
    table = {
        "none": lambda: None,
        "causal_br": lambda: mh.causal(),
        "causal_tl": lambda: mh.causal("top_left"),
        "window_3": lambda: mh.sliding_window(3),
        "window_5_2_tl": lambda: mh.sliding_window(5, 2, align="top_left"),
        "key_padding": lambda: mh.key_padding(lengths),
        "document": lambda: mh.document(q_ids, kv_ids),
        "prefix_lm": lambda: mh.prefix_lm(min(3, Lk)),
        "causal&padding": lambda: mh.causal() & mh.key_padding(lengths),
        "document&causal": lambda: mh.document(q_ids, kv_ids) & mh.causal(),
        "window|prefix": lambda: mh.sliding_window(2) | mh.prefix_lm(2),
        "~causal": lambda: ~mh.causal(),
        "custom": lambda: mh.custom(lambda b, h, q, kv: (q + kv + h) % 3 != 0),
        "bool_tensor": lambda: torch.rand(B, Hq, Lq, Lk, generator=gen) > 0.3,
        "bool_keys_only": lambda: torch.rand(B, 1, 1, Lk, generator=gen) > 0.5,
        "additive_tensor": lambda: torch.where(
            torch.rand(1, Hq, Lq, Lk, generator=gen) > 0.3, torch.randn(1, Hq, Lq, Lk, generator=gen), float("-inf")
        ),
        # A float mask is split by attention() into its -inf pattern (here causal) and a bias.
        "additive&causal": lambda: torch.randn(Lq, Lk, generator=gen).masked_fill(
            ~mh.causal().materialize(1, 1, Lq, Lk)[0, 0], float("-inf")
        ),
        "shifted_causal": lambda: mh.causal("top_left").shifted(q_offset=-2, kv_offset=0),
        "shifted_causal_br": lambda: mh.causal().shifted(Lq, 3, q_len=2 * Lq, kv_len=Lk + 3),
        "positions_window": lambda: mh.sliding_window(4).at(
            torch.arange(Lq) * 2, torch.arange(Lk) * 2, q_len=2 * Lq, kv_len=2 * Lk
        ),
        # Issue 9, item 11: aligned per sequence of a padded batch, and per document.
        "window_per_sequence": lambda: (
            mh.sliding_window(5, kv_lengths=lengths, q_lengths=torch.clamp(lengths, max=Lq)) & mh.key_padding(lengths)
        ),
        "document_causal": lambda: mh.document_causal(q_ids, kv_ids),
    }
    return table[kind]()


def make_inputs(case: Case, dtype=torch.float64, requires_grad=False):
    gen = torch.Generator().manual_seed(case.seed)
    q = torch.randn(case.B, case.Hq, case.Lq, case.D, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, case.Hkv, case.Lk, case.D, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, case.Hkv, case.Lk, case.Dv, generator=gen, dtype=torch.float64)
    mask = make_mask(case.mask, case.B, case.Hq, case.Lq, case.Lk, gen)
    q, k, v = (t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))
    return q, k, v, mask


def refuses(backend: str, q, k, v, **kwargs) -> bool:
    """Whether ``backend`` declares it cannot serve this call; if so, also check that forcing it
    raises ``BackendRefusedError`` naming it (a declared refusal is a real answer, not a skip)."""
    return bool(refusals(backend, q, k, v, **kwargs))


def refusals(backend: str, q, k, v, **kwargs) -> list[str]:
    """The reasons ``backend`` declares for not serving ``multihead.attention(q, k, v, **kwargs)``
    (none: it serves it); a declared refusal must also make a forced call raise
    ``BackendRefusedError`` naming the backend, which this checks."""
    import pytest

    from multihead.validation import validate_call

    call = validate_call(
        q,
        k,
        v,
        mask=kwargs.get("mask"),
        score_mod=kwargs.get("score_mod"),
        scale=kwargs.get("scale"),
        dropout_p=kwargs.get("dropout_p", 0.0),
        dropout_mask=kwargs.get("dropout_mask"),
        return_weights=kwargs.get("return_weights", False),
        return_lse=kwargs.get("return_lse", False),
    )
    reasons = mh.get_backend(backend).refusals(call)
    if reasons:
        assert all(isinstance(r, str) and r for r in reasons)
        with pytest.raises(mh.BackendRefusedError, match=backend):
            mh.attention(q, k, v, backend=backend, **kwargs)
    return reasons


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any ATen op returns: the allocations of the code under test,
    so that a regression to an ``Lq x Lk`` tensor fails a test."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# ------------------------------------------------------------------ position biases, independently
# Written from the papers (ALiBi: Press et al.; T5: Raffel et al.), not from multihead's code: the
# oracles that tests/positions, tests/backends and tests/layers check the library's biases against.
def paper_slopes(n: int) -> list[float]:
    """The ALiBi paper's ``get_slopes`` (Press et al., github.com/ofirpress/attention_with_linear_biases),
    rewritten: a geometric sequence starting at ``2^(-8/n)`` for a power of two; otherwise the
    slopes of the closest smaller power of two, then every other slope of twice that many heads."""

    def power_of_two(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def aligned_distance(Lq: int, Lk: int, align: str) -> torch.Tensor:
    """``(Lq, Lk)`` int64: key position minus query position, query ``i`` at ``i + Lk - Lq``
    (bottom-right: the last query meets the last key) or at ``i`` (top-left)."""
    offset = Lk - Lq if align == "bottom_right" else 0
    q_pos = torch.arange(Lq).view(-1, 1) + offset
    k_pos = torch.arange(Lk).view(1, -1)
    return k_pos - q_pos


def loop_bucket(d: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one distance ``d = key - query``, in plain Python arithmetic."""
    buckets, bucket = num_buckets, 0
    if bidirectional:
        buckets //= 2
        if d > 0:
            bucket += buckets  # keys after the query: the upper half
        n = abs(d)
    else:
        n = max(-d, 0)  # keys after the query share bucket 0
    exact = buckets // 2
    if n < exact:
        return bucket + n
    log_part = int(math.log(n / exact) / math.log(max_distance / exact) * (buckets - exact))
    return bucket + min(exact + log_part, buckets - 1)
