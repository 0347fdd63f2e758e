"""Relative biases (ALiBi, T5, any :class:`multihead.scores.RelativeBias`) on the pieces of the
``blocksparse`` backend: a bias that is a function of the head and the distance ``j - i`` only.

On an unmasked or causal piece of ``R`` queries x ``K`` keys the bias is passed to the CPU flash
kernel as a strided (Toeplitz) view of ``R + K - 1`` values, rows in reverse order (strides
cannot be negative), never ``R x K`` values (:func:`relative_piece`); the same view gathers a
trainable bias's gradient (:func:`diagonal_sums`). Entries no row can weigh above ``e^-50`` of
its largest are ``-inf`` (:func:`_underflow_cut`): far keys of a steep head then cost no
denormal arithmetic, each group of heads reads keys from the first it may weigh
(:func:`head_runs`), and heads whose bias still spans ``87.3`` or more take
:func:`~multihead.backends.bias_backward.bias_backward` instead of the kernel's backward.
The band interior's bias (:func:`run_bias`) follows the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.backends.band_runs import BandRun
from multihead.backends.bias_backward import LOG_TINY, add_grads, bias_backward
from multihead.backends.block_plan import CAUSAL, MASKED, Piece, QueryBlock
from multihead.backends.flash_pieces import flash, flash_backward
from multihead.conventions import softmax_dtype
from multihead.scores import ScoreMod
from multihead.scores.relative import toeplitz_view

__all__ = ["Bounds", "relative_piece", "relative_forward", "relative_backward", "run_bias", "head_runs"]

#: log of fp32's smallest normal number (1.18e-38).
_LOG_NORMAL = -87.3
#: Keys whose weight is provably below ``e^-50`` of the row's largest are left out (``-inf``), as
#: :mod:`bias_backward` sets such probabilities to 0: even ``2^31`` of them add less than
#: ``2^-41`` to a row's sum, which fp32 cannot hold (see _underflow_cut).
_NEGLIGIBLE = -LOG_TINY


@dataclass(frozen=True)
class Bounds:
    """``|scale · q_i · k_j| <= scale · |q_i| · |k_j|``: the norms of the query rows ``(B, Hq, Lq)``
    and of the keys ``(B, Hkv, Lk)``, for :func:`_underflow_cut`."""

    q: Tensor
    k: Tensor
    scale: float

    @staticmethod
    def of(q: Tensor, k: Tensor, scale: float, mods: ScoreMod | None) -> Bounds | None:
        if mods is None or not mods.relative or q.dtype == torch.float64:
            return None  # fp64 kernels accumulate in fp64: nothing to cut
        acc = softmax_dtype(q.dtype)
        return Bounds(
            torch.linalg.vector_norm(q, dim=-1, dtype=acc), torch.linalg.vector_norm(k, dim=-1, dtype=acc), abs(scale)
        )

    def score(self, q0: int, q1: int, k0: int, k1: int) -> Tensor:
        """An upper bound of ``|scale · q·k|`` over rows ``[q0, q1)`` x keys ``[k0, k1)`` (a 0-dim tensor)."""
        return self.scale * self.q[:, :, q0:q1].amax() * self.k[:, :, k0:k1].amax()


def _underflow_cut(vec: Tensor, common: tuple[int, int], bound: Tensor) -> Tensor:
    """``vec (H|1, n)`` of a relative bias with ``-inf`` where no row can give the entry a weight
    above ``e^-50`` of its largest (:data:`_NEGLIGIBLE`). Every row sees the entries
    ``vec[:, common[0]:common[1]]``, so its maximum score is at least ``max(those) - bound``; an
    entry below that by more than ``bound + 50`` scores below ``max - 50`` for every row that
    reads it. ALiBi at long context has many such entries, and they cost more than nothing: their
    ``exp`` is mostly an fp32 denormal, on which x86 arithmetic is far slower, so a causal ALiBi
    attention ran slower before entries below fp32's underflow were cut; cutting at ``e^-50``
    instead leaves the kernel of a sliding window's band almost no denormal (:func:`run_bias`).
    measured: docs/performance.md#position-biases"""
    lo, hi = common
    if lo >= hi:
        return vec
    floor = vec[:, lo:hi].amax(dim=-1, keepdim=True) - 2 * bound - _NEGLIGIBLE  # (H|1, 1)
    return vec.masked_fill(vec < floor, float("-inf"))  # NaN bounds compare False: nothing cut


