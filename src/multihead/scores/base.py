"""The `ScoreMod` base class: what a score modifier is, and how several compose.

A score modifier changes the scaled scores ``s = scale · q·k`` before the softmax, at absolute
positions of the whole attention, the way FlexAttention's ``score_mod(score, b, h, q_idx,
kv_idx)`` does. Masks decide *whether* a query sees a key (:mod:`multihead.masks`); modifiers
decide *what is added or changed*. The order of one call is fixed (:func:`multihead.scoring.score_block`)::

    s = scale · q·k   ->   s = score_mod(s, b, h, q_pos, kv_pos)   ->   blocked keys: -inf

Every modifier has a ``kind`` that backends declare support for:

* ``"additive"``: ``s + bias(b, h, q_pos, kv_pos)``; any kernel that takes an additive
  ``attn_mask`` can run it, one block of the bias at a time (:meth:`ScoreMod.bias_block`);
* ``"elementwise"``: any other function of the score (softcap); needs a kernel that applies it
  inside the softmax (the reference, flex).

The block methods follow the block protocol of :mod:`multihead.blocks`, as masks do: the whole
attention's :class:`~multihead.blocks.Extent` ``(B, H, Lq, Lk)`` first, the
:class:`~multihead.blocks.Block` ``(q0, q1, k0, k1)`` second, then the rest::

    score_mod.check(extent)
    score_mod.bias_block(extent, block, device, dtype)      (B|1, H|1, rows, cols)
    score_mod.apply_block(extent, block, scores, heads)     scores (B, H|h, rows, cols), modified
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.blocks import Block, Extent, check_protocol
from multihead.values import Value

__all__ = ["ScoreMod", "Chain", "ADDITIVE", "ELEMENTWISE"]

ADDITIVE, ELEMENTWISE = "additive", "elementwise"
#: The block protocol's methods and the parameters each takes first (:mod:`multihead.blocks`).
_PROTOCOL = {"check": ("extent",), "bias_block": ("extent", "block"), "apply_block": ("extent", "block")}


class ScoreMod(Value, abc.ABC):
    """Base class of score modifiers. Subclasses set ``kind`` and implement :meth:`__call__`
    (FlexAttention's signature) and :meth:`_describe`; additive ones also :meth:`bias_block`.

    A modifier is a :class:`~multihead.values.Value`, as a mask is: its fields are set once, in
    ``__init__`` (``self.x = ...`` or :meth:`_set`), compared and hashed by value (tensors by
    :func:`~multihead.values.tensor_identity`); :meth:`_replace` gives a copy with some changed.

    The block methods a subclass may override take the block protocol's values in its one order
    (:mod:`multihead.blocks`)::

        check(self, extent)                                      ValueError if it cannot apply
        bias_block(self, extent, block, device=None, dtype=...)  additive: (B|1, H|1, rows, cols)
        apply_block(self, extent, block, scores, heads=None)     scores of the block, modified

    A subclass written for the positional integers of before (``bias_block(batch, heads, q0, q1,
    k0, k1, ...)``) is refused when its class is defined, with the new signature in the message."""

    kind: str = ELEMENTWISE

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        check_protocol(cls, _PROTOCOL)

    @abc.abstractmethod
    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The modified scores, for broadcastable position tensors (FlexAttention's ``score_mod``)."""

    @abc.abstractmethod
    def _describe(self) -> str:
        """The modifier as the expression that builds it, e.g. ``softcap(30.0)``."""

    def __repr__(self) -> str:
        return self._describe()

    def check(self, extent: Extent) -> None:  # noqa: B027 (a default)
        """Raise ``ValueError`` if this modifier cannot apply to ``extent`` ``(B, Hq, Lq, Lk)``."""

    def for_lengths(self, q_len: int, kv_len: int) -> ScoreMod:
        """This modifier for an attention of ``Lq`` queries and ``Lk`` keys. Modifiers whose value
        depends on the alignment of queries and keys (a relative bias reads the distance between
        aligned positions, see :mod:`multihead.scores.relative`) bind the lengths here; every
        call is resolved once, before a backend sees it. Default: unchanged."""
        return self

    def distance_bias(
        self, d0: int, d1: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor | None:
        """Additive modifiers that depend only on the head and on the distance
        ``d = kv_idx - q_idx`` (call indices): the bias ``(H|1, d1 - d0)`` at ``d = d0 .. d1 - 1``.
        Backends run such a bias on a block as a strided (Toeplitz) view of this vector, never a
        ``rows x keys`` tensor. ``None`` (the default): not a function of the distance alone."""
        return None

    @property
    def relative(self) -> bool:
        """Whether :meth:`distance_bias` gives this modifier's whole bias."""
        return False

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the modifier reads (their gradients flow through every backend that runs it)."""
        return ()

    @property
    def requires_grad(self) -> bool:
        """Whether a tensor the modifier reads needs a gradient (and autograd is on)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.tensors())

    def apply_block(self, extent: Extent, block: Block, scores: Tensor, heads: Tensor | None = None) -> Tensor:
        """``scores (B, H|h, rows, cols)`` of the block's queries ``[q0, q1)`` x keys ``[k0, k1)``
        in the whole attention ``extent``, modified. ``heads`` selects query heads (default all).
        Subclasses may slice instead of gathering."""
        B, H = scores.shape[0], scores.shape[1]
        dev = scores.device
        b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
        h = (torch.arange(H, device=dev) if heads is None else heads).view(1, -1, 1, 1)
        q = torch.arange(block.q0, block.q1, device=dev).view(1, 1, -1, 1)
        kv = torch.arange(block.k0, block.k1, device=dev).view(1, 1, 1, -1)
        return self(scores, b, h, q, kv)

    def bias_block(
        self,
        extent: Extent,
        block: Block,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Additive modifiers: the bias of the block's queries ``[q0, q1)`` x keys ``[k0, k1)``,
        broadcastable to ``(B, H, rows, cols)`` (size 1 where it does not vary)."""
        raise TypeError(f"{self._describe()} is not additive: it has no bias to add")


class Chain(ScoreMod):
    """Modifiers applied one after the other (``[bias(t), softcap(30)]`` adds, then caps)."""

    mods: tuple[ScoreMod, ...]

    def __init__(self, mods: Sequence[ScoreMod]):
        flat: list[ScoreMod] = []
        for m in mods:
            flat.extend(m.mods if isinstance(m, Chain) else [m])
        self._set(mods=tuple(flat), kind=ADDITIVE if all(m.kind == ADDITIVE for m in flat) else ELEMENTWISE)

    # A -inf produced by one modifier (a bias entry that blocks) stays -inf through the next ones:
    # softcap(-inf) would be -cap, a visible score again.
    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for m in self.mods:
            score = _keep_blocked(score, m(score, b, h, q_idx, kv_idx))
        return score

    def apply_block(self, extent: Extent, block: Block, scores: Tensor, heads: Tensor | None = None) -> Tensor:
        for m in self.mods:
            scores = _keep_blocked(scores, m.apply_block(extent, block, scores, heads))
        return scores

    def bias_block(
        self,
        extent: Extent,
        block: Block,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        if self.kind != ADDITIVE:
            return super().bias_block(extent, block, device, dtype)
        total = self.mods[0].bias_block(extent, block, device, dtype)
        for m in self.mods[1:]:
            total = total + m.bias_block(extent, block, device, dtype)
        return total

    def check(self, extent: Extent) -> None:
        for m in self.mods:
            m.check(extent)

    def for_lengths(self, q_len: int, kv_len: int) -> ScoreMod:
        resolved = [m.for_lengths(q_len, kv_len) for m in self.mods]
        return self if all(r is m for r, m in zip(resolved, self.mods)) else Chain(resolved)

    @property
    def relative(self) -> bool:
        return all(m.relative for m in self.mods)

    def distance_bias(
        self, d0: int, d1: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor | None:
        if not self.relative:
            return None
        total = self.mods[0].distance_bias(d0, d1, device, dtype)
        for m in self.mods[1:]:
            part = m.distance_bias(d0, d1, device, dtype)
            total = None if total is None or part is None else total + part  # never None: all are relative
        return total

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for m in self.mods for t in m.tensors())

    def _describe(self) -> str:
        return "[" + ", ".join(m._describe() for m in self.mods) + "]"


def _keep_blocked(before: Tensor, after: Tensor) -> Tensor:
    return torch.where(torch.isneginf(before), before, after)
