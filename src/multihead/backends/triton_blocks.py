"""The ``triton_blocks`` backend: block-sparse flash attention in Triton kernels of our own
(:mod:`multihead.backends.triton_kernels`), forward and backward, on CUDA.

What it runs is the mask's own structure: the tile plan (:mod:`multihead.backends.tile_plan`)
says which key tiles each query tile reads and which of them need the mask at all, and a partial
tile evaluates the mask element by element from its program (:mod:`multihead.backends.mask_program`:
band offsets, key lengths, document ids), so no ``Lq x Lk`` tensor is ever built and the work
follows the visible tiles. GQA reads each KV head through strides (no copies); the LSE comes from
the kernel; fp16/bf16 accumulate in fp32.

``auto`` does not choose it (it is registered without a priority): its place in the decision
table waits for GPU measurements (``benchmarks/gpu.py``, docs/performance.md). Force it with
``backend="triton_blocks"``. On the CPU it refuses, except under :func:`_cpu_interpreter`, the
test switch of ``tests/backends/test_triton_blocks.py``, which runs the same kernels through
Triton's interpreter (``TRITON_INTERPRET=1`` set before the kernels are first imported).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.backends.base import Backend, Capabilities
from multihead.backends.mask_program import MaskProgram, mask_program
from multihead.backends.score_program import ScoreProgram, score_program
from multihead.backends.tile_plan import TilePlan, tile_plan
from multihead.call import AttentionCall, AttentionResult
from multihead.masks import Mask
from multihead.memo import BoundedCache
from multihead.scores import ADDITIVE, ELEMENTWISE, ScoreMod

__all__ = ["TritonBlocksBackend", "Tiles"]

_CPU_INTERPRETER = False  # the test switch: see _cpu_interpreter


@contextlib.contextmanager
def _cpu_interpreter() -> Iterator[None]:
    """Within this block the backend serves CPU tensors through Triton's interpreter, when forced
    by name (``auto`` never chooses it). For tests of the kernels on a machine without a GPU."""
    global _CPU_INTERPRETER
    before, _CPU_INTERPRETER = _CPU_INTERPRETER, True
    try:
        yield
    finally:
        _CPU_INTERPRETER = before


@dataclass(frozen=True)
class Tiles:
    """Tiles (queries x keys, powers of two, at least 16: ``tl.dot``'s smallest) and the warps and
    software-pipeline stages of the three kernels: the forward and dQ share one tiling (and one
    plan); dK/dV has its own (few queries x many keys, as Triton's fused-attention tutorial). The
    defaults compile for sm_90 at head dim 128 without spilling registers, or with the fewest
    (``benchmarks/triton_compile.py``); which is fastest is for a GPU to say
    (``benchmarks/gpu.py --only tiles``)."""

    forward: tuple[int, int] = (128, 64)
    dkdv: tuple[int, int] = (32, 64)
    warps: tuple[int, int, int] = (8, 8, 8)  # forward, dQ, dK/dV
    stages: tuple[int, int, int] = (3, 2, 3)

    def __post_init__(self) -> None:
        for name, sizes in (("forward", self.forward), ("dkdv", self.dkdv)):
            if len(sizes) != 2 or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 16 or n & (n - 1) for n in sizes
            ):
                raise ValueError(f"Tiles: {name} must be two powers of two >= 16 (queries, keys), got {sizes!r}")
        for name, values in (("warps", self.warps), ("stages", self.stages)):
            if len(values) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
                raise ValueError(f"Tiles: {name} must be three positive ints (forward, dQ, dK/dV), got {values!r}")


class TritonBlocksBackend(Backend):
    """The ``triton_blocks`` backend: Triton block-sparse flash attention driven by the mask's tile
    plan; partial tiles evaluate the mask from its structure. What it runs is declared in its
    ``capabilities``; why it refuses a call, in ``explain()``."""

    name = "triton_blocks"
    summary = "Triton block-sparse flash attention: key tiles from the mask's structure, partial ones masked in-kernel"
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_head_dim=256,
        mask_kinds=frozenset({"band", "key_padding", "document"}),
        score_mods=frozenset({ADDITIVE, ELEMENTWISE}),  # relative biases and softcap (score_program.py)
        score_mod_grad=False,
        dropout=False,
        native_lse=True,
        masks="causal and sliding windows (either alignment, or per sequence), key padding (lengths or a table), "
        "documents and document_causal, and & | ~ of up to five of them, read at offsets (Mask.shifted)",
        compiles=False,
        compile_note="a Triton launch from Python after a tile plan read on the host from the mask's structure",
    )

    def __init__(self, tiles: Tiles | None = None):
        """``tiles``: the tile shapes and launch settings of the three kernels (:class:`Tiles`)."""
        if tiles is not None and not isinstance(tiles, Tiles):
            raise TypeError(f"TritonBlocksBackend: tiles must be a Tiles, got {type(tiles).__name__}")
        self.tiles = Tiles() if tiles is None else tiles
        # Plans and mask programs per (mask value, shape, tiles, device): a repeated call reads them.
        self._plans: BoundedCache[tuple, tuple[TilePlan, TilePlan]] = BoundedCache(32)
        self._programs: BoundedCache[tuple, MaskProgram | str] = BoundedCache(32)
        self._scores: BoundedCache[tuple, ScoreProgram | str] = BoundedCache(32)

    # ------------------------------------------------------------------------- refusals
    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        device = call.q.device.type
        if device == "cpu" and _CPU_INTERPRETER:
            reasons = [r for r in reasons if not r.startswith("device type")]
        if not _triton_installed():
            reasons.append("triton is not installed (pip install 'multihead[triton]')")
        elif device == "cpu" and _CPU_INTERPRETER and not _kernels().INTERPRETED:
            reasons.append("its kernels were built for the GPU in this process (TRITON_INTERPRET=1 was not set)")
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        if B * max(Hq, Hkv) > 65535:
            reasons.append(f"B*H = {B * max(Hq, Hkv)} > 65535, the kernels' second grid dimension")
        if not reasons and not call.empty:
            program = self._program(call.mask, B, Lq, Lk)
            if isinstance(program, str):
                reasons.append(program)
            scores = self._score_program(call.score_mod, Lq, Lk)
            if isinstance(scores, str):
                reasons.append(scores)
        return reasons

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        bm, bn = self.tiles.forward
        forward, _ = self._plan(call.mask, B, Hq, Lq, Lk, bm, bn, torch.device("cpu"))
        total = -(-Lq // bm) * -(-Lk // bn)
        return [
            f"{forward.tiles} of {total} tiles of {bm}x{bn} visible "
            f"({int((forward.ptr[:, 1] - forward.ptr[:, 0]).sum())} partial: mask evaluated in the kernel)",
            "GQA through strides, no K/V copies" if Hq != Hkv else "one KV head per query head",
        ]

    # ------------------------------------------------------------------------- running
    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        device = call.q.device
        program = self._program(call.mask, B, Lq, Lk)
        scores = self._score_program(call.score_mod, Lq, Lk)
        assert not isinstance(program, str) and not isinstance(scores, str)  # refused otherwise
        programs = (program.to(device), scores.to(device))
        tiles = self.tiles
        by_query, _ = self._plan(call.mask, B, Hq, Lq, Lk, *tiles.forward, device)
        if call.requires_grad:
            _, by_key = self._plan(call.mask, B, Hq, Lq, Lk, *tiles.dkdv, device)
            out, lse = _Attention.apply(call.q, call.k, call.v, call.scale, programs, by_query, by_key, tiles)
        else:
            out, lse = _forward(call.q, call.k, call.v, call.scale, programs, by_query, tiles)
        return AttentionResult(out, None, lse if call.return_lse else None)

    def _program(self, mask: Mask | None, batch: int, q_len: int, kv_len: int) -> MaskProgram | str:
        key = (mask, batch, q_len, kv_len)
        hit = self._programs.get(key)
        return hit if hit is not None else self._programs.put(key, mask_program(mask, batch, q_len, kv_len))

    def _score_program(self, mod: ScoreMod | None, q_len: int, kv_len: int) -> ScoreProgram | str:
        key = (mod, q_len, kv_len)
        hit = self._scores.get(key)
        return hit if hit is not None else self._scores.put(key, score_program(mod, q_len, kv_len))

    def _plan(self, mask, batch, heads, q_len, kv_len, block_m, block_n, device) -> tuple[TilePlan, TilePlan]:
        key = (mask, batch, heads, q_len, kv_len, block_m, block_n, str(device))
        hit = self._plans.get(key)
        if hit is not None:
            return hit
        by_query, by_key = tile_plan(mask, batch, heads, q_len, kv_len, block_m, block_n)
        return self._plans.put(key, (by_query.to(device), by_key.to(device)))


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels():
    from multihead.backends import triton_kernels

    return triton_kernels


def _runtime_args(programs: tuple[MaskProgram, ScoreProgram]) -> tuple:
    """The mask program's and score program's tensors and values every kernel reads."""
    program, scores = programs
    rb = program.data if scores.relative is None else scores.relative  # (any pointer when no bias)
    srbh = 0 if scores.relative is None or scores.relative.shape[0] == 1 else scores.relative.stride(0)
    return program.params, program.data, rb, srbh, scores.cap


def _launch_args(programs: tuple[MaskProgram, ScoreProgram], bd: int, bdv: int, dtype: torch.dtype, D: int, Dv: int):
    """The compile-time arguments every kernel takes (the programs' kinds, table and flags, sizes)."""
    program, scores = programs
    kinds = (*program.kinds, *[0] * (5 - len(program.kinds)))
    dt, prec = _kernels().dot_operands(dtype)
    return dict(
        D=D,
        DV=Dv,
        NLEAF=len(program.kinds),
        K0=kinds[0],
        K1=kinds[1],
        K2=kinds[2],
        K3=kinds[3],
        K4=kinds[4],
        TABLE=program.table,
        BD=bd,
        BDV=bdv,
        DT=dt,
        PREC=prec,
        MODS=scores.relative is not None or scores.cap > 0,
        HAS_REL=scores.relative is not None,
        HAS_CAP=scores.cap > 0,
        CAP_FIRST=scores.cap_first,
    )


def _padded(d: int) -> int:
    """The head dim a tile holds: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, 1 << (d - 1).bit_length())


def _forward(q, k, v, scale, program, plan: TilePlan, tiles: Tiles) -> tuple[Tensor, Tensor]:
    block_m, block_n = tiles.forward
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kernels = _kernels()
    out = torch.empty(B, Hq, Lq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    grid = (-(-Lq // block_m), B * Hq)
    kernels.forward[grid](
        q, k, v, out, lse, plan.ptr, _nonempty(plan.idx), *_runtime_args(program),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Hq, Hq // Hkv, Lq, Lk, scale * kernels.LOG2E, scale,
        BM=block_m, BN=block_n, **_launch_args(program, _padded(D), _padded(Dv), q.dtype, D, Dv),
        num_warps=tiles.warps[0], num_stages=tiles.stages[0],
    )  # fmt: skip
    return out, lse


def _nonempty(t: Tensor) -> Tensor:
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


class _Attention(torch.autograd.Function):
    """The forward kernel, and the backward's two kernels (dQ by query tile; dK, dV by key tile)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, program, by_query, by_key, tiles):
        out, lse = _forward(q, k, v, scale, program, by_query, tiles)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.program, ctx.plans, ctx.tiles = scale, program, (by_query, by_key), tiles
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        B, Hq, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        kernels, program, (by_query, by_key), tiles = _kernels(), ctx.program, ctx.plans, ctx.tiles
        if dout is None:
            dout = torch.zeros_like(out)
        # delta = rowsum(dO ∘ O) - dLSE: the LSE's gradient joins the softmax's in one column.
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - dlse.float()
        delta = delta.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        consts = _launch_args(program, _padded(D), _padded(Dv), q.dtype, D, Dv)
        (bm, bn), (km, kn) = tiles.forward, tiles.dkdv
        qk_scale = ctx.scale * kernels.LOG2E
        kernels.backward_dq[(-(-Lq // bm), B * Hq)](
            q, k, v, dout, dq, lse, delta, by_query.ptr, _nonempty(by_query.idx), *_runtime_args(program),
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
            Hq, Hq // Hkv, Lq, Lk, qk_scale, ctx.scale, BM=bm, BN=bn, **consts,
            num_warps=tiles.warps[1], num_stages=tiles.stages[1],
        )  # fmt: skip
        kernels.backward_dkdv[(-(-Lk // kn), B * Hkv)](
            q, k, v, dout, dk, dv, lse, delta, by_key.ptr, _nonempty(by_key.idx), *_runtime_args(program),
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            Hq, Hkv, Hq // Hkv, Lq, Lk, qk_scale, ctx.scale, BM=km, BN=kn, **consts,
            num_warps=tiles.warps[2], num_stages=tiles.stages[2],
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None