def relative_piece(mods: ScoreMod | None, q: Tensor, blk: QueryBlock, piece: Piece, bounds: Bounds | None = None):
    """A relative bias (:mod:`multihead.scores.relative`) on a FULL or CAUSAL piece, as the
    kernel's ``attn_mask``: ``(1, H|1, R, K)``, a strided view of ``R + K - 1`` values for the
    piece's rows in *reverse* order (strides cannot be negative; the caller flips q and the
    results), with the causal diagonal as ``-inf``; and the per-head shift ``(1, H|1, 1)`` taken off
    for fp16/bf16 (``None`` otherwise), which the kernel's LSE lacks. ``None`` for other pieces,
    other modifiers, or a bias that blocks (a ``-inf`` of its own: the general path handles it).
    With ``bounds`` (fp32/fp16/bf16 kernels), entries that can only underflow are ``-inf`` too, and
    the third value is, per row of the bias (``H|1``), the first key of the piece that some row may
    weigh: the keys before it are ``-inf`` for every row; and the fourth, per row of the bias,
    whether its finite values span less than 87.3 (so that its probabilities are fp32 denormals
    only for extreme scores, and the kernel's backward serves it: see :func:`run_bias`). Both
    ``None`` without ``bounds``."""
    if mods is None or piece.kind == MASKED or not mods.relative:
        return None
    rows, keys = blk.q1 - blk.q0, piece.k1 - piece.k0
    d0 = piece.k0 - (blk.q1 - 1)  # the smallest distance j - i: last row, first key
    vec = mods.distance_bias(d0, d0 + rows + keys - 1, q.device, softmax_dtype(q.dtype))  # (H|1, R + K - 1)
    assert vec is not None  # a relative modifier: its bias is a function of the distance
    if not bool(torch.isfinite(vec).all()):
        return None
    if piece.kind == CAUSAL:  # row r sees keys up to diagonal + r: distances up to diagonal - q0
        diagonal = piece.k0 if piece.diagonal is None else piece.diagonal
        d = torch.arange(d0, d0 + rows + keys - 1, device=q.device)
        vec = vec.masked_fill(d > diagonal - blk.q0, float("-inf"))
        # Row r sees keys k0 .. min(diagonal + r, k1 - 1): every row sees distances k0 - q0 ..
        # min(diagonal - q0, k1 - q0 - R) (the keys may end before a late row's diagonal).
        common = (piece.k0 - blk.q0 - d0, min(diagonal - blk.q0, piece.k1 - blk.q0 - rows) - d0 + 1)
    else:  # every row sees distances k0 - q0 .. k1 - q0 - R
        common = (piece.k0 - blk.q0 - d0, piece.k1 - blk.q0 - rows - d0 + 1)
    starts = calm = None
    if bounds is not None:
        vec = _underflow_cut(vec, common, bounds.score(blk.q0, blk.q1, piece.k0, piece.k1))
        # Key c reads vec[c : c + R] (one entry per row): all -inf below the first finite entry.
        finite = torch.isfinite(vec)
        first = finite.to(torch.int8).argmax(dim=-1)  # (H|1,)
        spread = torch.where(finite, vec, -torch.inf).amax(-1) - torch.where(finite, vec, torch.inf).amin(-1)
        starts = (first - (rows - 1)).clamp(min=0).tolist()
        calm = (spread < -_LOG_NORMAL).tolist()
    shift = None
    if q.dtype in (torch.float16, torch.bfloat16):  # as additive_block: keep the values near 0
        peak = vec.amax(dim=-1, keepdim=True)
        vec, shift = vec - peak, peak.view(1, -1, 1)
    view = toeplitz_view(vec, rows, keys).unsqueeze(0)  # in the softmax dtype: unrounded (see flash_pieces.flash)
    return view, shift, starts, calm


#: Heads whose cut keys begin within this many keys of each other share one kernel call.
_HEAD_RUN_SLACK = 128


def head_runs(starts: list[int] | None, Hq: int, Hkv: int) -> list[tuple[int, int, int]]:
    """``(h0, h1, start)``: query heads ``[h0, h1)`` (whole KV groups) and the first key of the
    piece their kernel call reads. A relative bias cut at ``e^-50`` (:func:`_underflow_cut`) leaves
    a steep head (ALiBi's first slopes) only the near past: its call starts where its first
    weighable key is, and heads whose starts are close share a call. Exact: the keys a call
    leaves out are ``-inf`` for every row of its heads."""
    if starts is None or len(starts) == 1:
        return [(0, Hq, 0 if starts is None else starts[0])]
    G = Hq // Hkv
    runs: list[tuple[int, int, int]] = []
    for g in range(Hkv):
        start = min(starts[g * G : (g + 1) * G])
        if runs and abs(start - runs[-1][2]) <= _HEAD_RUN_SLACK:
            h0, _, s0 = runs[-1]
            runs[-1] = (h0, (g + 1) * G, min(s0, start))
        else:
            runs.append((g * G, (g + 1) * G, start))
    return runs


