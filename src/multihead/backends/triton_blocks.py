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

import torch
from torch import Tensor

from multihead.backends.base import Backend, Capabilities
from multihead.backends.mask_program import MaskProgram, mask_program
from multihead.backends.tile_plan import TilePlan, tile_plan
from multihead.call import AttentionCall, AttentionResult
from multihead.masks import Mask
from multihead.memo import BoundedCache

__all__ = ["TritonBlocksBackend"]

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
        score_mods=frozenset(),
        dropout=False,
        native_lse=True,
        masks="causal and sliding windows (either alignment, or per sequence), key padding (lengths or a table), "
        "documents and document_causal, and & | ~ of up to five of them, read at offsets (Mask.shifted)",
        compiles=False,
        compile_note="a Triton launch from Python after a tile plan read on the host from the mask's structure",
    )

    def __init__(
        self,
        block_m: int = 128,
        block_n: int = 64,
        backward_block: int = 64,
        *,
        num_warps: int = 8,
        backward_warps: int = 4,
        num_stages: int = 3,
    ):
        """Tiles of ``block_m`` queries x ``block_n`` keys in the forward, ``backward_block`` square
        in the backward (powers of two, at least 16, ``tl.dot``'s smallest); the warps and software
        pipeline stages of each launch. The defaults are the shapes of Triton's fused-attention
        tutorial for head dim 128 until GPU measurements choose (benchmarks/gpu.py --only tiles)."""
        for name, value in (("block_m", block_m), ("block_n", block_n), ("backward_block", backward_block)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"TritonBlocksBackend: {name} must be a power of two >= 16, got {value!r}")
        for name, value in (("num_warps", num_warps), ("backward_warps", backward_warps), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TritonBlocksBackend: {name} must be a positive int, got {value!r}")
        self.block_m, self.block_n, self.backward_block = block_m, block_n, backward_block
        self.launch = ((num_warps, num_stages), (backward_warps, num_stages))
        # Plans and mask programs per (mask value, shape, tiles, device): a repeated call reads them.
        self._plans: BoundedCache[tuple, tuple[TilePlan, TilePlan]] = BoundedCache(32)
        self._programs: BoundedCache[tuple, MaskProgram | str] = BoundedCache(32)

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
        return reasons

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        forward, _ = self._plan(call.mask, B, Hq, Lq, Lk, self.block_m, self.block_n, torch.device("cpu"))
        total = -(-Lq // self.block_m) * -(-Lk // self.block_n)
        return [
            f"{forward.tiles} of {total} tiles of {self.block_m}x{self.block_n} visible "
            f"({int((forward.ptr[:, 1] - forward.ptr[:, 0]).sum())} partial: mask evaluated in the kernel)",
            "GQA through strides, no K/V copies" if Hq != Hkv else "one KV head per query head",
        ]

    # ------------------------------------------------------------------------- running
    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        device = call.q.device
        program = self._program(call.mask, B, Lq, Lk)
        assert not isinstance(program, str)  # refused otherwise
        program = program.to(device)
        fwd, _ = self._plan(call.mask, B, Hq, Lq, Lk, self.block_m, self.block_n, device)
        bwd = self._plan(call.mask, B, Hq, Lq, Lk, self.backward_block, self.backward_block, device)
        tiles = (self.block_m, self.block_n, self.backward_block)
        if call.requires_grad:
            out, lse = _Attention.apply(call.q, call.k, call.v, call.scale, program, fwd, bwd, tiles, self.launch)
        else:
            out, lse = _forward(call.q, call.k, call.v, call.scale, program, fwd, tiles, self.launch[0])
        return AttentionResult(out, None, lse if call.return_lse else None)

    def _program(self, mask: Mask | None, batch: int, q_len: int, kv_len: int) -> MaskProgram | str:
        key = (mask, batch, q_len, kv_len)
        hit = self._programs.get(key)
        return hit if hit is not None else self._programs.put(key, mask_program(mask, batch, q_len, kv_len))

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


def _launch_args(program: MaskProgram, bd: int, bdv: int, dtype: torch.dtype, D: int, Dv: int) -> dict:
    """The compile-time arguments every kernel takes (the mask program's kinds and table, sizes)."""
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
    )


def _padded(d: int) -> int:
    """The head dim a tile holds: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, 1 << (d - 1).bit_length())


def _forward(q, k, v, scale, program, plan, tiles, launch) -> tuple[Tensor, Tensor]:
    block_m, block_n, _ = tiles
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kernels = _kernels()
    out = torch.empty(B, Hq, Lq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    grid = (-(-Lq // block_m), B * Hq)
    kernels.forward[grid](
        q, k, v, out, lse, plan.ptr, _nonempty(plan.idx), program.params, program.data,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Hq, Hq // Hkv, Lq, Lk, scale * kernels.LOG2E,
        BM=block_m, BN=block_n, **_launch_args(program, _padded(D), _padded(Dv), q.dtype, D, Dv),
        num_warps=launch[0], num_stages=launch[1],
    )  # fmt: skip
    return out, lse


def _nonempty(t: Tensor) -> Tensor:
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


class _Attention(torch.autograd.Function):
    """The forward kernel, and the backward's two kernels (dQ by query tile; dK, dV by key tile)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, program, fwd, bwd, tiles, launch):
        out, lse = _forward(q, k, v, scale, program, fwd, tiles, launch[0])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.program, ctx.bwd, ctx.block, ctx.launch = scale, program, bwd, tiles[2], launch[1]
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        B, Hq, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        kernels, program, (by_query, by_key), block = _kernels(), ctx.program, ctx.bwd, ctx.block
        if dout is None:
            dout = torch.zeros_like(out)
        # delta = rowsum(dO ∘ O) - dLSE: the LSE's gradient joins the softmax's in one column.
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - dlse.float()
        delta = delta.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        consts = dict(BM=block, BN=block, **_launch_args(program, _padded(D), _padded(Dv), q.dtype, D, Dv))
        consts.update(num_warps=ctx.launch[0], num_stages=ctx.launch[1])
        qk_scale = ctx.scale * kernels.LOG2E
        kernels.backward_dq[(-(-Lq // block), B * Hq)](
            q, k, v, dout, dq, lse, delta, by_query.ptr, _nonempty(by_query.idx), program.params, program.data,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
            Hq, Hq // Hkv, Lq, Lk, qk_scale, ctx.scale, **consts,
        )  # fmt: skip
        kernels.backward_dkdv[(-(-Lk // block), B * Hkv)](
            q, k, v, dout, dk, dv, lse, delta, by_key.ptr, _nonempty(by_key.idx), program.params, program.data,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            Hq, Hkv, Hq // Hkv, Lq, Lk, qk_scale, ctx.scale, **consts,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None
