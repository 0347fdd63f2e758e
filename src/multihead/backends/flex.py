"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, compiled once and reused.

A mask becomes a ``BlockMask`` through :meth:`Mask.as_mask_mod` and ``create_block_mask``,
cached per (mask value, shape, device) so it is built once, not per call; a score modifier is
passed as flex's ``score_mod`` (it has flex's signature). The LSE comes from the kernel
(``return_lse=True``) off CPU. The compiled ``flex_attention`` is created on first use and shared.

On a 2-core CPU the first compile takes about a minute and dense causal runs slower than SDPA,
so ``auto`` never picks it there (``auto_refusals``; decision table in docs/performance.md).
On CUDA ``auto`` picks it for structured masks (sliding windows, packed documents, padding) from
``Lq * Lk >= CUDA_MIN_WORK``, where sdpa would run a dense ``Lq x Lk`` mask on a slower kernel;
the first call of each shape compiles. Force it with ``backend="flex"``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from multihead.backends.base import Backend, Capabilities
from multihead.blocks import Block, Extent
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import lse_dtype
from multihead.masks import Mask
from multihead.scoring import mask_unseen_keys

__all__ = ["FlexBackend"]

try:  # absent on old PyTorch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except Exception:  # pragma: no cover - depends on the PyTorch build
    create_block_mask = flex_attention = None  # type: ignore[assignment]  # refused in capabilities instead

_compiled = None

#: On CUDA, ``auto`` sends a structured mask to flex from ``Lq * Lk >= CUDA_MIN_WORK``, and a mask
#: made of bands only (sliding windows) from ``CUDA_MIN_WORK_BAND``: sdpa then runs a dense mask on
#: its masked kernels, which read a dense ``Lq x Lk`` mask and compute every score, while flex's cost
#: follows the visible blocks. Below these flex's fixed cost per call loses, except that a document or padding
#: mask costs sdpa more to prepare than a band (which it builds from two comparisons), hence the
#: lower threshold for those: a document mask already runs faster on flex at L=2048, a window does
#: not (L=4096 is not measured).
#: measured (H100, bf16, benchmarks/gpu_dispatch.py): docs/performance.md#on-the-gpu-h100
CUDA_MIN_WORK = 2048 * 2048
CUDA_MIN_WORK_BAND = 4096 * 4096


def _recompile_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def _compiled_flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


