"""The scores of a block of queries x keys: scale, modify, block. Written once.

Both the reference (:mod:`multihead.reference`, the whole square as one block) and the blockwise
helpers (:mod:`multihead.blockwise`, a block of rows at a time) call :func:`score_block`::

    S = scale · Q Kᵀ                      (B, H, rows, keys), softmax dtype
    S = score_mod(S, b, h, q_pos, kv_pos)  at absolute positions q0.., k0..
    visible = mask(b, h, q_pos, kv_pos)  and  S != -inf
    S[~visible] = -inf

:func:`additive_block` is the same for fused kernels that take an additive ``attn_mask``: the
bias of the additive modifiers plus ``-inf`` where blocked.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.conventions import kv_head_of, softmax_dtype
from multihead.masks import Mask
from multihead.scores import ADDITIVE, ScoreMod

__all__ = ["score_block", "additive_block", "unseen_keys", "mask_unseen_keys"]

# Query rows x keys of a mask evaluated at a time by mask_unseen_keys (bool elements).
_ROWS_ELEMENTS = 1 << 22


def unseen_keys(visible: Tensor, num_kv_heads: int) -> Tensor:
    """``(B|1, Hkv|1, Lk, 1)`` bool: keys of each KV head that no query head of its group may see
    in ``visible (B|1, Hq|1, rows, Lk)``. Such keys can hold anything, even NaN, and are zeroed
    before a product that would compute ``0 · NaN``; per KV head, since a key one group sees may be
    garbage for another."""
    seen = visible.any(dim=2)  # (B|1, Hq|1, Lk)
    if seen.shape[1] > 1:  # query head h belongs to KV head h // G (conventions.kv_head_of)
        seen = seen.view(seen.shape[0], num_kv_heads, seen.shape[1] // num_kv_heads, seen.shape[-1]).any(dim=2)
    return (~seen).unsqueeze(-1)


def mask_unseen_keys(mask: Mask, extent: Extent, num_kv_heads: int, device: torch.device | str | None) -> Tensor:
    """:func:`unseen_keys` of ``mask`` over the whole ``extent``, the mask evaluated a chunk of
    query rows at a time (never ``Lq x Lk`` at once); traced (``torch.compile``), all rows at once,
    since a loop over a symbolic ``Lq`` would fix its value."""
    if torch.compiler.is_compiling():
        return unseen_keys(mask.materialize_block(extent, extent.whole(), device), num_kv_heads)
    Lq, Lk = extent.lengths
    step = max(1, _ROWS_ELEMENTS // max(1, Lk * extent.batch * extent.heads))
    seen: Tensor | None = None
    for q0 in range(0, Lq, step):
        rows = mask.materialize_block(extent, extent.rows(q0, min(q0 + step, Lq)), device).any(dim=2, keepdim=True)
        seen = rows if seen is None else seen | rows  # (B|1, H|1, 1, Lk)
    assert seen is not None  # Lq >= 1: a call with no query never reaches a kernel
    return unseen_keys(seen, num_kv_heads)


def score_block(
    q: Tensor,
    k: Tensor,
    mask: Mask | None,
    score_mod: ScoreMod | None,
    scale: float,
    block: Block,
    *,
    heads: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scores of the block's query rows ``[q0, q1)`` against its keys ``[k0, k1)``, positions in
    the whole attention of ``q`` and ``k`` (``Block(q0, q1, 0, Lk)``: a block of rows against every
    key): ``(B, h, rows, keys)`` with ``-inf`` where blocked, and the bool ``visible`` block
    (``None`` when nothing is masked).

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``; ``heads`` selects query heads (default all);
    ``dtype`` defaults to the softmax dtype. For all heads K is not copied per group: the ``G``
    query heads of a KV head are folded into the rows of one matmul.
    """
    B, Hq, q_len, D = q.shape
    Hkv, kv_len = k.shape[1], k.shape[2]
    extent = Extent(B, Hq, q_len, kv_len)
    q0, q1, k0, k1 = block
    if (k0, k1) != (0, kv_len):
        k = k[:, :, k0:k1]
    Lk = k1 - k0
    dtype = dtype or softmax_dtype(q.dtype)
    rows = q1 - q0
    visible = None
    if mask is not None:
        visible = mask.materialize_block(extent, block, q.device)
        if torch.is_grad_enabled() and q.requires_grad:
            # A key no query of the block sees may hold anything, even NaN; its score is blocked,
            # but dQ = dS · K would still compute 0 · NaN. Such keys are zeroed for the product.
            k = torch.where(unseen_keys(visible, Hkv), torch.zeros((), dtype=k.dtype, device=k.device), k)
        if visible.shape[1] != 1 and heads is not None:
            visible = visible[:, heads]
    if heads is None:
        # Query head h = kv * G + g reads KV head kv (kv_head_of): (B, Hq, rows, D) -> (B, Hkv, G*rows, D).
        qb = q[:, :, q0:q1].to(dtype).reshape(B, Hkv, (Hq // Hkv) * rows, D)
        scores = torch.matmul(qb, k.to(dtype).transpose(-2, -1)).view(B, Hq, rows, Lk) * scale
    else:
        qb = q[:, heads, q0:q1].to(dtype)  # (B, h, rows, D)
        kb = k[:, kv_head_of(heads, Hq, Hkv)].to(dtype)  # (B, h, Lk, D): only the KV heads the selection reads
        scores = torch.matmul(qb, kb.transpose(-2, -1)) * scale  # (B, h, rows, Lk)
    if score_mod is not None:
        scores = score_mod.apply_block(extent, block, scores, heads)
    if score_mod is not None:  # a modifier may block too (a -inf bias entry)
        finite = ~torch.isneginf(scores)
        visible = finite if visible is None else visible & finite
    if visible is None:
        return scores, None
    return scores.masked_fill(~visible, float("-inf")), visible


def additive_block(
    mask: Mask | None,
    score_mod: ScoreMod | None,
    extent: Extent,
    block: Block,
    device: torch.device | str | None,
    dtype: torch.dtype,
    *,
    mask_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The additive ``attn_mask`` of the block's queries ``[q0, q1)`` x keys ``[k0, k1)`` (in the
    whole attention ``extent``) for a fused kernel
    whose inputs are in ``dtype``: the additive modifiers' bias, ``-inf`` where blocked, in
    ``mask_dtype`` (default ``dtype``); the bool ``visible`` block; and a per-row ``shift``
    (``(B|1, H|1, rows)`` fp32, or ``None``). Mask and visible broadcast to ``(B, H, rows, keys)``.

    The bias is built in the softmax dtype (fp32, fp64 for fp64). A kernel in any dtype but fp64
    gets it minus its largest visible value per row (``shift``): the softmax, which is
    shift-invariant, only needs the differences, and a large common part costs them precision. A
    bias of -1e5 would be -inf in fp16, and in bf16 -1e5 + x loses x to rounding. In fp32 a row
    whose visible keys all sit at -256 (ALiBi far from its keys) holds its scores to ulp(256) =
    3e-5; a fused backward that recomputes them then disagrees with its forward's LSE by that much,
    and a row that sees one key gets a weight of 1 ± 3e-5 (measured on CUDA's efficient kernel:
    dV 20 ulps off). The kernel's LSE is then ``shift`` too small.

    ``mask_dtype``: a kernel that takes its mask in the softmax dtype whatever its inputs' dtype
    (PyTorch's CPU flash kernel takes fp32, and computes its softmax in fp32) should get it so.
    Rounded to fp16/bf16, the bias differs from the one the weights are recomputed with
    (:mod:`multihead.blockwise`, against the kernel's LSE) and the reference computes with; and
    the shift keeps only the *bias* near 0: where ``q·k`` decides which keys weigh, the entries
    that weigh can sit hundreds of units below the row's largest bias, where a bf16 rounding step
    is a unit or more.
    """
    bias = None
    if score_mod is not None:
        if score_mod.kind != ADDITIVE:
            raise TypeError(f"{score_mod._describe()} is not additive; a fused kernel cannot apply it")
        bias = score_mod.bias_block(extent, block, device, softmax_dtype(dtype))
    visible = None if mask is None else mask.materialize_block(extent, block, device)
    if bias is not None:
        finite = ~torch.isneginf(bias)
        visible = finite if visible is None else visible & finite
    if visible is None:
        visible = torch.ones((1, 1, block.rows, block.cols), dtype=torch.bool, device=device)
    shift = None
    if bias is not None and dtype != torch.float64:
        peak = torch.where(visible, bias, float("-inf")).amax(dim=-1).detach()  # (B|1, H|1, rows)
        shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        bias = bias - shift.unsqueeze(-1)
    out = dtype if mask_dtype is None else mask_dtype
    blocked = torch.full((), float("-inf"), dtype=out, device=device)
    zero = torch.zeros((), dtype=out, device=device)
    return torch.where(visible, zero if bias is None else bias.to(out), blocked), visible, shift
