"""PyTorch's CPU flash-attention kernel as pieces: a forward that returns its log-sum-exp, and a
backward that takes an output and an LSE as arguments.

The backward is FlashAttention's: given the output ``O`` and LSE of the *whole* rows, a call on
some of the keys gives exactly those keys' share of ``dq, dk, dv``::

    P = exp(S - lse)        dS = P (dP - rowsum(dO · O))        (S = scale · Q Kᵀ, dP = dO Vᵀ)

so pieces of one attention (``blocksparse``'s per-block pieces, the ring's blocks) are each given
the merged ``(O, lse)`` and need no recomputed forward. The kernel knows no gradient of the LSE;
``d lse_i / d s_ij = P_ij``, so it gets one through one extra column (:func:`padded`)::

    q, k  -> [q, 0]              (scores unchanged)
    v     -> [v, 0]
    out   -> [out, 1]            rowsum(dO' · O') = rowsum(dO · O) - g
    dout  -> [dout, -g]          so dS = P (dP - rowsum(dO · O) + g)

Used by :mod:`multihead.backends.blocksparse` (its pieces, and its ``backward_from_lse``),
:mod:`multihead.backends.sdpa` and :mod:`multihead.backends.decode` (their ``backward_from_lse``
on CPU) and, through those, by the ring (:mod:`multihead.distributed.ring`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.call import AttentionCall
from multihead.masks import BlockState, Mask

__all__ = ["flash", "flash_backward", "available", "padded", "backward_from_lse", "call_backward", "TILE"]

# torch.ops entries have no annotations (Any); None on a build without them (refusals say so).
# Their attn_mask may be fp32 whatever q's dtype: the kernel computes its softmax in fp32 and
# reads an fp16/bf16 mask as fp32 anyway. Every bias reaches it unrounded, in the softmax dtype
# (fp32; fp64 for fp64): rounded to bf16, a relative bias whose rows peak at different values
# (ALiBi with keys after the query) or a bias under large ``q·k`` scores loses the differences
# that decide the softmax, and the kernel's LSE would be that of another bias than the one the
# weights are recomputed with (multihead.blockwise).
flash: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
flash_backward: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: Query rows per kernel call of a masked block's backward: each tile reads only the keys its
#: rows can see and a mask of that size, not the whole block (a window of 512 inside a shard of
#: 4096 would otherwise compute, and materialize a mask for, all 4096 x 4096 pairs).
TILE = 512


def available(q: Tensor) -> bool:
    """Whether :func:`backward_from_lse` serves ``q``'s device and dtype on this PyTorch."""
    return flash_backward is not None and q.device.type == "cpu" and q.dtype in _DTYPES


