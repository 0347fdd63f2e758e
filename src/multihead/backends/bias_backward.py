"""The backward of attention with an additive bias, in PyTorch, without denormal arithmetic.

Used by the ``blocksparse`` backend for relative biases (ALiBi, T5), on its per-block pieces and
on the batched interior of a band (:mod:`multihead.backends.band_runs`), instead of PyTorch's CPU
flash backward, for the heads whose bias still spans 87.3 or more once the entries below
``exp(-50)`` of a row's largest weight are cut, and for a bias that trains (its gradient comes
from ``dS`` here). Why: with a bias that spans hundreds of units (ALiBi at long range), many
probabilities ``exp(S - lse)`` are fp32 *denormals*, x86 arithmetic on denormals is far slower,
and on causal ALiBi the kernel's backward took many times its forward
(measured: docs/performance.md#position-biases). Here
probabilities below ``exp(LOG_TINY) = exp(-50) = 2e-22`` are set to 0 before the matrix products:
then neither ``P`` nor ``dS = P (dP - delta)`` holds a denormal (``|dP - delta|`` would have to be
below ``5e-17``, which in fp32 arithmetic is an exact 0), and what is dropped, at most
``2e-22 · K`` of a row whose probabilities sum to 1, is below fp64's rounding (``1.1e-16``) for
any ``K`` up to 500k::

    P  = exp(S + bias - lse)                  (S = scale · Q Kᵀ; 0 below exp(-50), where blocked,
                                               and on fully masked rows, whose lse is +inf)
    dV = Pᵀ dO          dS = P (dO Vᵀ - rowsum(dO O))
    dQ = scale · dS K   dK = scale · dSᵀ Q

``KEYS`` keys at a time: four ``(N, Hq, R, KEYS)`` blocks live at once, whatever ``K`` is. The
gradient of the scores is computed anyway, so a trainable bias takes it per chunk (``on_ds``)
at no second pass. Grouped-query heads fold into the rows of one matmul per KV head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.blocks import Block, Extent

__all__ = [
    "bias_backward",
    "piece_ds",
    "accumulate_mod_grads",
    "add_grads",
    "row_peak",
    "normalise_",
    "row_delta",
    "LOG_TINY",
    "KEYS",
]

#: Probabilities below exp(-50) = 2e-22 are set to 0 (fp32's smallest normal is exp(-87.3)).
LOG_TINY = -50.0
#: Keys per step.
KEYS = 1024


def bias_backward(
    go: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    bias: Tensor,
    scale: float,
    on_ds: Callable[[Tensor, int, int], None] | None = None,
    whole_rows: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq (N, Hq, R, D)``, ``dk (N, Hkv, K, D)``, ``dv (N, Hkv, K, Dv)`` in the accumulation
    dtype (fp32; fp64 for fp64) of attention with an additive ``bias``.

    Args:
        go, o: ``(N, Hq, R, Dv)``: the gradient of the output and the output (merged, when these
            keys were one part of a row's keys: then the result is this part's share).
        q: ``(N, Hq, R, D)``; k: ``(N, Hkv, K, D)``; v: ``(N, Hkv, K, Dv)``; ``Hkv`` divides ``Hq``.
        lse: ``(N, Hq, R)``, the log-sum-exp of the whole rows (``+inf`` for fully masked ones) as
            the kernel saw them (minus any shift taken off the bias).
        bias: broadcastable to ``(N, Hq, R, K)``, ``-inf`` where blocked (any strides: a view).
        on_ds: called as ``on_ds(ds, c0, c1)`` with ``dS (N, Hq, R, c1 - c0)`` of keys ``[c0, c1)``.
        whole_rows: these keys are every key the rows weigh (the rows' only piece). Then, when
            they fit one step (``K <= KEYS``), ``P`` is normalised by its own row sums
            (:func:`row_peak`) and ``rowsum(dO O)`` taken from it (:func:`row_delta`): each row's
            ``dS`` sums to 0 up to fp32 rounding, as the autograd softmax's does.
    """
    N, Hq, R, D = q.shape
    Hkv, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    acc = lse.dtype
    G = Hq // Hkv
    # Query head h = kv * G + g -> KV head kv. Contiguous: a gradient of .sum() arrives expanded
    # (stride 0), and a stride-0 operand sends bmm to a loop far slower than BLAS.
    # measured: docs/performance.md#position-biases
    fold = lambda x: x.to(acc).reshape(N, Hkv, G * R, x.shape[-1]).contiguous()
    qs, gof = fold(q) * scale, fold(go)  # the scale folded into q: a pass over R x D, not over R x K
    delta = (go.to(acc) * o.to(acc)).sum(-1, keepdim=True)  # (N, Hq, R, 1)
    lse = lse.unsqueeze(-1)  # (N, Hq, R, 1)
    dq = torch.zeros((N, Hkv, G * R, D), dtype=acc, device=q.device)
    dk = torch.empty((N, Hkv, K, D), dtype=acc, device=q.device)
    dv = torch.empty((N, Hkv, K, Dv), dtype=acc, device=q.device)
    for c0 in range(0, K, KEYS):
        c1 = min(c0 + KEYS, K)
        n = c1 - c0
        kc, vc = k[:, :, c0:c1].to(acc).contiguous(), v[:, :, c0:c1].to(acc).contiguous()  # windows may overlap
        p = torch.matmul(qs, kc.transpose(-2, -1)).view(N, Hq, R, n)  # S, then P in place
        p += bias[..., c0:c1].to(acc)
        exact = whole_rows and K <= KEYS
        p -= row_peak(p, lse) if exact else lse
        F.threshold(p, LOG_TINY, float("-inf"), inplace=True)  # exp of what is left is >= 2e-22, or 0
        p.exp_()
        if exact:
            normalise_(p)
        dv[:, :, c0:c1] = torch.matmul(p.view(N, Hkv, G * R, n).transpose(-2, -1), gof)
        ds = torch.matmul(gof, vc.transpose(-2, -1)).view(N, Hq, R, n)  # dP
        if exact:
            delta = row_delta(p, ds, go, o, v)
        ds -= delta
        ds *= p  # dS = P (dP - rowsum(dO O))
        dsf = ds.view(N, Hkv, G * R, n)
        dq += torch.matmul(dsf, kc)
        dk[:, :, c0:c1] = torch.matmul(dsf.transpose(-2, -1), qs)
        if on_ds is not None:
            on_ds(ds, c0, c1)
    return (dq * scale).view(N, Hq, R, D), dk, dv