def reversed_rows(x: Tensor) -> Tensor:
    """``x (B, H, rows, ...)`` with its rows in reverse order (``index_select``: ``flip`` is slower
    on these sizes; measured: docs/performance.md#position-biases)."""
    rows = x.shape[2]
    return x.index_select(2, torch.arange(rows - 1, -1, -1, device=x.device))


def run_bias(mods: ScoreMod | None, run: BandRun, q: Tensor, bounds: Bounds | None = None):
    """A relative bias on a band run: ``(1, H|1, block, span)`` for row ``s`` and window column
    ``c`` of every interior block (distance ``lo + c - s``: the same for each block), the
    fp16/bf16 per-head shift ``(1, H|1, 1)`` as for :func:`relative_piece`, and the query heads
    whose backward may use the kernel (see below); ``(None, None, None)`` without a modifier.

    Every row of the band sees every distance ``lo .. hi``. The kernel's backward is faster than
    ``bias_backward`` unless it meets many fp32 denormals, which a probability ``exp(s + b - lse)``
    becomes below ``e^-87.3``. After :func:`_underflow_cut` a head's bias spans at most
    ``50 + 2·bound`` over the band; a head whose bias spans less than ``87.3`` reaches a denormal
    only where a key's score falls more than the rest of that margin below the row's typical
    scores, which is rare: its backward takes the kernel (a choice of speed only: the kernel is
    exact on denormals, just slower; measured: docs/performance.md#position-biases). Only with
    ``bounds`` (fp32/fp16/bf16 kernels); ``None`` means every head takes ``bias_backward``."""
    if mods is None:
        return None, None, None
    block, span = run.block, run.span
    d0 = run.lo - (block - 1)
    vec = mods.distance_bias(d0, d0 + block + span - 1, q.device, softmax_dtype(q.dtype))  # (H|1, block + span - 1)
    assert vec is not None  # a relative modifier: its bias is a function of the distance
    kernel_heads = None
    if bounds is not None:  # every row sees the whole band, distances lo .. hi
        bound = bounds.score(run.q0, run.q1, run.k0, run.k1)
        vec = _underflow_cut(vec, (run.lo - d0, run.hi - d0 + 1), bound)
        band = vec[:, run.lo - d0 : run.hi - d0 + 1]
        finite = torch.isfinite(band)
        spread = torch.where(finite, band, -torch.inf).amax(-1) - torch.where(finite, band, torch.inf).amin(-1)
        kernel_heads = (spread < -_LOG_NORMAL).expand(q.shape[1]).tolist()  # (Hq,) bools
    s = torch.arange(block, device=q.device).view(-1, 1)
    c = torch.arange(span, device=q.device).view(1, -1)
    bias = vec[:, c - s + block - 1]  # (H|1, block, span)
    shift = None
    if q.dtype in (torch.float16, torch.bfloat16):
        peak = vec.amax(dim=-1, keepdim=True).unsqueeze(-1)
        bias, shift = bias - peak, peak.view(1, -1, 1)
    return bias.unsqueeze(0), shift, kernel_heads  # in the softmax dtype: unrounded (see flash_pieces.flash)


def diagonal_sums(win: Tensor, rows: int, keys: int):
    """A zero ``d_vec (H|1, R + K - 1)`` and the ``on_ds(ds, c0, c1)`` of :func:`bias_backward`
    that adds the chunk's ``dS``, summed over the batch (and the heads for a head-less bias),
    along the diagonals of the strided view: ``d_vec[n] += sum of dS over r' + c = n``."""
    acc = torch.float64 if win.dtype == torch.float64 else torch.float32
    d_vec = torch.zeros(win.shape[1], rows + keys - 1, dtype=acc, device=win.device)

    def on_ds(ds: Tensor, c0: int, c1: int) -> None:
        g = ds.sum(dim=0) if win.shape[1] > 1 else ds.sum(dim=(0, 1)).unsqueeze(0)  # (H|1, R, n)
        # Keys [c0, c1) read the values [c0, c1 + R - 1): the unfold's backward over those only
        # (one over the whole piece per chunk would cost O(K^2)).
        part = torch.zeros(win.shape[1], c1 - c0 + rows - 1, dtype=acc, device=win.device, requires_grad=True)
        with torch.enable_grad():
            d_vec[:, c0 : c1 + rows - 1] += torch.autograd.grad(toeplitz_view(part, rows, c1 - c0), part, g.to(acc))[0]

    return d_vec, on_ds


