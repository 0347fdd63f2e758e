"""Non-finite inputs: the rules :func:`multihead.attention` applies with ``check_finite=True``
(``docs/conventions.md``, "Non-finite inputs").

By default a call is not checked, on every device: finite inputs give the exact result, a row
that sees no key gives output 0 and LSE ``-inf`` (known from the mask, no look at the data), and a
NaN or an infinity gives what the kernel gives, as PyTorch's SDPA, FlashAttention and
FlexAttention do. The check reads the data after every call (one reduction and one host
synchronisation), which on CPU cost bf16 calls many times the kernel's own time (its reduction is
slow there; docs/performance.md#every-dtype-against-the-raw-sdpa-call-check-off-and-on-benchmarksdtypespy)
and on a GPU stops the host from queueing work ahead of the device: a debugging aid, not a
default.

With ``check_finite=True``, on any device, a NaN or ``±inf`` reaches exactly the rows that read
it: a query row holding one, or a row that may see a key or value holding one, gets output NaN
(and LSE and weights NaN). Rows that may not see it are unaffected, and a key or value that no row
may see can hold anything. A row that sees no key at all is fully masked: output 0, LSE ``-inf``,
whatever its query holds. (IEEE arithmetic would sometimes give a finite row, e.g.
``q·k = -inf`` weighs a key 0; the rule is simpler to state and every backend, the reference
included, follows it exactly.)

Fused kernels do not follow this by themselves: PyTorch's flash kernels return 0 for a query row
of NaN, and compute ``0 · NaN = NaN`` for rows that must not see a NaN value. So
:func:`apply_policy` checks, after the kernel, the queries and the output (:func:`all_finite`:
one reduction over both, one host synchronisation per call); only when something is not finite
does it run the call again on cleaned inputs and mark the rows the policy names. Under
``torch.compile`` the check is skipped (a data-dependent branch): compiled code gets what the
kernel gives.

Two cases leave the output finite although a row sees a bad key: an infinite key entry whose score
is ``-inf`` for every row that sees it (``k[..., d] = -inf`` under queries with ``q[..., d] > 0``:
the kernels weigh the key 0), and a row whose visible keys are *all* bad (``Lk = 1`` and a NaN key:
the kernels treat the row as fully masked, output 0). Only a look at the keys finds them, so a call
with at least :data:`KEYS_CHECKED_FROM` query rows per KV head (``Lq · Hq / Hkv``) also sums its
keys: there the kernel does at least ``4 · 64`` multiply-adds per key element it reads, and one
more read of the keys costs a few percent of it. A call with fewer rows per key (a decoding step:
its cost *is* reading the keys, and the sum would read them again) is not checked for those two
cases, and gets what the kernel gives there (docs/conventions.md).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from multihead.blocks import Block
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import repeat_kv

__all__ = ["apply_policy", "all_finite", "check_finite_flag", "set_nonfinite_check", "skip_nonfinite_check"]

# Rows x keys evaluated at a time when the policy looks for rows that see a bad key.
_CHUNK_ELEMENTS = 1 << 22
#: From this many query rows per KV head (``Lq · Hq / Hkv``) the check also reads the keys.
KEYS_CHECKED_FROM = 64
_MOVED = "the non-finite rules are opt-in per call, the same on every device: attention(..., check_finite=True)"


def check_finite_flag(where: str, check_finite: object) -> bool:
    """``check_finite`` as given, or a ``TypeError`` naming ``where`` when it is not a bool."""
    if check_finite is not True and check_finite is not False:
        raise TypeError(
            f"{where}: check_finite must be a bool, got {type(check_finite).__name__} {check_finite!r}; "
            f"True applies the non-finite rules of docs/conventions.md"
        )
    return check_finite


def set_nonfinite_check(device_type: str, enabled: bool) -> bool:
    """Removed: the non-finite rules are opt-in per call, the same on every device
    (``attention(..., check_finite=True)``). Turning the check off warns (it is off already) and
    returns ``False``; turning it on raises, since no global switch remains to honour it."""
    if enabled:
        raise TypeError(f"set_nonfinite_check({device_type!r}, True) was removed: {_MOVED}")
    warnings.warn(f"set_nonfinite_check is deprecated and does nothing: {_MOVED}", DeprecationWarning, stacklevel=2)
    return False


class skip_nonfinite_check:
    """Deprecated: calls are not checked unless they ask for it (``check_finite=True``), so a block
    that skips the check changes nothing. Entering it warns once per block."""

    __slots__ = ()

    def __enter__(self) -> None:
        warnings.warn(
            f"skip_nonfinite_check is deprecated: calls are unchecked by default; {_MOVED}",
            DeprecationWarning,
            stacklevel=2,
        )

    def __exit__(self, *exc: object) -> None:
        return None


def apply_policy(
    call: AttentionCall,
    result: AttentionResult,
    run: Callable[[AttentionCall], AttentionResult],
    *,
    keys: bool = False,
) -> tuple[AttentionResult, Tensor | None]:
    """``result`` of ``call`` with the non-finite policy applied, and the rows it made NaN
    (``(B, Hq, Lq)`` bool, ``None`` when none): whatever is derived from the call afterwards (an LSE
    or weights recomputed blockwise) is NaN there too. ``run(call)`` reruns a call; ``keys``: read
    the keys whatever the call's size (a backend that merges pieces of keys, ``keys_in_pieces``)."""
    if torch.compiler.is_compiling() or all_finite(call.q, call.k, result.output, keys=keys):
        return result, None
    bad_q = ~torch.isfinite(call.q).all(dim=-1)  # (B, Hq, Lq)
    bad_kv = ~(torch.isfinite(call.k).all(dim=-1) & torch.isfinite(call.v).all(dim=-1))  # (B, Hkv, Lk)
    clean = dataclasses.replace(call, q=_zeroed(call.q), k=_zeroed(call.k), v=_zeroed(call.v))
    result = run(clean)
    poisoned = (bad_q & ~_empty_rows(call)) | _rows_seeing(call, bad_kv)  # (B, Hq, Lq)
    if not bool(poisoned.any()):
        return result, None  # a non-finite output from finite inputs (an overflow): as the kernel gave it
    nan = float("nan")
    output = result.output.masked_fill(poisoned.unsqueeze(-1), nan)
    lse = None if result.lse is None else result.lse.masked_fill(poisoned, nan)
    return AttentionResult(output, result.weights, lse), poisoned


