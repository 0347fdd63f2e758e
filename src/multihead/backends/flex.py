"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, compiled once and reused.

A mask becomes a ``BlockMask`` through :meth:`Mask.as_mask_mod` and ``create_block_mask``,
cached per (mask object, shape, device) so it is built once, not per call. The compiled
``flex_attention`` is created on first use and shared by every call.

On a 2-core CPU the first compile takes about a minute and dense causal runs slower than SDPA,
so ``auto`` never picks it there (``auto_refusals``; decision table in docs/performance.md).
Force it with ``backend="flex"``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from multihead.backends.base import Backend, Capabilities
from multihead.masks import Mask
from multihead.blockwise import lse_by_blocks
from multihead.reference import AttentionResult
from multihead.validation import AttentionCall

__all__ = ["FlexBackend"]

try:  # absent on old PyTorch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except Exception:  # pragma: no cover - depends on the PyTorch build
    create_block_mask = flex_attention = None

_compiled = None


def _compiled_flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


class FlexBackend(Backend):
    name = "flex"
    summary = "torch.nn.attention.flex_attention, compiled once; BlockMask cached per mask and shape"
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        dropout=False,
        masks="boolean masks (every structured mask and custom); not additive tensors",
    )

    def __init__(self):
        self._block_masks: OrderedDict = OrderedDict()

    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        if call.q.device.type == "cpu" and call.requires_grad:
            reasons.append("compiled flex_attention on CPU supports inference only (no backward)")
        if flex_attention is None:
            reasons.append("torch.nn.attention.flex_attention is not available in this PyTorch")
        if call.mask is not None and call.mask.is_additive:
            reasons.append("additive (float) masks would need a score_mod; not supported")
        return reasons

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        if call.q.device.type == "cpu":
            return ["on CPU its compile takes about a minute and blocksparse/sdpa are faster (measured)"]
        return ["not measured on this device yet; sdpa is the safe default"]

    def plan(self, call: AttentionCall) -> list[str]:
        return ["torch.compile(flex_attention) once per process (slow first call)",
                "mask -> BlockMask via create_block_mask(mask.as_mask_mod(Lq, Lk)), cached per mask and shape",
                "GQA passed natively (enable_gqa=True)"]

    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        block_mask = None if call.mask is None else self._block_mask(call.mask, B, Hq, Lq, Lk, call.q.device)
        # Compiled flex on CPU cannot return the LSE: it is recomputed block by block when asked.
        out = _compiled_flex()(call.q, call.k, call.v, block_mask=block_mask, scale=call.scale,
                               enable_gqa=Hq != Hkv)
        if call.mask is not None:
            empty = call.mask.empty_rows(B, Hq, Lq, Lk, device=call.q.device)
            if empty is not None:  # fully masked rows: exactly 0
                out = out.masked_fill(empty.unsqueeze(-1), 0.0)
        lse = lse_by_blocks(call.q, call.k, call.mask, call.scale) if call.return_lse else None
        return AttentionResult(out, None, lse)

    def _block_mask(self, mask: Mask, B, Hq, Lq, Lk, device):
        key = (id(mask), B, Hq, Lq, Lk, str(device))
        hit = self._block_masks.get(key)
        if hit is not None and hit[0] is mask:
            return hit[1]
        # Dimensions the mask does not depend on are passed as None (one BlockMask row for all).
        probe = mask.materialize_block(B, Hq, 0, 1, Lq, Lk, device, None, 0, 1)
        b = B if probe.shape[0] > 1 else None
        h = Hq if probe.shape[1] > 1 else None
        block_mask = create_block_mask(mask.as_mask_mod(Lq, Lk), b, h, Lq, Lk, device=str(device))
        self._block_masks[key] = (mask, block_mask)
        while len(self._block_masks) > 16:
            self._block_masks.popitem(last=False)
        return block_mask
