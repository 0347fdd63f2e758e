"""Plain tensors as masks, and :func:`custom` for a user ``mask_mod``.

A bool tensor (``True`` = may attend) or a float tensor (an additive bias, ``-inf`` blocks),
broadcastable to ``(B, H, Lq, Lk)``. Integer and uint8 tensors are refused: ``1`` means
"attend" in some libraries and "blocked" in others.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from multihead.masks.base import BlockState, Mask

__all__ = ["as_mask", "bias", "custom", "TensorMask", "Custom"]


def as_mask(mask, name: str = "mask") -> Mask | None:
    """``None``, a :class:`Mask`, or a bool/float tensor, as a :class:`Mask` (or ``None``)."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return TensorMask(mask, name=name, refuse_binary=True)
    raise TypeError(f"{name} must be a multihead mask, a bool or float tensor, or None; "
                    f"got {type(mask).__name__}")


def bias(tensor: Tensor, name: str = "bias") -> "TensorMask":
    """A float tensor declared an additive bias (``-inf`` blocks), broadcastable to
    ``(B, H, Lq, Lk)``. Unlike a float tensor passed as ``mask=``, a bias of only 0s and 1s is
    accepted: here you said it is meant to be added."""
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise TypeError(f"bias: expected a float tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    return TensorMask(tensor, name=name)


def custom(mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], name: str | None = None) -> "Custom":
    """A mask from a function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``.

    The function receives broadcastable integer index tensors and must broadcast its result
    (FlexAttention's signature). It decides the meaning; backends evaluate it block by block.
    """
    if not callable(mask_mod):
        raise TypeError(f"custom: mask_mod must be callable, got {type(mask_mod).__name__}")
    return Custom(mask_mod, name or getattr(mask_mod, "__name__", "mask_mod"))


class TensorMask(Mask):
    """A bool or additive float tensor broadcastable to ``(B, H, Lq, Lk)``."""

    def __init__(self, tensor: Tensor, name: str = "mask", refuse_binary: bool = False):
        if tensor.dtype == torch.bool:
            additive = False
        elif tensor.is_floating_point():
            additive = True
        else:
            raise TypeError(
                f"{name} has dtype {tensor.dtype}; expected torch.bool (True = may attend) or a float "
                "additive bias. Integer masks are refused because their polarity differs between "
                "libraries: use `mask.bool()` if 1 means attend, or `mask == 0` if 1 means blocked")
        if tensor.dim() > 4 or tensor.dim() < 2:
            raise ValueError(f"{name} must have 2 to 4 dims broadcastable to (B, H, Lq, Lk), "
                             f"got shape {tuple(tensor.shape)}")
        # One elementwise pass over the mask per call (a few % of an attention call at D=64);
        # skipped under torch.compile, where its data-dependent branch would break the graph.
        if additive and refuse_binary and not torch.compiler.is_compiling() and _is_zero_one(tensor):
            # torch.tril(torch.ones(L, L)) as a "mask" would be *added* to the scores: a silent bug
            # several tutorials invite. Adding 1 to some scores is never what such a tensor meant.
            raise ValueError(
                f"{name} is a float tensor of only 0s and 1s; float masks are additive, so this would add "
                "1 to some scores instead of masking. Use `mask.bool()` if 1 means attend, `mask == 0` "
                "if 1 means blocked, or multihead.masks.bias(tensor) if you really mean an additive bias")
        t4 = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
        self._set(tensor=t4, is_additive=additive, name=name)

    def check(self, batch, heads, q_len, kv_len):
        expected = (batch, heads, q_len, kv_len)
        if any(s not in (1, e) for s, e in zip(self.tensor.shape, expected)):
            raise ValueError(f"{self.name} of shape {tuple(self.tensor.shape)} is not broadcastable to "
                             f"(B, H, Lq, Lk) = {expected}; each dim must be 1 or the matching size")

    def _index(self, b, h, q, kv):
        t = self.tensor.to(q.device)
        idx = [i * 0 if size == 1 else i for i, size in zip((b, h, q, kv), t.shape)]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def _mod(self, b, h, q, kv, q_len, kv_len):
        values = self._index(b, h, q, kv)
        return values if not self.is_additive else ~torch.isneginf(values)

    def _bias(self, b, h, q, kv, q_len, kv_len, dtype, allowed):
        return self._index(b, h, q, kv).to(dtype)

    def materialize(self, batch, heads, q_len, kv_len, device=None, dtype=None):
        t = self.tensor.to(device) if device is not None else self.tensor
        if self.is_additive:
            return t.to(dtype or torch.float32)
        return t

    def materialize_block(self, batch, heads, q0, q1, q_len, kv_len, device=None, dtype=None, k0=0, k1=None):
        k1 = kv_len if k1 is None else k1
        t = self.tensor
        rows = slice(q0, q1) if t.shape[2] > 1 else slice(0, 1)
        cols = slice(k0, k1) if t.shape[3] > 1 else slice(0, 1)
        block = t[:, :, rows, cols]
        block = block.expand(t.shape[0], t.shape[1], q1 - q0, k1 - k0).to(device) if device else \
            block.expand(t.shape[0], t.shape[1], q1 - q0, k1 - k0)
        return block.to(dtype or torch.float32) if self.is_additive else block

    def _describe(self):
        kind = "additive" if self.is_additive else "bool"
        return f"{self.name}(<{kind} tensor {tuple(self.tensor.shape)}>)"

    def to_string(self, q_len=None, kv_len=None, b=0, h=0):
        q_len = self.tensor.shape[2] if q_len is None else q_len
        kv_len = self.tensor.shape[3] if kv_len is None else kv_len
        return super().to_string(min(q_len, 32), min(kv_len, 64), b, h)

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        block = self.materialize_block(1, 1, q0, q1, q_len, kv_len, k0=k0, k1=k1)
        if self.is_additive:
            return BlockState.EMPTY if bool(torch.isneginf(block).all()) else BlockState.PARTIAL
        if bool(block.all()):
            return BlockState.FULL
        return BlockState.PARTIAL if bool(block.any()) else BlockState.EMPTY

    def _empty_rows(self, batch, heads, q_len, kv_len, device=None):
        t = self.tensor.to(device) if device is not None else self.tensor
        visible = ~torch.isneginf(t) if self.is_additive else t
        empty = ~visible.any(-1)
        return empty.expand(empty.shape[0], empty.shape[1], q_len)


class Custom(Mask):
    def __init__(self, fn, name: str):
        self._set(fn=fn, name=name)

    def _mod(self, b, h, q, kv, q_len, kv_len):
        out = self.fn(b, h, q, kv)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise TypeError(f"custom mask {self.name!r} must return a bool tensor, got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        return out

    def _describe(self):
        return f"custom({self.name})"


def _is_zero_one(tensor: Tensor) -> bool:
    """Only 0s and 1s, with at least one of each (an all-0 or all-1 bias changes nothing)."""
    zeros, ones = tensor == 0, tensor == 1
    return bool((zeros | ones).all()) and bool(zeros.any()) and bool(ones.any())