def accumulate_relative_grads(mods, tensors, grads, d_vec, blk, piece) -> None:
    """Add ``d_vec``, the gradient of one relative piece's bias values, to the gradients of the
    tensors the bias reads (through :meth:`ScoreMod.distance_bias`; memory of one vector)."""
    rows, keys = blk.q1 - blk.q0, piece.k1 - piece.k0
    d0 = piece.k0 - (blk.q1 - 1)
    with torch.enable_grad():
        vec = mods.distance_bias(d0, d0 + rows + keys - 1, d_vec.device, d_vec.dtype)  # (H|1, R + K - 1)
        add_grads(vec, d_vec, tensors, grads)


def relative_forward(relative, qb: Tensor, kb: Tensor, vb: Tensor, scale: float):
    """Output ``(B, Hq, R, Dv)``, LSE ``(B, Hq, R)`` as the kernel computed it and the shift taken
    off the bias, of one piece whose bias is ``relative`` (:func:`relative_piece`): one kernel
    call per group of heads (:func:`head_runs`), on the rows reversed and back."""
    win, shift, starts, _ = relative
    qr, Hq, Hkv = reversed_rows(qb), qb.shape[1], kb.shape[1]
    runs = head_runs(starts, Hq, Hkv)
    parts = []
    for h0, h1, t in runs:  # each group of heads from its first weighable key
        g0, g1 = h0 * Hkv // Hq, h1 * Hkv // Hq
        w = win[:, h0:h1, :, t:] if win.shape[1] > 1 else win[:, :, :, t:]
        parts.append(flash(qr[:, h0:h1], kb[:, g0:g1, t:], vb[:, g0:g1, t:], 0.0, False, attn_mask=w, scale=scale))
    out, lse = (
        parts[0] if len(parts) == 1 else (torch.cat([o for o, _ in parts], 1), torch.cat([l for _, l in parts], 1))
    )
    return reversed_rows(out), reversed_rows(lse), shift


def relative_backward(relative, go, qb, kb, vb, ob, lse, scale, whole, grads, blk, piece, trains) -> None:
    """Add one piece's share of ``dq, dk, dv`` (``grads``, the whole call's) for a piece whose bias
    is ``relative`` (:func:`relative_piece`), given the merged ``ob`` and ``lse`` of its rows as
    the kernel saw them. ``whole``: the piece holds every key its rows see. ``trains``:
    ``(mods, tensors, grads)`` when the bias's tensors want gradients: ``dS`` is then summed along
    the view's diagonals into theirs. Else each group of heads as the forward ran it, on the
    kernel's backward or, for a steep bias, :func:`~multihead.backends.bias_backward.bias_backward`."""
    dq, dk, dv = grads
    rows, keys = slice(blk.q0, blk.q1), slice(piece.k0, piece.k1)
    win, shift, starts, calm = relative
    lp = reversed_rows(lse)
    gor, qr, orr = reversed_rows(go), reversed_rows(qb), reversed_rows(ob)
    if trains is not None:  # dS summed along the view's diagonals: the bias values' gradient
        mods, mod_tensors, d_mods = trains
        d_vec, on_ds = diagonal_sums(win, rows=blk.q1 - blk.q0, keys=piece.k1 - piece.k0)
        g_q, g_k, g_v = bias_backward(gor, qr, kb, vb, orr, lp, win, scale, on_ds=on_ds, whole_rows=whole)
        dq[:, :, rows] += reversed_rows(g_q)
        dk[:, :, keys] += g_k
        dv[:, :, keys] += g_v
        accumulate_relative_grads(mods, mod_tensors, d_mods, d_vec, blk, piece)
        return
    Hq_, Hkv_ = qb.shape[1], kb.shape[1]
    for h0, h1, t in head_runs(starts, Hq_, Hkv_):  # as the forward: keys before t are -inf
        g0, g1 = h0 * Hkv_ // Hq_, h1 * Hkv_ // Hq_
        w = win[:, h0:h1, :, t:] if win.shape[1] > 1 else win[:, :, :, t:]
        args = (gor[:, h0:h1], qr[:, h0:h1], kb[:, g0:g1, t:], vb[:, g0:g1, t:], orr[:, h0:h1])
        if calm is not None and all(calm[h0:h1] if len(calm) > 1 else calm):
            g_q, g_k, g_v = flash_backward(
                *args, lp[:, h0:h1], 0.0, False, attn_mask=w, scale=scale,
            )  # fmt: skip
        else:  # a steep bias: denormals would slow the kernel's backward (bias_backward)
            g_q, g_k, g_v = bias_backward(*args, lp[:, h0:h1], w, scale, whole_rows=whole)
        dq[:, h0:h1, rows] += reversed_rows(g_q)
        dk[:, g0:g1, piece.k0 + t : piece.k1] += g_k
        dv[:, g0:g1, piece.k0 + t : piece.k1] += g_v
