"""The `Mask` base class, its combinators (``&``, ``|``, ``~``) and shifting.

A mask is an immutable predicate over ``(b, h, q_idx, kv_idx)``: ``True`` means the query may
attend to the key (see :mod:`multihead.conventions`). Every mask answers three kinds of question:

* **meaning**: :meth:`Mask.mask_mod` on index tensors, the single source of truth;
* **dense form**: :meth:`Mask.materialize` (built from ``mask_mod`` unless a subclass knows
  better) and a text picture in ``repr``/:meth:`Mask.to_string`;
* **structure**, for backends that must not build an ``Lq x Lk`` tensor:
  :meth:`Mask.causal_offset`, :meth:`Mask.key_range`, :meth:`Mask.block_state`,
  :meth:`Mask.empty_rows`.

Alignment-dependent masks (bottom-right causal, windows) resolve their diagonal with the
lengths of the call; :meth:`Mask.mask_mod` without lengths assumes ``Lq == Lk``.
"""

from __future__ import annotations

import abc
import enum
from typing import Callable

import torch
from torch import Tensor

__all__ = ["Mask", "BlockState", "And", "Or", "Not", "Shifted", "UNBOUNDED"]

# Rows evaluated at a time when a generic question has to look at the mask element by element:
# bounds the memory of those fallbacks to about this many booleans.
_CHUNK_ELEMENTS = 1 << 22
_PICTURE_SIZE = 8
#: "No limit" for an unbounded side of a key range, before clamping to ``[0, Lk)``.
UNBOUNDED = 1 << 62


class BlockState(enum.Enum):
    """What a mask looks like over a block of queries x keys, across every batch and head."""

    EMPTY = "empty"  # nothing visible: skip the block
    PARTIAL = "partial"  # needs an element-wise mask
    FULL = "full"  # everything visible: no mask needed