class FlexBackend(Backend):
    """The ``flex`` backend: torch.nn.attention.flex_attention, compiled once; BlockMask cached per mask and
    shape. What it runs is declared in its ``capabilities``; why it refuses a call, in ``explain()``."""

    name = "flex"
    summary = "torch.nn.attention.flex_attention, compiled once; BlockMask cached per mask and shape"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        dropout=False,
        native_lse=True,
        masks="every mask, as a BlockMask from its mask_mod",
    )

    def __init__(self) -> None:
        self._block_masks: OrderedDict = OrderedDict()
        self._compiled: set = set()  # the calls compiled so far (shapes, dtype, mask, modifier), see refusals

    @staticmethod
    def _compile_key(call: AttentionCall) -> tuple:
        return (call.shape, call.q.dtype, str(call.q.device), call.mask, call.score_mod)

    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        if call.q.device.type == "cpu" and call.requires_grad:
            reasons.append("compiled flex_attention on CPU supports inference only (no backward)")
        if flex_attention is None:
            reasons.append("torch.nn.attention.flex_attention is not available in this PyTorch")
        limit = _recompile_limit()
        if torch.compiler.is_compiling():
            pass  # inside a caller's torch.compile: flex_attention is traced into that graph, no compile of its own
        elif self._compile_key(call) not in self._compiled and len(self._compiled) >= limit:
            # PyTorch's fault, worked around here: past torch.compile's recompile limit the compiled
            # flex_attention silently falls back to an unfused path that materializes every score.
            reasons.append(
                f"this would be compile number {len(self._compiled) + 1} of flex_attention (a new shape, "
                f"mask or modifier); past torch.compile's recompile limit ({limit}) PyTorch falls back to "
                "an unfused path that materializes the full score matrix: use blocksparse or sdpa, or "
                "raise torch._dynamo.config.recompile_limit"
            )
        return reasons

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        device = call.q.device.type
        if device == "cpu":
            return ["on CPU its compile takes about a minute and blocksparse/sdpa are faster (measured)"]
        if device != "cuda":
            return [f"not measured on {device}; sdpa is the safe default"]
        # CUDA: flex's cost follows the visible blocks; sdpa's masked kernels read a dense Lq x Lk
        # mask and are slower than flex's even where most of it is visible (measured; above).
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        mask = call.mask
        if mask is None or mask.causal_offset(Lq, Lk) is not None:
            return ["no mask or a causal diagonal: sdpa runs it without a mask tensor (flash/cuDNN)"]
        least = CUDA_MIN_WORK_BAND if mask.kinds() <= {"band"} else CUDA_MIN_WORK
        if Lq * Lk < least:
            return [f"Lq*Lk = {Lq * Lk} < {least}: flex's fixed cost per call loses to sdpa with the dense mask"]
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        return [
            "torch.compile(flex_attention) once per process (slow first call)",
            "mask -> BlockMask via create_block_mask(mask.as_mask_mod(Lq, Lk)), cached per mask value and shape",
            "score modifier passed as flex's score_mod" if call.score_mod is not None else "no score modifier",
            "GQA passed natively (enable_gqa=True)",
        ]

    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        # Inside a caller's torch.compile, flex_attention and create_block_mask are traced into the
        # caller's graph: no compile of their own, no BlockMask cache (a dict keyed by a mask object),
        # and the fully masked rows zeroed without asking first whether there are any (a host sync).
        compiling = torch.compiler.is_compiling()
        block_mask, empty, unseen = (
            (None, None, None) if call.mask is None else self._block_mask(call.mask, call.extent, Hkv, call.q.device)
        )
        k, v = call.k, call.v
        if unseen is not None:
            # A key no query may see can hold anything (docs/conventions.md), but the kernel computes
            # 0 · value for it inside a partly visible block, and 0 · NaN = NaN: zeroed first, as sdpa does.
            zero = torch.zeros((), dtype=k.dtype, device=k.device)
            k, v = torch.where(unseen, zero, k), torch.where(unseen, zero, v)
        if not compiling:
            self._compiled.add(self._compile_key(call))
        # The kernel's LSE where it has one; compiled flex on CPU has none (PyTorch 2.13: "return_lse
        # is not supported yet"), and attention() then recomputes it in one blockwise pass.
        with_lse = call.return_lse and call.q.device.type != "cpu"
        result = (flex_attention if compiling else _compiled_flex())(
            call.q,
            k,
            v,
            score_mod=call.score_mod,
            block_mask=block_mask,
            scale=call.scale,
            enable_gqa=Hq != Hkv,
            return_lse=with_lse,
        )
        out, lse = result if with_lse else (result, None)
        if call.mask is not None:
            if empty is not None:  # fully masked rows: exactly 0, LSE -inf
                # Traced, the output is left as flex_attention gives it (0 on a row that sees no key:
                # eager, aot_eager and Inductor, torch 2.13 CPU): Inductor's CPU flex template
                # refuses an epilogue ("Unsupported for `epilogue_nodes` in CppFlexAttentionTemplate").
                out = out if compiling else out.masked_fill(empty.unsqueeze(-1), 0.0)
                if lse is not None:
                    lse = lse.masked_fill(empty.expand_as(lse), float("-inf"))
        return AttentionResult(out, None, None if lse is None else lse.to(lse_dtype(call.q.dtype)))

    def _block_mask(self, mask: Mask, extent: Extent, num_kv_heads: int, device):
        """``(BlockMask, fully masked rows (B|1, Hq|1, Lq) or None, keys no query sees (B|1, Hkv|1,
        Lk, 1) or None)`` of the call's ``extent``, kept per mask value, extent and ``Hkv``: a
        repeated call costs a dictionary lookup (the rows and keys are host questions, asked once)."""
        if torch.compiler.is_compiling():
            # Traced: the rows and keys as tensors always (no data-dependent branch), nothing kept.
            return (
                self._new_block_mask(mask, extent, device),
                mask._empty_rows(extent, device=device),
                mask_unseen_keys(mask, extent, num_kv_heads, device),
            )
        key = (mask, extent, num_kv_heads, str(device))  # by value; the key holds the mask's tensors alive
        hit = self._block_masks.get(key)
        if hit is not None:
            self._block_masks.move_to_end(key)
            return hit
        unseen = mask_unseen_keys(mask, extent, num_kv_heads, device)
        made = (
            self._new_block_mask(mask, extent, device),
            mask.empty_rows(extent, device=device),
            unseen if bool(unseen.any()) else None,
        )
        self._block_masks[key] = made
        while len(self._block_masks) > 16:
            self._block_masks.popitem(last=False)
        return made

    @staticmethod
    def _new_block_mask(mask: Mask, extent: Extent, device):
        # The kernel evaluates the mask_mod inside itself: every tensor it reads must be on its
        # device already (a copy inside a compiled flex kernel fails to lower).
        mask = mask.to(device)
        Lq, Lk = extent.lengths
        # Dimensions the mask does not depend on are passed as None (one BlockMask row for all).
        probe = mask.materialize_block(extent, Block(0, 1, 0, 1), device)
        b = extent.batch if probe.shape[0] > 1 else None
        h = extent.heads if probe.shape[1] > 1 else None
        return create_block_mask(mask.as_mask_mod(Lq, Lk), b, h, Lq, Lk, device=str(device))
