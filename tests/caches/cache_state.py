"""What a cache holds, to compare before and after a refused call: every attribute, tensors
compared bit for bit (unwritten capacity may hold NaN), the undo record included (a call that
wrote and rolled back would have cleared it). Equal means the call changed nothing."""

from __future__ import annotations

from typing import Any

import torch


def everything(cache: object) -> dict[str, Any]:
    """Every attribute of ``cache``, tensors cloned and containers copied."""
    return {name: _copy(value) for name, value in vars(cache).items()}


def identical(a: object, b: object) -> bool:
    """Whether two :func:`everything` snapshots (or values in them) are bit-identical."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[n], b[n]) for n in a)
    return a == b


def _copy(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
