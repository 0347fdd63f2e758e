"""multihead's CPU kernel for block-selected attention (``cpu_sparse.c``): built for this machine on
first use, called through ``ctypes``, forward and backward.

A ``block_select`` mask made per query token (NSA, MoBA) names a few key blocks per row, a
different few for each. PyTorch's CPU kernels cannot read each selected block once for the rows
that chose it without copying those rows: :mod:`~multihead.backends.key_major` gathers query rows
into tiles and joins a row's 16 partials by LSE, through the flash kernel on 64 x 64 problems
(docs/variants.md). The kernel is query-major instead: for a tile of query rows of one unit
(query heads sharing a row of the table), each key block the tile chose is read once, its rows
go through it four at a time in registers, an online softmax carrying their outputs::

    out (B, Hq, Lq, E) fp32, lse (B, Hq, Lq) fp32  =  sparse_attention(q, k, v, selection, scale)

with the mask ``block_select(...)`` alone or ``& causal()`` (any alignment). Its backward reads
the saved output and LSE (``delta = rowsum(dout · out) - dlse``) and recomputes the scores per
block. Built by :mod:`~multihead.backends.native_build` as the decode kernel is; where no
compiler is found, the build fails or the self-test disagrees with an fp64 computation,
:func:`kernel` is ``None``, :func:`unavailable` says why, and the PyTorch paths run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead.backends.block_gather import Selection, _whole_blocks
from multihead.backends.native_build import FLAGS, NativeLibrary

__all__ = ["kernel", "unavailable", "supports", "sparse_attention", "build"]

_SOURCE = Path(__file__).with_name("cpu_sparse.c")
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Job(ctypes.Structure):
    """``sparse_t`` of ``cpu_sparse.c``, field for field."""

    _fields_ = [
        *((name, _I) for name in ("B", "Hq", "Hkv", "Lq", "Lk", "D", "Dv", "He", "Gp", "qbs", "bs", "ksel", "causal")),
        ("d", _L),
        ("scale", _F),
        ("q", _P),
        *((name, _L) for name in ("q_b", "q_h", "q_l")),
        ("kt", _P),
        ("vt", _P),
        ("k", _P),
        ("v", _P),
        *((name, _L) for name in ("k_b", "k_h", "k_l", "v_b", "v_h", "v_l")),
        ("idx", _P),
        *((name, _L) for name in ("i_b", "i_h", "i_n", "i_s")),
        ("row", _P),
        ("kv", _P),
        ("out", _P),
        ("lse", _P),
        ("dout", _P),
        ("delta", _P),
        ("lse_in", _P),
        ("dq", _P),
        ("dk", _P),
        ("dv", _P),
    ]


def kernel(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The built kernel, or ``None`` (see :func:`unavailable`). Built and self-tested once per process."""
    return _LIBRARY.library(flags)


def unavailable(flags: tuple[str, ...] = FLAGS) -> str | None:
    """Why :func:`kernel` is ``None`` (no compiler, a failed build, a failed self-test); ``None`` if it is not."""
    return _LIBRARY.unavailable(flags)


def build(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Compile ``cpu_sparse.c`` (``native_build``: reused while the source, flags, compiler and CPU
    are the same) and load it. Raises ``RuntimeError`` when no compiler is found, the build fails
    or the library's ``sparse_t`` differs from its ctypes mirror."""
    return _LIBRARY.build(flags)


def _bind(lib: ctypes.CDLL) -> None:
    for name in ("mh_sparse_forward", "mh_sparse_backward"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Job), _I]
        getattr(lib, name).restype = _I
    lib.mh_sparse_size.restype = _L
    if lib.mh_sparse_size() != ctypes.sizeof(_Job):  # the mirror must match sparse_t field for field
        raise RuntimeError(
            f"{_SOURCE.name}: sparse_t is {lib.mh_sparse_size()} bytes, its ctypes mirror {ctypes.sizeof(_Job)}"
        )


