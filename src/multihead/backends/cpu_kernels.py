"""multihead's CPU decode kernel (``cpu_decode.c``): built for this machine on first use, called through ``ctypes``.

A decode step's cost is reading the cache, and PyTorch's CPU ops cannot read a half or 8-bit cache
at memory speed for a few query rows: oneDNN's GEMMs run a few output columns well below it, an
``int8 -> bf16`` conversion costs more per element than reading the element, and a paged or
quantized cache must be copied or converted before a GEMM may read it (docs/inference.md). The
kernel reads each key and value once, as stored (fp32, bf16, fp16, int8 or fp8 with scales; through a
page table), converts it in registers and does both products and the softmax of a partial
attention in one pass per (batch row, KV head)::

    out (B, Hkv, R, Dv) fp32, lse (B, Hkv, R) fp32  =  decode_partial(qg (B, Hkv, R, D), slots [lo, lo + n))

It is C, not a PyTorch extension: ``native_build`` builds it with the host's compiler (``cc``,
``-O3 -march=native``) into ``$XDG_CACHE_HOME/multihead`` (``~/.cache/multihead``) under a name that hashes the source,
the flags, the compiler and the CPU, so nothing is rebuilt until one of them changes; no
dependency is added, no PyTorch header is needed. Where no compiler is found, the build fails or
the first call's self-test disagrees with PyTorch, :func:`kernel` is ``None`` (with
:func:`unavailable` saying why) and the callers run their PyTorch paths, which give the same
results.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from .native_build import FLAGS, NativeLibrary

__all__ = [
    "kernel",
    "unavailable",
    "supports",
    "tiles",
    "bands",
    "decode_partial",
    "decode_joined",
    "Segment",
    "Int8Scales",
    "build",
]

_SOURCE = Path(__file__).with_name("cpu_decode.c")
ONE_THREAD_WORK = 1 << 20  # multiply-adds below which a call runs on the calling thread alone
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
if hasattr(torch, "float8_e4m3fn"):
    _KINDS[torch.float8_e4m3fn] = 4
#: 8-bit storage: read with the scales of :class:`Int8Scales`
_SCALED = tuple(dtype for dtype, kind in _KINDS.items() if kind >= 3)
_SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Job(ctypes.Structure):
    """``job_t`` of ``cpu_decode.c``, field for field."""

    _fields_ = [
        *((name, _I) for name in ("B", "H", "G", "Lq", "D", "Dv")),
        ("lo", _L),
        ("n", _L),
        ("q", _P),
        ("scale", _F),
        ("K", _P),
        ("V", _P),
        *((name, _L) for name in ("k_h", "k_page", "k_t", "v_h", "v_page", "v_t")),
        ("table", _P),
        ("width", _L),
        ("ps", _L),
        ("blocked", _P),
        *((name, _L) for name in ("m_b", "m_h", "m_g", "m_l", "m_t")),
        ("kc", _P),
        ("kt", _P),
        ("vt", _P),
        *((name, _L) for name in ("kc_b", "kc_h", "kc_j", "kt_b", "kt_h", "vt_b", "vt_h", "first", "span")),
        ("sdt", _I),
        ("out", _P),
        ("lse", _P),
        ("band", _P),
        ("band_at", _L),
        ("half", _I),
    ]


def kernel(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The built kernel, or ``None`` (see :func:`unavailable`). Built and self-tested once per process."""
    return _LIBRARY.library(flags)


def unavailable(flags: tuple[str, ...] = FLAGS) -> str | None:
    """Why :func:`kernel` is ``None`` (no compiler, a failed build, a failed self-test); ``None`` if it is not."""
    return _LIBRARY.unavailable(flags)


