"""Band masks: causal attention and sliding windows, in either alignment.

Query ``i`` lines up with key ``i + offset`` (``offset = Lk - Lq`` bottom-right, ``0``
top-left; see :mod:`multihead.conventions`) and may see keys ``j`` with::

    i + offset - left  <=  j  <=  i + offset + right

``causal()`` is the band with no left limit and ``right = 0``. ``sliding_window(2)`` on 6 x 6::

    █·····
    ██····
    ███···
    ·███··
    ··███·
    ···███
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from multihead.conventions import check_align, resolve_alignment_offset
from multihead.masks.base import UNBOUNDED, BlockState, Mask

__all__ = ["causal", "sliding_window", "Band", "Window"]


class Window(NamedTuple):
    """Query ``i`` sees keys ``i + lo .. i + hi`` (inclusive); ``None`` is unbounded."""

    lo: int | None
    hi: int | None


def causal(align: str = "bottom_right") -> "Band":
    """Each query sees its aligned key and every key before it.

    ``align="bottom_right"`` (default): the last query sees the last key (KV caches).
    ``align="top_left"``: query ``i`` sees keys ``0..i`` (PyTorch's ``is_causal``).
    """
    return Band(None, 0, check_align(align), name="causal")


def sliding_window(left: int, right: int | None = 0, align: str = "bottom_right") -> "Band":
    """Query ``i`` sees the ``left`` keys before its aligned key, that key, and ``right`` after.

    ``left + 1 + right`` keys at most, the convention of FlashAttention's ``window_size``.
    ``right=None`` removes the right limit.
    """
    _check_extent("left", left, allow_none=False)
    _check_extent("right", right, allow_none=True)
    return Band(left, right, check_align(align), name="sliding_window")


class Band(Mask):
    """Keys within ``[i + offset - left, i + offset + right]``; ``None`` means unbounded."""

    kind = "band"

    def __init__(self, left: int | None, right: int | None, align: str, name: str = "band"):
        self._set(left=left, right=right, align=align, name=name)

    def depends_on_lengths(self) -> bool:
        return self.align == "bottom_right"

    def window(self, q_len: int, kv_len: int) -> Window:
        """The visible keys of query ``i`` relative to ``i``, in an attention of ``q_len x kv_len``."""
        off = self._offset(q_len, kv_len)
        return Window(None if self.left is None else off - self.left, None if self.right is None else off + self.right)

    def _offset(self, q_len: int, kv_len: int) -> int:
        return resolve_alignment_offset(self.align, q_len, kv_len)

    def _mod(self, b, h, q, kv, q_len, kv_len):
        center = q + self._offset(q_len, kv_len)
        allowed = None
        if self.left is not None:
            allowed = kv >= center - self.left
        if self.right is not None:
            upper = kv <= center + self.right
            allowed = upper if allowed is None else allowed & upper
        if allowed is None:  # unbounded on both sides: everything
            allowed = (kv >= 0) | (kv < 0)
        return allowed

    def _describe(self):
        if self.name == "causal":
            return f"causal(align={self.align!r})"
        return f"sliding_window(left={self.left}, right={self.right}, align={self.align!r})"

    def causal_offset(self, q_len, kv_len):
        if self.left is None and self.right is not None:
            return self._offset(q_len, kv_len) + self.right
        return None

    def _key_range(self, q0, q1, q_len, kv_len):
        off = self._offset(q_len, kv_len)
        lo = -UNBOUNDED if self.left is None else q0 + off - self.left
        hi = UNBOUNDED if self.right is None else q1 - 1 + off + self.right + 1
        return lo, hi

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        off = self._offset(q_len, kv_len)
        first, last = q0 + off, q1 - 1 + off  # aligned keys of the first and last query
        if self.right is not None and k0 > last + self.right:
            return BlockState.EMPTY
        if self.left is not None and k1 - 1 < first - self.left:
            return BlockState.EMPTY
        left_ok = self.left is None or k0 >= last - self.left
        right_ok = self.right is None or k1 - 1 <= first + self.right
        return BlockState.FULL if left_ok and right_ok else BlockState.PARTIAL

    def _empty_rows(self, batch, heads, q_len, kv_len, device=None):
        lo, hi = _row_bounds(self, q_len, kv_len, device)
        return (hi <= lo).view(1, 1, -1)


def _row_bounds(band: Band, q_len: int, kv_len: int, device):
    """Per-query visible key range ``[lo, hi)``, clamped to the keys that exist."""
    center = torch.arange(q_len, device=device) + band._offset(q_len, kv_len)
    lo = torch.zeros_like(center) if band.left is None else (center - band.left).clamp(0, kv_len)
    hi = torch.full_like(center, kv_len) if band.right is None else (center + band.right + 1).clamp(0, kv_len)
    return lo, hi


def _check_extent(name: str, value, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        expected = "a non-negative int" + (" or None (unbounded)" if allow_none else "")
        raise ValueError(f"sliding_window: {name} must be {expected}, got {value!r}")
