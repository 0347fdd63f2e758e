"""Band runs: the uniform interior query blocks of a band mask as ONE fused-kernel call.

A band (``causal() & sliding_window(w)``, any ``sliding_window(left, right)``) lets query ``i``
see the keys ``j`` with::

    i + lo  <=  j  <=  i + hi          lo = offset - left,  hi = offset + right

where ``offset`` is the alignment offset of :mod:`multihead.conventions` (``Lk - Lq``
bottom-right, ``0`` top-left): ``causal() & sliding_window(w)`` bottom-right has
``lo = Lk - Lq - w``, ``hi = Lk - Lq``. Away from the edges of the ``Lq x Lk`` square every query
block of ``block`` rows sees the same *relative* pattern: block ``[r, r + block)`` reads the
``span = block + hi - lo`` keys starting at ``r + lo``, and inside that window its row ``r + s``
sees columns ``s .. s + hi - lo``. ``block = 4, hi - lo = 3`` (``span = 7``)::

    row s of a block    its window of keys (█ visible, · masked)
    s = 0               ████···
    s = 1               ·████··
    s = 2               ··████·
    s = 3               ···████

So instead of a few kernel calls per block (one per piece, each its own OpenMP parallel region,
which costs a barrier per call and suffers badly when other processes share the cores), a run
of ``n`` such blocks is folded into the kernel's batch dimension::

    q rows  (B, Hq,  n*block, D) -> (n, B*Hq,  block, D)   a view of q (no copy)
    k, v    (B, Hkv, Lk,      D) -> (n, B*Hkv, span,  D)   overlapping windows: a view of k, v
    mask                            (1, 1,     block, span) one additive (0 / -inf) mask for all

and ``aten._scaled_dot_product_flash_attention_for_cpu`` runs once. Folding ``B`` into the head
axis keeps PyTorch's grouped-query mapping: folded query head ``b*Hq + h`` reads folded KV head
``(b*Hq + h) // G = b*Hkv + h // G`` (``G = Hq // Hkv``), i.e. batch ``b``, KV head ``h // G``.
The kernel reads strided inputs, so the overlapping windows are never copied (measured: no
slower than contiguous copies).

The backward is the kernel's backward on the same folded views; the ``dk, dv`` of overlapping
windows are summed back onto the keys (``ceil(span / block)`` strided adds, not one per block).

Exact: the result equals attention over the band for those rows (the kernel's rounding only).
Interior rows always see ``hi - lo + 1`` keys, so no row is fully masked. The cost is the
``block x span`` rectangle per block, ``span / (hi - lo + 1)`` times the visible area (1.5 at
``block = 256``, window 512); 256 was the fastest block size measured at window 512
(``benchmarks/band_prototype.py --blocks 128 512``).

Usage (the blocksparse backend; imports only torch)::

    run = interior_run(Lq, Lk, block=256, lo=lo, hi=hi)         # a BandRun, or None
    out_rows, lse_rows = run_forward(q, k, v, run, scale)        # rows run.q0 .. run.q1 - 1
    dq_rows, dk, dv = run_backward(grad_out_rows, q, k, v, out_rows, lse_rows, run, scale)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from multihead.backends.bias_backward import bias_backward

__all__ = [
    "BandRun",
    "interior_run",
    "run_forward",
    "run_backward",
    "fold_rows",
    "fold_windows",
    "unfold_rows",
    "window_mask",
]

# torch.ops entries have no annotations (Any); None on a build without them (capabilities refuse then).
_flash: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


@dataclass(frozen=True)
class BandRun:
    """Query rows ``[q0, q1)``, ``(q1 - q0) / block`` blocks of ``block`` rows, under the band
    "query ``i`` sees keys ``i + lo .. i + hi``" (both ends included, ``lo <= hi``).

    Every block must be *interior*: all the keys of its window exist (``k0 >= 0``, ``k1 <= Lk``);
    :func:`interior_run` finds the longest such run on a block grid, :meth:`check` verifies one.
    """

    q0: int
    q1: int
    block: int
    lo: int
    hi: int

    @property
    def blocks(self) -> int:
        return (self.q1 - self.q0) // self.block

    @property
    def span(self) -> int:
        """Keys in the window of one block: ``block + hi - lo``."""
        return self.block + self.hi - self.lo

    @property
    def k0(self) -> int:
        """First key read by the run (its first block's window starts here)."""
        return self.q0 + self.lo

    @property
    def k1(self) -> int:
        """One past the last key read by the run."""
        return self.q1 + self.hi

    def check(self, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` unless the run is well formed and interior for ``Lq, Lk``."""
        fields = (self.q0, self.q1, self.block, self.lo, self.hi)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in fields):
            raise ValueError(f"BandRun fields must be ints, got {self}")
        if self.block < 1:
            raise ValueError(f"BandRun.block must be a positive int, got {self.block}")
        if self.lo > self.hi:
            raise ValueError(f"BandRun: lo={self.lo} > hi={self.hi} would leave every row without keys")
        if not 0 <= self.q0 < self.q1 <= q_len or (self.q1 - self.q0) % self.block:
            raise ValueError(
                f"BandRun rows [{self.q0}, {self.q1}) must be a non-empty multiple of block="
                f"{self.block} inside [0, Lq={q_len})"
            )
        if self.k0 < 0 or self.k1 > kv_len:
            raise ValueError(
                f"BandRun rows [{self.q0}, {self.q1}) read keys [{self.k0}, {self.k1}), outside "
                f"[0, Lk={kv_len}): not interior; interior_run(...) finds the interior rows"
            )


def interior_run(q_len: int, kv_len: int, *, block: int, lo: int, hi: int) -> BandRun | None:
    """The longest run of whole query blocks on the grid ``0, block, 2*block, ...`` (the grid of
    the blocksparse backend) whose key windows lie inside ``[0, Lk)``; ``None`` if there is none.

    Block ``[r, r + block)`` is interior iff ``r + lo >= 0``, ``r + block - 1 + hi <= Lk - 1`` and
    ``r + block <= Lq``; on a band these blocks are consecutive.
    """
    if lo > hi:
        return None
    first = -(-max(0, -lo) // block)  # ceil: the smallest t with t*block + lo >= 0
    last_row = min(kv_len - hi, q_len) - block  # the largest interior block start r
    if last_row < 0 or last_row // block < first:
        return None
    run = BandRun(first * block, (last_row // block + 1) * block, block, lo, hi)
    run.check(q_len, kv_len)
    return run


def run_forward(
    q: Tensor, k: Tensor, v: Tensor, run: BandRun, scale: float, *, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of the rows ``[run.q0, run.q1)`` under the band, in one kernel call.

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, D)`` (the kernel needs
            ``Dv == D``: pad with zeros as the blocksparse backend does). ``Hq % Hkv == 0``;
            query head ``h`` reads KV head ``h // (Hq // Hkv)``. CPU, float32/float64/bfloat16/float16.
        run: the interior rows and the band (:class:`BandRun`, :func:`interior_run`).
        scale: multiplies ``q k^T`` (no default here: the caller has resolved it).
        bias: optional ``(1, Hq|1, block, span)`` added to the scores of every block (row ``s``,
            window column ``c``): a relative bias, the same for each interior block.

    Returns:
        ``out_rows (B, Hq, q1 - q0, D)`` in q's dtype and ``lse_rows (B, Hq, q1 - q0)`` (natural
        log of the scaled scores; fp32, fp64 for fp64 inputs), as the kernel returns them.
    """
    B, Hq, Lq, D = q.shape
    _check_inputs(q, k, v, run)
    qf, kf, vf = (
        fold_rows(q, run),
        fold_windows(k, run),
        fold_windows(v, run),
    )  # (n, B*Hq, block, D), (n, B*Hkv, span, D)
    out, lse = _flash(qf, kf, vf, 0.0, False, attn_mask=_run_mask(run, q, bias), scale=scale)
    return unfold_rows(out, B, Hq), unfold_rows(lse, B, Hq)


def run_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    run: BandRun,
    scale: float,
    *,
    dk: Tensor | None = None,
    dv: Tensor | None = None,
    bias: Tensor | None = None,
    kernel_heads: list[bool] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the rows ``[run.q0, run.q1)``: the flash backward in one kernel call.

    Args:
        grad_out: ``(B, Hq, q1 - q0, D)``, the gradient of ``out``.
        q, k, v, run, scale: as for :func:`run_forward`.
        out, lse: ``(B, Hq, q1 - q0, D)`` and ``(B, Hq, q1 - q0)``: what :func:`run_forward`
            returned for these rows (or, when these rows were merged with other pieces, the
            *merged* output and LSE: then the result is exactly this run's share of the gradients).
        bias: the ``bias`` :func:`run_forward` was given (``None``: none). With a bias the backward
            runs in PyTorch (:mod:`multihead.backends.bias_backward`), not the kernel, except for
            the query heads ``kernel_heads`` (``(Hq,)`` bools) marks: heads whose probabilities
            cannot be denormal, whose whole KV group then runs on the kernel.
        dk, dv: optional ``(B, Hkv, Lk, D)`` accumulators (any float dtype, e.g. fp32 for bf16
            inputs); the run's key gradients are *added* into them and they are returned.

    Returns:
        ``dq_rows (B, Hq, q1 - q0, D)`` in q's dtype, and ``dk, dv (B, Hkv, Lk, D)``: zero outside
        keys ``[run.k0, run.k1)`` when freshly allocated (q's dtype), the accumulators otherwise.
    """
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    _check_inputs(q, k, v, run)
    n = run.blocks
    go, qf, of = fold_rows(grad_out, run, rows_only=True), fold_rows(q, run), fold_rows(out, run, rows_only=True)
    lf = fold_rows(lse.unsqueeze(-1), run, rows_only=True).squeeze(-1).contiguous()  # (n, B*Hq, block)
    if bias is None:
        dqf, dkf, dvf = _flash_backward(
            go,
            qf,
            fold_windows(k, run),
            fold_windows(v, run),
            of,
            lf,
            0.0,
            False,
            attn_mask=window_mask(run, q.dtype, q.device),
            scale=scale,
        )
    else:  # a bias spanning many units makes the kernel's backward crawl through denormals (bias_backward)
        dqf, dkf, dvf = _biased_backward(
            go, qf, fold_windows(k, run), fold_windows(v, run), of, lf, _run_mask(run, q, bias), scale, B, kernel_heads
        )
    dq = unfold_rows(dqf, B, Hq)
    if dk is None:
        dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    if dv is None:
        dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for acc, windows in ((dk, dkf), (dv, dvf)):
        _overlap_add(acc, windows.view(n, B, Hkv, run.span, D), run)
    return dq, dk, dv


# ----------------------------------------------------------------------------------- helpers
# The folds and the window mask are public: torch_blocks runs dropout on the same views.
def _biased_backward(go, qf, kf, vf, of, lf, mask, scale, B: int, kernel_heads):
    """The folded backward with a bias: the KV groups whose query heads are all in
    ``kernel_heads`` on the kernel, the others in :func:`bias_backward`. Folded head ``b*H + h``."""
    Hq, Hkv = qf.shape[1] // B, kf.shape[1] // B
    G = Hq // Hkv
    groups = [all(kernel_heads[kv * G : (kv + 1) * G]) for kv in range(Hkv)] if kernel_heads else [False] * Hkv
    if not any(groups):
        return bias_backward(go, qf, kf, vf, of, lf, mask, scale)
    if all(groups):  # no head picked out: K/V stay overlapping windows of one storage (no copy)
        return _flash_backward(go, qf, kf, vf, of, lf, 0.0, False, attn_mask=mask, scale=scale)
    acc = lf.dtype
    dq = torch.empty(qf.shape, dtype=acc, device=qf.device)
    dk = torch.empty(kf.shape, dtype=acc, device=qf.device)
    dv = torch.empty(vf.shape, dtype=acc, device=qf.device)
    for on_kernel in (True, False):
        kvs = [kv for kv in range(Hkv) if groups[kv] == on_kernel]
        if not kvs:
            continue
        iq = torch.tensor([b * Hq + kv * G + g for b in range(B) for kv in kvs for g in range(G)], device=qf.device)
        ikv = torch.tensor([b * Hkv + kv for b in range(B) for kv in kvs], device=qf.device)
        pick = lambda x, i: x.index_select(1, i)
        m = mask if mask.shape[1] == 1 else pick(mask, iq)
        args = (pick(go, iq), pick(qf, iq), pick(kf, ikv), pick(vf, ikv), pick(of, iq), pick(lf, iq))
        if on_kernel:
            gq, gk, gv = _flash_backward(*args, 0.0, False, attn_mask=m, scale=scale)
        else:
            gq, gk, gv = bias_backward(*args, m, scale)
        dq.index_copy_(1, iq, gq.to(acc))
        dk.index_copy_(1, ikv, gk.to(acc))
        dv.index_copy_(1, ikv, gv.to(acc))
    return dq, dk, dv


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, run: BandRun) -> None:
    if _flash is None:
        raise RuntimeError("band_runs needs aten._scaled_dot_product_flash_attention_for_cpu (PyTorch >= 2.3)")
    if (
        q.dim() != 4
        or k.dim() != 4
        or v.dim() != 4
        or k.shape != v.shape
        or q.shape[-1] != k.shape[-1]
        or q.shape[0] != k.shape[0]
        or q.shape[1] % k.shape[1]
    ):
        raise ValueError(
            f"band_runs: expected q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D) with Hq % Hkv == 0, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    run.check(q.shape[2], k.shape[2])


def fold_rows(x: Tensor, run: BandRun, rows_only: bool = False) -> Tensor:
    """``(B, H, Lq, D)`` (or already the run's rows, ``(B, H, q1 - q0, D)``) -> ``(n, B*H, block, D)``.
    A view when ``B`` and ``H`` merge (x contiguous in them), a copy otherwise."""
    B, H, _, D = x.shape
    rows = x if rows_only else x[:, :, run.q0 : run.q1]
    return rows.reshape(B, H, run.blocks, run.block, D).permute(2, 0, 1, 3, 4).reshape(run.blocks, B * H, run.block, D)


def fold_windows(x: Tensor, run: BandRun) -> Tensor:
    """``(B, Hkv, Lk, D)`` -> ``(n, B*Hkv, span, D)``: window ``t`` is keys
    ``[k0 + t*block, k0 + t*block + span)``; overlapping windows of one storage (no copy)."""
    B, H, _, D = x.shape
    windows = x[:, :, run.k0 : run.k1].unfold(2, run.span, run.block)  # (B, Hkv, n, D, span)
    return windows.permute(2, 0, 1, 4, 3).reshape(run.blocks, B * H, run.span, D)


def unfold_rows(x: Tensor, B: int, H: int) -> Tensor:
    """Kernel output ``(n, B*H, block, ...)`` -> ``(B, H, n*block, ...)`` (one copy)."""
    n, _, block, *rest = x.shape
    return x.view(n, B, H, block, *rest).permute(1, 2, 0, 3, *range(4, 4 + len(rest))).reshape(B, H, n * block, *rest)


def _overlap_add(acc: Tensor, windows: Tensor, run: BandRun) -> None:
    """``acc[:, :, k0 + t*block + c] += windows[t, :, :, c]`` for every block ``t`` and column ``c``.

    The windows overlap (``span > block``), so they are added a column chunk ``[c, c + block)`` at
    a time: chunk ``c`` of consecutive blocks lands on disjoint keys (stride ``block``), one
    strided add per chunk, ``ceil(span / block)`` adds in all.
    """
    n, block, span = run.blocks, run.block, run.span
    for c in range(0, span, block):
        width = min(block, span - c)
        start = run.k0 + c
        target = acc[:, :, start : start + (n - 1) * block + width].unfold(2, width, block)  # (B, Hkv, n, D, width)
        target += windows[:, :, :, c : c + width].permute(1, 2, 0, 4, 3).to(acc.dtype)


def _run_mask(run: BandRun, q: Tensor, bias: Tensor | None) -> Tensor:
    """The kernel's ``attn_mask``: the window mask, plus ``bias`` per head when given, for the
    folded heads ``b*Hq + h`` of the batch ``(1, B*Hq, block, span)``."""
    mask = window_mask(run, q.dtype, q.device)
    if bias is None:
        return mask
    mask = mask + bias  # (1, Hq|1, block, span)
    B = q.shape[0]
    return mask.repeat(1, B, 1, 1) if mask.shape[1] > 1 and B > 1 else mask


def window_mask(run: BandRun, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(1, 1, block, span)`` additive mask: row ``s`` sees window columns ``s .. s + hi - lo``.
    Shared by every block and head (broadcast by the kernel); cached on the pattern, not the rows."""
    return _cached_mask(run.block, run.hi - run.lo, dtype, device)


@functools.lru_cache(maxsize=16)
def _cached_mask(block: int, width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    s = torch.arange(block, device=device).unsqueeze(1)
    c = torch.arange(block + width, device=device).unsqueeze(0)
    visible = (c >= s) & (c <= s + width)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))[None, None]