def causal_offset(selection: Selection, Lq: int, Lk: int) -> int | None:
    """``d`` of the causal part (key ``t`` visible to query ``i`` iff ``t <= i + d``), ``-1`` with
    no other mask (nothing beyond the selection: ``_Job.causal`` off), ``None`` when the rest of
    the mask is something the kernel does not evaluate."""
    if selection.rest is None:
        return -1
    return selection.rest.causal_offset(Lq, Lk)


def supports(q: Tensor, k: Tensor, v: Tensor, selection: Selection) -> bool:
    """Whether :func:`sparse_attention` takes these operands: fp32 CPU tensors, outside
    ``torch.compile``, head sizes and the key block size multiples of 16, the rest of the mask
    nothing or causal, and the kernel built."""
    sel = selection.select
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k, v))
        and sel.indices.device.type == "cpu"
        and q.shape[-1] % 16 == 0
        and v.shape[-1] % 16 == 0
        and sel.block_size % 16 == 0
        and max(q.shape[2], k.shape[2]) < 2**30
        and causal_offset(selection, q.shape[2], k.shape[2]) is not None
        and not torch.compiler.is_compiling()
        and kernel() is not None
    )


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, selection: Selection, scale: float) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hq, Lq, Dv)`` and LSE ``(B, Hq, Lq)`` (fp32) of ``q (B, Hq, Lq, D)``, ``k, v
    (B, Hkv, Lk, D|Dv)`` under the selection's mask (as
    :func:`~multihead.backends.block_gather.gathered_attention`); differentiable in ``q, k, v``.
    Callers check :func:`supports` first."""
    out, lse = _SparseAttention.apply(q, k, v, selection, scale)  # type: ignore[no-untyped-call]
    return out, lse


class _Call:
    """The job of one call: its operands as the kernel reads them (kept alive with it)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, selection: Selection, scale: float, backward: bool):
        B, Hq, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
        sel = selection.select
        He, Gp, row, kv = selection.units(Hq, Hkv)
        bs, qbs = sel.block_size, sel.query_block_size
        d = causal_offset(selection, Lq, Lk)
        if d is None:
            raise ValueError(f"sparse_attention: the rest of the mask, {selection.rest}, is not causal")
        self.q, self.k, self.v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        # the key blocks transposed, (B, Hkv, nK, D, bs): 16 keys of a block are one vector
        self.kt = _packed(self.k, bs)
        self.vt = _packed(self.v, bs) if backward else None
        idx = sel.indices.expand(B, -1, -1, -1)  # stride 0 over the batch when it has one row
        self.idx, self.row, self.kv = idx, row.to(torch.int64).contiguous(), kv.to(torch.int64).contiguous()
        job = _Job(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, Dv=Dv, He=He, Gp=Gp, qbs=qbs, bs=bs)
        job.ksel, job.causal, job.scale = idx.shape[-1], int(selection.rest is not None), scale
        job.d = d if selection.rest is not None else 0
        job.q, (job.q_b, job.q_h, job.q_l) = self.q.data_ptr(), self.q.stride()[:3]
        job.k, (job.k_b, job.k_h, job.k_l) = self.k.data_ptr(), self.k.stride()[:3]
        job.v, (job.v_b, job.v_h, job.v_l) = self.v.data_ptr(), self.v.stride()[:3]
        job.kt = self.kt.data_ptr()
        job.vt = self.vt.data_ptr() if self.vt is not None else None
        job.idx, (job.i_b, job.i_h, job.i_n, job.i_s) = idx.data_ptr(), idx.stride()
        job.row, job.kv = self.row.data_ptr(), self.kv.data_ptr()
        self.job, self.shape = job, (B, Hq, Hkv, Lq, Lk, D, Dv)


def _packed(t: Tensor, bs: int) -> Tensor:
    """``t (B, H, L, E)`` as whole blocks of ``bs`` keys, each transposed: ``(B, H, nK, E, bs)``."""
    B, H, _, E = t.shape
    return _whole_blocks(t, bs).reshape(B, H, -1, bs, E).transpose(-1, -2).contiguous()


