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
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch
from torch import Tensor

from multihead.masks.base import tensor_identity

__all__ = ["ScoreMod", "Chain", "as_score_mod", "ADDITIVE", "ELEMENTWISE"]

ADDITIVE, ELEMENTWISE = "additive", "elementwise"


class ScoreMod(abc.ABC):
    """Base class of score modifiers. Subclasses set ``kind`` and implement :meth:`__call__`
    (FlexAttention's signature) and :meth:`_describe`; additive ones also :meth:`bias_block`."""

    kind: str = ELEMENTWISE

    @abc.abstractmethod
    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The modified scores, for broadcastable position tensors (FlexAttention's ``score_mod``)."""

    @abc.abstractmethod
    def _describe(self) -> str:
        """The modifier as the expression that builds it, e.g. ``softcap(30.0)``."""

    def __repr__(self) -> str:
        return self._describe()

    def check(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` if this modifier cannot apply to ``(B, Hq, Lq, Lk)``."""

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the modifier reads (their gradients flow through every backend that runs it)."""
        return ()

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.tensors())

    def apply_block(self, scores: Tensor, q0: int, q1: int, k0: int, k1: int, heads: Tensor | None = None) -> Tensor:
        """``scores (B, H|h, q1-q0, k1-k0)`` of queries ``[q0, q1)`` x keys ``[k0, k1)``, modified.
        ``heads`` selects query heads (default all). Subclasses may slice instead of gathering."""
        B, H = scores.shape[0], scores.shape[1]
        dev = scores.device
        b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
        h = (torch.arange(H, device=dev) if heads is None else heads).view(1, -1, 1, 1)
        q = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        kv = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
        return self(scores, b, h, q, kv)

    def bias_block(self, batch: int, heads: int, q0: int, q1: int, k0: int, k1: int,
                   device=None, dtype=torch.float32) -> Tensor:
        """Additive modifiers: the bias of queries ``[q0, q1)`` x keys ``[k0, k1)``, broadcastable
        to ``(B, H, rows, keys)`` (size 1 where it does not vary)."""
        raise TypeError(f"{self._describe()} is not additive: it has no bias to add")

    # Values and hashing: modifiers are immutable, compared by value (tensors by identity).
    def _value(self) -> tuple:
        fields = sorted(vars(self).items())
        return (type(self),) + tuple((k, tensor_identity(v) if isinstance(v, Tensor) else v) for k, v in fields)

    def __eq__(self, other) -> bool:
        return isinstance(other, ScoreMod) and self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())


class Chain(ScoreMod):
    """Modifiers applied one after the other (``[bias(t), softcap(30)]`` adds, then caps)."""

    def __init__(self, mods: Sequence[ScoreMod]):
        flat: list[ScoreMod] = []
        for m in mods:
            flat.extend(m.mods if isinstance(m, Chain) else [m])
        self.mods = tuple(flat)
        self.kind = ADDITIVE if all(m.kind == ADDITIVE for m in flat) else ELEMENTWISE

    # A -inf produced by one modifier (a bias entry that blocks) stays -inf through the next ones:
    # softcap(-inf) would be -cap, a visible score again.
    def __call__(self, score, b, h, q_idx, kv_idx):
        for m in self.mods:
            score = _keep_blocked(score, m(score, b, h, q_idx, kv_idx))
        return score

    def apply_block(self, scores, q0, q1, k0, k1, heads=None):
        for m in self.mods:
            scores = _keep_blocked(scores, m.apply_block(scores, q0, q1, k0, k1, heads))
        return scores

    def bias_block(self, batch, heads, q0, q1, k0, k1, device=None, dtype=torch.float32):
        if self.kind != ADDITIVE:
            return super().bias_block(batch, heads, q0, q1, k0, k1, device, dtype)
        total = self.mods[0].bias_block(batch, heads, q0, q1, k0, k1, device, dtype)
        for m in self.mods[1:]:
            total = total + m.bias_block(batch, heads, q0, q1, k0, k1, device, dtype)
        return total

    def check(self, batch, heads, q_len, kv_len):
        for m in self.mods:
            m.check(batch, heads, q_len, kv_len)

    def tensors(self):
        return tuple(t for m in self.mods for t in m.tensors())

    def _describe(self):
        return "[" + ", ".join(m._describe() for m in self.mods) + "]"


def _keep_blocked(before: Tensor, after: Tensor) -> Tensor:
    return torch.where(torch.isneginf(before), before, after)


def as_score_mod(score_mod, name: str = "score_mod") -> ScoreMod | None:
    """``None``, a :class:`ScoreMod`, or a sequence of them (applied in order), as one modifier."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if isinstance(score_mod, (list, tuple)):
        for i, m in enumerate(score_mod):
            if not isinstance(m, ScoreMod):
                raise TypeError(f"{name}[{i}] must be a multihead.scores modifier, got {type(m).__name__}"
                                + ("; a plain function is not a modifier yet (the positions issue adds a user "
                                   "score_mod)" if callable(m) else ""))
        return None if not score_mod else (score_mod[0] if len(score_mod) == 1 else Chain(score_mod))
    hint = ""
    if isinstance(score_mod, Tensor):
        hint = "; for a bias tensor use multihead.scores.bias(tensor)"
    elif callable(score_mod):
        hint = "; a plain function is not a modifier yet (the positions issue adds a user score_mod)"
    raise TypeError(f"{name} must be a multihead.scores modifier, a list of them, or None; "
                    f"got {type(score_mod).__name__}{hint}")