def build(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Compile ``cpu_decode.c`` with ``flags`` (``native_build``: reused while the source, flags,
    compiler and CPU are the same) and load it. Raises ``RuntimeError`` when no compiler is found,
    the build fails or the library's ``job_t`` differs from its ctypes mirror."""
    return _LIBRARY.build(flags)


def _bind(lib: ctypes.CDLL) -> None:
    lib.mh_decode.argtypes = [ctypes.POINTER(_Job), _I, _I]
    lib.mh_decode.restype = _I
    lib.mh_decode_joined.argtypes = [ctypes.POINTER(ctypes.POINTER(_Job)), ctypes.POINTER(_I), _I, _I]
    lib.mh_decode_joined.restype = _I
    lib.mh_job_size.restype = _L
    lib.mh_decode_tiles.argtypes = [_I, _I, _I, _I, _I]
    lib.mh_decode_tiles.restype = _I
    lib.mh_decode_int8_tiles.argtypes = [_I, _I]
    lib.mh_decode_int8_tiles.restype = _I
    if lib.mh_job_size() != ctypes.sizeof(_Job):  # the mirror of job_t must match it field for field
        size, mirror = lib.mh_job_size(), ctypes.sizeof(_Job)
        raise RuntimeError(f"{_SOURCE.name}: job_t is {size} bytes, its ctypes mirror {mirror}")


def supports(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None = None) -> bool:
    """Whether :func:`decode_partial` takes these operands: CPU tensors without autograd, outside
    ``torch.compile``, keys and values stored as fp32, bf16, fp16 (or int8 / fp8 e4m3, with scales)
    with contiguous features, head sizes multiples of 16, and the kernel built."""
    return (
        q.device.type == "cpu"
        and k.device.type == "cpu"
        and v.device.type == "cpu"
        and k.dtype in _KINDS
        and v.dtype == k.dtype
        and (k.dtype in _SCALED or q.dtype == k.dtype)
        and k.shape[-1] % 16 == 0
        and v.shape[-1] % 16 == 0
        and k.shape[-1] <= 4096
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and not torch.compiler.is_compiling()
        and (blocked is None or blocked.device.type == "cpu")
        and kernel() is not None
    )


def tiles(storage: torch.dtype, rows: int, D: int, Dv: int, masked: bool, lib: ctypes.CDLL | None = None) -> bool:
    """Whether the kernel runs a call on the AMX tiles (``cpu_decode_amx.h``): bf16 storage from 8 query
    rows per KV head, int8 / fp8 slots from 16 (MLA's 16 heads over one latent head, MQA), head sizes
    multiples of 32, no row mask (``masked``: a row mask that :func:`bands` cannot express), on a CPU
    with AMX-BF16 whose OS grants the tile state. The kernel decides; this asks it."""
    lib = kernel() if lib is None else lib
    kind = _KINDS.get(storage)
    return lib is not None and kind is not None and bool(lib.mh_decode_tiles(kind, rows, D, Dv, int(masked)))


def int8_tiles(rows: int, D: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether the kernel computes the scores of int8 slots read by ``rows`` query rows per KV head
    (at most 16: GQA's few rows) on the AMX int8 tiles (``cpu_decode_amx8.h``: the codes multiplied
    as stored, the query in three int8 terms), where :func:`tiles` does not take the call; up to 4
    rows ``P V`` too (the weights in four 7-bit digits), else ``P V`` on the FMA path. Keys of 64
    to 256 features in steps of 64, on a CPU with AMX-INT8 whose OS grants the tile state. The
    kernel decides; this asks it."""
    lib = kernel() if lib is None else lib
    return lib is not None and bool(lib.mh_decode_int8_tiles(rows, D))


class Int8Scales:
    """The scales of 8-bit slots, int8 or fp8 e4m3 (:class:`multihead.caches.QuantizedKVCache`):
    ``k = K8 · kc[span] · kt``,
    ``v = V8 · vt``. ``key_channel (B, Hkv, spans, D)``, ``key_token`` and ``value_token (B, Hkv, N)``
    in one float dtype; the slots read are ``first ..`` of the quantized region, spans of ``span`` slots."""

    def __init__(self, key_channel: Tensor, key_token: Tensor, value_token: Tensor, first: int, span: int):
        self.key_channel, self.key_token, self.value_token = key_channel, key_token, value_token
        self.first, self.span = first, span


class Segment(NamedTuple):
    """Slots of one storage for :func:`decode_joined`: ``keys``/``values``, ``blocked``, ``table``,
    ``lo``, ``n`` and ``scales`` as for :func:`decode_partial`."""

    keys: Tensor
    values: Tensor
    blocked: Tensor | None = None
    table: Tensor | None = None
    lo: int = 0
    n: int | None = None
    scales: Int8Scales | None = None


def decode_partial(
    qg: Tensor,
    keys: Tensor,
    values: Tensor,
    scale: float,
    G: int,
    Lq: int,
    blocked: Tensor | None = None,
    table: Tensor | None = None,
    lo: int = 0,
    n: int | None = None,
    scales: Int8Scales | None = None,
) -> tuple[Tensor, Tensor]:
    """One partial attention per (batch row, KV head): ``(out (B, Hkv, R, Dv) fp32, lse (B, Hkv, R) fp32)``,
    ``out`` normalised over the slots read, 0 and ``-inf`` on rows that see none.

    ``qg (B, Hkv, R = G·Lq, D)``: the folded query rows (``conventions.fold_query_heads``), times
    ``scale`` inside. ``keys``/``values``: ``(B, Hkv, n, D|Dv)`` (any strides but the last), or with
    ``table (B, width)`` int64 a head-major pool ``(Hkv, pages, ps, D|Dv)`` whose row ``b`` holds
    slot ``s`` in page ``table[b, s // ps]`` at ``s % ps``: the slots ``[lo, lo + n)`` are read.
    ``blocked``: ``None`` or ``(B|1, Hkv|1, G|1, Lq, n)`` bool, True where a row may not see the slot.
    ``scales``: for int8 or fp8 ``keys``/``values`` (:class:`Int8Scales`). Callers check :func:`supports` first."""
    return decode_joined(qg, [Segment(keys, values, blocked, table, lo, n, scales)], scale, G, Lq)


def decode_joined(qg: Tensor, segments: Sequence[Segment], scale: float, G: int, Lq: int) -> tuple[Tensor, Tensor]:
    """:func:`decode_partial` over several segments of slots at once, each in its own storage (a
    quantized cache's full-precision sinks, its 8-bit slots, its residual window), joined by their
    log-sum-exp inside the kernel: one call, one ``(out, lse)``, as :func:`multihead.merge_partials`
    of the segments' partials would give. Each segment is checked as :func:`decode_partial`'s
    operands (:func:`supports`)."""
    lib = kernel()
    if lib is None:
        raise RuntimeError(f"decode_partial: the CPU decode kernel is unavailable: {unavailable()}")
    R, D, Dv = qg.shape[2], qg.shape[3], segments[0].values.shape[-1] if segments else 0
    work = sum(qg.shape[0] * qg.shape[1] * R * (s.keys.shape[2] if s.n is None else s.n) * (D + Dv) for s in segments)
    # A small read (a short cache, a few tokens) on one thread: waking the pool costs more than it
    # saves, and on a busy machine a woken thread may wait a time slice.
    threads = torch.get_num_threads() if work >= ONE_THREAD_WORK else 1
    return _call(lib, qg, segments, scale, G, Lq, threads)


def _call(
    lib: ctypes.CDLL, qg: Tensor, segments: Sequence[Segment], scale: float, G: int, Lq: int, threads: int
) -> tuple[Tensor, Tensor]:
    B, Hkv, R, D = qg.shape
    if R != G * Lq:
        raise ValueError(f"decode_partial: qg has {R} rows per KV head, expected G·Lq = {G}·{Lq}")
    if not segments:
        raise ValueError("decode_joined: no segments")
    Dv = segments[0].values.shape[-1]
    q = qg.to(torch.float32).contiguous()
    out = torch.empty(B, Hkv, R, Dv, dtype=torch.float32)
    lse = torch.empty(B, Hkv, R, dtype=torch.float32)
    jobs, keep = [], []
    for segment in segments:
        job, held = _job(lib, q, segment, scale, G, Lq, out, lse)
        job.half = qg.dtype in (torch.bfloat16, torch.float16)  # the weights to the precision the call keeps
        jobs.append(job)
        keep.append(held)  # pages, masks and bands: alive until the call returns
    kinds = (_I * len(jobs))(*(_KINDS[segment.keys.dtype] for segment in segments))
    pointers = (ctypes.POINTER(_Job) * len(jobs))(*(ctypes.pointer(job) for job in jobs))
    if lib.mh_decode_joined(pointers, kinds, len(jobs), threads) != 0:
        raise MemoryError(f"decode_partial: the kernel could not allocate its buffers ({R} x slots scores per thread)")
    del keep
    return out, lse


def _job(
    lib: ctypes.CDLL, q: Tensor, segment: Segment, scale: float, G: int, Lq: int, out: Tensor, lse: Tensor
) -> tuple[_Job, tuple[object, ...]]:
    """The ``job_t`` of one segment (``q``: the fp32 contiguous query rows), and the tensors it points
    into that nobody else holds."""
    keys, values, blocked, table, lo, n, scales = segment
    B, Hkv, R, D = q.shape
    Dv = values.shape[-1]
    if table is None:  # (B, Hkv, n, ·): row b is one page
        n = keys.shape[2] if n is None else n
        width, ps = 1, max(1, keys.shape[2])
        pages = torch.arange(B, dtype=torch.int64)
        (k_page, k_h, k_t), (v_page, v_h, v_t) = keys.stride()[:3], values.stride()[:3]
    else:  # a head-major pool (Hkv, pages, ps, ·)
        if n is None:
            raise ValueError("decode_partial: a paged read needs n, the slots read")
        pages = table.to(torch.int64).contiguous()
        width, ps = pages.shape[1], keys.shape[2]
        (k_h, k_page, k_t), (v_h, v_page, v_t) = keys.stride()[:3], values.stride()[:3]
    job = _Job(B=B, H=Hkv, G=G, Lq=Lq, D=D, Dv=Dv, lo=lo, n=n, q=q.data_ptr(), scale=float(scale))
    job.K, job.V = keys.data_ptr(), values.data_ptr()
    job.k_h, job.k_page, job.k_t, job.v_h, job.v_page, job.v_t = k_h, k_page, k_t, v_h, v_page, v_t
    job.table, job.width, job.ps = pages.data_ptr(), width, ps
    job.out, job.lse = out.data_ptr(), lse.data_ptr()
    mask = band = None
    if blocked is not None:
        mask = blocked.expand(B, Hkv, G, Lq, n)  # stride 0 where it broadcasts
        job.blocked = mask.data_ptr()
        job.m_b, job.m_h, job.m_g, job.m_l, job.m_t = mask.stride()
        if tiles(keys.dtype, R, D, Dv, False, lib):  # the tile path takes a row mask only as bands
            band = bands(blocked, G, Lq, n)
            if band is not None:
                job.band = band.data_ptr()
    if scales is not None:
        kc, kt, vt = scales.key_channel, scales.key_token, scales.value_token
        job.kc, job.kt, job.vt = kc.data_ptr(), kt.data_ptr(), vt.data_ptr()
        job.kc_b, job.kc_h, job.kc_j = kc.stride()[:3]
        job.kt_b, job.kt_h, job.vt_b, job.vt_h = kt.stride(0), kt.stride(1), vt.stride(0), vt.stride(1)
        job.first, job.span, job.sdt = scales.first, scales.span, _SCALE_DTYPES[kc.dtype]
    return job, (pages, mask, band)


def bands(blocked: Tensor, G: int, Lq: int, n: int) -> Tensor | None:
    """``(R, 2)`` int32: each folded row's visible slots ``[first, end)`` where ``blocked`` (``(1, 1, G|1,
    Lq, n)``: the same for every batch row and KV head) is one range of slots per row and every slot is
    seen by some row (a slot no row sees may hold anything: the tiles would multiply it by 0); else
    ``None``. Causal multi-token steps and windows are such bands."""
    if blocked.shape[0] != 1 or blocked.shape[1] != 1:
        return None
    visible = ~blocked[0, 0].expand(G, Lq, n).reshape(G * Lq, n)
    if not bool(visible.any(dim=0).all()):
        return None
    count = visible.sum(dim=-1)
    first = visible.to(torch.int8).argmax(dim=-1)  # the first visible slot (0 where none)
    end = n - visible.flip(-1).to(torch.int8).argmax(dim=-1)
    empty = count == 0
    first, end = first.masked_fill(empty, 0), end.masked_fill(empty, 0)
    if not bool((count == end - first).all()):  # a row with a hole
        return None
    return torch.stack([first, end], dim=-1).to(torch.int32).contiguous()


def _self_test(lib: ctypes.CDLL) -> None:
    """The built kernel against an fp64 computation on a small case of each storage kind, masked
    rows and one that sees nothing included (a wrong build, or a compiler that miscompiles it, must
    not give wrong answers): raises ``AssertionError``."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 32, generator=generator)
    k = torch.randn(2, 2, 37, 32, generator=generator)
    v = torch.randn(2, 2, 37, 16, generator=generator)
    blocked = torch.rand(2, 1, 3, 1, 37, generator=generator) < 0.3
    blocked[1, :, 2] = True  # a row that sees nothing
    kt, vt = torch.rand(2, 2, 37, generator=generator) / 64, torch.rand(2, 2, 37, generator=generator) / 64
    k8 = (k * 40).round().clamp(-127, 127).to(torch.int8)
    v8 = (v * 40).round().clamp(-127, 127).to(torch.int8)
    kc = torch.rand(2, 2, 1, 32, generator=generator) + 0.5
    cases: list[tuple[torch.dtype, Tensor, Tensor, Int8Scales | None]]
    cases = [(dtype, k.to(dtype), v.to(dtype), None) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    cases.append((torch.int8, k8, v8, Int8Scales(kc, kt, vt, 0, 64)))
    if torch.float8_e4m3fn in _KINDS:  # every finite byte but the largest: subnormals to 448
        f8 = torch.float8_e4m3fn
        k8f, v8f = (k * 100).clamp(-448, 448).to(f8), (v / 50).to(f8)  # v / 50: e4m3's subnormals
        cases.append((f8, k8f, v8f, Int8Scales(kc, kt, vt, 0, 64)))
    # many query rows over bf16, no mask: the AMX tile path where the CPU has it (rows at a 64-slot chunk's edge)
    q16 = q.repeat(1, 1, 6, 1)[:, :, :17].bfloat16()
    k16, v16 = torch.randn(2, 2, 65, 32, generator=generator).bfloat16(), v.repeat(1, 1, 2, 2)[:, :, :65].bfloat16()
    expected = torch.softmax(q16.double() @ k16.double().transpose(-1, -2) * 0.5, -1) @ v16.double()
    out, _ = _call(lib, q16, [Segment(k16, v16, None, scales=None)], 0.5, 17, 1, 2)
    error = (out.double() - expected).abs().max().item()
    assert error < 1e-4, f"the CPU decode kernel's self-test failed for bf16 with 17 rows (error {error:.2e})"
    # 8-bit slots with 17 rows: the tiles too (16 rows and more), kc folded into the query per span
    k8, v8 = (k16.float() * 20).round().to(torch.int8), (v16.float() * 20).round().to(torch.int8)
    kc8 = torch.rand(2, 2, 3, 32, generator=generator) + 0.5
    kt8, vt8 = torch.rand(2, 2, 65, generator=generator) / 20, torch.rand(2, 2, 65, generator=generator) / 20
    keys = k8.double() * kc8.double()[:, :, torch.arange(65) // 30] * kt8.double()[..., None]
    expected = torch.softmax(q16.double() @ keys.transpose(-1, -2) * 0.5, -1) @ (v8.double() * vt8.double()[..., None])
    out, _ = _call(lib, q16, [Segment(k8, v8, None, scales=Int8Scales(kc8, kt8, vt8, 0, 30))], 0.5, 17, 1, 2)
    error = (out.double() - expected).abs().max().item()
    assert error < 1e-4, f"the CPU decode kernel's self-test failed for int8 with 17 rows (error {error:.2e})"
    # a few rows over int8 slots: the scores on the int8 tiles where the CPU has them (cpu_decode_amx8.h)
    q4 = torch.randn(2, 2, 4, 64, generator=generator)
    k4 = (torch.randn(2, 2, 40, 64, generator=generator) * 40).round().clamp(-127, 127).to(torch.int8)
    v4 = k4.flip(-2)
    kc4 = torch.rand(2, 2, 2, 64, generator=generator) + 0.5
    kt4, vt4 = torch.rand(2, 2, 40, generator=generator) / 40, torch.rand(2, 2, 40, generator=generator) / 40
    k4d = k4.double() * kc4.double()[:, :, torch.arange(40) // 32] * kt4.double()[..., None]
    expected = torch.softmax(q4.double() @ k4d.transpose(-1, -2) * 0.5, -1) @ (v4.double() * vt4.double()[..., None])
    out, _ = _call(lib, q4, [Segment(k4, v4, scales=Int8Scales(kc4, kt4, vt4, 0, 32))], 0.5, 4, 1, 2)
    error = (out.double() - expected).abs().max().item()
    assert error < 1e-4, f"the CPU decode kernel's self-test failed for int8 with 4 rows (error {error:.2e})"
    # bf16 sinks, those int8 slots and a bf16 window joined in one call (a quantized cache's read)
    sinks, window = Segment(k16[:, :, :5], v16[:, :, :5]), Segment(k16[:, :, 5:12], v16[:, :, 5:12])
    joined = [sinks, Segment(k8, v8, scales=Int8Scales(kc8, kt8, vt8, 0, 30)), window]
    every_k = torch.cat([k16[:, :, :5].double(), keys, k16[:, :, 5:12].double()], 2)
    every_v = torch.cat([v16[:, :, :5], v8 * vt8[..., None], v16[:, :, 5:12]], 2).double()
    expected = torch.softmax(q16.double() @ every_k.transpose(-1, -2) * 0.5, -1) @ every_v
    out, _ = _call(lib, q16, joined, 0.5, 17, 1, 2)
    error = (out.double() - expected).abs().max().item()
    assert error < 1e-4, f"the CPU decode kernel's self-test failed for joined segments (error {error:.2e})"
    band = torch.arange(65)[None, :] < torch.arange(17)[:, None]  # row r sees slots [r, 65): bands on the tiles
    scores = (q16.double() @ k16.double().transpose(-1, -2) * 0.5).masked_fill(band, float("-inf"))
    out, _ = _call(lib, q16, [Segment(k16, v16, band.view(1, 1, 17, 1, 65))], 0.5, 17, 1, 2)
    error = (out.double() - torch.softmax(scores, -1) @ v16.double()).abs().max().item()
    assert error < 1e-4, f"the CPU decode kernel's self-test failed for bf16 bands (error {error:.2e})"
    # many fp32 rows: 16 to a vector's lanes (cpu_decode.c's scores_t16, values_t16), the 17th in 4-row blocks
    q32, k32, v32 = q16.float(), k16.float(), v16.float()
    for mask in (None, band):
        scores = q32.double() @ k32.double().transpose(-1, -2) * 0.5
        scores = scores if mask is None else scores.masked_fill(mask, float("-inf"))
        seen = None if mask is None else mask.view(1, 1, 17, 1, 65)
        out, _ = _call(lib, q32, [Segment(k32, v32, seen)], 0.5, 17, 1, 2)
        error = (out.double() - torch.softmax(scores, -1) @ v32.double()).abs().max().item()
        assert error < 1e-4, f"the CPU decode kernel's self-test failed for 17 fp32 rows (error {error:.2e})"
    for dtype, kd, vd, scales in cases:
        keys, values = kd.double(), vd.double()
        if scales is not None:
            keys, values = keys * kc.double() * kt.double()[..., None], values * vt.double()[..., None]
        scores = (q.double() @ keys.transpose(-1, -2) * 0.5).masked_fill(blocked.squeeze(-2), float("-inf"))
        expected = torch.nan_to_num(torch.softmax(scores, dim=-1)) @ values
        out, _ = _call(lib, q, [Segment(kd, vd, blocked, scales=scales)], 0.5, 3, 1, 2)
        error = (out.double() - expected).abs().max().item()
        assert error < 1e-4, f"the CPU decode kernel's self-test failed for {dtype} (error {error:.2e})"


_LIBRARY = NativeLibrary(_SOURCE, _bind, _self_test)