def row_peak(scores: Tensor, lse: Tensor) -> Tensor:
    """The largest of ``scores (N, Hq, R, K)`` per row ``(N, Hq, R, 1)``, for rows whose every
    weighed key is there; ``lse`` where that is not finite (``+inf`` on fully masked rows, so
    that their probabilities are 0). :func:`normalise_` then divides ``exp(scores - peak)`` by its
    row sums: probabilities that sum to 1 up to fp32 rounding, as the autograd softmax's do. With
    the kernel's LSE instead, a row sums to ``1 + δ`` (its LSE, rounded at ``|lse|``, and its
    own rounding of the scores), and its ``dS`` to ``-δ · rowsum(P dP)`` instead of 0."""
    peak = scores.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(lse) & torch.isfinite(peak), peak, lse)


def normalise_(p: Tensor) -> Tensor:
    """``p (N, Hq, R, K)`` divided in place by its row sums (rows of zeros stay zeros)."""
    total = p.sum(dim=-1, keepdim=True)
    return p.div_(torch.where(total > 0, total, torch.ones_like(total)))


def row_delta(p: Tensor, dp: Tensor, go: Tensor, o: Tensor, v: Tensor) -> Tensor:
    """``rowsum(dO O)`` ``(N, Hq, R, 1)`` of rows whose every weighed key is in ``p (N, Hq, R, K)``
    (normalised, :func:`row_peak`), from the probabilities and ``dP = dO Vᵀ``, in their dtype:
    ``rowsum(P dP)``, plus ``dO O`` over the columns where ``v (N, Hkv, K, Dv)`` is zero for
    every key (the column that carries the LSE's gradient holds 1 in ``O``; columns padding
    ``Dv`` to ``D`` hold 0).

    Why: ``dS = P (dP - delta)`` sums to 0 along a row only when ``delta`` is ``rowsum(P dP)``
    of these same ``P``. From ``O`` rounded to fp16/bf16 each row's ``dS`` sums to a rounding
    error instead, and a bias that is shared along rows (a relative bias table, a broadcast
    bias tensor) receives the sum of those errors over every row of its entry."""
    acc = p.dtype
    Hq, Hkv = p.shape[1], v.shape[1]
    zero = (v == 0).all(dim=2).repeat_interleave(Hq // Hkv, dim=1).unsqueeze(2)  # (N, Hq, 1, Dv)
    tail = (go.to(acc) * o.to(acc)).masked_fill(~zero, 0.0).sum(-1, keepdim=True)
    return (p * dp).sum(-1, keepdim=True) + tail


def piece_ds(go, qb, kb, vb, ob, lb, bias, scale, whole_rows=False) -> Tensor:
    """``dS = P (dP - rowsum(dO O))`` of one piece ``(B, Hq, rows, keys)``: the gradient of the
    scores, which an additive bias receives as it is. Memory: one piece. ``whole_rows``: the
    piece holds every key its rows weigh, so ``P`` is normalised by its own row sums and
    ``rowsum(dO O)`` comes from it (:func:`row_delta`)."""
    B, Hq, rows, _ = qb.shape
    Hkv, keys = kb.shape[1], kb.shape[2]
    acc = lb.dtype
    fold = lambda x: x.to(acc).reshape(B, Hkv, (Hq // Hkv) * rows, x.shape[-1])  # query head h -> KV head h // G
    s = torch.matmul(fold(qb), kb.to(acc).transpose(-2, -1)).view(B, Hq, rows, keys) * scale
    if bias is not None:
        s = s + bias.to(acc)
    lb = lb.unsqueeze(-1)
    # 0 where blocked (-inf) and on fully masked rows (lse +inf)
    p = torch.exp(s - (row_peak(s, lb) if whole_rows else lb))
    if whole_rows:
        normalise_(p)
    dp = torch.matmul(fold(go), vb.to(acc).transpose(-2, -1)).view(B, Hq, rows, keys)
    delta = row_delta(p, dp, go, ob, vb) if whole_rows else (go.to(acc) * ob.to(acc)).sum(-1, keepdim=True)
    return p * (dp - delta)


def accumulate_mod_grads(mods, tensors, grads, ds, extent: Extent, block: Block) -> None:
    """Add ``dS`` of one piece (``block`` of the whole attention ``extent``) to the gradients of the
    tensors an additive modifier reads, through the same ``bias_block`` the forward used (autograd
    of a slice: memory of one piece)."""
    with torch.enable_grad():
        bias = mods.bias_block(extent, block, ds.device, ds.dtype)
        reduce = [d for d in range(4) if bias.shape[d] == 1 and ds.shape[d] != 1]
        add_grads(bias, ds.sum(dim=reduce, keepdim=True) if reduce else ds, tensors, grads)


def add_grads(output: Tensor, grad: Tensor, tensors, grads) -> None:
    """``grads[i] += d(output)/d(tensors[i]) · grad`` for the tensors that require grad."""
    needed = [t for t in tensors if t.requires_grad]
    found = iter(torch.autograd.grad(output, needed, grad, allow_unused=True))
    for i, t in enumerate(tensors):
        if t.requires_grad:
            g = next(found)
            if g is not None:
                grads[i] += g.to(grads[i].dtype)
