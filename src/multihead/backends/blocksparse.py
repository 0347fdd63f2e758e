"""The ``blocksparse`` backend: structured masks run as a few fused-kernel calls per query block.

Cost follows the *visible* area of the mask instead of the ``Lq x Lk`` square, and no tensor of
``Lq x Lk`` elements is ever built. For each block of ``block_size`` queries::

    keys:   lo ................................................ hi      (mask.key_range)
            [ mask piece ][        full piece        ][ causal piece ]   (mask.block_state)
              small mask      no mask at all            is_causal=True, no mask

* keys outside ``mask.key_range`` and key blocks in state ``EMPTY`` are skipped;
* runs of ``FULL`` key blocks become one kernel call with no mask;
* the diagonal block of a causal edge (``causal()``, the right edge of ``sliding_window``) is
  passed as ``is_causal=True`` on a key range starting at the query block's aligned key;
* runs of ``PARTIAL`` key blocks become one call with a small additive mask of that run only
  (``mask.materialize_block``), e.g. the left edge of a sliding window or a document boundary;
* an additive score modifier (a bias) is added to every piece as a block-sized ``attn_mask``
  (:func:`multihead.scoring.additive_block`), never an ``Lq x Lk`` tensor; a bias that requires
  grad gets ``dS`` of each piece in the backward.

For a band (``causal() & sliding_window(w)``, any ``sliding_window``) the query blocks away from
the edges all see the same relative pattern; they run as ONE kernel call with the blocks folded
into the batch (:mod:`multihead.backends.band_runs`): one parallel region instead of three per
block, which keeps the speed when other processes share the cores (docs/performance.md).

Each piece returns its output and log-sum-exp (PyTorch's CPU flash kernel,
``aten._scaled_dot_product_flash_attention_for_cpu``); pieces of one query block are merged
with their LSE by :func:`multihead.merge_partials`::

    lse = log sum_i exp(lse_i)        out = sum_i exp(lse_i - lse) * out_i

The backward pass is the flash-attention one: for each piece, the kernel's backward is called
with the *merged* output and LSE, which gives exactly that piece's share of ``dq, dk, dv``;
nothing but ``q, k, v``, the output and the LSE is kept between forward and backward.
Fully masked rows give output 0, LSE ``-inf`` and zero gradients (see
:mod:`multihead.conventions`). Block size: ``docs/performance.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.backends.band_runs import run_backward, run_forward
from multihead.backends.base import MASK_KINDS, Backend, Capabilities
from multihead.backends.bias_backward import LOG_TINY, accumulate_mod_grads, piece_ds
from multihead.backends.block_plan import (
    CAUSAL,
    DEFAULT_BLOCK_SIZE,
    FULL,
    MASKED,
    Piece,
    Plan,
    QueryBlock,
    band_run,
    block_plan,
    kernel_pieces,
)
from multihead.backends.document_runs import Segment, document_segments
from multihead.backends.flash_pieces import call_backward, flash, flash_backward, padded
from multihead.backends.relative_pieces import Bounds, relative_backward, relative_forward, relative_piece, run_bias
from multihead.backends.selection_runs import selected_attention, selected_plan, selection_of
from multihead.blocks import Block, Extent
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import lse_dtype, softmax_dtype
from multihead.masks import Mask
from multihead.merge import merge_partials
from multihead.scores import ADDITIVE, ScoreMod
from multihead.scoring import additive_block, unseen_keys

__all__ = ["BlockSparseBackend", "block_plan", "Plan", "DEFAULT_BLOCK_SIZE"]


class BlockSparseBackend(Backend):
    """The ``blocksparse`` backend: structured masks as a few fused CPU flash-kernel calls per query block; cost
    ~ visible area. What it runs is declared in its ``capabilities``; why it refuses a call, in ``explain()``."""

    name = "blocksparse"
    summary = "structured masks as a few fused CPU flash-kernel calls per query block; cost ~ visible area"
    capabilities = Capabilities(
        device_types=frozenset({"cpu"}),
        native_lse=True,
        keys_in_pieces=True,  # bands and runs of heads merge per piece (merge_partials)
        # A plain tensor mask is already Lq x Lk: sdpa passes it to the kernel as it is.
        mask_kinds=MASK_KINDS - {"tensor"},
        score_mods=frozenset({ADDITIVE}),  # elementwise ones and dropout: torch_blocks
        dropout=False,
        masks="structured masks (causal, sliding window, document, prefix-LM, key padding, custom, "
        "positions, and & | ~ of them); not plain tensor masks",
        compiles=False,
        compile_note="its per-block plan is Python control flow over the mask's values (key ranges, block states "
        "read on the host: lengths, document ids), which breaks the graph; sdpa traces into one",
    )

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self._plans: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------------------- dispatch
    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        if flash is None:
            reasons.append("this PyTorch has no CPU flash-attention kernel with a log-sum-exp")
        hint = "; hint: backend='torch_blocks' runs it a query block at a time"  # the fused kernel cannot
        return [r + hint if r == "dropout not supported" or "is elementwise;" in r else r for r in reasons]

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        """Why ``auto`` passes over this backend although it could serve the call (decision table
        in docs/performance.md)."""
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        mask = call.mask
        relative = call.score_mod is not None and call.score_mod.relative
        if mask is None and not relative:
            return ["no mask: sdpa runs one fused call, as fast"]
        offset = mask.causal_offset(Lq, Lk) if call.score_mod is None and mask is not None else None
        if offset == 0 or (offset is not None and offset >= Lk - 1):
            return ["causal diagonal that sdpa passes as is_causal: sdpa is as fast"]
        if Lq * Lk < SMALL_CALL_ELEMENTS:
            return [
                f"Lq*Lk = {Lq * Lk} < {SMALL_CALL_ELEMENTS}: per-block overhead exceeds the saving; "
                "sdpa with the mask materialized is faster"
            ]
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        selection = _gathers(call)
        if selection is not None:
            return selected_plan(selection, call.q, call.k, call.v)
        plan = self._plan(call)
        mods = call.score_mod
        relative = mods is not None and mods.relative
        counts = {FULL: 0, CAUSAL: 0, MASKED: 0}
        computed = 0
        for blk in plan.blocks:
            for p in kernel_pieces(blk, mods):
                counts[p.kind] += 1
                computed += (blk.q1 - blk.q0) * (p.k1 - p.k0)
        skipped = sum(1 for b in plan.blocks if not b.pieces)
        lines = []
        if plan.run is not None:
            run = plan.run
            computed += (run.q1 - run.q0) * run.span
            lines.append(
                f"band interior: {run.blocks} query blocks (rows {run.q0}-{run.q1 - 1}) as one batched kernel "
                f"call, each over a window of {run.span} keys"
            )
        if relative:
            calls = (
                f"kernel calls: {counts[FULL] + counts[CAUSAL]} with the relative bias as a strided view of "
                f"R + K - 1 values per head (rows reversed; a causal diagonal as -inf in those values), "
                f"{counts[MASKED]} with a block-sized mask"
            )
        else:
            calls = (
                f"kernel calls: {counts[FULL]} without mask, {counts[CAUSAL]} is_causal, "
                f"{counts[MASKED]} with a block-sized mask"
            )
        if plan.documents:
            lines.append(f"{len(plan.blocks)} documents, each one kernel call over its own keys; {skipped} see no key")
        else:
            lines.append(
                f"{len(plan.blocks)} other query blocks of {self.block_size} rows; {skipped} fully masked and skipped"
            )
        lines += [
            calls,
            f"scores computed: {computed} of {Lq * Lk} ({100.0 * computed / max(1, Lq * Lk):.1f}% of the square)",
            "PyTorch kernel: aten._scaled_dot_product_flash_attention_for_cpu, pieces merged by log-sum-exp",
        ]
        if relative and call.q.dtype != torch.float64:
            lines.append(
                f"relative bias: entries that no row can weigh above exp({LOG_TINY:g}) of its largest (by "
                "the bound scale·|q|·|k|) are -inf, so little denormal arithmetic; each group of heads reads "
                "keys from the first it may weigh; backward on the kernel for heads whose bias then spans "
                f"< 87.3, else in PyTorch with probabilities below exp({LOG_TINY:g}) set to 0"
            )
        elif mods is not None and mods.kind == ADDITIVE and not relative:
            lines.append(f"score modifier {mods._describe()}: added per piece as a block-sized attn_mask")
        if Hq != Hkv:
            lines.append(f"heads: GQA {Hq}/{Hkv} passed natively to the kernel")
        if D != Dv:
            lines.append(f"head dims D={D}, Dv={Dv} padded with zeros to {max(D, Dv)} (the kernel needs one size)")
        return lines

    # ------------------------------------------------------------------------------- running
    def backward_from_lse(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """The flash kernel's backward given the merged ``(out, lse)`` over the block's key ranges
        (:func:`multihead.backends.flash_pieces.call_backward`)."""
        return call_backward(call, out, lse, dout, dlse)

    def forward(self, call: AttentionCall) -> AttentionResult:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        q, k, v = call.q, call.k, call.v
        if D < Dv:  # the kernel needs one head size: zero columns leave q.k unchanged
            q, k = F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D))
        elif Dv < D:  # zero value columns give zero output columns, dropped below
            v = F.pad(v, (0, D - Dv))
        mods = call.score_mod
        selection = _gathers(call)
        if selection is not None:
            out, lse = selected_attention(q, k, v, selection, call.scale)
            return AttentionResult(out[..., :Dv], None, lse if call.return_lse else None)
        plan = self._plan(call)  # not for a selection: it would classify every block of its table
        out, lse = _BlockSparseAttention.apply(
            q, k, v, call.mask, mods, call.scale, plan, *(mods.tensors() if mods is not None else ())
        )
        if Dv < D:
            out = out[..., :Dv]
        return AttentionResult(out, None, lse if call.return_lse else None)

    def _plan(self, call: AttentionCall) -> Plan:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        # One shared window mask for the band's interior blocks; a relative bias is the same for
        # each of them too (a function of j - i), unless it needs its gradient (per piece, below).
        mods = call.score_mod
        batched = mods is None or (mods.relative and not mods.requires_grad)
        key = (call.mask, B, Hq, Lq, Lk, self.block_size, batched)  # by value; holds the mask's tensors alive
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        # Packed documents: one call per document, not a few per block (backends/document_runs.py).
        docs = document_segments(call.mask, Lq, Lk, -(-Lq // self.block_size)) if mods is None else None
        blocks = _document_blocks(docs) if docs is not None else block_plan(call.mask, call.extent, self.block_size)
        run = band_run(call.mask, Lq, Lk, self.block_size) if batched and docs is None else None
        if run is not None:
            inside = [b for b in blocks if run.q0 <= b.q0 and b.q1 <= run.q1]
            if sum(b.q1 - b.q0 for b in inside) == run.q1 - run.q0:  # the run replaces exactly these
                blocks = tuple(b for b in blocks if not (run.q0 <= b.q0 and b.q1 <= run.q1))
            else:
                run = None
        plan = Plan(run, blocks, documents=docs is not None)
        self._plans[key] = plan
        while len(self._plans) > 32:
            self._plans.popitem(last=False)
        return plan


def _gathers(call: AttentionCall):
    """The call's block selection when it runs gathered (:mod:`multihead.backends.selection_runs`):
    a ``block_select`` joined by ``&`` to any other mask, and no score modifier."""
    return selection_of(call.mask) if call.score_mod is None else None


def _document_blocks(segments: Sequence[Segment]) -> tuple[QueryBlock, ...]:
    """Each document (:class:`~multihead.backends.document_runs.Segment`) as a query block of one piece."""
    return tuple(
        QueryBlock(s.q0, s.q1, (Piece(s.k0, s.k1, CAUSAL if s.causal else FULL),) if s.k0 < s.k1 else ())
        for s in segments
    )


#: Below this many scores a single SDPA call with a materialized mask beats the per-block loop
#: (measured, docs/performance.md).
SMALL_CALL_ELEMENTS = 256 * 256


def _piece_mask(
    mask: Mask | None,
    mods: ScoreMod | None,
    q: Tensor,
    blk: QueryBlock,
    piece: Piece,
    extent: Extent,
    k_heads: int,
):
    """The additive ``attn_mask`` of one piece ``(B|1, Hq|1, rows, keys)`` in the softmax dtype
    (unrounded, see :data:`flash_pieces.flash`; ``None`` when the kernel needs none), the rows (``(B|1, Hq|1,
    rows)`` bool) that see no key of the piece, the keys (``(B|1, 1, keys, 1)``) that no row of
    the piece sees, and what the kernel's LSE lacks per row (``None``, or the shift of
    :func:`multihead.scoring.additive_block`)."""
    if mods is None and piece.kind != MASKED:
        return None, None, None, None
    # A FULL piece sees every key; a CAUSAL one with a modifier needs its diagonal as -inf.
    piece_mask = None if piece.kind == FULL else mask
    block = Block(blk.q0, blk.q1, piece.k0, piece.k1)
    bias, visible, shift = additive_block(
        piece_mask, mods, extent, block, q.device, q.dtype, mask_dtype=softmax_dtype(q.dtype)
    )
    return bias, ~visible.any(-1), unseen_keys(visible, k_heads), shift


def _zero_unseen(kb: Tensor, vb: Tensor, unseen: Tensor | None) -> tuple[Tensor, Tensor]:
    """Keys no query of a piece may see can hold anything (NaN beyond a length); the kernel
    computes ``0 * value`` for them and ``0 * NaN = NaN``, so they are zeroed."""
    if unseen is None or not bool(unseen.any()):
        return kb, vb
    zero = torch.zeros((), dtype=kb.dtype, device=kb.device)
    return torch.where(unseen, zero, kb), torch.where(unseen, zero, vb)


def _run_piece(q, k, v, mask, mods, scale, blk, piece, extent: Extent, bounds=None):
    """Output, LSE as the kernel computed it, and the shift taken off the bias (``None``, or
    broadcastable to ``(B, Hq, rows)``: the piece's LSE is the kernel's plus the shift); rows
    that see none of its keys get LSE ``-inf``."""
    qb = q[:, :, blk.q0 : blk.q1]
    kb, vb = k[:, :, piece.k0 : piece.k1], v[:, :, piece.k0 : piece.k1]
    relative = relative_piece(mods, q, blk, piece, bounds)
    if relative is not None:  # rows reversed: the bias is a strided view (relative_pieces)
        return relative_forward(relative, qb, kb, vb, scale)
    bias, empty, unseen, shift = _piece_mask(mask, mods, q, blk, piece, extent, k.shape[1])
    if bias is None:
        return *flash(qb, kb, vb, 0.0, piece.kind == CAUSAL, scale=scale), None
    kb, vb = _zero_unseen(kb, vb, unseen)
    out, lse = flash(qb, kb, vb, 0.0, False, attn_mask=bias, scale=scale)
    if bool(empty.any()):  # the kernel gives such rows LSE 0; they must weigh nothing in the merge
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse, shift


def _frame(lses: list[Tensor], shifts: list[Tensor | None]) -> Tensor | None:
    """The row LSEs of a query block's pieces, ``(B, Hq, rows)`` as the kernels computed them
    with the pieces' shifts taken off their biases, are merged relative to one shift per row,
    the ``base`` returned here (``None`` when no piece shifts): the largest shift among the
    pieces the row sees keys of (0 where it sees none). See :class:`_BlockSparseAttention`."""
    if all(s is None for s in shifts):
        return None
    found = [
        torch.where(torch.isfinite(l), torch.zeros((), dtype=l.dtype, device=l.device) if s is None else s, -torch.inf)
        for l, s in zip(lses, shifts)
    ]
    base = found[0] if len(found) == 1 else torch.stack(torch.broadcast_tensors(*found)).amax(0)
    return torch.where(torch.isfinite(base), base, torch.zeros_like(base))


def _offset(base: Tensor, shift: Tensor | None) -> Tensor:
    """``base - shift``: what a row LSE kept relative to ``base`` (:func:`_frame`) lacks to be the
    LSE of a kernel that saw its bias with ``shift`` taken off. Exactly 0 where they are equal (a
    query block of one piece); large only for a piece the row gives no weight."""
    return base if shift is None else base - shift.to(base.dtype)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, mods, scale, plan, *mod_tensors):
        B, Hq, Lq, _ = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        extent = Extent(B, Hq, Lq, Lk)
        out = torch.zeros((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
        # The LSE is kept relative to a per-row base (the shift of the bias the kernels saw, see
        # _frame) and returned as lse + base: the backward needs each piece's LSE as its kernel
        # saw it, and lse + shift - shift in fp32 would be exact only to ulp(|lse + shift|)
        # (0.008 at a bias of -1e5), which exp makes a relative error of every probability.
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        base = torch.zeros((B, Hq, Lq), dtype=lse.dtype, device=q.device)
        bounds = Bounds.of(q, k, scale, mods)
        if plan.run is not None:
            rows = slice(plan.run.q0, plan.run.q1)
            bias, shift, _ = run_bias(mods, plan.run, q, bounds)
            out[:, :, rows], lse[:, :, rows] = run_forward(q, k, v, plan.run, scale, bias=bias)
            if shift is not None:
                base[:, :, rows] = shift
        for blk in plan.blocks:
            parts = [_run_piece(q, k, v, mask, mods, scale, blk, p, extent, bounds) for p in kernel_pieces(blk, mods)]
            if not parts:
                continue  # fully masked block: output 0, LSE -inf
            rows = slice(blk.q0, blk.q1)
            outs, lses, shifts = zip(*parts)
            frame = _frame(list(lses), list(shifts))
            if frame is not None:
                base[:, :, rows] = frame
                lses = tuple(l - _offset(frame, s) for l, s in zip(lses, shifts))
            if len(parts) == 1:
                out[:, :, rows], lse[:, :, rows] = outs[0], lses[0]
                continue
            out[:, :, rows], lse[:, :, rows] = merge_partials(list(outs), [l.expand(B, Hq, -1) for l in lses])
        ctx.save_for_backward(q, k, v, out, lse, base)
        ctx.mask, ctx.mods, ctx.scale, ctx.plan = mask, mods, scale, plan
        ctx.set_materialize_grads(False)
        return out, lse + base

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, base = ctx.saved_tensors  # lse relative to base (forward)
        mods = ctx.mods
        bounds = Bounds.of(q, k, ctx.scale, mods)  # as in the forward: the same entries cut
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is not None:
            # The LSE's gradient through one extra column (flash_pieces), dropped at the end.
            q, k, v, out, grad_out = padded(q, k, v, out, grad_out, lse, grad_lse)
        Lq, Lk = q.shape[2], k.shape[2]
        extent = Extent(q.shape[0], q.shape[1], Lq, Lk)
        acc_dtype = lse_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
        mod_tensors = mods.tensors() if mods is not None else ()
        wants_mod_grad = [t.requires_grad for t in mod_tensors]
        d_mods = [torch.zeros_like(t) if w else None for t, w in zip(mod_tensors, wants_mod_grad)]
        run = ctx.plan.run
        if run is not None:  # interior band rows are never fully masked: the LSE is finite there
            rows = slice(run.q0, run.q1)
            bias, shift, kernel_heads = run_bias(mods, run, q, bounds)
            run_lse = lse[:, :, rows].to(acc_dtype) + _offset(base[:, :, rows], shift)  # what the kernel saw
            g_q, _, _ = run_backward(
                grad_out[:, :, rows],
                q,
                k,
                v,
                out[:, :, rows],
                run_lse,
                run,
                ctx.scale,
                dk=dk,
                dv=dv,
                bias=bias,
                kernel_heads=kernel_heads,
            )
            dq[:, :, rows] += g_q
        # Fully masked rows: LSE +inf makes every probability exp(s - inf) = 0, so no NaN.
        lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
        for blk in ctx.plan.blocks:
            if not blk.pieces:
                continue
            rows = slice(blk.q0, blk.q1)
            go, qb, ob = grad_out[:, :, rows], q[:, :, rows], out[:, :, rows]
            lb, lb_base = lse_b[:, :, rows].to(acc_dtype), base[:, :, rows]
            pieces = kernel_pieces(blk, mods)
            whole = len(pieces) == 1  # the piece holds every key its rows see
            for p in pieces:
                keys = slice(p.k0, p.k1)
                kb, vb = k[:, :, keys], v[:, :, keys]
                relative = relative_piece(mods, q, blk, p, bounds)
                if relative is not None:  # rows reversed: the bias is a strided view (relative_pieces)
                    lp = lb + _offset(lb_base, relative[1])
                    trains = (mods, mod_tensors, d_mods) if any(wants_mod_grad) else None
                    relative_backward(relative, go, qb, kb, vb, ob, lp, ctx.scale, whole, (dq, dk, dv), blk, p, trains)
                    continue
                bias, _, unseen, shift = _piece_mask(ctx.mask, mods, q, blk, p, extent, k.shape[1])
                kb, vb = _zero_unseen(kb, vb, unseen)
                causal = bias is None and p.kind == CAUSAL
                lp = lb + _offset(lb_base, shift)  # the kernel saw the bias shifted down
                g_q, g_k, g_v = flash_backward(go, qb, kb, vb, ob, lp, 0.0, causal, attn_mask=bias, scale=ctx.scale)
                dq[:, :, rows] += g_q
                dk[:, :, keys] += g_k
                dv[:, :, keys] += g_v
                if any(wants_mod_grad):
                    ds = piece_ds(go, qb, kb, vb, ob, lp, bias, ctx.scale, whole)
                    accumulate_mod_grads(mods, mod_tensors, d_mods, ds, extent, Block(blk.q0, blk.q1, p.k0, p.k1))
        if grad_lse is not None:
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, *d_mods)
