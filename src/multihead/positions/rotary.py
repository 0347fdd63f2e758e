"""Rotary position embeddings (RoPE): ``apply_rotary`` and the ``RotaryEmbedding`` module, with the
context-extension scalings that published checkpoints ship (linear, dynamic NTK, YaRN, Llama 3).

Notation of :mod:`multihead.conventions`; ``R = rotary_dim / 2`` is the number of rotated pairs.
A token at position ``p`` turns pair ``i`` of each head by the angle ``p · θ_i`` with
``θ_i = base^(-2i / rotary_dim)`` (the "inverse frequencies", ``inv_freq``)::

    (a, b) -> (a·cos(pθ_i) - b·sin(pθ_i),  b·cos(pθ_i) + a·sin(pθ_i))

so ``rot(q, m) · rot(k, n)`` depends on ``m - n`` only: the relative position. Which two features
of a head form pair ``i`` is the layout (``D = 8``, ``rotary_dim = 8``, ``R = 4``)::

    half-split (GPT-NeoX, Llama in HF):  x0 x1 x2 x3 | x4 x5 x6 x7     pair i = (i, i + R)
                                         a0 a1 a2 a3   b0 b1 b2 b3
    interleaved (GPT-J, Meta's Llama):   x0 x1 x2 x3 x4 x5 x6 x7       pair i = (2i, 2i + 1)
                                         a0 b0 a1 b1 a2 b2 a3 b3

With ``rotary_dim < D`` (partial rotary: GPT-NeoX/Pythia, Phi) only features ``[0, rotary_dim)``
are paired as drawn; features ``[rotary_dim, D)`` pass through bit-identical.

The rotation is computed in fp32 for fp16/bf16/fp32 inputs and in fp64 for fp64 inputs, then
rounded once to the dtype of ``x``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from multihead.inputs import check_positions, check_tensor

__all__ = [
    "apply_rotary",
    "RotaryEmbedding",
    "LinearScaling",
    "DynamicNTKScaling",
    "YaRNScaling",
    "Llama3Scaling",
    "RopeScaling",
]


def apply_rotary(
    x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False, rotary_dim: int | None = None
) -> Tensor:
    """Rotate the first ``rotary_dim`` features of each head of ``x`` by precomputed angles.

    Args:
        x: ``(..., L, D)``, usually ``(B, H, L, D)`` queries or keys after the head split; any
            strides (transposed, expanded and sliced views are read as they are).
        cos, sin: ``cos(angle)`` and ``sin(angle)`` of one shape, either

            * ``(L, R)``: one angle per position and pair, shared by every leading dim of ``x``;
            * ``(B, L, R)``: one per batch row, for a 4-D ``x (B, H, L, D)``, shared by the heads.

            ``R = rotary_dim / 2``. Any floating dtype; they are cast to the compute dtype. A scale
            folded into them (YaRN's attention factor) scales the rotated features only.
        interleaved: ``False`` pairs features ``(i, i + R)`` (half-split, GPT-NeoX/Llama);
            ``True`` pairs ``(2i, 2i + 1)`` (GPT-J). See the module docstring for pictures.
        rotary_dim: how many leading features of each head rotate (even, ``<= D``); default ``D``.
            The features ``[rotary_dim, D)`` are returned bit-identical.

    Returns:
        A new tensor of the shape and dtype of ``x``.
    """
    _check_tensor("apply_rotary", "x", x, "(..., L, D)", min_dim=2)
    L, D = x.shape[-2], x.shape[-1]
    rotary_dim = D if rotary_dim is None else _check_rotary_dim("apply_rotary", rotary_dim, D)
    R = rotary_dim // 2
    _check_table("apply_rotary", "cos", cos, x, L, R)
    _check_table("apply_rotary", "sin", sin, x, L, R)
    if cos.shape != sin.shape:
        raise ValueError(
            f"apply_rotary: cos and sin must have one shape, got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"apply_rotary: cos and sin must be on the device of x, {x.device}, got {cos.device} and {sin.device}"
        )

    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = cos.to(compute), sin.to(compute)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, L, R): the same angles for every head
    rot = x[..., :rotary_dim].to(compute)  # (..., L, rotary_dim)
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]  # (..., L, R) each: features 2i and 2i + 1
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (..., L, rotary_dim)
    else:
        a, b = rot[..., :R], rot[..., R:]  # (..., L, R) each: features i and i + R
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., L, rotary_dim)
    out = out.to(x.dtype)
    if rotary_dim == D:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)  # (..., L, D); the pass-through copied, not recomputed


# ------------------------------------------------------------------------------------ scalings
# Each scaling maps (rotary_dim, base, seq_len) to the inverse frequencies θ_i and a factor that
# multiplies cos and sin. All arithmetic is float64; the formulas are those of the cited releases.


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Chen et al. 2023; kaiokendev's SuperHOT): positions divided by
    ``factor``, i.e. ``θ_i / factor``. HF: ``{"rope_type": "linear", "factor": f}``."""

    factor: float

    def __post_init__(self) -> None:
        _check_number(self, "factor", self.factor, minimum=0.0, strict=True)

    def _frequencies(self, rotary_dim: int, base: float, seq_len: int | None) -> tuple[list[float], float]:
        return [t / self.factor for t in _default_thetas(rotary_dim, base)], 1.0


@dataclass(frozen=True)
class DynamicNTKScaling:
    """Dynamic NTK-aware scaling (u/emozilla, 2023): while a call's sequence length
    ``s = max(positions) + 1`` exceeds ``original_max_position_embeddings = m``, the base grows to
    ``base · (factor · s / m - (factor - 1)) ^ (rotary_dim / (rotary_dim - 2))``; at ``s <= m`` it is
    the plain RoPE. HF: ``{"rope_type": "dynamic", "factor": f}`` with ``m = max_position_embeddings``."""

    factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _check_number(self, "factor", self.factor, minimum=0.0, strict=True)
        _check_count(self, "original_max_position_embeddings", self.original_max_position_embeddings)

    def _frequencies(self, rotary_dim: int, base: float, seq_len: int | None) -> tuple[list[float], float]:
        m = self.original_max_position_embeddings
        s = m if seq_len is None else max(seq_len, m)
        base = base * ((self.factor * s / m) - (self.factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _default_thetas(rotary_dim, base), 1.0


@dataclass(frozen=True)
class YaRNScaling:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models").

    NTK-by-parts: pair ``i`` makes ``r_i = m · θ_i / 2π`` turns over the original context
    ``m = original_max_position_embeddings``. Pairs with ``r_i > beta_fast`` keep ``θ_i``
    (extrapolate), pairs with ``r_i < beta_slow`` use ``θ_i / factor`` (interpolate), a linear ramp
    over the pair index in between. The ramp ends are the pair indices where ``r = beta_fast`` and
    ``r = beta_slow``, ``floor``/``ceil``-ed when ``truncate`` (gpt-oss ships ``truncate=False``).

    Attention temperature: cos and sin are multiplied by ``attention_factor``, by default
    ``0.1 · ln(factor) + 1`` (1 when ``factor <= 1``), so every q·k score is multiplied by its
    square, the paper's ``1/t`` with ``sqrt(1/t) = 0.1 ln(s) + 1``. DeepSeek-V2/V3 configs give
    ``mscale`` and ``mscale_all_dim`` instead: the factor is then
    ``(0.1·mscale·ln f + 1) / (0.1·mscale_all_dim·ln f + 1)`` (1 when they are equal; DeepSeek's own
    softmax-scale correction lives in its attention, not here). An explicit ``attention_factor``
    wins over both. HF: ``{"rope_type": "yarn", "factor": f, "original_max_position_embeddings": m, ...}``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _check_number(self, "factor", self.factor, minimum=0.0, strict=True)
        _check_count(self, "original_max_position_embeddings", self.original_max_position_embeddings)
        _check_number(self, "beta_fast", self.beta_fast, minimum=0.0, strict=True)
        _check_number(self, "beta_slow", self.beta_slow, minimum=0.0, strict=True)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"YaRNScaling: beta_fast must be greater than beta_slow (turns over the original "
                f"context: fast pairs extrapolate, slow ones interpolate), "
                f"got beta_fast={self.beta_fast!r}, "
                f"beta_slow={self.beta_slow!r}; the paper's values are 32 and 1"
            )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                _check_number(self, name, getattr(self, name), minimum=0.0, strict=name == "attention_factor")
        if (self.mscale is None) != (self.mscale_all_dim is None):
            given, missing = ("mscale", "mscale_all_dim") if self.mscale is not None else ("mscale_all_dim", "mscale")
            raise ValueError(
                f"YaRNScaling: {given} needs {missing} (the attention factor is DeepSeek's ratio "
                f"get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)), got only "
                f"{given}={getattr(self, given)!r}; hint: give both, or neither for 0.1·ln(factor) + 1, "
                f"or attention_factor= for an explicit value"
            )
        if not isinstance(self.truncate, bool):
            raise TypeError(
                f"YaRNScaling: truncate must be a bool, got {type(self.truncate).__name__} {self.truncate!r}"
            )

    def _frequencies(self, rotary_dim: int, base: float, seq_len: int | None) -> tuple[list[float], float]:
        m = self.original_max_position_embeddings

        def pair_of(turns: float) -> float:  # solves m · base^(-2i/rotary_dim) / 2π = turns for i
            return rotary_dim * math.log(m / (turns * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = pair_of(self.beta_fast), pair_of(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001  # a one-point ramp would divide by zero (as the reference code does)
        thetas = []
        for i, theta in enumerate(_default_thetas(rotary_dim, base)):
            interpolate = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep θ_i, 1: θ_i / factor
            thetas.append(theta / self.factor * interpolate + theta * (1 - interpolate))
        return thetas, self._attention_factor()

    def _attention_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * scale * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.mscale) / mscale(self.mscale_all_dim)
        return mscale(1.0)


@dataclass(frozen=True)
class Llama3Scaling:
    """The frequency-band rule of Meta's Llama 3.1 release (``apply_scaling`` in ``llama/model.py``).

    With wavelength ``λ_i = 2π / θ_i``, ``lo = m / low_freq_factor`` and ``hi = m / high_freq_factor``
    (``m = original_max_position_embeddings``): ``λ_i < hi`` keeps ``θ_i``, ``λ_i > lo`` uses
    ``θ_i / factor``, and in between ``(1 - s) · θ_i / factor + s · θ_i`` with
    ``s = (m / λ_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    HF: ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}`` (Llama 3.1; Llama 3.2 1B/3B ship ``factor=32``).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _check_number(self, "factor", self.factor, minimum=0.0, strict=True)
        _check_number(self, "low_freq_factor", self.low_freq_factor, minimum=0.0, strict=True)
        _check_number(self, "high_freq_factor", self.high_freq_factor, minimum=0.0, strict=True)
        _check_count(self, "original_max_position_embeddings", self.original_max_position_embeddings)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"Llama3Scaling: high_freq_factor must be greater than low_freq_factor (the smooth band "
                f"lies between them), got high_freq_factor={self.high_freq_factor!r}, "
                f"low_freq_factor={self.low_freq_factor!r}; Meta's values are 4 and 1"
            )

    def _frequencies(self, rotary_dim: int, base: float, seq_len: int | None) -> tuple[list[float], float]:
        m = self.original_max_position_embeddings
        lo_wavelen, hi_wavelen = m / self.low_freq_factor, m / self.high_freq_factor
        thetas = []
        for theta in _default_thetas(rotary_dim, base):
            wavelen = 2 * math.pi / theta
            if wavelen < hi_wavelen:
                thetas.append(theta)
            elif wavelen > lo_wavelen:
                thetas.append(theta / self.factor)
            else:
                s = (m / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
                thetas.append((1 - s) * theta / self.factor + s * theta)
        return thetas, 1.0


RopeScaling = LinearScaling | DynamicNTKScaling | YaRNScaling | Llama3Scaling
_SCALINGS: dict[str, type[LinearScaling] | type[DynamicNTKScaling] | type[YaRNScaling] | type[Llama3Scaling]] = {
    "linear": LinearScaling,
    "dynamic": DynamicNTKScaling,
    "yarn": YaRNScaling,
    "llama3": Llama3Scaling,
}


# ------------------------------------------------------------------------------------ the module
class RotaryEmbedding(nn.Module):
    """Rotary position embedding for the ``rope=`` seam of :class:`multihead.MultiHeadAttention`.

    ``forward(x, positions)`` rotates ``x (B, H, L, D)`` by the explicit ``positions`` through
    :func:`apply_rotary`; positions are never inferred (no implicit ``arange``).

    Args:
        dim: ``D``, the head dim (not ``d_model``); even.
        base: ``θ`` of ``θ_i = base^(-2i / rotary_dim)`` (``rope_theta`` in HF configs).
        interleaved: pair layout, see :func:`apply_rotary`.
        rotary_dim: rotate only the first ``rotary_dim`` features (even, ``<= dim``); default ``dim``.
            HF's ``partial_rotary_factor = f`` is ``rotary_dim = int(dim * f)``.
        scaling: ``None``, a :class:`LinearScaling`, :class:`DynamicNTKScaling`, :class:`YaRNScaling`,
            :class:`Llama3Scaling`, or the equivalent Hugging Face ``rope_scaling`` dict
            (``{"rope_type" or "type": "linear" | "dynamic" | "yarn" | "llama3" | "default", ...}``),
            parsed into the dataclass kept as ``self.scaling``.
        max_position_embeddings: the model's context length. The tables are first built this long,
            and a dict without ``original_max_position_embeddings`` takes this value for it (HF's
            ``config.max_position_embeddings``, which dynamic NTK always uses).
        device: of the ``inv_freq`` buffer.

    Buffers (all non-persistent: derived from the arguments, never in a ``state_dict``):
    ``inv_freq (R,)`` float64 (float32 on MPS), and the tables ``cos_cached``/``sin_cached``
    ``(N, R)`` for positions ``0 .. N-1``, scaled by the attention factor, in the compute dtype
    (fp32, or fp64 for fp64 inputs). They are rebuilt when a call reaches position ``N`` (doubling),
    or uses another compute dtype or device.

    Dynamic NTK's frequencies depend on ``s = max(positions) + 1`` of each call (over all batch
    rows): within a call the scores depend on relative positions only, across calls of different
    ``s > m`` they do not, so keys cached at one length and queries at a later one disagree (as in
    every implementation of it). Beyond ``m`` its angles are computed per call, not tabled.

    Each call validates ``positions`` with one ``aminmax`` (a host sync on accelerators).
    """

    inv_freq: Tensor  # (R,)
    cos_cached: Tensor  # (N, R)
    sin_cached: Tensor  # (N, R)

    def __init__(
        self,
        dim: int,
        *,
        base: float = 10000.0,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        scaling: RopeScaling | dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"RotaryEmbedding: dim must be an int (the head dim D), got {type(dim).__name__} {dim!r}")
        if dim < 2 or dim % 2:
            raise ValueError(
                f"RotaryEmbedding: dim must be an even int >= 2 (the head dim D; features rotate in "
                f"pairs), got {dim}; hint: dim is the head dim, d_model // num_heads"
            )
        self.dim = dim
        self.rotary_dim = dim if rotary_dim is None else _check_rotary_dim("RotaryEmbedding", rotary_dim, dim)
        # base is rope_theta: 1e4 (Llama 2), 5e5 (Llama 3)
        _check_number("RotaryEmbedding", "base", base, minimum=1.0, strict=True)
        self.base = float(base)
        if not isinstance(interleaved, bool):
            raise TypeError(
                f"RotaryEmbedding: interleaved must be a bool (True: pairs (2i, 2i+1), GPT-J; False: "
                f"pairs (i, i + rotary_dim/2), GPT-NeoX/Llama), got {interleaved!r}"
            )
        self.interleaved = interleaved
        if max_position_embeddings is not None:
            _check_count("RotaryEmbedding", "max_position_embeddings", max_position_embeddings)
        self.max_position_embeddings = max_position_embeddings
        self.scaling = _parse_scaling(scaling, dim, self.rotary_dim, self.base, max_position_embeddings)
        if isinstance(self.scaling, DynamicNTKScaling) and self.rotary_dim == 2:
            raise ValueError(
                "RotaryEmbedding: dynamic NTK scaling needs rotary_dim >= 4 (its base exponent is "
                "rotary_dim / (rotary_dim - 2)), got rotary_dim=2"
            )

        inv_freq, self.attention_factor = self.frequencies()  # (R,) float64, and cos/sin's factor
        self.register_buffer(
            "inv_freq", inv_freq.to(device=device, dtype=_math_dtype(torch.device(device or "cpu"))), persistent=False
        )
        R = self.rotary_dim // 2
        self.register_buffer("cos_cached", torch.empty(0, R, device=device), persistent=False)  # (N, R)
        self.register_buffer("sin_cached", torch.empty(0, R, device=device), persistent=False)  # (N, R)

    def frequencies(self, seq_len: int | None = None) -> tuple[Tensor, float]:
        """``(inv_freq, attention_factor)`` for a call whose largest position is ``seq_len - 1``:
        the ``R`` inverse frequencies ``θ_i`` (float64, on the CPU) after scaling, and the factor
        that multiplies cos and sin (1 except for YaRN). Only dynamic NTK depends on ``seq_len``."""
        if self.scaling is None:
            thetas, factor = _default_thetas(self.rotary_dim, self.base), 1.0
        else:
            thetas, factor = self.scaling._frequencies(self.rotary_dim, self.base, seq_len)
        return torch.tensor(thetas, dtype=torch.float64), factor

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x (B, H, L, D)`` (or any ``(..., L, D)`` with ``(L,)`` positions) by
        ``positions``: ``int`` ``(L,)`` (shared by the batch) or ``(B, L)`` (one row per sequence,
        e.g. left padding or packed documents), the absolute position of each token, ``>= 0``."""
        _check_tensor("RotaryEmbedding", "x", x, "(B, H, L, D)", min_dim=2)
        if x.shape[-1] != self.dim:
            raise ValueError(
                f"RotaryEmbedding: x must have the head dim D={self.dim} as its last dim, got shape "
                f"{tuple(x.shape)}; hint: rotate after the head split, (B, L, H·D) -> (B, H, L, D), "
                f"with RotaryEmbedding(head_dim)"
            )
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        if torch.compiler.is_compiling() and not isinstance(self.scaling, DynamicNTKScaling):
            # Traced: max(positions) is not read (a host value would break the graph, and a table
            # grown to it would be a buffer mutation); the angles at these positions are computed
            # directly, the same float64 products the tables hold, so the result is the same.
            _check_positions(positions, x, values=False)
            angle = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # (L, R) or (B, L, R)
            cos = (angle.cos() * self.attention_factor).to(compute)
            sin = (angle.sin() * self.attention_factor).to(compute)
            return apply_rotary(x, cos, sin, interleaved=self.interleaved, rotary_dim=self.rotary_dim)
        seq_len = _check_positions(positions, x)  # max(positions) + 1
        positions = positions.long()  # int64 indices (a uint8 index would be read as a boolean mask)
        if isinstance(self.scaling, DynamicNTKScaling) and seq_len > self.scaling.original_max_position_embeddings:
            cos, sin = self._angles(positions, compute, seq_len)  # (L, R) or (B, L, R)
        else:
            cos_table, sin_table = self._tables(seq_len, compute, x.device)  # (N, R) each
            cos, sin = cos_table[positions], sin_table[positions]  # (L, R) or (B, L, R)
        return apply_rotary(x, cos, sin, interleaved=self.interleaved, rotary_dim=self.rotary_dim)

    def extra_repr(self) -> str:
        parts = [f"dim={self.dim}", f"base={self.base:g}"]
        if self.rotary_dim != self.dim:
            parts.append(f"rotary_dim={self.rotary_dim}")
        if self.interleaved:
            parts.append("interleaved=True")
        if self.scaling is not None:
            parts.append(f"scaling={self.scaling}")
        return ", ".join(parts)

    # ------------------------------------------------------------------------------ helpers
    def _tables(self, seq_len: int, compute: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """The cos/sin tables ``(N, R)`` with ``N >= seq_len``, rebuilt (to at least twice their
        old length) when too short, or in another dtype or device."""
        N = self.cos_cached.shape[0]
        if N >= seq_len and self.cos_cached.dtype == compute and self.cos_cached.device == device:
            return self.cos_cached, self.sin_cached
        N = max(seq_len, 2 * N if N < seq_len else N, self.max_position_embeddings or 0)
        # Built as ordinary tensors even under inference_mode, so that tables first built during
        # generation can later be saved for backward in training.
        with torch.inference_mode(False), torch.no_grad():
            inv_freq = self.inv_freq.to(device=device, dtype=_math_dtype(device))  # (R,)
            angle = torch.arange(N, device=device, dtype=inv_freq.dtype)[:, None] * inv_freq  # (N, R)
            self.cos_cached = (angle.cos() * self.attention_factor).to(compute)  # stays a registered buffer
            self.sin_cached = (angle.sin() * self.attention_factor).to(compute)
        return self.cos_cached, self.sin_cached

    def _angles(self, positions: Tensor, compute: torch.dtype, seq_len: int) -> tuple[Tensor, Tensor]:
        """cos/sin at exactly these positions with the frequencies of a ``seq_len`` call (dynamic NTK)."""
        inv_freq, factor = self.frequencies(seq_len)
        inv_freq = inv_freq.to(device=positions.device, dtype=_math_dtype(positions.device))  # (R,)
        angle = positions.to(inv_freq.dtype)[..., None] * inv_freq  # (L, R) or (B, L, R)
        return (angle.cos() * factor).to(compute), (angle.sin() * factor).to(compute)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RotaryEmbedding:
        # .half()/.to(dtype) would round inv_freq to the model dtype; the angles need it exact, so
        # it is recomputed in float64 on its new device, and the tables are rebuilt on next use.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch's Module._apply is unannotated
        device = self.inv_freq.device
        if self.inv_freq.dtype != _math_dtype(device):
            self.inv_freq = self.frequencies()[0].to(device=device, dtype=_math_dtype(device))
        return self


# ---------------------------------------------------------------------------------- helpers


def _default_thetas(rotary_dim: int, base: float) -> list[float]:
    """``θ_i = base^(-2i / rotary_dim)`` for ``i < rotary_dim / 2``, in float64."""
    return [base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]


def _math_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _parse_scaling(
    scaling: object, dim: int, rotary_dim: int, base: float, max_position_embeddings: int | None
) -> RopeScaling | None:
    """A scaling dataclass (or ``None``) from a dataclass or a Hugging Face ``rope_scaling`` dict."""
    if scaling is None or isinstance(scaling, (LinearScaling, DynamicNTKScaling, YaRNScaling, Llama3Scaling)):
        return scaling
    if not isinstance(scaling, dict):
        raise TypeError(
            f"RotaryEmbedding: scaling must be None, a LinearScaling, DynamicNTKScaling, YaRNScaling, "
            f"Llama3Scaling or a Hugging Face rope_scaling dict, got {type(scaling).__name__} {scaling!r}"
        )
    config = {key: value for key, value in scaling.items() if value is not None}  # HF reads None as "default"
    kind = config.pop("rope_type", None)
    legacy = config.pop("type", None)
    if kind is not None and legacy is not None and kind != legacy:
        raise ValueError(
            f"RotaryEmbedding: scaling has rope_type={kind!r} and type={legacy!r}; expected one, or both equal"
        )
    kind = kind if kind is not None else legacy
    supported = ["default", *_SCALINGS]
    if kind not in supported:
        raise ValueError(
            f"RotaryEmbedding: unknown scaling rope_type {kind!r} in {scaling!r}; expected one of "
            f"{supported}" + ("; hint: the dict needs a 'rope_type' (or 'type') key" if kind is None else "")
        )
    # HF (v5) keeps rope_theta and partial_rotary_factor in the same dict: accepted when they agree.
    if "rope_theta" in config and float(config.pop("rope_theta")) != base:
        raise ValueError(
            f"RotaryEmbedding: scaling has rope_theta={scaling['rope_theta']!r} but base={base!r}; "
            f"hint: pass base={scaling['rope_theta']!r}"
        )
    if "partial_rotary_factor" in config:
        factor = config.pop("partial_rotary_factor")
        if int(dim * factor) != rotary_dim:
            raise ValueError(
                f"RotaryEmbedding: scaling has partial_rotary_factor={factor!r}, which rotates "
                f"int({dim} * {factor}) = {int(dim * factor)} features, but rotary_dim={rotary_dim}; "
                f"hint: pass rotary_dim={int(dim * factor)}"
            )
    if kind == "default":
        if config:
            raise ValueError(
                f"RotaryEmbedding: scaling of rope_type 'default' takes no parameters, got {sorted(config)}"
            )
        return None
    cls = _SCALINGS[kind]
    accepted = [f.name for f in fields(cls)]
    if "original_max_position_embeddings" in accepted and "original_max_position_embeddings" not in config:
        if max_position_embeddings is None:
            raise ValueError(
                f"RotaryEmbedding: a {kind!r} scaling needs original_max_position_embeddings (the "
                f"pretraining context length), got neither it in {scaling!r} nor "
                "max_position_embeddings=; hint: pass "
                "max_position_embeddings=config.max_position_embeddings"
            )
        config["original_max_position_embeddings"] = max_position_embeddings
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise ValueError(
            f"RotaryEmbedding: unknown keys {unknown} in a {kind!r} scaling {scaling!r}; expected "
            f"'rope_type' (or 'type'), 'rope_theta', 'partial_rotary_factor' and {accepted}"
        )
    return cls(**config)


def _check_tensor(where: str, name: str, t: object, shape: str, *, min_dim: int) -> None:
    t = check_tensor(name, t, shape, where=where)
    if t.dim() < min_dim:
        raise ValueError(f"{where}: {name} must have at least {min_dim} dims {shape}, got shape {tuple(t.shape)}")


def _check_rotary_dim(where: str, rotary_dim: object, D: int) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"{where}: rotary_dim must be None or an int, got {type(rotary_dim).__name__} {rotary_dim!r}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(
            f"{where}: rotary_dim must be even and in [2, D={D}] (features rotate in pairs, the first "
            f"rotary_dim of each head), got {rotary_dim}; hint: HF's partial_rotary_factor f is "
            f"rotary_dim = int(D * f)"
        )
    return rotary_dim


def _check_table(where: str, name: str, t: Tensor, x: Tensor, L: int, R: int) -> None:
    # (Traced, without the sizes: formatting a symbolic L would fix it in the graph.)
    sizes = "(L, R)" if torch.compiler.is_compiling() else f"(L, R) = ({L}, {R})"
    _check_tensor(where, name, t, f"{sizes} or (B, L, R)", min_dim=2)
    if t.dim() == 2 and tuple(t.shape) == (L, R):
        return
    if t.dim() == 3 and tuple(t.shape[1:]) == (L, R) and x.dim() == 4 and t.shape[0] == x.shape[0]:
        return
    expected = f"(L, R) = ({L}, {R})" + (f" or (B, L, R) = ({x.shape[0]}, {L}, {R})" if x.dim() == 4 else "")
    raise ValueError(
        f"{where}: {name} must have shape {expected} for x of shape {tuple(x.shape)} "
        f"(R = rotary_dim / 2), got {tuple(t.shape)}; hint: a per-row (B, L, R) table needs a 4-D "
        f"x (B, H, L, D); pass rotary_dim= when only part of each head rotates"
    )


def _check_positions(positions: object, x: Tensor, values: bool = True) -> int:
    """Check ``positions`` against ``x (..., L, D)``; return ``max(positions) + 1`` (0 when empty).
    ``values=False``: type, shape and device only (no host read; returns -1)."""
    L = x.shape[-2]

    def expected() -> str:  # written only for an error: formatting a traced size would fix it in the graph
        return f"(L,) = ({L},)" + (f" or (B, L) = ({x.shape[0]}, {L})" if x.dim() == 4 else "")

    shapes = ((L,), (x.shape[0], L)) if x.dim() == 4 else ((L,),)
    positions = check_positions(
        "RotaryEmbedding",
        positions,
        shapes,
        x.device,
        device_of="x",
        expected=expected,
        hint="torch.arange(L); a fractional position is a scaling",
    )
    if not values:
        return -1
    if positions.numel() == 0:
        return 0
    low, high = (int(v) for v in torch.aminmax(positions))
    if low < 0:
        raise ValueError(
            f"RotaryEmbedding: positions must be >= 0 (absolute token positions), got a minimum of "
            f"{low}; hint: left padding may reuse position 0, it never needs negative ones"
        )
    return high + 1


def _check_number(owner: object, name: str, value: object, *, minimum: float, strict: bool) -> None:
    where = owner if isinstance(owner, str) else type(owner).__name__
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(
            f"{where}: {name} must be a finite number {'>' if strict else '>='} {minimum:g}, got {value!r}"
        )


def _check_count(owner: object, name: str, value: object) -> None:
    where = owner if isinstance(owner, str) else type(owner).__name__
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int (a number of positions), got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{where}: {name} must be a positive int (a number of positions), got {value}")
