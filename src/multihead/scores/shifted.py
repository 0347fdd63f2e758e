"""A score modifier read at absolute positions of a larger attention: :func:`shifted`.

A ring step (:func:`multihead.distributed.ring_attention`) attends with a block of the whole
attention: its query ``i`` is position ``q_offset + i`` of the ``Lq`` queries, its key ``j``
position ``kv_offset + j`` of the ``Lk`` keys. A modifier whose formula reads positions (ALiBi,
a relative bias, a dense bias tensor, a user's ``score_mod`` of ``q_idx``/``kv_idx``) must see
those positions, not ``0 .. rows - 1``, exactly as a mask does (:meth:`multihead.Mask.shifted`)::

    whole attention (Lq x Lk)             the block's call (rows x keys)
          kv_offset                        index 0 ... keys-1
    q_offset ┌──────┐                     0 ┌──────┐   score_mod(s, b, h, i, j) of the call
             │block │   ──shifted──>        │      │   = whole.score_mod(s, b, h,
             └──────┘                       └──────┘       q_offset + i, kv_offset + j)

The whole attention's lengths are bound once (:meth:`ScoreMod.for_lengths`, the bottom-right
alignment of relative biases), so the call's own lengths change nothing. Modifiers that read no
position (``softcap``) come back as they are; a chain is shifted element by element, so each
backend still sees the kinds it knows.
"""

from __future__ import annotations

from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.scores.base import Chain, ScoreMod
from multihead.scores.softcap import Softcap
from multihead.scores.view import View

__all__ = ["shifted", "Shifted"]


def shifted(score_mod: ScoreMod | None, q_offset: int, kv_offset: int, *, q_len: int, kv_len: int) -> ScoreMod | None:
    """``score_mod`` of an attention of ``q_len x kv_len``, read on the block whose query ``i`` is
    position ``i + q_offset`` and key ``j`` position ``j + kv_offset`` of it. ``None`` stays ``None``."""
    for name, value in (("q_offset", q_offset), ("kv_offset", kv_offset), ("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"shifted: {name} must be a non-negative int, got {value!r}")
    if score_mod is None:
        return None
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(f"shifted: expected a multihead.scores.ScoreMod, got {type(score_mod).__name__}")
    bound = score_mod.for_lengths(q_len, kv_len)
    if isinstance(bound, Chain):
        parts = (shifted(m, q_offset, kv_offset, q_len=q_len, kv_len=kv_len) for m in bound.mods)
        return Chain([m for m in parts if m is not None])  # (none is: each part is a modifier)
    if isinstance(bound, Softcap):
        return bound  # reads no position
    # Wrapped even at offsets (0, 0): the wrapper keeps the whole attention's lengths, which a
    # bottom-right relative bias would otherwise re-bind to the block's (for_lengths per call).
    if isinstance(bound, Shifted):  # offsets compose
        return Shifted(bound.inner, bound.q_offset + q_offset, bound.kv_offset + kv_offset, bound.q_len, bound.kv_len)
    return Shifted(bound, q_offset, kv_offset, q_len, kv_len)


class Shifted(View):
    """``inner`` (bound to the whole ``q_len x kv_len`` attention) read at offsets; built by
    :func:`shifted`. Its kind, tensors and relative form are the inner modifier's."""

    inner: ScoreMod
    q_offset: int
    kv_offset: int
    q_len: int
    kv_len: int

    def __init__(self, inner: ScoreMod, q_offset: int, kv_offset: int, q_len: int, kv_len: int):
        self._set(inner=inner, q_offset=q_offset, kv_offset=kv_offset, q_len=q_len, kv_len=kv_len, kind=inner.kind)

    def _whole(self, extent: Extent) -> Extent:
        return extent.with_lengths(self.q_len, self.kv_len)

    def _whole_block(self, block: Block) -> Block:
        return block.shifted(self.q_offset, self.kv_offset)

    def _whole_distances(self, d0: int, d1: int) -> tuple[int, int]:
        # d = kv_idx - q_idx in the call is d + (kv_offset - q_offset) in the whole attention
        shift = self.kv_offset - self.q_offset
        return d0 + shift, d1 + shift

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner(score, b, h, q_idx + self.q_offset, kv_idx + self.kv_offset)

    def check(self, extent: Extent) -> None:
        _, _, q_len, kv_len = extent
        reads = (("Lq", self.q_offset, q_len, self.q_len), ("Lk", self.kv_offset, kv_len, self.kv_len))
        for what, offset, n, whole in reads:
            if n is not None and offset + n > whole:
                raise ValueError(
                    f"{self._describe()}: a call of {what}={n} at offset {offset} reaches past the whole "
                    f"attention's {what}={whole}; expected offset + {what} <= {whole}"
                )
        self.inner.check(self._whole(extent))

    def for_lengths(self, q_len: int, kv_len: int) -> ScoreMod:
        return self  # bound to the whole attention's lengths: the block's own change nothing

    def _describe(self) -> str:
        return (
            f"{self.inner._describe()}.shifted(q_offset={self.q_offset}, kv_offset={self.kv_offset}, "
            f"q_len={self.q_len}, kv_len={self.kv_len})"
        )