class Mask(abc.ABC):
    """Base class of all masks. Subclasses implement :meth:`_mod` and :meth:`_describe`."""

    #: A float mask adds a bias to the scores; a boolean mask only allows or blocks.
    is_additive: bool = False

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; build a new mask instead")

    def _set(self, **fields) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    # ----------------------------------------------------------------------------- meaning
    @abc.abstractmethod
    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        """The predicate on broadcastable index tensors: ``True`` where the query may attend."""

    @abc.abstractmethod
    def _describe(self) -> str:
        """The mask as the expression that builds it, e.g. ``causal(align='top_left')``."""

    def mask_mod(self, b, h, q_idx, kv_idx, q_len: int | None = None, kv_len: int | None = None) -> Tensor:
        """``True`` where query ``q_idx`` of batch ``b``, head ``h`` may attend to ``kv_idx``.

        Arguments are integers or broadcastable integer tensors. ``q_len``/``kv_len`` resolve
        the causal alignment; without them the mask is read as square (``Lq == Lk``).
        """
        if (q_len is None) != (kv_len is None):
            raise ValueError("mask_mod: give both q_len and kv_len, or neither (square)")
        if q_len is None:
            q_len = kv_len = 0
        idx = [x if isinstance(x, Tensor) else torch.tensor(x) for x in (b, h, q_idx, kv_idx)]
        return self._mod(*idx, q_len, kv_len)

    def as_mask_mod(self, q_len: int, kv_len: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """A FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` for these lengths."""

        def mask_mod(b, h, q_idx, kv_idx):
            return self._mod(b, h, q_idx, kv_idx, q_len, kv_len)

        return mask_mod

    def check(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` if this mask cannot apply to ``(B, H, Lq, Lk)``."""

    # ----------------------------------------------------------------------------- dense form
    def materialize(
        self,
        batch: int,
        heads: int,
        q_len: int,
        kv_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """The mask as a tensor broadcastable to ``(B, H, Lq, Lk)``.

        Dimensions the mask does not depend on have size 1. Boolean masks give ``bool``;
        additive masks give a float bias (``dtype``, default fp32) with ``-inf`` where blocked.
        """
        return self.materialize_block(batch, heads, 0, q_len, q_len, kv_len, device, dtype)

    def materialize_block(self, batch, heads, q0, q1, q_len, kv_len, device=None, dtype=None,
                          k0=0, k1=None) -> Tensor:
        """Queries ``[q0, q1)`` x keys ``[k0, k1)`` of :meth:`materialize`, built from the block's
        indices only (memory proportional to the block)."""
        k1 = kv_len if k1 is None else k1
        b, h, q, kv = _grid(batch, heads, q0, q1, k0, k1, device)
        allowed = _as_4d(self._mod(b, h, q, kv, q_len, kv_len), q1 - q0, k1 - k0)
        if not self.is_additive:
            return allowed
        return self._bias(b, h, q, kv, q_len, kv_len, dtype or torch.float32, allowed)

    def _bias(self, b, h, q, kv, q_len, kv_len, dtype, allowed) -> Tensor:
        """Additive form; boolean masks only block (0 / -inf)."""
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=dtype, device=allowed.device))

    def to_string(self, q_len: int = _PICTURE_SIZE, kv_len: int | None = None, b: int = 0, h: int = 0) -> str:
        """A picture of the mask for batch ``b``, head ``h``: rows are queries, columns keys.

        ``█`` may attend, ``·`` blocked.
        """
        kv_len = q_len if kv_len is None else kv_len
        bb, hh = torch.tensor(b).view(1, 1, 1, 1), torch.tensor(h).view(1, 1, 1, 1)
        q = torch.arange(q_len).view(1, 1, -1, 1)
        kv = torch.arange(kv_len).view(1, 1, 1, -1)
        allowed = _as_4d(self._mod(bb, hh, q, kv, q_len, kv_len), q_len, kv_len)[0, 0]
        rows = ["".join("█" if x else "·" for x in row.tolist()) for row in allowed]
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"{self._describe()}\n{self.to_string()}"

    # ----------------------------------------------------------------------------- composition
    def __and__(self, other: "Mask") -> "Mask":
        return And(self, _coerce(other, "&"))

    def __rand__(self, other) -> "Mask":
        return And(_coerce(other, "&"), self)

    def __or__(self, other: "Mask") -> "Mask":
        return Or(self, _coerce(other, "|"))

    def __ror__(self, other) -> "Mask":
        return Or(_coerce(other, "|"), self)

    def __invert__(self) -> "Mask":
        return Not(self)

    def shifted(self, q_offset: int = 0, kv_offset: int = 0) -> "Mask":
        """The same mask with query ``i`` read as position ``i + q_offset`` and key ``j`` as
        ``j + kv_offset``: a block of a larger attention (cache steps, ring steps)."""
        for name, value in (("q_offset", q_offset), ("kv_offset", kv_offset)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"shifted: {name} must be an int, got {type(value).__name__}")
        if q_offset == 0 and kv_offset == 0:
            return self
        return Shifted(self, q_offset, kv_offset)

    # ----------------------------------------------------------------------------- structure
    def causal_offset(self, q_len: int, kv_len: int) -> int | None:
        """``d`` if this mask is exactly "key ``j`` visible iff ``j <= i + d``", else ``None``."""
        return None

    def key_range(self, q0: int, q1: int, q_len: int, kv_len: int) -> tuple[int, int]:
        """A range ``[lo, hi)`` of keys covering every key visible to queries ``[q0, q1)`` in
        any batch or head (conservative: it may include masked keys, never omits visible ones)."""
        lo, hi = self._key_range(q0, q1, q_len, kv_len)
        lo, hi = max(lo, 0), min(hi, kv_len)
        return (lo, hi) if lo < hi else (0, 0)

    def _key_range(self, q0, q1, q_len, kv_len) -> tuple[int, int]:
        """Unclamped range in this mask's own key coordinates (``UNBOUNDED`` where unknown)."""
        return -UNBOUNDED, UNBOUNDED

    def block_state(self, q0: int, q1: int, k0: int, k1: int, q_len: int, kv_len: int,
                    batch: int = 1, heads: int = 1) -> BlockState:
        """Whether queries ``[q0, q1)`` x keys ``[k0, k1)`` are all visible, all blocked, or mixed,
        across every batch and head. Subclasses answer in O(1); this fallback evaluates the block."""
        block = self.materialize_block(batch, heads, q0, q1, q_len, kv_len, None, None, k0, k1)
        if self.is_additive:
            if bool(torch.isneginf(block).all()):
                return BlockState.EMPTY
            return BlockState.PARTIAL
        if bool(block.all()):
            return BlockState.FULL
        if not bool(block.any()):
            return BlockState.EMPTY
        return BlockState.PARTIAL

    def empty_rows(self, batch: int, heads: int, q_len: int, kv_len: int,
                   device: torch.device | str | None = None) -> Tensor | None:
        """Queries that see no key, as a bool tensor broadcastable to ``(B, H, Lq)``, or
        ``None`` when there are none."""
        empty = self._empty_rows(batch, heads, q_len, kv_len, device)
        return empty if bool(empty.any()) else None

    def _empty_rows(self, batch, heads, q_len, kv_len, device=None) -> Tensor:
        """:meth:`empty_rows` as a tensor always (no data-dependent branch: compiles in one graph).
        The fallback evaluates the mask a chunk of rows at a time."""
        step = max(1, _CHUNK_ELEMENTS // max(1, kv_len * batch * heads))
        parts = []
        for q0 in range(0, q_len, step):
            rows = self.materialize_block(batch, heads, q0, min(q0 + step, q_len), q_len, kv_len, device, None)
            visible = ~torch.isneginf(rows) if self.is_additive else rows
            parts.append(~visible.any(-1))
        shape = torch.broadcast_shapes(*(p.shape for p in parts))
        return torch.cat([p.expand(*shape[:2], p.shape[-1]) for p in parts], dim=-1)


# --------------------------------------------------------------------------------- combinators
class And(Mask):
    """Visible where every part is visible. Additive parts add their biases."""

    def __init__(self, *parts: Mask):
        flat = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, And) else [p])
        self._set(parts=tuple(flat), is_additive=any(p.is_additive for p in flat))

    def _mod(self, b, h, q, kv, q_len, kv_len):
        out = self.parts[0]._mod(b, h, q, kv, q_len, kv_len)
        for p in self.parts[1:]:
            out = out & p._mod(b, h, q, kv, q_len, kv_len)
        return out

    def _bias(self, b, h, q, kv, q_len, kv_len, dtype, allowed):
        bias = super()._bias(b, h, q, kv, q_len, kv_len, dtype, allowed)
        for p in self.parts:
            if p.is_additive:
                bias = bias + p._bias(b, h, q, kv, q_len, kv_len, dtype, allowed)
        return bias

    def _describe(self):
        return " & ".join(_paren(p, Or) for p in self.parts)

    def check(self, batch, heads, q_len, kv_len):
        for p in self.parts:
            p.check(batch, heads, q_len, kv_len)

    def causal_offset(self, q_len, kv_len):
        # causal & (something that blocks nothing structurally) is not provable here: only
        # a single causal part qualifies.
        return self.parts[0].causal_offset(q_len, kv_len) if len(self.parts) == 1 else None

    def _key_range(self, q0, q1, q_len, kv_len):
        ranges = [p._key_range(q0, q1, q_len, kv_len) for p in self.parts]
        return max(r[0] for r in ranges), min(r[1] for r in ranges)

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        states = [p.block_state(q0, q1, k0, k1, q_len, kv_len, batch, heads) for p in self.parts]
        if BlockState.EMPTY in states:
            return BlockState.EMPTY
        if all(s is BlockState.FULL for s in states) and not self.is_additive:
            return BlockState.FULL
        return BlockState.PARTIAL


class Or(Mask):
    """Visible where any part is visible. Additive masks cannot be combined with ``|``."""

    def __init__(self, *parts: Mask):
        flat = []
        for p in parts:
            if p.is_additive:
                raise TypeError("an additive (float) mask cannot be combined with '|' or '~': "
                                "only '&' is defined for additive biases")
            flat.extend(p.parts if isinstance(p, Or) else [p])
        self._set(parts=tuple(flat))

    def _mod(self, b, h, q, kv, q_len, kv_len):
        out = self.parts[0]._mod(b, h, q, kv, q_len, kv_len)
        for p in self.parts[1:]:
            out = out | p._mod(b, h, q, kv, q_len, kv_len)
        return out

    def _describe(self):
        return " | ".join(_paren(p, And) for p in self.parts)

    def check(self, batch, heads, q_len, kv_len):
        for p in self.parts:
            p.check(batch, heads, q_len, kv_len)

    def _key_range(self, q0, q1, q_len, kv_len):
        ranges = [r for r in (p._key_range(q0, q1, q_len, kv_len) for p in self.parts) if r[0] < r[1]]
        if not ranges:
            return 0, 0
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        states = [p.block_state(q0, q1, k0, k1, q_len, kv_len, batch, heads) for p in self.parts]
        if BlockState.FULL in states:
            return BlockState.FULL
        if all(s is BlockState.EMPTY for s in states):
            return BlockState.EMPTY
        return BlockState.PARTIAL


class Not(Mask):
    """Visible where the inner mask is blocked."""

    def __init__(self, inner: Mask):
        if inner.is_additive:
            raise TypeError("an additive (float) mask cannot be inverted with '~'")
        self._set(inner=inner)

    def _mod(self, b, h, q, kv, q_len, kv_len):
        return ~self.inner._mod(b, h, q, kv, q_len, kv_len)

    def _describe(self):
        return f"~{_paren(self.inner, (And, Or))}"

    def check(self, batch, heads, q_len, kv_len):
        self.inner.check(batch, heads, q_len, kv_len)

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        state = self.inner.block_state(q0, q1, k0, k1, q_len, kv_len, batch, heads)
        swap = {BlockState.FULL: BlockState.EMPTY, BlockState.EMPTY: BlockState.FULL}
        return swap.get(state, BlockState.PARTIAL)


class Shifted(Mask):
    """``inner`` read at positions ``q_idx + q_offset`` and ``kv_idx + kv_offset``."""

    def __init__(self, inner: Mask, q_offset: int, kv_offset: int):
        if isinstance(inner, Shifted):
            q_offset, kv_offset, inner = q_offset + inner.q_offset, kv_offset + inner.kv_offset, inner.inner
        self._set(inner=inner, q_offset=q_offset, kv_offset=kv_offset, is_additive=inner.is_additive)

    def _mod(self, b, h, q, kv, q_len, kv_len):
        return self.inner._mod(b, h, q + self.q_offset, kv + self.kv_offset, q_len, kv_len)

    def _bias(self, b, h, q, kv, q_len, kv_len, dtype, allowed):
        return self.inner._bias(b, h, q + self.q_offset, kv + self.kv_offset, q_len, kv_len, dtype, allowed)

    def _describe(self):
        return f"{_paren(self.inner, (And, Or, Not))}.shifted(q_offset={self.q_offset}, kv_offset={self.kv_offset})"

    def causal_offset(self, q_len, kv_len):
        inner = self.inner.causal_offset(q_len, kv_len)
        return None if inner is None else inner + self.q_offset - self.kv_offset

    def _key_range(self, q0, q1, q_len, kv_len):
        lo, hi = self.inner._key_range(q0 + self.q_offset, q1 + self.q_offset, q_len, kv_len)
        return lo - self.kv_offset, hi - self.kv_offset

    def block_state(self, q0, q1, k0, k1, q_len, kv_len, batch=1, heads=1):
        qo, ko = self.q_offset, self.kv_offset
        return self.inner.block_state(q0 + qo, q1 + qo, k0 + ko, k1 + ko, q_len, kv_len, batch, heads)


# --------------------------------------------------------------------------------- helpers
def _grid(batch, heads, q0, q1, k0, k1, device):
    """Broadcastable index tensors ``b (B,1,1,1), h (1,H,1,1), q (1,1,Lq,1), kv (1,1,1,Lk)``."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q0, q1, device=device).view(1, 1, -1, 1)
    kv = torch.arange(k0, k1, device=device).view(1, 1, 1, -1)
    return b, h, q, kv


def _as_4d(allowed: Tensor, q_len: int, kv_len: int) -> Tensor:
    """Give a mask_mod result the query and key dimensions even if it ignored them."""
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed.expand(allowed.shape[0], allowed.shape[1], q_len, kv_len)


def _coerce(other, op: str) -> Mask:
    from multihead.masks.tensor import as_mask  # a tensor on either side of & | is a mask too

    mask = as_mask(other, name=f"the right-hand side of '{op}'")
    if mask is None:
        raise TypeError(f"cannot combine a mask with None using '{op}'")
    return mask


def _paren(mask: Mask, kinds) -> str:
    text = mask._describe()
    return f"({text})" if isinstance(mask, kinds) else text
