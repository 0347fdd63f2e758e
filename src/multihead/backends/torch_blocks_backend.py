"""The ``torch_blocks`` backend: what PyTorch's fused CPU kernels cannot do, dropout and
elementwise score modifiers (softcap, a user's ``score_mod``), a query block at a time in plain
PyTorch (:func:`multihead.backends.torch_blocks.attention_by_blocks`): each block attends to the
key range its mask lets it see, under activation checkpointing, so cost follows the visible area
and memory is one block. ``auto`` takes it for those calls only (``blocksparse`` runs the others
on the fused kernel), and for dropout only where it beats ``sdpa``'s math kernel on the dense
mask (the decision table, docs/performance.md).
"""

from __future__ import annotations

import torch.nn.functional as F

from multihead.backends.base import MASK_KINDS, Backend, Capabilities
from multihead.backends.block_plan import DEFAULT_BLOCK_SIZE, band_run
from multihead.backends.torch_blocks import attention_by_blocks
from multihead.blocks import Extent
from multihead.call import AttentionCall, AttentionResult
from multihead.masks import Mask
from multihead.scores import ADDITIVE, ELEMENTWISE

__all__ = ["TorchBlocksBackend", "needs_torch"]


class TorchBlocksBackend(Backend):
    """The ``torch_blocks`` backend: dropout and elementwise score modifiers, each query block over
    its visible key range in PyTorch. What it runs is declared in its ``capabilities``; why it
    refuses a call, in ``explain()``."""

    name = "torch_blocks"
    summary = (
        "dropout and elementwise score modifiers: each query block over its visible key range in PyTorch, "
        "checkpointed; cost ~ visible area"
    )
    capabilities = Capabilities(
        device_types=frozenset({"cpu"}),
        native_lse=True,
        keys_in_pieces=True,  # as blocksparse declared for this path: the non-finite check reads every key
        mask_kinds=MASK_KINDS - {"tensor"},
        score_mods=frozenset({ADDITIVE, ELEMENTWISE}),
        masks="structured masks (causal, sliding window, document, prefix-LM, key padding, custom, "
        "positions, and & | ~ of them); not plain tensor masks",
        compiles=False,
        compile_note="its blocks are Python control flow over the mask's key ranges, read on the host for "
        "documents and padding (a graph break); sdpa and reference trace into one",
    )

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        """Why ``auto`` passes over this backend although it could serve the call (decision table
        in docs/performance.md)."""
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        if not needs_torch(call):
            return ["no dropout and no elementwise score modifier: the fused kernels (blocksparse, sdpa) are faster"]
        if call.dropout_p > 0 and B * Hq * Lq * Lk < DROPOUT_DENSE_ELEMENTS:
            if Lq * Lk < DROPOUT_MIN_SQUARE:
                return [
                    f"dropout: Lq*Lk = {Lq * Lk} < {DROPOUT_MIN_SQUARE}: the blockwise path's per-block ops cost "
                    "more than sdpa's math kernel on the dense mask (benchmarks/dropout.py)"
                ]
            share = _visited_share(call.mask, call.extent, self.block_size)
            if share > DROPOUT_MAX_SHARE:
                return [
                    f"dropout: the blockwise path visits {share:.0%} of the scores (> {DROPOUT_MAX_SHARE:.0%}), "
                    "slower than sdpa's math kernel on the dense mask while the scores fit "
                    f"({B * Hq * Lq * Lk} < {DROPOUT_DENSE_ELEMENTS} elements; benchmarks/dropout.py)"
                ]
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        why = (
            f"dropout p={call.dropout_p}: the CPU flash kernel has none"
            if call.dropout_p > 0
            else f"score modifier {call.score_mod._describe() if call.score_mod else None} is elementwise: "
            "the CPU flash kernel takes only an "
            "additive mask"
        )
        return [
            f"{why}, so each block of {self.block_size} queries attends to its visible key range in PyTorch "
            "(activation checkpointing: memory of one block, recomputed in the backward)"
        ]

    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        q, k, v = call.q, call.k, call.v
        # One head size, as blocksparse's kernels need (kept so that results match that path's).
        if D < Dv:  # zero columns leave q.k unchanged
            q, k = F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D))
        elif Dv < D:  # zero value columns give zero output columns, dropped below
            v = F.pad(v, (0, D - Dv))
        # A band's interior blocks in batched chunks (no modifier: each block's own scores otherwise).
        run = band_run(call.mask, Lq, Lk, self.block_size) if call.score_mod is None else None
        out, lse = attention_by_blocks(
            q, k, v, call.mask, call.score_mod, call.scale, call.dropout_p, self.block_size, run
        )
        if Dv < D:
            out = out[..., :Dv]
        return AttentionResult(out, None, lse if call.return_lse else None)


#: With dropout, sdpa runs its math kernel on the dense scores, and the blockwise path
#: (:mod:`torch_blocks`) PyTorch ops on each query block's visible key range, which cost more per
#: score than the math kernel: the blockwise path wins when it visits at most about half the
#: square, and only from ``Lq·Lk = 1024²`` on, below which its per-block ops weigh more.
#: measured: docs/performance.md#dropout
DROPOUT_MAX_SHARE = 0.55
DROPOUT_MIN_SQUARE = 1 << 20
#: The math kernel holds B*Hq*Lq*Lk scores and probabilities: from this many (1 GiB of fp32
#: scores) on, auto takes the blockwise path whatever it visits, since its memory is one block.
DROPOUT_DENSE_ELEMENTS = 1 << 28


def _visited_share(mask: Mask | None, extent: Extent, block_size: int) -> float:
    """The share of the ``Lq x Lk`` scores that the blockwise path computes: each query block's key
    range (``mask.key_range``), as :func:`~multihead.backends.torch_blocks.attention_by_blocks` visits them."""
    q_len, kv_len = extent.lengths
    if mask is None or q_len * kv_len == 0:
        return 1.0
    visited = 0
    for q0 in range(0, q_len, block_size):
        q1 = min(q0 + block_size, q_len)
        k0, k1 = mask.key_range(extent, extent.rows(q0, q1))
        visited += (q1 - q0) * max(0, k1 - k0)
    return visited / (q_len * kv_len)


def needs_torch(call: AttentionCall) -> bool:
    """Dropout or an elementwise modifier: the fused kernel can do neither (torch_blocks runs it)."""
    return call.dropout_p > 0 or (call.score_mod is not None and call.score_mod.kind == ELEMENTWISE)