def padded(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, dlse: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``q, k, v, out, dout`` for the kernel's backward, which wants one head size: zero columns up
    to ``E = max(D, Dv)``, and with ``dlse`` ``(B, H, rows)`` one more column that carries the
    LSE's gradient (module docstring; ``dlse`` is taken as 0 on rows whose ``lse`` is ``-inf``).
    As they are when nothing is to be added; else new tensors (callers may write into them)."""
    E = max(q.shape[-1], v.shape[-1]) + int(dlse is not None)
    if E == q.shape[-1] == v.shape[-1]:
        return q, k, v, out, dout
    q, k, v, out, dout = (_pad(t, E) for t in (q, k, v, out, dout))
    if dlse is not None:
        out[..., -1] = 1
        dout[..., -1] = -dlse.masked_fill(torch.isneginf(lse), 0.0).to(dout.dtype)
    return q, k, v, out, dout


def backward_from_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    scale: float,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq (B, Hq, rows, D)``, ``dk (B, Hkv, keys, D)``, ``dv (B, Hkv, keys, Dv)`` of one block of
    rows and keys under ``mask`` (at the block's positions), against the *merged* ``out (B, Hq,
    rows, Dv)`` and ``lse (B, Hq, rows)`` of whole rows, given their gradients ``dout`` and
    ``dlse`` (``None``: no LSE gradient). Only where :func:`available`.

    The kernel takes strided views (the block's rows of ``q``, ``out``, ``dout``, ``lse`` are
    passed as they are), but wants one head size and equal head counts: where ``Dv != D`` or the
    LSE has a gradient, copies are padded (:func:`padded`); GQA K/V are repeated and their
    gradients summed per group. A causal diagonal runs as ``is_causal`` (no mask tensor), another
    mask tile by tile (:data:`TILE`). Rows with no visible key anywhere (``lse = -inf``) get
    ``lse = +inf``: ``P = 0``."""
    B, Hq, rows, D = q.shape
    Hkv, keys, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    dt = q.dtype
    out, dout = out.to(dt), dout.to(dt)
    q, k, v, out, dout = padded(q, k, v, out, dout, lse, dlse)
    if G > 1:  # (B, Hkv, keys, E) -> (B, Hq, keys, E): query head h reads KV head h // G
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    glse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    q, k, v, out, dout = (_unit_stride(t) for t in (q, k, v, out, dout))
    if mask is None or mask.causal_offset(rows, keys) == 0:
        gq, gk, gv = flash_backward(dout, q, k, v, out, glse, 0.0, mask is not None, scale=scale)
    else:
        gq, gk, gv = _tiled_backward(q, k, v, mask, scale, out, glse, dout)
    gq, gk, gv = gq[..., :D], gk[..., :D], gv[..., :Dv]
    if G > 1:
        gk = gk.reshape(B, Hkv, G, keys, D).sum(2)
        gv = gv.reshape(B, Hkv, G, keys, Dv).sum(2)
    return gq, gk, gv


def call_backward(
    call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """:meth:`multihead.backends.base.Backend.backward_from_lse` for the backends whose CPU kernel
    is this one: :func:`backward_from_lse` of the call's ``q, k, v``, mask and scale where it is
    :func:`available`; ``None`` elsewhere (another device, no such kernel in this PyTorch)."""
    if not available(call.q):
        return None
    return backward_from_lse(call.q, call.k, call.v, call.mask, call.scale, out, lse, dout, dlse)


def _tiled_backward(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, out: Tensor, glse: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward of a block under a (non-causal-diagonal) ``mask``, tile by tile of query
    rows: keys outside ``mask.key_range`` of a tile are skipped, a tile that sees no key is skipped
    (its rows' gradient from this block is 0), a fully visible tile runs with no mask."""
    B, H, rows, _ = q.shape
    extent = Extent(B, H, rows, k.shape[2])
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r0 in range(0, rows, TILE):
        r1 = min(rows, r0 + TILE)
        lo, hi = mask.key_range(extent, extent.rows(r0, r1))
        tile = Block(r0, r1, lo, hi)
        state = BlockState.EMPTY if lo >= hi else mask.block_state(extent, tile)
        if state is BlockState.EMPTY:
            continue
        additive = None
        if state is BlockState.PARTIAL:
            allowed = mask.materialize_block(extent, tile, q.device)  # (B|1, H|1, r, k)
            additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        tq, tk, tv = flash_backward(
            dout[:, :, r0:r1],
            q[:, :, r0:r1],
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            out[:, :, r0:r1],
            glse[:, :, r0:r1],
            0.0,
            False,
            attn_mask=additive,
            scale=scale,
        )
        gq[:, :, r0:r1] = tq
        gk[:, :, lo:hi] += tk
        gv[:, :, lo:hi] += tv
    return gq, gk, gv


def _unit_stride(x: Tensor) -> Tensor:
    """The kernel reads any strides of the batch, head and position dims, the head dim densely."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _pad(x: Tensor, E: int) -> Tensor:
    """``x (…, d)`` as a new tensor ``(…, E)`` with zeros after it (always a copy: callers write into it)."""
    padded = x.new_zeros(x.shape[:-1] + (E,))
    padded[..., : x.shape[-1]] = x
    return padded
