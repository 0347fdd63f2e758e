"""Plain bool tensors as masks, and :func:`custom` for a user ``mask_mod``.

A bool tensor (``True`` = may attend) broadcastable to ``(B, H, Lq, Lk)``. Float tensors are
additive biases, not masks: :func:`multihead.attention` accepts one as ``mask=`` (the way PyTorch
does) and splits it into the bool mask of the entries that do not block (:func:`additive_blocked`,
the one rule) and a :func:`multihead.scores.bias` score modifier. Integer and uint8 tensors are
refused: ``1`` means "attend" in some libraries and "blocked" in others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn, overload

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks.base import BlockState, Mask, register_coercion

__all__ = ["additive_blocked", "as_mask", "bias", "custom", "TensorMask", "Custom"]


@overload
def as_mask(mask: None, name: str = "mask") -> None: ...
@overload
def as_mask(mask: Mask | Tensor, name: str = "mask") -> Mask: ...
@overload
def as_mask(mask: object, name: str = "mask") -> Mask | None: ...


def as_mask(mask: object, name: str = "mask") -> Mask | None:
    """``None``, a :class:`Mask`, or a bool tensor, as a :class:`Mask` (or ``None``)."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        if mask.is_floating_point():
            raise TypeError(
                f"{name} is a float tensor: an additive bias, not a mask (masks only allow or block). "
                "Pass it as score_mod=multihead.scores.bias(tensor), or as mask= to multihead.attention, "
                "which splits a float mask into what it blocks (masks.additive_blocked) and a bias"
            )
        return TensorMask(mask, name=name)
    raise TypeError(f"{name} must be a multihead mask, a bool tensor, or None; got {type(mask).__name__}")


def additive_blocked(mask: Tensor) -> Tensor:
    """Where a float (additive) ``mask`` blocks: its entries at or below ``finfo(dtype).min / 2``,
    ``-inf`` included. The one rule for every reader of a float mask (``mask=`` of
    :func:`multihead.attention` and the layers, :func:`multihead.masks.recognize.from_dense`,
    ``compat``'s ``attn_mask``, a Hugging Face 4-D mask), so that one tensor means one thing.

    ``-inf`` blocks by definition. A value near the dtype's lowest is how libraries write
    "blocked" without infinities (Hugging Face writes ``finfo(dtype).min``); half of it still
    catches the sum of two such masks and a mask cast from a wider dtype. Anything above is a bias,
    however negative: ``-1e4`` or ``-1e9`` underflow ``exp()`` to 0 beside a visible key, but a row
    of only such entries is a uniform average, where a blocked row is fully masked (output 0,
    :mod:`multihead.conventions`). NaN and ``+inf`` do not block.
    """
    return mask <= torch.finfo(mask.dtype).min / 2


def bias(tensor: Tensor, name: str = "bias") -> NoReturn:
    """Moved: an additive bias is a score modifier now, ``multihead.scores.bias(tensor)``."""
    raise TypeError(
        "multihead.masks.bias moved: an additive bias is a score modifier, not a mask. "
        "Use score_mod=multihead.scores.bias(tensor) (with mask= for what is blocked)"
    )


def custom(mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], name: str | None = None) -> Custom:
    """A mask from a function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``.

    The function receives broadcastable integer index tensors and must broadcast its result
    (FlexAttention's signature). It decides the meaning; backends evaluate it block by block.
    """
    if not callable(mask_mod):
        raise TypeError(f"custom: mask_mod must be callable, got {type(mask_mod).__name__}")
    return Custom(mask_mod, name or str(getattr(mask_mod, "__name__", "mask_mod")))


