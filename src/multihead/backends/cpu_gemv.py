"""multihead's CPU one-token projection (``cpu_gemv.c``): ``F.linear(x, weight, bias)`` for bf16
weights and 1 to 4 rows of bf16 input, the weights read once at the memory's speed, built for this
machine on first use and called through ``ctypes``.

A decode step applies every projection to one token. PyTorch's bf16 ``F.linear`` on the CPU reads
the weights at about half the rate of its fp32 one (docs/inference.md#one-token-projections), so
a bf16 step paid as much for its projections as an fp32 step. The kernel sums in fp32 and rounds
each output once to bf16, as ``F.linear`` does. Built by :mod:`~multihead.backends.native_build`;
where no compiler is found, the build fails, the CPU lacks AVX512-BF16 or the self-test disagrees
with ``F.linear`` in float64, :func:`supports` is ``False`` and callers run ``F.linear``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.backends.native_build import FLAGS, NativeLibrary

__all__ = ["kernel", "unavailable", "supports", "supports_heads", "linear", "heads_linear", "heads_matmul"]

_SOURCE = Path(__file__).with_name("cpu_gemv.c")
_PLAIN = (Tensor, nn.Parameter)  # tensor subclasses (fake, distributed, quantized) run F.linear
_MAX_ROWS = 4  # input rows a call takes (cpu_gemv.c: MAX_ROWS)
_MIN_WEIGHTS = 1 << 13  # measured: docs/inference.md#one-token-projections
_READY: bool | None = None  # _kernel_takes(), once found


def kernel(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The built kernel, or ``None`` (see :func:`unavailable`). Built and self-tested once per process."""
    return _LIBRARY.library(flags)


def unavailable(flags: tuple[str, ...] = FLAGS) -> str | None:
    """Why :func:`kernel` is ``None``; ``None`` if it is not."""
    return _LIBRARY.unavailable(flags)


def _bind(lib: ctypes.CDLL) -> None:
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.mh_gemv_bf16.argtypes = [p, n, n, p, n, n, n, i, p, p, n, n, n, i, i, i, i, i]
    lib.mh_gemv_bf16.restype = i
    lib.mh_vecmat_bf16.argtypes = [p, n, n, p, n, n, n, i, p, n, n, n, i, i, i, i, i]
    lib.mh_vecmat_bf16.restype = i
    lib.mh_gemv_takes.restype = i
    lib.mh_gemv_max_rows.restype = i


def _takes(*tensors: Tensor | None) -> bool:
    """Plain bf16 CPU tensors (``None``: no bias), features contiguous, no gradient wanted, outside
    ``torch.compile`` and tracing (a ctypes call is not traced), and the kernel built with AVX512-BF16.
    (Ordered cheapest first: a decode step asks once per projection.)"""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or t.dtype is not torch.bfloat16 or not t.is_cpu or t.dim() < 1:
            return False
        if (t.stride(-1) != 1 and t.shape[-1] > 1) or (grad and t.requires_grad):
            return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call]
        return False
    return _kernel_takes()


def _kernel_takes() -> bool:
    """The kernel is built, passed its self-test and has AVX512-BF16 (asked once per process)."""
    global _READY
    if _READY is None:
        lib = kernel()
        _READY = lib is not None and bool(lib.mh_gemv_takes())
    return _READY


