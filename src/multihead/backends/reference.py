"""The ``reference`` backend: :func:`multihead.reference.reference_attention` behind the registry.

Supports everything (every mask, every score modifier with gradients, GQA, dropout including an
injected ``dropout_mask``, the LSE); materializes the full ``(B, Hq, Lq, Lk)`` scores, so it is
the choice of last resort.
"""

from __future__ import annotations

import torch

from multihead.backends.base import Backend, Capabilities
from multihead.call import AttentionCall, AttentionResult
from multihead.reference import reference_attention

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """The ``reference`` backend: plain PyTorch, every feature, O(Lq*Lk) memory; the oracle. What it runs is
    declared in its ``capabilities``; why it refuses a call, in ``explain()``."""

    name = "reference"
    summary = "plain PyTorch, every feature, O(Lq*Lk) memory; the oracle"
    capabilities = Capabilities(injected_dropout=True, native_lse=True)

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        precision = {torch.float16: "fp32 (inputs fp16)", torch.bfloat16: "fp32 (inputs bf16)"}.get(
            call.q.dtype, str(call.q.dtype).replace("torch.", "")
        )
        return [f"materializes scores and weights: {B}x{Hq}x{Lq}x{Lk} elements", f"softmax accumulated in {precision}"]

    def forward(self, call: AttentionCall) -> AttentionResult:
        result = reference_attention(
            call.q,
            call.k,
            call.v,
            mask=call.mask,
            score_mod=call.score_mod,
            scale=call.scale,
            dropout_p=call.dropout_p,
            dropout_mask=call.dropout_mask,
        )
        return AttentionResult(result.output, None, result.lse if call.return_lse else None)
