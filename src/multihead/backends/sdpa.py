"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention``.

How a call is passed on, in order of preference:

* mask: ``None`` when nothing is masked; ``is_causal=True`` when the mask is exactly a causal
  diagonal that SDPA's top-left ``is_causal`` expresses (top-left, or bottom-right with
  ``Lq == Lk``); otherwise the mask is materialized, at its broadcast shape, as a last resort.
* score modifiers: additive ones only, materialized with the mask as one additive ``attn_mask``
  (:func:`multihead.scoring.additive_block`); their tensors get gradients through it.
* GQA: SDPA's ``enable_gqa`` when PyTorch will run it on a fused kernel; otherwise K/V are
  expanded as a view when ``Hkv == 1`` and repeated by the grouped mapping when not.
* fully masked rows: SDPA's behaviour differs across versions and kernels, so such rows are
  opened to every key before the call and zeroed after; no NaN enters forward or backward.
* LSE, only when asked for: on CPU without autograd, from the same call of PyTorch's CPU flash
  kernel; otherwise ``None``, and :func:`multihead.attention` recomputes it (with the weights,
  in one blockwise pass).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.backends import flash_pieces
from multihead.backends.base import Backend, Capabilities, Runner
from multihead.blocks import Extent
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import (
    default_scale,
    fold_query_heads,
    lse_dtype,
    repeat_kv,
    softmax_dtype,
    unfold_query_heads,
)
from multihead.scores import ADDITIVE
from multihead.scoring import additive_block, unseen_keys

__all__ = ["SDPABackend", "pytorch_kernel"]


class SDPABackend(Backend):
    """The ``sdpa`` backend: torch.nn.functional.scaled_dot_product_attention (fused kernels). What it runs is
    declared in its ``capabilities``; why it refuses a call, in ``explain()``."""

    name = "sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention (fused kernels)"
    capabilities = Capabilities(
        score_mods=frozenset({ADDITIVE}),
        native_lse=True,
        masks="every mask; causal diagonals as is_causal, others materialized at broadcast shape",
    )

    def plan(self, call: AttentionCall) -> list[str]:
        args = _Arguments(call)
        lines = [args.mask_note, args.gqa_note] + ([args.fit_note] if args.fit_note else [])
        if args.empty_rows is not None:
            lines.append(
                f"{int(args.empty_rows.sum())} fully masked query rows opened before the call and zeroed after"
            )
        q, k, v = args.inputs(call.q, call.k, call.v)
        kernel = pytorch_kernel(q, k, v, args.attn_mask, call.dropout_p, args.is_causal, call.scale, args.enable_gqa)
        lines.append(f"PyTorch kernel: {kernel}")
        if call.return_lse and _one_pass_lse(call):
            lines.append("log-sum-exp from the same kernel call (aten._scaled_dot_product_flash_attention_for_cpu)")
        elif call.return_lse:
            lines.append("log-sum-exp: none from this kernel; recomputed with the weights in one blockwise pass")
        return lines

    def backward_from_lse(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """On CPU, where its fused kernel is the flash one: that kernel's backward given the merged
        ``(out, lse)`` (:func:`multihead.backends.flash_pieces.call_backward`)."""
        return flash_pieces.call_backward(call, out, lse, dout, dlse)

    def forward(self, call: AttentionCall) -> AttentionResult:
        if call.return_lse and _one_pass_lse(call):
            # The CPU flash kernel takes the bias unrounded (fp32 for fp16/bf16 inputs): its LSE
            # is then that of the bias the weights are recomputed with (multihead.blockwise).
            args = _Arguments(call, mask_dtype=softmax_dtype(call.q.dtype))
            out, lse = _flash_cpu_with_lse(call, args, *args.inputs(call.q, call.k, call.v))
            if args.lse_shift is not None:
                lse = lse + args.lse_shift.expand_as(lse)
            if args.empty_rows is not None:
                out = out.masked_fill(args.empty_rows.unsqueeze(-1), 0.0)
                lse = lse.masked_fill(args.empty_rows.expand_as(lse), float("-inf"))
            return AttentionResult(out, None, lse)
        # The public SDPA returns no LSE: attention() recomputes it when asked for. (Its fused
        # CUDA kernels take a mask in the inputs' dtype only: the bias is rounded to it.)
        args = _Arguments(call)
        return AttentionResult(args.run(call.q, call.k, call.v, call.dropout_p), None, None)

    def runner(self, call: AttentionCall) -> Runner:
        if call.return_lse or call.dropout_p > 0:
            return super().runner(call)
        args = _Arguments(call)  # the prepared mask and every decision; no tensor of the call
        # Nothing prepared for this Lk (no mask tensor, no causal diagonal, no expanded or fitted
        # K/V): the runner serves a growing cache's every step (multihead.plans.growing_signature).
        any_kv_len = (args.plain or args.fold is not None) and args.attn_mask is None and not args.is_causal
        return Runner(self._runner(call, args), self.name, any_kv_len)

    @staticmethod
    def _runner(call: AttentionCall, args: _Arguments) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        if not args.plain or args.enable_gqa or args.fold is not None:
            return functools.partial(args.run)  # (called in C: no Python frame of its own)
        # The common cases with no more arguments than they need (each keyword costs a little,
        # and on a small call the kernel itself takes a few microseconds).
        # (F.scaled_dot_product_attention is looked up on every call: a wrapper installed later,
        # a profiler's or a test's, still sees it.)
        attn_mask, is_causal, scale = args.attn_mask, args.is_causal, args.scale
        if scale == default_scale(call.shape[5]):  # SDPA's own default, the same double: left out
            if attn_mask is None and not is_causal:
                return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
        if attn_mask is None and not is_causal:
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale)


