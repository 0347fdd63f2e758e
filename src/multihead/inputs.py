"""What a tensor argument must be before its shape is read: one check shared by every entry point
(:func:`multihead.attention`, the layers, the caches, rotary embeddings, context parallelism), and
one for token positions (:func:`check_positions`: the layers, every cache's ``update`` and rotary
embeddings read positions through it).

A tensor of queries, keys, values or activations must be a ``torch.Tensor`` with the dense
(strided) layout and a floating-point dtype. Sparse, mkldnn and nested tensors have no strides or
no sizes, so without this check they fail deep inside PyTorch with a message that names neither
the argument nor the fix (``unsupported memory format option``, ``NestedTensorImpl doesn't support
sizes``); here each gets an error that names the argument, what it is and how to convert it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["check_tensor", "check_positions", "INTEGER_DTYPES"]

#: The dtypes a tensor of positions may have (read as int64: a uint8 index would be a boolean mask).
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_positions(
    where: str,
    positions: object,
    shapes: tuple[tuple[int, ...], ...],
    device: torch.device | None,
    *,
    device_of: str = "",
    expected: str | Callable[[], str] | None = None,
    optional: bool = False,
    hint: str = "positions count tokens, e.g. torch.arange(L)",
) -> Tensor:
    """``positions``, checked and read as ``int64``: the one check of token positions. An integer
    tensor of one of ``shapes`` (e.g. ``((L,), (B, L))``; ``expected`` describes them in errors, a
    string or a function called only for an error) on ``device`` (that of the argument named
    ``device_of``; ``None``: any device, for callers that move them). The type, dtype, shape and
    device are each refused naming the argument, what was given and what was expected; the values
    are the caller's to check (a cache compares them with what it holds, rotary embeddings read
    their maximum)."""

    def described() -> str:  # formatted only for an error: a traced size formatted would fix it in the graph
        if expected is None:
            return " or ".join(str(s) if len(s) != 1 else f"({s[0]},)" for s in shapes)
        return expected if isinstance(expected, str) else expected()

    if not isinstance(positions, Tensor) or positions.dtype not in INTEGER_DTYPES:
        got = f"dtype {positions.dtype}" if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(
            f"{where}: positions must be {'None or ' if optional else ''}an integer tensor {described()} of "
            f"absolute token positions (torch.int64), got {got}; hint: {hint}"
        )
    if tuple(positions.shape) not in shapes:
        raise ValueError(f"{where}: positions must have shape {described()}, got {tuple(positions.shape)}")
    if device is not None and positions.device != device:
        raise ValueError(f"{where}: positions must be on the device of {device_of}, {device}, got {positions.device}")
    return positions.long()


def check_tensor(name: str, t: object, layout: str, *, where: str = "") -> Tensor:
    """``t``, checked: raise unless it is a dense floating-point ``torch.Tensor``.

    Args:
        name: the argument's name (``"q"``, ``"query"``, ``"k"``, ...).
        t: what was passed.
        layout: the expected shape in words, e.g. ``"(B, Hq, Lq, D)"``; may be empty.
        where: the caller's name for the message prefix (``"MultiHeadAttention"``), or ``""``.
    """
    prefix = f"{where}: " if where else ""
    shape = f" {layout}" if layout else ""
    if not isinstance(t, Tensor):
        raise TypeError(f"{prefix}{name} must be a torch.Tensor{shape}, got {type(t).__name__}")
    if t.is_nested:
        raise TypeError(
            f"{prefix}{name} must be a dense tensor{shape}, got a nested tensor; hint: pad it "
            f"({name}.to_padded_tensor(0.0)) and pass the real lengths as mask=key_padding(lengths), "
            f"or pack the sequences into one row with mask=document(ids)"
        )
    if t.layout is not torch.strided:
        raise TypeError(
            f"{prefix}{name} must be a dense (strided) tensor{shape}, got layout {t.layout}; hint: {name}.to_dense()"
        )
    if not t.is_floating_point():
        raise TypeError(f"{prefix}{name} must be a floating-point tensor{shape}, got dtype {t.dtype}")
    return t
