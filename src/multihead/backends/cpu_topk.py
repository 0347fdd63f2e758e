"""multihead's CPU best-first kernel (``cpu_topk.c``): the ``n`` best of each row of fp32 scores,
best first, ties to the lower index, ``-1`` for ``-inf``, as :func:`multihead.layers.ranking.best_first`
defines them, built for this machine on first use and called through ``ctypes``.

MoBA's gate and NSA's choice rank up to ``L / 64`` block scores per query and head to keep 16;
PyTorch's CPU ``topk`` spent two-thirds of MoBA's gate at 16k on those short rows
(docs/variants.md). The kernel reads each row once against the ``n`` best so far. Rows holding a
NaN are flagged and left to the caller. Built by :mod:`~multihead.backends.native_build`; where
no compiler is found, the build fails or the self-test disagrees with a stable sort,
:func:`kernel` is ``None``, :func:`unavailable` says why, and ``best_first`` runs ``topk``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from multihead.backends.native_build import FLAGS, NativeLibrary

__all__ = ["kernel", "unavailable", "supports", "best_first_rows"]

_SOURCE = Path(__file__).with_name("cpu_topk.c")


def kernel(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The built kernel, or ``None`` (see :func:`unavailable`). Built and self-tested once per process."""
    return _LIBRARY.library(flags)


def unavailable(flags: tuple[str, ...] = FLAGS) -> str | None:
    """Why :func:`kernel` is ``None``; ``None`` if it is not."""
    return _LIBRARY.unavailable(flags)


def _bind(lib: ctypes.CDLL) -> None:
    lib.mh_best_first.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.mh_best_first.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.mh_best_first.restype = ctypes.c_long
    lib.mh_best_first_max.restype = ctypes.c_int


def supports(scores: Tensor, n: int) -> bool:
    """Whether :func:`best_first_rows` takes these scores: fp32 on the CPU, outside ``torch.compile``,
    ``n`` at most 256, and the kernel built."""
    return (
        scores.device.type == "cpu"
        and scores.dtype == torch.float32
        and 0 < n <= 256
        and scores.dim() >= 1
        and scores.shape[-1] > 0
        and not torch.compiler.is_compiling()
        and kernel() is not None
    )


def best_first_rows(scores: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``(..., n)`` int64: the indices of the ``n`` best of each row of ``scores (..., m)`` (``n <= m``),
    best first, ties to the lower index, ``-1`` past the row's finite scores; and ``(...)`` bool,
    the rows holding a NaN, whose indices the caller computes. Callers check :func:`supports`."""
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"best_first_rows: the CPU best-first kernel is unavailable: {unavailable()}")
    return _run(lib, scores, n, torch.get_num_threads())


def _run(lib: ctypes.CDLL, scores: Tensor, n: int, threads: int) -> tuple[Tensor, Tensor]:
    m = scores.shape[-1]
    rows = scores.reshape(-1, m)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.int64)
    nan = torch.empty(rows.shape[0], dtype=torch.uint8)
    lib.mh_best_first(rows.data_ptr(), rows.shape[0], m, rows.stride(0), n, out.data_ptr(), nan.data_ptr(), threads)
    return out.view(*scores.shape[:-1], n), nan.view(scores.shape[:-1]).bool()


def _self_test(lib: ctypes.CDLL) -> None:
    """Against a stable descending sort on rows with ties, -inf, -0.0 and 0.0, fewer finite scores
    than ``n``: raises ``AssertionError``."""
    generator = torch.Generator().manual_seed(0)
    s = torch.randint(-3, 4, (50, 37), generator=generator).float()
    s[s == -3] = float("-inf")
    s[0, :30] = float("-inf")  # fewer than n finite
    s[1, 3], s[1, 5] = -0.0, 0.0
    got, nan = _run(lib, s, 9, 2)
    ranked, order = torch.sort(s + 0.0, dim=-1, descending=True, stable=True)
    want = torch.where(torch.isneginf(ranked[:, :9]), -1, order[:, :9])
    assert not bool(nan.any()) and torch.equal(got, want), "the CPU best-first kernel's self-test failed"


_LIBRARY = NativeLibrary(_SOURCE, _bind, _self_test)