class TensorMask(Mask):
    """A bool tensor broadcastable to ``(B, H, Lq, Lk)``."""

    kind = "tensor"
    tensor: Tensor  # (B|1, H|1, Lq|1, Lk|1) bool
    name: str

    def __init__(self, tensor: Tensor, name: str = "mask"):
        if tensor.dtype != torch.bool:
            raise TypeError(
                f"{name} has dtype {tensor.dtype}; expected torch.bool (True = may attend). Integer masks are "
                "refused because their polarity differs between libraries: use `mask.bool()` if 1 means "
                "attend, or `mask == 0` if 1 means blocked"
            )
        if tensor.dim() > 4 or tensor.dim() < 2:
            raise ValueError(
                f"{name} must have 2 to 4 dims broadcastable to (B, H, Lq, Lk), got shape {tuple(tensor.shape)}"
            )
        t4 = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
        self._set(tensor=t4, name=name)

    def check(self, extent: Extent) -> None:
        expected = tuple(extent)
        # (not `s not in (1, e)`: dynamo, torch 2.13, answers it True for a symbolic size e)
        if any(s != 1 and s != e for s, e in zip(self.tensor.shape, expected) if e is not None):
            raise ValueError(
                f"{self.name} of shape {tuple(self.tensor.shape)} is not broadcastable to "
                f"(B, H, Lq, Lk) = {expected}; each dim must be 1 or the matching size"
            )

    def extent(self) -> tuple[int | None, int | None]:
        _, _, lq, lk = self.tensor.shape
        return (lq if lq > 1 else None), (lk if lk > 1 else None)

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        t = self.tensor.to(q.device)
        idx = [i * 0 if size == 1 else i for i, size in zip((b, h, q, kv), t.shape)]
        return t[idx[0], idx[1], idx[2], idx[3]]

    def materialize(
        self, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device | str | None = None
    ) -> Tensor:
        return self.tensor.to(device) if device is not None else self.tensor

    def materialize_block(self, extent: Extent, block: Block, device: torch.device | str | None = None) -> Tensor:
        q0, q1, k0, k1 = block
        t = self.tensor
        rows = slice(q0, q1) if t.shape[2] > 1 else slice(0, 1)
        cols = slice(k0, k1) if t.shape[3] > 1 else slice(0, 1)
        part = t[:, :, rows, cols].expand(t.shape[0], t.shape[1], q1 - q0, k1 - k0)
        return part.to(device) if device is not None else part

    def _describe(self) -> str:
        return f"{self.name}(<bool tensor {tuple(self.tensor.shape)}>)"

    def by_value(self) -> bool:
        return False  # a view of the caller's tensor, not a copy: it may change in place

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        allowed = self.materialize_block(extent, block)  # the tensor's own (B|1, H|1, ...): no expansion
        if bool(allowed.all()):
            return BlockState.FULL
        return BlockState.PARTIAL if bool(allowed.any()) else BlockState.EMPTY

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        q_len = extent.lengths[0]
        t = self.tensor.to(device) if device is not None else self.tensor
        empty = ~t.any(-1)
        return empty.expand(empty.shape[0], empty.shape[1], q_len)


class Custom(Mask):
    """A mask whose meaning is a user function ``fn(b, h, q_idx, kv_idx) -> bool tensor`` on
    broadcastable index tensors. Built by :func:`custom`."""

    kind = "custom"
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    name: str

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], name: str):
        self._set(fn=fn, name=name)

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        out = self.fn(b, h, q, kv)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise TypeError(
                f"custom mask {self.name!r} must return a bool tensor, got {getattr(out, 'dtype', type(out).__name__)}"
            )
        grid = torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
        try:
            torch.broadcast_shapes(out.shape, grid)
        except RuntimeError:
            raise ValueError(
                f"custom mask {self.name!r} returned shape {tuple(out.shape)}, which does not "
                f"broadcast to its index grid {tuple(grid)}; mask_mod(b, h, q_idx, kv_idx) must "
                "combine its (broadcastable) arguments elementwise"
            ) from None
        return out

    def _describe(self) -> str:
        return f"custom({self.name})"


def _tensor_as_mask(tensor: Tensor, name: str) -> Mask:
    return as_mask(tensor, name)


register_coercion(Tensor, _tensor_as_mask)