def _forward(lib: ctypes.CDLL, call: _Call, threads: int) -> tuple[Tensor, Tensor]:
    B, Hq, _, Lq, _, _, Dv = call.shape
    out = torch.empty(B, Hq, Lq, Dv, dtype=torch.float32)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32)
    call.job.out, call.job.lse = out.data_ptr(), lse.data_ptr()
    if lib.mh_sparse_forward(ctypes.byref(call.job), threads) != 0:
        raise MemoryError("sparse_attention: the kernel could not allocate its buffers")
    return out, lse


def _backward(
    lib: ctypes.CDLL, call: _Call, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None, threads: int
) -> tuple[Tensor, Tensor, Tensor]:
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    dout = dout.to(torch.float32).contiguous()
    delta = (dout * out).sum(-1)  # rowsum(dO ∘ O); the LSE's own gradient enters as -dlse
    if dlse is not None:
        delta = delta - dlse.to(torch.float32)
    delta, lse = delta.contiguous(), lse.contiguous()
    dq = torch.empty(B, Hq, Lq, D, dtype=torch.float32)
    dk = torch.zeros(B, Hkv, Lk, D, dtype=torch.float32)
    dv = torch.zeros(B, Hkv, Lk, Dv, dtype=torch.float32)
    job = call.job
    job.dout, job.delta, job.lse_in = dout.data_ptr(), delta.data_ptr(), lse.data_ptr()
    job.dq, job.dk, job.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    if lib.mh_sparse_backward(ctypes.byref(job), threads) != 0:
        raise MemoryError("sparse_attention: the kernel could not allocate its backward buffers")
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, selection: Selection, scale: float) -> tuple[Tensor, Tensor]:
        lib = kernel()
        if lib is None:
            raise RuntimeError(f"sparse_attention: the CPU sparse kernel is unavailable: {unavailable()}")
        out, lse = _forward(lib, _Call(q, k, v, selection, scale, backward=False), torch.get_num_threads())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.selection, ctx.scale = selection, scale
        ctx.set_materialize_grads(False)  # an unused output reaches backward as None
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: Tensor | None, grad_lse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        lib = kernel()
        assert lib is not None  # the forward ran it
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        call = _Call(q, k, v, ctx.selection, ctx.scale, backward=True)
        dq, dk, dv = _backward(lib, call, out, lse, grad_out, grad_lse, torch.get_num_threads())
        return dq, dk, dv, None, None


def _self_test(lib: ctypes.CDLL) -> None:
    """The built kernel against an fp64 computation on a small case (GQA units, per-token
    selections with -1 and a repeat, causal, a short last block, a row that sees nothing): outputs
    and gradients. A wrong build must not give wrong answers: raises ``AssertionError``."""
    from multihead.backends.block_gather import selection_of
    from multihead.masks import block_select, causal

    generator = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, E, bs = 1, 4, 2, 45, 32, 16
    q, k, v, dout = (torch.randn(B, h, L, E, generator=generator) for h in (Hq, Hkv, Hkv, Hq))
    idx = torch.randint(-1, 3, (B, Hkv, L, 2), generator=generator)
    idx[0, 0, 5] = torch.tensor([1, 1])  # query 5 of heads 0-1: a block after it, twice: sees nothing
    mask = block_select(idx, bs, num_heads=Hq, query_block_size=1) & causal()
    selection = selection_of(mask)
    assert selection is not None
    call = _Call(q, k, v, selection, 0.5, backward=True)
    out, lse = _forward(lib, call, 2)
    grads = _backward(lib, call, out, lse, dout, None, 2)
    with torch.enable_grad():  # the first call may come under no_grad
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        allowed = mask.materialize(B, Hq, L, L)
        scores = (qd @ kd.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
        want = torch.nan_to_num(torch.softmax(scores, dim=-1)) @ vd.repeat_interleave(Hq // Hkv, 1)
        want.backward(dout.double())
    assert qd.grad is not None and kd.grad is not None and vd.grad is not None
    for got, expected, what in zip((out, *grads), (want, qd.grad, kd.grad, vd.grad), ("out", "dq", "dk", "dv")):
        error = (got.double() - expected).abs().max().item()
        assert error < 1e-4, f"the CPU sparse kernel's self-test failed for {what} (error {error:.2e})"


_LIBRARY = NativeLibrary(_SOURCE, _bind, _self_test)