def all_finite(q: Tensor, k: Tensor, output: Tensor, *, keys: bool = False) -> bool:
    """``False`` when ``q`` or ``output`` holds a NaN or an infinity, or ``k`` does in a call of
    at least :data:`KEYS_CHECKED_FROM` query rows per KV head or with ``keys`` (then the policy has
    work to do); possibly ``False`` also for huge finite values (then the policy finds nothing: no
    harm).

    One reduction for the queries and the output: ``sum q · output`` is not finite when a term is
    not (``inf · x`` and ``NaN · x`` are not, ``inf · 0`` is NaN; finite terms never cancel an
    infinite one), and otherwise only when the sum of finite products overflows. Contiguous
    tensors take ``torch.dot`` of the flat views (one BLAS call, no temporary, no parallel region);
    other strides ``torch.dist``, which allocates nothing either. fp16, and shapes that differ
    (``D != Dv``), take one fp32 sum of each instead: an fp16 product or sum of large finite values
    would overflow. The keys, when read, are summed (in fp32 for half types)."""
    rows_per_key = q.shape[2] * (q.shape[1] // max(1, k.shape[1])) if q.dim() == 4 and k.dim() == 4 else 0
    if q.shape == output.shape and q.dtype is not torch.float16:
        if q.is_contiguous() and output.is_contiguous():
            finite = math.isfinite(torch.dot(q.view(-1), output.view(-1)).item())
        else:
            finite = math.isfinite(torch.dist(q, output, 1).item())
    else:
        finite = math.isfinite(q.sum(dtype=torch.float32).item()) and math.isfinite(
            output.sum(dtype=torch.float32).item()
        )
    if finite and (keys or rows_per_key >= KEYS_CHECKED_FROM):
        total = k.sum(dtype=torch.float32) if k.element_size() < 4 else k.sum()
        finite = math.isfinite(total.item())
    return finite


def _zeroed(t: Tensor) -> Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _empty_rows(call: AttentionCall) -> Tensor:
    if call.mask is None:
        return torch.zeros((1, 1, 1), dtype=torch.bool, device=call.q.device)
    return call.mask._empty_rows(call.extent, device=call.q.device)


def _rows_seeing(call: AttentionCall, bad_kv: Tensor) -> Tensor:
    """``(B, Hq, Lq)``: rows that may see a key whose key or value is not finite."""
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    columns = bad_kv.any(dim=0).any(dim=0).nonzero().flatten()
    if len(columns) == 0:
        return torch.zeros((B, Hq, Lq), dtype=torch.bool, device=call.q.device)
    k0, k1 = int(columns.min()), int(columns.max()) + 1
    bad = repeat_kv(bad_kv[:, :, k0:k1].unsqueeze(-1), Hq).squeeze(-1).unsqueeze(2)  # (B, Hq, 1, span)
    if call.mask is None:
        return bad.any(dim=-1).expand(B, Hq, Lq)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * Hq * (k1 - k0)))
    rows = []
    for q0 in range(0, Lq, step):
        q1 = min(q0 + step, Lq)
        visible = call.mask.materialize_block(call.extent, Block(q0, q1, k0, k1), call.q.device)
        rows.append((visible & bad).any(dim=-1).expand(B, Hq, q1 - q0))
    return torch.cat(rows, dim=-1)
