"""The conventions of `multihead`, decided once. Every other docstring points here.

Notation
--------
====  =====================================================
B     batch size
Hq    number of query heads
Hkv   number of key/value heads (``Hq % Hkv == 0``)
G     group size, ``Hq // Hkv`` query heads per KV head
Lq    query length
Lk    key/value length
D     head dim of queries and keys
Dv    head dim of values (may differ from ``D``)
E     model (embedding) dim of a layer
====  =====================================================

Layout
------
The functional core takes ``q: (B, Hq, Lq, D)``, ``k: (B, Hkv, Lk, D)``, ``v: (B, Hkv, Lk, Dv)``
and returns ``(B, Hq, Lq, Dv)``. Layers convert from ``(B, L, E)`` (or ``(L, B, E)``) once.

Grouped-query mapping
---------------------
Query head ``h`` reads KV head ``h // G`` (contiguous groups), the mapping of SDPA's
``enable_gqa``, FlashAttention and Hugging Face ``repeat_kv``; not the tiled ``h % Hkv``::

    Hq = 8, Hkv = 2 (G = 4)
    query head : 0 1 2 3 | 4 5 6 7
    kv head    : 0 0 0 0 | 1 1 1 1

A backend that runs each KV head once folds its ``G`` query heads into rows
(:func:`fold_query_heads`, :func:`unfold_query_heads`)::

    q (B, Hq, Lq, D) -> (B, Hkv, G·Lq, D): row g·Lq + i is query i of head kv·G + g

Masks
-----
Boolean: ``True`` means *may attend*, everywhere in `multihead` (the one exception is the
``key_padding_mask`` of :class:`multihead.compat.MultiheadAttention`, which copies PyTorch's
polarity on purpose). Float masks are *additive* biases; an entry blocks when it is ``-inf`` or at
or below ``finfo(dtype).min / 2`` (:func:`multihead.masks.additive_blocked`, the one rule).
Integer and uint8 masks are refused: their polarity differs between libraries.

Causal alignment
----------------
Bottom-right is the default: the last query sees the last key, which is what a KV cache needs
(``Lq`` new tokens appended after ``Lk - Lq`` cached ones). Top-left is available by name.
Query ``i`` may see key ``j`` iff ``j <= i + offset`` with ``offset = Lk - Lq`` (bottom-right)
or ``0`` (top-left)::

    Lq=2, Lk=5                 Lq=5, Lk=2
    bottom_right  top_left     bottom_right  top_left
    1 1 1 1 .     1 . . . .    . .           1 .
    1 1 1 1 1     1 1 . . .    . .           1 1
                               . .           1 1
                               1 .           1 1
                               1 1           1 1

Fully masked rows
-----------------
A query row that may see no key gives output exactly 0, log-sum-exp ``-inf``, a weights row of
0, and zero (never NaN) gradients, on every backend.

Scale and precision
-------------------
The default scale is ``1 / sqrt(D)``. The softmax is accumulated in fp32 for fp16/bf16 inputs
(fp64 inputs stay fp64); the output has the dtype of ``q``. The log-sum-exp is returned in
fp32 (fp64 for fp64 inputs), shape ``(B, Hq, Lq)``, in the natural log of the *scaled* scores.

Weights and dropout
-------------------
Returned attention weights are the softmax probabilities ``(B, Hq, Lq, Lk)`` *before* dropout,
in the dtype of ``q``.
Dropout (``dropout_p > 0``) zeroes probabilities with probability ``p`` and scales the kept
ones by ``1 / (1 - p)`` on the path to the output only; it is reproducible under
``torch.manual_seed``.
"""

from __future__ import annotations

import math
from typing import overload

import torch

__all__ = [
    "ALIGNMENTS",
    "default_scale",
    "kv_head_of",
    "repeat_kv",
    "group_query_heads",
    "fold_query_heads",
    "unfold_query_heads",
    "softmax_dtype",
    "lse_dtype",
]

#: The two causal alignments, by name. ``bottom_right`` is the default everywhere.
ALIGNMENTS = ("bottom_right", "top_left")


def default_scale(head_dim: int) -> float:
    """The default softmax scale, ``1 / sqrt(D)``."""
    return 1.0 / math.sqrt(head_dim)


@overload
def kv_head_of(query_head: int, num_q_heads: int, num_kv_heads: int) -> int: ...
@overload
def kv_head_of(query_head: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor: ...


def kv_head_of(query_head: int | torch.Tensor, num_q_heads: int, num_kv_heads: int) -> int | torch.Tensor:
    """The KV head read by ``query_head`` (an int or an integer tensor of heads):
    ``h // (Hq // Hkv)`` (contiguous groups). Every other place that maps heads calls this."""
    return query_head // (num_q_heads // num_kv_heads)


def repeat_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``(B, Hkv, L, ·)`` -> ``(B, Hq, L, ·)``: KV head ``kv_head_of(h)`` copied to query head ``h``."""
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


def group_query_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``(B, Hq, L, ·)`` -> ``(B, Hkv, G, L, ·)``: query head ``kv·G + g`` at ``[:, kv, g]``, the
    heads :func:`kv_head_of` maps to KV head ``kv``. A tensor shared by every head ``(B, 1, L, ·)``
    (a mask) stays shared: ``(B, 1, 1, L, ·)``. A view where ``x`` allows one."""
    B, H = x.shape[:2]
    if H == 1:
        return x.unsqueeze(2)
    return x.reshape(B, num_kv_heads, H // num_kv_heads, *x.shape[2:])


def fold_query_heads(x: torch.Tensor, num_kv_heads: int, num_q_heads: int) -> torch.Tensor:
    """``(B, Hq|1, L, ·)`` -> ``(B, Hkv|1, G·L, ·)``: the ``G`` query heads of each KV head as the
    rows of one (row ``g·L + i`` is row ``i`` of head ``kv·G + g``), so that one matmul per KV head
    serves them all; a tensor shared by every head is repeated for each of the ``G``."""
    grouped = group_query_heads(x, num_kv_heads)  # (B, Hkv|1, G|1, L, ·)
    G = num_q_heads // num_kv_heads
    return grouped.expand(grouped.shape[0], grouped.shape[1], G, *grouped.shape[3:]).flatten(2, 3)


def unfold_query_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``(B, Hkv, G·L, ·)`` -> ``(B, Hq, L, ·)`` (and ``(B, Hkv, G·L)`` -> ``(B, Hq, L)``): the
    inverse of :func:`fold_query_heads`."""
    B, Hkv, rows = x.shape[:3]
    return x.reshape(B, num_q_heads, rows * Hkv // num_q_heads, *x.shape[3:])


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax is accumulated in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the returned log-sum-exp for inputs of ``dtype``."""
    return softmax_dtype(dtype)


def resolve_alignment_offset(align: str, q_len: int, kv_len: int) -> int:
    """The diagonal offset of an alignment: query ``i`` lines up with key ``i + offset``."""
    return kv_len - q_len if align == "bottom_right" else 0


def check_align(align: str) -> str:
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    return align
