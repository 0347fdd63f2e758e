"""Non-finite inputs: what every backend gives, decided once (``docs/conventions.md``).

A NaN or ``±inf`` reaches exactly the rows that read it: a query row holding one, or a row that
may see a key or value holding one, gets output NaN (and LSE and weights NaN). Rows that may not
see it are unaffected, and a key or value that no row may see can hold anything. A row that sees
no key at all is fully masked: output 0, LSE ``-inf``, whatever its query holds. (IEEE arithmetic
would sometimes give a finite row, e.g. ``q·k = -inf`` weighs a key 0; the rule is simpler to
state and every backend, the reference included, follows it exactly.)

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

The check runs on CPU calls only, by default. On a GPU its host synchronisation stops the host
from queueing work ahead of the device: measured on an H100 (bf16, 16k tokens, docs/performance.md
"On the GPU"), it made a 1024-token causal forward 1.55x slower than the same cuDNN kernel called
directly, and it cannot run inside a CUDA graph. :func:`set_nonfinite_check` turns it on for a
device type (``set_nonfinite_check("cuda", True)``): then the rules above hold there too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch import Tensor

from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import repeat_kv

__all__ = ["apply_policy", "all_finite", "finite_check", "set_nonfinite_check", "skip_nonfinite_check"]

# Rows x keys evaluated at a time when the policy looks for rows that see a bad key.
_CHUNK_ELEMENTS = 1 << 22
# Device types whose calls are checked (set_nonfinite_check).
_CHECKED: set[str] = {"cpu"}
#: From this many query rows per KV head (``Lq · Hq / Hkv``) the check also reads the keys.
KEYS_CHECKED_FROM = 64
# True inside ``skip_nonfinite_check()`` (per thread and per asyncio task, as a ContextVar is).
_SKIPPED: ContextVar[bool] = ContextVar("multihead_nonfinite_skipped", default=False)


def set_nonfinite_check(device_type: str, enabled: bool) -> bool:
    """Check every call on ``device_type`` (``"cpu"``, ``"cuda"``, ...) for non-finite inputs and
    apply the rules of this module's docstring (``enabled=True``), or give what the kernel gives
    (``False``). Default: checked on CPU only (the check costs one host synchronisation per call,
    which a GPU pays in idle time). Returns the previous setting, for restoring it."""
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"set_nonfinite_check: device_type must be a device type such as 'cuda', got {device_type!r}")
    if not isinstance(enabled, bool):
        raise TypeError(f"set_nonfinite_check: enabled must be a bool, got {type(enabled).__name__}")
    device_type = torch.device(device_type).type
    previous = device_type in _CHECKED
    (_CHECKED.add if enabled else _CHECKED.discard)(device_type)
    return previous


class skip_nonfinite_check:
    """A ``with`` block in which calls are not checked, on any device: each gives what its kernel
    gives for non-finite inputs, as PyTorch's SDPA does (the rules of this module's docstring do
    not hold there). It saves the check's reduction and host read per call: about 1% of a
    Hugging Face decoding step on CPU, where ``multihead.integrations.hf`` uses it, since
    ``transformers``' own implementations follow no such rules (docs/integrations.md). Local to
    the thread (and asyncio task) that enters it; blocks nest."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _SKIPPED.set(True)

    def __exit__(self, *exc: object) -> None:
        _SKIPPED.reset(self._token)


def _checked(device_type: str) -> bool:
    """Whether a call on ``device_type`` is checked here and now."""
    return device_type in _CHECKED and not _SKIPPED.get()


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
    if (
        torch.compiler.is_compiling()
        or not _checked(call.q.device.type)
        or all_finite(call.q, call.k, result.output, keys=keys)
    ):
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
    harm). One or two reductions and host synchronisations (:func:`finite_check`)."""
    return finite_check(q, k, output, keys=keys)(q, k, output)


def finite_check(
    q: Tensor, k: Tensor, output: Tensor, *, keys: bool = False
) -> Callable[[Tensor, Tensor, Tensor], bool]:
    """The test :func:`all_finite` applies to tensors shaped like these (plans keep it): the
    queries and the output, below; and the keys too from :data:`KEYS_CHECKED_FROM` query rows per
    KV head, or always with ``keys`` (a sum, in fp32 for half types, whose overflow would only cost
    a useless look).

    This runs after every call, and on a small call each PyTorch op costs about half the attention
    kernel itself, so it is one reduction: ``sum q · output`` is not finite when a term is not
    (``inf · x`` and ``NaN · x`` are not, ``inf · 0`` is NaN; finite terms never cancel an infinite
    one), and otherwise only when the sum of finite products overflows (then the policy finds
    nothing). Contiguous tensors (the usual case) take ``torch.dot`` of the flat views: one BLAS
    call, no temporary (``vecdot``'s products were a whole temporary the size of ``q``: the ring's
    per-rank memory bound caught it) and no parallel region, which on a loaded machine waits for a
    thread the scheduler took away (``torch.dist(q, output, 1)``, a difference then a norm, ran two:
    17.7 ms against 0.57 ms on a 1024-token prefill, median, load 8; docs/performance.md, Hugging
    Face backend). Other strides take ``torch.dist``, which allocates nothing either. fp16, and
    shapes that differ (``D != Dv``), take one fp32 sum of each instead: an fp16 product or sum of
    large finite values would overflow."""
    rows_per_key = q.shape[2] * (q.shape[1] // max(1, k.shape[1])) if q.dim() == 4 and k.dim() == 4 else 0
    with_keys = keys or rows_per_key >= KEYS_CHECKED_FROM
    if q.shape == output.shape and q.dtype is not torch.float16:
        return _one_reduction_and_keys if with_keys else _one_reduction
    return _two_sums_and_keys if with_keys else _two_sums


def _one_reduction(q: Tensor, k: Tensor, output: Tensor) -> bool:
    if _SKIPPED.get() or q.device.type not in _CHECKED:  # (_checked, inlined: a plan's every call)
        return True
    if q.is_contiguous() and output.is_contiguous():
        return math.isfinite(torch.dot(q.view(-1), output.view(-1)).item())
    return math.isfinite(torch.dist(q, output, 1).item())


def _two_sums(q: Tensor, k: Tensor, output: Tensor) -> bool:
    if not _checked(q.device.type):
        return True
    return math.isfinite(q.sum(dtype=torch.float32).item()) and math.isfinite(output.sum(dtype=torch.float32).item())


def _one_reduction_and_keys(q: Tensor, k: Tensor, output: Tensor) -> bool:
    return _one_reduction(q, k, output) and _keys_finite(k)


def _two_sums_and_keys(q: Tensor, k: Tensor, output: Tensor) -> bool:
    return _two_sums(q, k, output) and _keys_finite(k)


def _keys_finite(k: Tensor) -> bool:
    if not _checked(k.device.type):
        return True
    total = k.sum(dtype=torch.float32) if k.element_size() < 4 else k.sum()
    return math.isfinite(total.item())


def _zeroed(t: Tensor) -> Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _empty_rows(call: AttentionCall) -> Tensor:
    B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
    if call.mask is None:
        return torch.zeros((1, 1, 1), dtype=torch.bool, device=call.q.device)
    return call.mask._empty_rows(B, Hq, Lq, Lk, device=call.q.device)


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
        visible = call.mask.materialize_block(B, Hq, q0, q1, Lq, Lk, call.q.device, k0, k1)
        rows.append((visible & bad).any(dim=-1).expand(B, Hq, q1 - q0))
    return torch.cat(rows, dim=-1)
