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

__all__ = ["kernel", "unavailable", "supports", "linear"]

_SOURCE = Path(__file__).with_name("cpu_gemv.c")
_PLAIN = (Tensor, nn.Parameter)  # tensor subclasses (fake, distributed, quantized) run F.linear


def kernel(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The built kernel, or ``None`` (see :func:`unavailable`). Built and self-tested once per process."""
    return _LIBRARY.library(flags)


def unavailable(flags: tuple[str, ...] = FLAGS) -> str | None:
    """Why :func:`kernel` is ``None``; ``None`` if it is not."""
    return _LIBRARY.unavailable(flags)


def _bind(lib: ctypes.CDLL) -> None:
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.mh_gemv_bf16.argtypes = [p, n, p, n, i, p, p, n, i, i, i]
    lib.mh_gemv_bf16.restype = i
    lib.mh_gemv_takes.restype = i
    lib.mh_gemv_max_rows.restype = i


def supports(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` runs the kernel for these arguments: plain bf16 CPU tensors, 1 to 4
    rows of ``x``, the weight's rows and the features of ``x`` contiguous, no gradient wanted,
    outside ``torch.compile`` and tracing, and the kernel built with AVX512-BF16."""
    if type(x) is not Tensor or type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(1) != 1 or x.dim() < 1:
        return False
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu" or bias.dim() != 1):
        return False
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features or in_features < 1 or out_features < 1 or x.stride(-1) != 1:
        return False
    if bias is not None and bias.shape[0] != out_features:
        return False
    rows = x.numel() // in_features
    tracing = torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]  # (a ctypes call is not traced)
    if not 1 <= rows <= 4 or torch.compiler.is_compiling() or tracing:
        return False
    wants_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if wants_grad and torch.is_grad_enabled():
        return False
    lib = kernel()
    return lib is not None and bool(lib.mh_gemv_takes())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: on the kernel where :func:`supports` says so, else ``F.linear``."""
    if not supports(x, weight, bias):
        return F.linear(x, weight, bias)
    lib = kernel()
    assert lib is not None  # supports() checked
    return _run(lib, x, weight, bias, torch.get_num_threads())


def _run(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None, threads: int) -> Tensor:
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)  # a view where the rows are evenly spaced, else a copy
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    status = lib.mh_gemv_bf16(
        weight.data_ptr(),
        weight.stride(0),
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        out_features,
        out_features,
        in_features,
        threads,
    )
    if status != 0:
        raise ValueError(f"cpu_gemv.linear: x has {rows.shape[0]} rows; the kernel takes 1 to 4")
    return y.view(*x.shape[:-1], out_features)


def _self_test(lib: ctypes.CDLL) -> None:
    """Against ``F.linear`` in float64 (then rounded to bf16) on 1 to 4 rows, sizes that leave a tail
    of features and of output rows, a bias, a strided weight: raises ``AssertionError``."""
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


_LIBRARY = NativeLibrary(_SOURCE, _bind, _self_test)