def supports(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` runs the kernel for these arguments: plain bf16 CPU tensors, 1 to 4
    rows of ``x``, at least ``2^13`` weights (fewer: the call's fixed cost is more than the faster
    read saves), the weight's rows and the features of ``x`` contiguous, no gradient wanted, outside
    ``torch.compile`` and tracing, and the kernel built with AVX512-BF16."""
    if type(x) is not Tensor or weight.dim() != 2 or x.dim() < 1 or (bias is not None and bias.dim() != 1):
        return False
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features or in_features < 1 or out_features * in_features < _MIN_WEIGHTS:
        return False
    if bias is not None and bias.shape[0] != out_features:
        return False
    return 1 <= x.numel() // in_features <= _MAX_ROWS and _takes(x, weight, bias)


def supports_heads(x: Tensor, weight: Tensor, transposed: bool) -> bool:
    """Whether :func:`heads_linear` (``transposed``: ``x W_hᵀ``) or :func:`heads_matmul` (``x W_h``)
    runs the kernel: ``x (B, H, M, ·)`` with 1 to 4 rows ``M``, ``weight (H, ·, ·)``, as :func:`supports`
    (at least ``2^13`` weights in all)."""
    if type(x) is not Tensor or x.dim() != 4 or weight.dim() != 3 or x.shape[1] != weight.shape[0]:
        return False
    inner = weight.shape[2] if transposed else weight.shape[1]
    if x.shape[-1] != inner or weight.numel() < _MIN_WEIGHTS or x.shape[0] < 1:
        return False
    return 1 <= x.shape[2] <= _MAX_ROWS and _takes(x, weight)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: on the kernel where :func:`supports` says so, else ``F.linear``."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    lib = kernel()
    assert lib is not None  # supports() checked
    return _run(lib, x, weight, bias, torch.get_num_threads())


def heads_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.transpose(-1, -2)`` per head: ``x (B, H, M, I)``, ``weight (H, O, I)`` ->
    ``(B, H, M, O)`` (MLA's ``o_h W_UV_hᵀ``), on the kernel where :func:`supports_heads` says so."""
    if not supports_heads(x, weight, transposed=True):
        if x.dtype in (torch.bfloat16, torch.float16):
            # oneDNN's half-precision batched matmul copies a transposed operand first (every
            # head's W_hᵀ, each call); W_h · xᵀ reads the rows as they lie. MKL's fp32 one reads
            # W_hᵀ in place and is the faster way round there.
            # measured: docs/inference.md#multi-head-latent-attention-mla
            return (weight @ x.transpose(-1, -2)).transpose(-1, -2)
        return x @ weight.transpose(-1, -2)
    lib = kernel()
    assert lib is not None  # supports_heads() checked
    return _run_heads(lib, x, weight, True, torch.get_num_threads())


def heads_matmul(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight`` per head: ``x (B, H, M, N)``, ``weight (H, N, C)`` -> ``(B, H, M, C)`` (MLA's
    ``q_nope_h W_UK_h``), on the kernel where :func:`supports_heads` says so."""
    if not supports_heads(x, weight, transposed=False):
        return x @ weight
    lib = kernel()
    assert lib is not None  # supports_heads() checked
    return _run_heads(lib, x, weight, False, torch.get_num_threads())


def _run(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None, threads: int) -> Tensor:
    """:func:`linear` on the kernel: one head of :func:`_call`."""
    out_features, in_features = weight.shape
    rows = x.reshape(1, 1, -1, in_features)  # a view where the rows are evenly spaced, else a copy
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = _call(lib, rows, weight.unsqueeze(0), True, threads, None if bias is None else bias.contiguous())
    return y.view(*x.shape[:-1], out_features)


def _run_heads(lib: ctypes.CDLL, x: Tensor, weight: Tensor, transposed: bool, threads: int) -> Tensor:
    """:func:`heads_linear` (``transposed``) or :func:`heads_matmul` on the kernel."""
    return _call(lib, x, weight, transposed, threads, None)


def _call(lib: ctypes.CDLL, x: Tensor, weight: Tensor, transposed: bool, threads: int, bias: Tensor | None) -> Tensor:
    """``x (B, H, M, ·)`` times each head's ``weight (H, ·, ·)`` (``transposed``: ``x W_hᵀ + bias``,
    else ``x W_h``) on the kernel: ``(B, H, M, out)`` in bf16."""
    B, H, M, inner = x.shape
    out = weight.shape[1] if transposed else weight.shape[2]
    y = torch.empty(B, H, M, out, dtype=torch.bfloat16)
    sxb, sxh, ldx = x.stride()[:3]
    args = (weight.data_ptr(), weight.stride(0), weight.stride(1), x.data_ptr(), sxb, sxh, ldx, M)
    tail = (y.data_ptr(), y.stride(0), y.stride(1), out, out, inner, B, H, threads)
    if transposed:
        status = lib.mh_gemv_bf16(*args, None if bias is None else bias.data_ptr(), *tail)
    else:
        status = lib.mh_vecmat_bf16(*args, *tail)
    if status != 0:
        raise ValueError(f"cpu_gemv: x has {M} rows (per head); the kernel takes 1 to {_MAX_ROWS}")
    return y


def _self_test(lib: ctypes.CDLL) -> None:
    """Against ``F.linear`` in float64 (then rounded to bf16) on 1 to 4 rows, sizes that leave a tail
    of features and of output rows, a bias, a strided weight: raises ``AssertionError``."""
    assert lib.mh_gemv_max_rows() == _MAX_ROWS, "cpu_gemv.c's MAX_ROWS differs from cpu_gemv.py's"
    if not lib.mh_gemv_takes():
        return
    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features in ((1, 7, 45), (3, 64, 96), (4, 13, 32)):
        big = torch.randn(out_features, in_features + 5, generator=generator).bfloat16()
        weight = big[:, 2 : 2 + in_features]  # rows of stride in_features + 5
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        bias = torch.randn(out_features, generator=generator).bfloat16()
        got = _run(lib, x, weight, bias, 2).double()
        want = F.linear(x.double(), weight.double(), bias.double())
        bound = 2.0**-8 * want.abs() + 1e-5 * (x.double().abs() @ weight.double().abs().T)
        assert bool(((got - want).abs() <= bound).all()), "the CPU one-token projection's self-test failed"
    x = torch.randn(2, 3, 2, 40, generator=generator).bfloat16()  # (B, H, M, ·)
    wv = torch.randn(3, 70, 40, generator=generator).bfloat16()
    got, want = _run_heads(lib, x, wv, True, 2).double(), x.double() @ wv.double().transpose(-1, -2)
    assert bool(((got - want).abs() <= 2.0**-8 * want.abs() + 1e-5).all()), "the CPU per-head x W_hᵀ self-test failed"
    wk = torch.randn(3, 40, 70, generator=generator).bfloat16()
    got, want = _run_heads(lib, x, wk, False, 2).double(), x.double() @ wk.double()
    assert bool(((got - want).abs() <= 2.0**-8 * want.abs() + 1e-5).all()), "the CPU per-head x W_h self-test failed"


_LIBRARY = NativeLibrary(_SOURCE, _bind, _self_test)