#: Up to this many query tokens, GQA/MQA calls on CPU fold each KV head's query heads into rows.
FOLD_MAX_QUERIES = 8


class _Arguments:
    """The arguments SDPA receives for a call, and a note for each decision. Holds no tensor of
    the call (only the mask tensors prepared for it), so that :meth:`run` serves every call with
    the same signature (:meth:`SDPABackend.runner`). ``mask_dtype``: of a bias's ``attn_mask``
    (default the inputs' dtype; :func:`multihead.scoring.additive_block`)."""

    def __init__(self, call: AttentionCall, *, mask_dtype: torch.dtype | None = None):
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        q, k, v, mask = call.q, call.k, call.v, call.mask
        self.scale = call.scale
        self.is_causal, self.attn_mask, self.empty_rows, self.lse_shift, self.unseen = False, None, None, None, None
        self.key_stop: int | None = None  # keys from here on are seen by no query: left out of the call
        mods = call.score_mod
        offset = None if mask is None or mods is not None else mask.causal_offset(Lq, Lk)
        if mask is None and mods is None:
            self.mask_note = "mask: none"
        elif offset == 0:
            self.is_causal = True
            self.mask_note = "mask: causal diagonal passed as is_causal=True (no mask tensor)"
            if Lq < Lk:  # top-left with more keys than queries: the last Lk - Lq keys are seen by no
                # query, and the kernel's backward would compute 0 * key for them (a NaN there: NaN dq)
                self.key_stop = Lq
                k, v = k[:, :, :Lq], v[:, :, :Lq]
                self.mask_note += (
                    "; the keys past the last query, seen by no query, left out"
                    if _compiling()  # (formatting a symbolic size would fix it in the graph)
                    else f"; keys {Lq}..{Lk - 1}, seen by no query, left out"
                )
        elif offset is not None and offset >= Lk - 1:
            self.mask_note = "mask: causal diagonal beyond the last key masks nothing; passed as none"
        else:
            prepared = _prepared_mask(mask, mods, call.extent, q.device, q.dtype, Hkv, mask_dtype)
            self.attn_mask, self.empty_rows, self.unseen, self.lse_shift, self.mask_note = prepared
            if self.unseen is not None:
                self.zero = torch.zeros((), dtype=q.dtype, device=q.device)
                k, v = self._zero_unseen(k, v)
        self.fit, self.fit_note = _head_fit(call, self.attn_mask, self.is_causal)
        if self.fit is not None:
            q, k, v = self._fitted(q, k, v)
        self.enable_gqa = False
        # MQA: the expanded K and V shapes; GQA on the math kernel: Hq; None: neither
        self.expand: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | int | None = None
        if Hq == Hkv:
            self.gqa_note = "heads: Hq == Hkv"
        elif _compiling() or pytorch_kernel(
            q, k, v, self.attn_mask, call.dropout_p, self.is_causal, call.scale, True
        ) not in ("MATH", "unknown"):
            # Under torch.compile the kernel query (a Python value) would break the graph; the
            # compiler lowers enable_gqa itself.
            self.enable_gqa = True
            self.gqa_note = f"heads: GQA {Hq}/{Hkv} passed natively (enable_gqa=True)"
        elif Hkv == 1:
            self.expand = ((B, Hq, k.shape[2], k.shape[-1]), (B, Hq, k.shape[2], v.shape[-1]))  # after any fit
            self.gqa_note = f"heads: MQA, K/V expanded to {Hq} heads as a view (stride 0)"
        else:
            self.expand = Hq
            self.gqa_note = (
                f"heads: GQA {Hq}/{Hkv} would run on the math kernel natively; "
                "K/V repeated by the grouped mapping instead"
            )
        self.plain = (
            self.unseen is None
            and self.expand is None
            and self.empty_rows is None
            and self.fit is None
            and self.key_stop is None
        )
        # A few query tokens with GQA/MQA on CPU: each KV head's G query heads become rows of one
        # call (K/V read once per group, no head mapping in the kernel), the mask repeated per
        # group: faster than enable_gqa for a few query tokens, slower from some tens on
        # (measured: docs/performance.md#the-decode-path-decode).
        self.fold, self.fold_mask = None, None
        if (
            not _compiling()  # first: no comparison of a symbolic Lq (torch.export) may guard the graph
            and not call.requires_grad  # decoding is inference; the kernel's backward on folded rows lost accuracy
            and Hq > Hkv
            and Lq <= FOLD_MAX_QUERIES
            and q.device.type == "cpu"
            and not self.is_causal
            and self.unseen is None
            and self.fit is None
            and self.empty_rows is None
            and self.lse_shift is None
            and (self.attn_mask is None or self.attn_mask.shape[1] == 1)
        ):
            G = Hq // Hkv
            self.fold = G
            if self.attn_mask is not None:  # (B|1, 1, Lq, Lk) -> (B|1, 1, G*Lq, Lk): row g*Lq + i is row i
                self.fold_mask = fold_query_heads(self.attn_mask, Hkv, Hq)
            self.gqa_note = (
                f"heads: GQA {Hq}/{Hkv} with {Lq} query token(s): each KV head's {G} query heads folded "
                f"into the rows of one call (a call returning the LSE: {self.gqa_note.removeprefix('heads: ')})"
            )

    def _zero_unseen(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # Keys that no query may see can hold anything (NaN beyond a length): zero them, since
        # the fused kernels compute 0 * value for them and 0 * NaN = NaN.
        assert self.unseen is not None  # called only when some keys are unseen
        return torch.where(self.unseen, self.zero, k), torch.where(self.unseen, self.zero, v)

    def _fitted(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``Dv != D`` brought to one head size, so that a fused kernel serves the call: V that is
        the first ``Dv`` features of K is replaced by K itself (no copy), a narrower V is padded
        with zeros to ``D``, narrower Q and K to ``Dv`` (zeros change no dot product). The output
        keeps its first ``Dv`` features (:meth:`run`)."""
        D, Dv = q.shape[-1], v.shape[-1]
        if self.fit == "prefix":
            return q, k, k
        if self.fit == "pad_v":
            return q, k, F.pad(v, (0, D - Dv))
        return F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D)), v

    def inputs(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` as SDPA receives them: keys no query sees left out (top-left causal, ``Lq <
        Lk``) or zeroed (other masks), one head size (``Dv != D``), K/V expanded for GQA if needed."""
        if self.key_stop is not None:
            k, v = k[:, :, : self.key_stop], v[:, :, : self.key_stop]
        if self.unseen is not None:
            prefix = self.fit == "prefix"
            k, v = self._zero_unseen(k, v)
            if prefix:  # zeroed alike, so V is still K's first features
                v = k[..., : v.shape[-1]]
        if self.fit is not None:
            q, k, v = self._fitted(q, k, v)
        if isinstance(self.expand, int):
            k, v = repeat_kv(k, self.expand), repeat_kv(v, self.expand)
        elif self.expand is not None:
            k, v = k.expand(self.expand[0]), v.expand(self.expand[1])
        return q, k, v

    def run(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
        """The output of SDPA for these inputs (fully masked rows zeroed)."""
        if self.fold is not None and dropout_p == 0.0:
            Hq = q.shape[1]
            folded = fold_query_heads(q, Hq // self.fold, Hq)  # (B, Hkv, G*Lq, D)
            out = F.scaled_dot_product_attention(folded, k, v, attn_mask=self.fold_mask, scale=self.scale)
            return unfold_query_heads(out, Hq)  # (B, Hkv, G*Lq, Dv) -> (B, Hq, Lq, Dv)
        if self.plain:  # the common case, on the hot path of small calls: no work but the kernel
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=self.attn_mask,
                dropout_p=dropout_p,
                is_causal=self.is_causal,
                scale=self.scale,
                enable_gqa=self.enable_gqa,
            )
        Dv = v.shape[-1]
        q, k, v = self.inputs(q, k, v)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self.attn_mask,
            dropout_p=dropout_p,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
        )
        if self.fit is not None:
            out = out[..., :Dv]
        return out if self.empty_rows is None else out.masked_fill(self.empty_rows.unsqueeze(-1), 0.0)


# Materialized structured masks, by (mask value, shape, device, dtype): a mask object reused across
# calls (or rebuilt with the same value) is materialized once. Only small ones (the per-call
# overhead matters for small calls; a large mask costs more to hold than to rebuild), and never
# masks made of tensors (a tensor is already dense, and a fresh one per call would never hit).
_MASKS: OrderedDict = OrderedDict()
_MASK_CACHE_SIZE = 16
_MASK_CACHE_ELEMENTS = 1 << 20


def _prepared_mask(mask, mods, extent: Extent, device, dtype, num_kv_heads, mask_dtype=None):
    """``(attn_mask, empty_rows | None, unseen_keys | None, lse_shift | None, note)`` for a mask that
    must be materialized over the call's ``extent``: the dense mask with fully masked rows opened,
    the rows to zero after the call, the keys to zero before it, and what the kernel's LSE lacks (a
    shifted bias, additive_block)."""
    B, Hq = extent.batch, extent.heads
    Lq, Lk = extent.lengths
    cacheable = (
        not _compiling() and mods is None and "tensor" not in mask.kinds() and B * Hq * Lq * Lk <= _MASK_CACHE_ELEMENTS
    )
    key = (mask, extent, num_kv_heads, str(device), dtype)
    if cacheable and key in _MASKS:
        _MASKS.move_to_end(key)
        return _MASKS[key]
    # Eagerly, the two fix-ups below are skipped when they change nothing; under torch.compile
    # they always run, so that no data-dependent branch breaks the graph.
    compiling = _compiling()
    shift = None
    if mods is None:
        dense = visible = mask.materialize(B, Hq, Lq, Lk, device=device)
        empty = mask._empty_rows(extent, device=device)
    else:
        dense, visible, shift = additive_block(mask, mods, extent, extent.whole(), device, dtype, mask_dtype=mask_dtype)
        empty = ~visible.any(-1)
    empty_rows = None
    if compiling or bool(empty.any()):
        empty_rows = empty
        opened = empty.unsqueeze(-1)
        dense = (
            dense | opened
            if dense.dtype == torch.bool
            else torch.where(opened, torch.zeros((), dtype=dense.dtype, device=device), dense)
        )
    found = unseen_keys(visible, num_kv_heads)  # (B|1, Hkv|1, Lk, 1)
    unseen = found if compiling or bool(found.any()) else None
    kept = ""
    if cacheable:
        # SDPA turns a bool mask into an additive one (0 / -inf) on every call; a kept mask is
        # turned once. (Under torch.compile the bool mask stays: the compiler folds it.)
        dense = torch.zeros(dense.shape, dtype=dtype, device=device).masked_fill_(~dense, float("-inf"))
        kept = ", built once for this mask value"
    kind = "bool" if dense.dtype == torch.bool else "additive"
    if compiling:  # (no description while tracing: formatting a symbolic size would fix it in the graph)
        note = f"mask: materialized as {'a bool' if kind == 'bool' else 'an additive'} tensor (traced)"
    else:
        what = "mask" if mods is None else ("mask and " if mask is not None else "") + mods._describe()
        article = "an" if kind[0] in "aeiou" else "a"
        note = f"{what}: materialized as {article} {kind} tensor of shape {tuple(dense.shape)} (last resort{kept})"
    prepared = (dense, empty_rows, unseen, shift, note)
    if cacheable:
        _MASKS[key] = prepared
        while len(_MASKS) > _MASK_CACHE_SIZE:
            _MASKS.popitem(last=False)
    return prepared


# PyTorch's CPU flash kernel returns the log-sum-exp beside the output (its LSE carries no
# gradient, so it serves calls that need none: inference with weights, capture_attention).
# torch.ops entries have no annotations (Any); None on a build without it (refusals say so).
_FLASH_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _head_fit(call: AttentionCall, attn_mask, is_causal: bool) -> tuple[str | None, str | None]:
    """How a call with ``Dv != D`` reaches a fused kernel, with a note for ``explain()``: PyTorch's
    CPU flash kernel wants one head size and silently takes the math path (``B·H·Lq·Lk`` scores
    materialized) otherwise. ``None`` when the head sizes agree, the kernel is fused anyway, or
    under compile (the kernel query is a Python value)."""
    q, k, v = call.q, call.k, call.v
    D, Dv = q.shape[-1], v.shape[-1]
    if D == Dv or _compiling():
        return None, None
    if pytorch_kernel(q, k, v, attn_mask, call.dropout_p, is_causal, call.scale, False) not in ("MATH",):
        return None, None
    if Dv < D and v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:3] == k.shape[:3]:
        return "prefix", (
            f"head sizes: V is the first Dv={Dv} features of K (MLA's latent): the fused kernel "
            f"runs with v=k and keeps the first {Dv} output features (no copy)"
        )
    if Dv < D:
        return "pad_v", (
            f"head sizes: Dv={Dv} < D={D}: V padded with zeros to D so the fused kernel serves "
            f"it (the math kernel would materialize the scores); the output keeps {Dv} features"
        )
    return "pad_qk", (
        f"head sizes: D={D} < Dv={Dv}: Q and K padded with zeros to Dv (no dot product "
        f"changes) so the fused kernel serves it"
    )


def _one_pass_lse(call: AttentionCall) -> bool:
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    return (
        _FLASH_CPU is not None
        and call.q.device.type == "cpu"
        and not call.requires_grad
        and call.dropout_p == 0.0
        and D == Dv
        and not _compiling()
    )


def _flash_cpu_with_lse(
    call: AttentionCall, args: _Arguments, q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """Output and LSE in one call of the CPU flash kernel (it takes additive masks only)."""
    mask = args.attn_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=call.q.dtype).masked_fill(~mask, float("-inf"))
    out, lse = _FLASH_CPU(q, k, v, 0.0, args.is_causal, attn_mask=mask, scale=call.scale)
    return out, lse.to(lse_dtype(call.q.dtype))


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def pytorch_kernel(
    q: Tensor, k: Tensor, v: Tensor, attn_mask, dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool
) -> str:
    """The SDPA kernel PyTorch will pick for these arguments (``FLASH_ATTENTION``, ``MATH``, ...),
    or ``"unknown"`` where this PyTorch cannot say."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return SDPBackend(choice).name
    except Exception:  # private API: absent or different on some versions
        return "unknown"
