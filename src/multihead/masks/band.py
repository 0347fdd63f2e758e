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

from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.conventions import check_align, resolve_alignment_offset
from multihead.masks.base import UNBOUNDED, BlockState, Mask

__all__ = ["causal", "sliding_window", "Band", "Window"]

#: Per-sequence lengths: one int, a sequence of ints (one per batch element) or an integer tensor ``(B,)``.
Lengths: TypeAlias = "int | Sequence[int] | Tensor | None"


class Window(NamedTuple):
    """Query ``i`` sees keys ``i + lo .. i + hi`` (inclusive); ``None`` is unbounded."""

    lo: int | None
    hi: int | None


def causal(align: str = "bottom_right", *, q_lengths: Lengths = None, kv_lengths: Lengths = None) -> Band:
    """Each query sees its aligned key and every key before it.

    ``align="bottom_right"`` (default): the last query sees the last key (KV caches).
    ``align="top_left"``: query ``i`` sees keys ``0..i`` (PyTorch's ``is_causal``).
    ``q_lengths``/``kv_lengths`` (one per batch element; default ``Lq``/``Lk``): bottom-right *per
    sequence* of a padded batch, FlashAttention's varlen meaning: in batch ``b`` the last real
    query (``q_lengths[b] - 1``) sees the last real key (``kv_lengths[b] - 1``).
    """
    return Band(None, 0, check_align(align), name="causal", **_lengths(align, q_lengths, kv_lengths))


def sliding_window(
    left: int,
    right: int | None = 0,
    align: str = "bottom_right",
    *,
    q_lengths: Lengths = None,
    kv_lengths: Lengths = None,
) -> Band:
    """Query ``i`` sees the ``left`` keys before its aligned key, that key, and ``right`` after.

    ``left + 1 + right`` keys at most, the convention of FlashAttention's ``window_size``.
    ``right=None`` removes the right limit. ``q_lengths``/``kv_lengths``: aligned per sequence,
    as in :func:`causal`.
    """
    _check_extent("left", left, allow_none=False)
    _check_extent("right", right, allow_none=True)
    return Band(left, right, check_align(align), name="sliding_window", **_lengths(align, q_lengths, kv_lengths))


