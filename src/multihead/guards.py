"""One C-level check that tensors have the type, shape, strides, dtype, device, dispatch keys and
``requires_grad`` of example tensors: what a stored plan needs of its inputs, read in one call.

Read from Python, each of those facts builds an object (a ``torch.Size``, a stride tuple, a
device): for ``q, k, v`` together a large part of a small SDPA call's time. PyTorch checks the same
facts for its compiled code in C++ (``torch._C._dynamo.guards.TensorGuards``), in a fraction of
that (docs/performance.md#per-call-overhead). That class is private, so :func:`tensor_guard` uses
it only where it behaves as :func:`_trusted` tests on first use: each fact changed alone must fail
the check, the same facts on other tensors must pass. Where it is missing or fails that test,
:func:`tensor_guard` returns ``None`` and callers use their Python key, which reads the same facts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["Guard", "tensor_guard"]

#: ``guard(*tensors) -> bool``: whether the tensors have the facts of the ones it was built from.
Guard = Callable[..., bool]

_TRUSTED: list[bool] = []  # [the self-test's verdict], computed on first use


def tensor_guard(*tensors: Tensor) -> Guard | None:
    """The check that other tensors match ``tensors`` in type, shape, strides, dtype, device,
    dispatch keys and ``requires_grad``, one C++ call; ``None`` where this PyTorch has none that
    passes the self-test (or it cannot be built for these tensors)."""
    if not _TRUSTED:
        _TRUSTED.append(_trusted())
    if not _TRUSTED[0]:
        return None
    try:
        check = _build(tensors)
        # (It fails tensors passed twice, as in ``attention(x, x, x)``: no guard for those.)
        return check if check(*tensors) else None
    except Exception:  # a tensor it cannot describe (sparse, nested): the caller's Python key decides
        return None


def _build(tensors: tuple[Tensor, ...]) -> Guard:
    from torch._C._dynamo import guards as dynamo_guards  # private: see the module docstring

    make: Any = dynamo_guards.TensorGuards  # (its stub's types differ from what it takes)
    guards = make(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )
    check: Guard = guards.check
    return check


def _trusted() -> bool:
    """Whether PyTorch's guard tells apart every fact a plan depends on, each changed alone."""
    try:
        a = torch.zeros(2, 3, 4)
        check = _build((a, a[:, :, :2]))
        b = a[:, :, :2]
        same = check(torch.ones(2, 3, 4), torch.ones(2, 3, 4)[:, :, :2])
        changed = [
            (torch.zeros(2, 3, 4, dtype=torch.float64), b),  # dtype
            (torch.zeros(2, 3, 5), b),  # shape
            (torch.zeros(4, 3, 2).permute(2, 1, 0), b),  # strides, same shape
            (torch.zeros(2, 3, 4, device="meta"), b),  # device
            (torch.zeros(2, 3, 4, requires_grad=True), b),  # requires_grad
            (torch.nn.Parameter(torch.zeros(2, 3, 4)), b),  # type
            (a, torch.zeros(2, 3, 2)),  # the second tensor's strides
        ]
        return bool(same) and not any(check(*pair) for pair in changed)
    except Exception:  # missing, or another signature in this version
        return False
