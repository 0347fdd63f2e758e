"""Plans of repeated calls: what :func:`multihead.attention` decided for a call signature.

A *plain* call passes only ``q, k, v``, a mask object and a scale (no score modifier, softcap,
sinks, dropout, weights or LSE). Everything validation and dispatch decide for it follows from
facts that are cheap to read, and that :func:`signature` puts in one key::

    q, k, v: type, shape, strides, dtype, device     (the checks of validation.py, the kernels' strides;
                                                      one flag for "all contiguous", one for "all on the CPU")
    autograd records (grad mode and requires_grad)   (backends without a backward refuse it)
    the mask's value (masks are immutable and compare by value), the scale, the backend name

The plan found last is also kept with a *guard* of its inputs (:mod:`multihead.guards`): a loop
calling one signature runs its plan on that one C++ check instead of building the key.

A call takes the whole path (validation, every refusal, the backend's own plan) until its
signature has been seen once before; then it stores a *runner*, :meth:`Backend.runner`: a
function of ``(q, k, v)`` that runs what was decided, holding the prepared mask tensors but no
tensor of the call. A later call with an equal key runs it directly. (Waiting for the second
sighting keeps one-off signatures, such as every step of a growing KV cache, from building
runners that are never used and from pushing out the plans that are.) Nothing in a key depends
on tensor *values*; a call asking for the non-finite rules (``check_finite=True``) is not plain.

A growing KV cache makes every decoding step a new signature (``Lk`` grows by one), so each
step would take the whole path. For calls whose plan cannot depend on ``Lk`` — no mask, or one
that masks nothing for any ``Lk`` (a single query under bottom-right ``causal()``) — a second key,
:func:`growing_signature`, holds everything but ``Lk`` and the strides ``Lk`` changes, plus
``Lk``'s power-of-two bucket. The plan stored under it serves every ``Lk`` of the bucket, and is
stored only when the backend's runner says it takes any ``Lk`` (``runner.any_kv_len``) and
``auto`` chooses the same backend at both ends of the bucket (its thresholds are monotone in
``Lk``), so it runs what the whole path would.

Inputs that share their first address (``attention(x, x, x)``, MLA's V that views K's first
features) have their own plans: both keys hold which of ``q, k, v`` start at one address, and
whether ``v`` then has ``k``'s strides (:func:`aliasing`: sdpa runs such a V as K itself, which a V
of the same shape elsewhere must not inherit, and the reverse), and such a plan gets no guard (a
guard compares each tensor alone, not where they lie).

Never stored (the whole path runs every time): masks holding a tensor taken by identity rather
than by content (:meth:`Mask.by_value`), inputs that validation would copy or change (a strided
last dimension, a scale <= 0), empty calls, and anything under ``torch.compile``
(dynamo traces the whole path into its graph instead). Registering or removing a backend clears every plan; a
backend changed in place so that it refuses other calls (its ``capabilities`` replaced) must be
registered again, or :func:`clear` called.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias, cast

import torch
from torch import Tensor

from multihead.guards import Guard, tensor_guard
from multihead.masks import Mask
from multihead.memo import BoundedCache

if TYPE_CHECKING:
    from multihead.call import AttentionCall

__all__ = [
    "Plan",
    "find",
    "signature",
    "growing_signature",
    "kv_len_bucket",
    "lookup",
    "worth_keeping",
    "aliasing",
    "repeated",
    "store",
    "clear",
    "MAX_PLANS",
]

#: At most this many signatures are kept; the oldest stored is dropped first.
MAX_PLANS = 64
#: A plain call's signature: shapes, strides, dtypes, devices, autograd, mask, scale, backend.
Key: TypeAlias = "tuple[object, ...]"
#: ``runner(q, k, v) -> output``: a :class:`multihead.backends.base.Runner` (typed here by what it
#: does: the backends import this module to clear it, so it cannot name their class).
Runner: TypeAlias = "Callable[[Tensor, Tensor, Tensor], Tensor]"
_PLANS: BoundedCache[Key, Runner] = BoundedCache(MAX_PLANS)
_SEEN: BoundedCache[Key, None] = BoundedCache(MAX_PLANS)  # signatures met once, oldest first (an ordered set)
_GUARDS: BoundedCache[Key, Guard] = BoundedCache(MAX_PLANS)  # the C-level check of a stored plan's q, k, v
#: The plan found last, with what a call must match to run it without a key: its guard of
#: ``q, k, v`` (multihead.guards), mask (the same object), scale, backend and grad mode.
_last: tuple[Guard, object, object, object, bool, Runner] | None = None


def find(
    q: Tensor, k: Tensor, v: Tensor, mask: object, scale: object, backend: object
) -> tuple[Runner | None, Key | None, Key | None]:
    """The stored plan of a plain call (``None``: none yet), and the keys the whole path stores
    its plans under: :func:`signature` and :func:`growing_signature` (``None`` where the call has
    none, or where the plan was found and no key is needed).

    A call of one query token looks for its growing cache's plan first: a decoding step's exact
    signature is new at every step (its ``Lk`` grew), so reading it first would cost every step
    a key that is never found, which costs a decoding step more than its kernel when the caches are
    cold (measured: docs/performance.md#hugging-face-backend-benchmarkshfpy). Other calls look for their exact
    signature first (a repeated call finds it at once) and for the growing plan on a miss.

    Before any key, the plan found last is tried: a call with the same mask object, scale, backend
    and grad mode whose ``q, k, v`` pass that plan's guard (:mod:`multihead.guards`: the key's facts
    about the tensors, checked in one C++ call) runs it without building a key."""
    global _last
    last = _last
    if last is not None:  # the plan found last, checked in one C++ call instead of a key
        guard, last_mask, last_scale, last_backend, grad_mode, run = last
        if (
            mask is last_mask
            and backend is last_backend
            and (scale is last_scale or (scale.__class__ is float and scale == last_scale))
            and torch.is_grad_enabled() is grad_mode
            and guard(q, k, v)
        ):
            return run, None, None
    if not _plain_arguments(q, k, v, mask, scale, backend):
        return None, None, None
    growing = None
    try:
        qs = q.shape  # (read once: every attribute read of a tensor costs a fraction of a microsecond)
    except RuntimeError:  # nested tensors have no sizes: validation says what is wrong
        return None, None, None
    one_query = len(qs) == 4 and qs[2] == 1
    if one_query:
        try:
            growing = _growing_tuple(q, k, v, mask, scale, backend)
        except RuntimeError:  # (as _growing_key; inlined on the decoding path)
            return None, None, None
        plan = None if growing is None else _PLANS.get(growing)
        if plan is not None:
            return plan, None, growing
    key = _key(q, k, v, mask, scale, backend, qs)
    if key is None:
        return None, None, None
    plan = _PLANS.get(key)
    if plan is not None:
        stored_guard = _GUARDS.get(key)
        if stored_guard is not None:
            _last = (stored_guard, mask, scale, backend, torch.is_grad_enabled(), plan)
    elif not one_query:
        growing = _growing_key(q, k, v, mask, scale, backend)
        plan = None if growing is None else _PLANS.get(growing)
    return plan, key, growing


def signature(q: Tensor, k: Tensor, v: Tensor, mask: object, scale: object, backend: object) -> Key | None:
    """The key of a plain call, or ``None`` when its arguments are not the kind a plan serves
    (the whole path then validates them and raises where they are wrong)."""
    if not _plain_arguments(q, k, v, mask, scale, backend):
        return None
    return _key(q, k, v, mask, scale, backend)


def _key(
    q: Tensor, k: Tensor, v: Tensor, mask: object, scale: object, backend: object, q_shape: object = None
) -> Key | None:
    # Each tensor attribute read from Python builds an object: contiguous tensors (the common case)
    # enter as one flag instead of three stride tuples (their strides follow from their shapes),
    # CPU tensors as one flag instead of three devices (docs/performance.md#per-call-overhead).
    try:
        contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        return (
            q.shape if q_shape is None else q_shape,
            k.shape,
            v.shape,
            None if contiguous else (q.stride(), k.stride(), v.stride()),
            q.dtype,
            k.dtype,
            v.dtype,
            None if q.is_cpu and k.is_cpu and v.is_cpu else (q.device, k.device, v.device),
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
            mask,
            scale,
            backend,
            aliasing(q, k, v),
        )
    except RuntimeError:  # sparse and nested tensors have no strides: validation says what is wrong
        return None


def aliasing(q: Tensor, k: Tensor, v: Tensor) -> object:
    """Which of ``q, k, v`` start at one address: ``None`` for none (the common case), else the
    three pairwise facts and, where ``k`` and ``v`` share one, whether ``v`` has ``k``'s strides
    (a V that is K's first features: sdpa decides on it)."""
    pq, pk, pv = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if pq != pk and pq != pv and pk != pv:
        return None
    return (pq == pk, pq == pv, pk == pv and k.stride()[:3] == v.stride()[:3])


def _plain_arguments(q: object, k: object, v: object, mask: object, scale: object, backend: object) -> bool:
    """Arguments of the kinds a plan serves (anything else takes the whole path, which validates it)."""
    if q.__class__ is not Tensor or k.__class__ is not Tensor or v.__class__ is not Tensor:
        return False  # subclasses (Parameter, fake and functional tensors) and non-tensors
    if mask is not None and not isinstance(mask, Mask):
        return False  # tensors (values not hashed) and wrong types (validation names them)
    if scale is not None and (scale.__class__ is not float or not 0.0 < scale < math.inf):
        return False
    return backend.__class__ is str


def growing_signature(q: Tensor, k: Tensor, v: Tensor, mask: object, scale: object, backend: object) -> Key | None:
    """The key of a plain call that holds no ``Lk`` (only its power-of-two bucket,
    :func:`kv_len_bucket`), or ``None`` when the call's plan could depend on ``Lk``: a mask that
    blocks something at some ``Lk``. Strides of ``k, v`` enter by their last dimension only (the
    others change with a growing cache; no plan depends on them: validation copies only a
    strided last dimension)."""
    if not _plain_arguments(q, k, v, mask, scale, backend):
        return None
    return _growing_key(q, k, v, mask, scale, backend)


def _growing_key(q: Tensor, k: Tensor, v: Tensor, mask: object, scale: object, backend: object) -> Key | None:
    try:
        return _growing_tuple(q, k, v, mask, scale, backend)
    except RuntimeError:  # sparse and nested tensors have no sizes or strides: validation says what is wrong
        return None


def _growing_tuple(q: Tensor, k: Tensor, v: Tensor, mask: object, scale: object, backend: object) -> Key | None:
    # (Each size read once: on a decoding step, with the caches cold, every attribute of a tensor
    # read from Python costs microseconds.)
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None  # validation names what is wrong
    if mask is not None and (not isinstance(mask, Mask) or qs[2] != 1 or not _blocks_nothing(mask)):
        return None
    return (
        "growing",
        qs,
        (ks[0], ks[1], ks[3]),
        (vs[0], vs[1], vs[3]),
        ks[2].bit_length(),
        q.stride(),
        k.stride(-1),
        v.stride(-1),
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        mask,
        scale,
        backend,
        aliasing(q, k, v),
    )


def kv_len_bucket(kv_len: int) -> tuple[int, int]:
    """The ``Lk`` range one growing plan serves: ``[2^(n-1), 2^n - 1]`` for ``n = Lk.bit_length()``."""
    n = kv_len.bit_length()
    return 1 << (n - 1), (1 << n) - 1


_FAR = 1 << 31  # a key length no call reaches


def _blocks_nothing(mask: Mask) -> bool:
    """Whether ``mask`` blocks nothing for one query, whatever ``Lk``: it is a causal diagonal
    ("key ``j`` visible iff ``j <= i + d``") whose ``d`` reaches the last key at every length,
    defined for any length (no tensor of positions or ids fixing ``Lk``)."""
    return mask._cached("_blocks_nothing_cache", lambda: _blocks_nothing_at_all_lengths(mask))


def _blocks_nothing_at_all_lengths(mask: Mask) -> bool:
    if mask.extent() != (None, None):
        return False
    for kv_len in (1, 2, _FAR):
        offset = mask.causal_offset(1, kv_len)
        if offset is None or offset < kv_len - 1:
            return False
    return True


#: ``lookup(key)``: the runner stored for ``key``, or ``None``.
lookup = _PLANS.get


def worth_keeping(key: Key, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a plan made from ``call`` (validated from ``q, k, v``) is safe for every call with
    ``key``, and likely to be used: validation changed nothing (no copy of a strided last
    dimension, no folded scale), the mask's value says all it means (:meth:`Mask.by_value`), and
    the signature was met before (:func:`repeated`). Inputs that share an address are told apart
    by the key itself (:func:`aliasing`)."""
    if call.q is not q or call.k is not k or call.v is not v:
        return False
    if call.mask is not None and not call.mask.by_value():
        return False
    return repeated(key)


def repeated(key: Key) -> bool:
    """Whether ``key`` was met before (a plan is then worth building); records it otherwise."""
    if key in _SEEN:
        return True
    _SEEN.put(key, None)
    return False


def store(key: Key, runner: Runner, inputs: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
    """Keep ``runner(q, k, v) -> output`` for ``key``, dropping the oldest plan beyond :data:`MAX_PLANS`.
    A :class:`multihead.backends.base.Runner` is kept as its ``run`` function: a stored plan runs
    without the object's own call in between (a Python frame, a fraction of a small call).
    ``inputs``: the ``q, k, v`` of ``key`` (an exact signature, not a growing one), from which the
    plan's guard is built: the plan found last then runs on a guard's check, without a key."""
    _PLANS.put(key, getattr(runner, "run", runner))
    # a guard checks each tensor alone: a plan of inputs that share an address gets none
    guard = None if inputs is None or aliasing(*inputs) is not None else tensor_guard(*inputs)
    if guard is not None:
        _GUARDS.put(key, guard)


def clear() -> None:
    """Forget every plan (the registry calls this whenever the backends change)."""
    global _last
    _last = None
    _PLANS.clear()
    _SEEN.clear()
    _GUARDS.clear()


class Plan:
    """A plan a caller holds: what :func:`multihead.attention` decided for one plain call signature
    (shapes, strides, dtypes, devices, autograd state, mask value, scale, backend), kept by the
    caller instead of the library's memo, as FlexAttention's caller keeps a ``BlockMask``. Made by
    :func:`multihead.plan`; ``plan(q, k, v)`` runs it on inputs of that signature, and refuses any
    other (naming what differs) rather than run a decision made for other inputs."""

    __slots__ = ("key", "runner", "_run", "_mask", "_scale", "_backend")

    def __init__(self, key: Key, runner: Runner, mask: object, scale: object, backend: object):
        self.key, self.runner = key, runner
        self._run = getattr(runner, "run", runner)  # (called without the Runner's own frame)
        self._mask, self._scale, self._backend = mask, scale, backend

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``(B, Hq, Lq, Dv)``: the attention of ``q, k, v`` as planned."""
        if _plain_arguments(q, k, v, None, None, "") and aliasing(q, k, v) is not None:
            raise ValueError(
                "Plan: q, k and v start at one address (a plan serves separate tensors); call "
                "multihead.attention(q, k, v, ...) for these"
            )
        key = signature(q, k, v, self._mask, self._scale, self._backend)
        if key != self.key:
            raise ValueError(
                f"Plan: these inputs differ from the planned ones: {_difference(self.key, key)}; make a "
                f"plan for them with multihead.plan(q, k, v, ...)"
            )
        return self._run(q, k, v)

    def __repr__(self) -> str:
        q_shape, k_shape, v_shape = self.key[0], self.key[1], self.key[2]
        devices = cast("tuple[torch.device, ...] | None", self.key[7])
        return (
            f"Plan(q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}, {self.key[4]}, "  # type: ignore[arg-type]
            f"{'cpu' if devices is None else devices[0]}, mask={self._mask!r}, "
            f"backend={getattr(self.runner, 'backend', self._backend)!r})"
        )


#: The fields of a :func:`signature`, in order, for messages.
_FIELDS = (
    "q shape",
    "k shape",
    "v shape",
    "strides of q, k, v (None: all contiguous)",
    "q dtype",
    "k dtype",
    "v dtype",
    "devices of q, k, v (None: all on the CPU)",
    "autograd (grad mode and requires_grad)",
    "mask",
    "scale",
    "backend",
    "inputs that start at one address (None: none)",
)


def _difference(planned: Key, got: Key | None) -> str:
    if got is None:
        return "they are not three dense tensors of a plain call"
    return "; ".join(
        f"{name} {_shown(g)} (planned: {_shown(p)})" for name, p, g in zip(_FIELDS, planned, got) if p != g
    )


def _shown(field: object) -> object:
    return tuple(field) if isinstance(field, torch.Size) else field