class Band(Mask):
    """Keys within ``[i + offset - left, i + offset + right]``; ``None`` means unbounded. The
    offset is that of the alignment, per batch element when ``q_lengths``/``kv_lengths`` are set."""

    kind = "band"
    left: int | None
    right: int | None
    align: str
    name: str
    q_lengths: Tensor | None  # (B|1,) int64 on the host
    kv_lengths: Tensor | None

    def __init__(
        self,
        left: int | None,
        right: int | None,
        align: str,
        name: str = "band",
        q_lengths: Tensor | None = None,
        kv_lengths: Tensor | None = None,
    ):
        self._set(left=left, right=right, align=align, name=name, q_lengths=q_lengths, kv_lengths=kv_lengths)

    @property
    def per_sequence(self) -> bool:
        """Whether the alignment is per batch element (``q_lengths``/``kv_lengths`` given)."""
        return self.q_lengths is not None or self.kv_lengths is not None

    def depends_on_lengths(self) -> bool:
        if self.per_sequence:
            return self.q_lengths is None or self.kv_lengths is None
        return self.align == "bottom_right"

    def check(self, extent: Extent) -> None:
        batch, _, q_len, kv_len = extent
        for name, lengths, whole, what in (
            ("q_lengths", self.q_lengths, q_len, "Lq"),
            ("kv_lengths", self.kv_lengths, kv_len, "Lk"),
        ):
            if lengths is None:
                continue
            # (not `in (1, B)`: dynamo, torch 2.13, answers it False for a symbolic B)
            if lengths.shape[0] != 1 and lengths.shape[0] != batch:
                raise ValueError(
                    f"{self.name}: {name} has {lengths.shape[0]} batch elements but B={batch}; expected 1 or {batch}"
                )
            if whole is not None and not torch.compiler.is_compiling() and int(lengths.max()) > whole:
                raise ValueError(f"{self.name}: {name} {lengths.tolist()} exceed {what}={whole}")

    def window(self, q_len: int, kv_len: int) -> Window | None:
        """The visible keys of query ``i`` relative to ``i``, in an attention of ``q_len x kv_len``;
        ``None`` when aligned per sequence (each batch element has its own)."""
        if self.per_sequence:
            return None
        off = self._offset(q_len, kv_len)
        return Window(None if self.left is None else off - self.left, None if self.right is None else off + self.right)

    def _offset(self, q_len: int, kv_len: int) -> int:
        return resolve_alignment_offset(self.align, q_len, kv_len)

    def _offsets(self, q_len: int, kv_len: int) -> Tensor | None:
        """Per-batch offsets ``(B|1,)`` when aligned per sequence (host tensors, small), else ``None``."""
        if not self.per_sequence:
            return None
        q = torch.tensor([q_len]) if self.q_lengths is None else self.q_lengths
        kv = torch.tensor([kv_len]) if self.kv_lengths is None else self.kv_lengths
        return kv - q

    def _offset_range(self, q_len: int, kv_len: int) -> tuple[int, int]:
        offs = self._offsets(q_len, kv_len)
        if offs is None:
            off = self._offset(q_len, kv_len)
            return off, off
        return int(offs.min()), int(offs.max())

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        offs = self._offsets(q_len, kv_len)
        if offs is None:
            center = q + self._offset(q_len, kv_len)
        else:
            offs = offs.to(q.device)
            center = q + offs[b * 0 if offs.shape[0] == 1 else b]
        allowed: Tensor | None = None
        if self.left is not None:
            allowed = kv >= center - self.left
        if self.right is not None:
            upper = kv <= center + self.right
            allowed = upper if allowed is None else allowed & upper
        if allowed is None:  # unbounded on both sides: everything
            allowed = (kv >= 0) | (kv < 0)
        return allowed

    def _describe(self) -> str:
        per_seq = "".join(
            f", {n}={t.tolist()}"
            for n, t in (("q_lengths", self.q_lengths), ("kv_lengths", self.kv_lengths))
            if t is not None
        )
        if self.name == "causal":
            return f"causal(align={self.align!r}{per_seq})"
        return f"sliding_window(left={self.left}, right={self.right}, align={self.align!r}{per_seq})"

    def causal_offset(self, q_len: int, kv_len: int) -> int | None:
        if self.left is None and self.right is not None and not self.per_sequence:
            return self._offset(q_len, kv_len) + self.right
        return None

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        q0, q1 = block.q0, block.q1
        low, high = self._offset_range(*extent.lengths)
        lo = -UNBOUNDED if self.left is None else q0 + low - self.left
        hi = UNBOUNDED if self.right is None else q1 - 1 + high + self.right + 1
        return lo, hi

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        q0, q1, k0, k1 = block
        low, high = self._offset_range(*extent.lengths)  # the same offset unless aligned per sequence
        if self.right is not None and k0 > q1 - 1 + high + self.right:
            return BlockState.EMPTY
        if self.left is not None and k1 - 1 < q0 + low - self.left:
            return BlockState.EMPTY
        left_ok = self.left is None or k0 >= q1 - 1 + high - self.left
        right_ok = self.right is None or k1 - 1 <= q0 + low + self.right
        return BlockState.FULL if left_ok and right_ok else BlockState.PARTIAL

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        q_len, kv_len = extent.lengths
        offs = self._offsets(q_len, kv_len)
        offs = torch.tensor([self._offset(q_len, kv_len)]) if offs is None else offs
        center = torch.arange(q_len).view(1, -1) + offs.view(-1, 1)  # (B|1, Lq)
        lo = torch.zeros_like(center) if self.left is None else (center - self.left).clamp(0, kv_len)
        hi = torch.full_like(center, kv_len) if self.right is None else (center + self.right + 1).clamp(0, kv_len)
        return (hi <= lo).view(center.shape[0], 1, q_len).to(device)


def _lengths(align: str, q_lengths: Lengths, kv_lengths: Lengths) -> dict[str, Tensor | None]:
    """``q_lengths``/``kv_lengths`` as int64 host copies (``None`` where not given)."""
    out: dict[str, Tensor | None] = {}
    for name, value in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        if value is None:
            out[name] = None
            continue
        if align != "bottom_right":
            raise ValueError(
                f"{name} aligns each sequence bottom-right; it needs align='bottom_right', got {align!r} "
                "(top-left needs no lengths: every sequence starts at position 0)"
            )
        if isinstance(value, Tensor):
            if value.is_floating_point() or value.dtype == torch.bool or value.dim() != 1:
                raise TypeError(
                    f"{name} must be an integer tensor (B,), got dtype {value.dtype}, shape {tuple(value.shape)}"
                )
            value = value.detach().to("cpu", torch.int64, copy=True)
        else:
            try:
                value = torch.tensor([value] if isinstance(value, int) else list(value), dtype=torch.int64)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name} must be ints, one per batch element, got {value!r}") from exc
        # (Under torch.compile the sign is not checked: a data-dependent branch; a negative length
        # then reads as an empty sequence, as key_padding's does.)
        if value.numel() == 0 or (not torch.compiler.is_compiling() and bool((value < 0).any())):
            raise ValueError(f"{name} must be non-negative, one per batch element, got {value.tolist()}")
        out[name] = value
    return out


def _check_extent(name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        expected = "a non-negative int" + (" or None (unbounded)" if allow_none else "")
        raise ValueError(f"sliding_window: {name} must be {expected}, got {value!r}")
