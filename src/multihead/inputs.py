"""What a tensor argument must be before its shape is read: one check shared by every entry point
(:func:`multihead.attention`, the layers, the caches, rotary embeddings, context parallelism).

A tensor of queries, keys, values or activations must be a ``torch.Tensor`` with the dense
(strided) layout and a floating-point dtype. Sparse, mkldnn and nested tensors have no strides or
no sizes, so without this check they fail deep inside PyTorch with a message that names neither
the argument nor the fix (``unsupported memory format option``, ``NestedTensorImpl doesn't support
sizes``); here each gets an error that names the argument, what it is and how to convert it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_tensor"]


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
