"""``SinksAndWindow``: StreamingLLM's cache, the first ``sinks`` tokens and the last ``window``.

Xiao et al. (2023) keep a few "attention sink" tokens from the start of the sequence and a
window of recent ones, so memory stays flat however long the stream runs. A query at position
``p`` sees the keys at positions ``< sinks`` and ``p - window .. p``::

    sinks=2, window=3     k0 k1 k2 k3 k4 k5 k6 k7
                     q7    1  1  .  .  1  1  1  1       causal() & (sliding_window(3) | key_padding(2))

Two position treatments (``positions=``):

* ``"sequence"`` (default): tokens keep their positions in the sequence; the attention equals
  full attention under ``causal() & (sliding_window(window) | key_padding(sinks))``.
* ``"cache"``: positions are slots of the cache, as StreamingLLM does for rotary models: the
  sinks at ``0 .. sinks-1``, then the window in order, the new token after them, so no query is
  ever further than ``sinks + window`` from a key. A layer rotates each new key at its slot when
  it arrives (``cache.next_positions``); when eviction moves a key to a lower slot, the cache
  rotates it by the difference at read time (``rotary=``: rotations compose, ``R(a) R(b) =
  R(a + b)``), once, from the key as it was stored, so no error accumulates over a long stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.caches.policies.base import CachePolicy, Candidates
from multihead.masks import Mask, key_padding, sliding_window
from multihead.positions.rotary import DynamicNTKScaling, RotaryEmbedding, apply_rotary

__all__ = ["SinksAndWindow"]

_TREATMENTS = ("sequence", "cache")


class SinksAndWindow(CachePolicy):
    """Keep the first ``sinks`` tokens and the last ``window`` (StreamingLLM).

    Args:
        sinks: tokens kept from the start (``>= 0``).
        window: recent tokens kept besides the query itself (``>= 0``): a query at ``p`` sees
            ``p - window .. p``, as :func:`~multihead.masks.sliding_window` ``(window)``.
        positions: ``"sequence"`` or ``"cache"`` (the module docstring).
        rotary: with ``positions="cache"``, the layer's :class:`~multihead.positions.RotaryEmbedding`
            (its rotations must compose: no YaRN attention factor, no dynamic NTK), so moved keys
            are rotated to their new slots; ``None`` for keys without rotary positions.

    The cache holds at most ``sinks + window`` tokens between updates (its :attr:`budget`).
    """

    def __init__(self, sinks: int, window: int, *, positions: str = "sequence", rotary: RotaryEmbedding | None = None):
        for name, value in (("sinks", sinks), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SinksAndWindow: {name} must be an int >= 0, got {value!r}")
        if positions not in _TREATMENTS:
            raise ValueError(
                f"SinksAndWindow: positions must be one of {_TREATMENTS} (positions in the sequence, or "
                f"slots of the cache as StreamingLLM assigns them), got {positions!r}"
            )
        if rotary is not None:
            if positions != "cache":
                raise ValueError(
                    "SinksAndWindow: rotary= re-rotates keys that move between slots, which only happens "
                    "with positions='cache'; with positions='sequence' keys keep their positions"
                )
            if not isinstance(rotary, RotaryEmbedding):
                raise TypeError(
                    f"SinksAndWindow: rotary must be a RotaryEmbedding or None, got {type(rotary).__name__}"
                )
            if rotary.attention_factor != 1.0 or isinstance(rotary.scaling, DynamicNTKScaling):
                raise ValueError(
                    f"SinksAndWindow: moving a rotated key by d positions rotates it by d, which needs "
                    f"rotations that compose; {rotary.scaling!r} scales cos/sin by "
                    f"{rotary.attention_factor} or changes frequencies with the length; hint: "
                    f"positions='sequence' works with every rotary embedding"
                )
        self.sinks, self.window, self.positions, self.rotary = sinks, window, positions, rotary

    @property
    def budget(self) -> int:
        """The tokens held between updates."""
        return self.sinks + self.window

    @property
    def reassigns_positions(self) -> bool:
        return self.positions == "cache"

    def policy_mask(self) -> Mask:
        mask = sliding_window(self.window)
        return mask | key_padding(self.sinks) if self.sinks else mask

    def hides_nothing(self, queries: Tensor, key_positions: Tensor) -> bool:
        # the last query's window starts furthest on: if it sees every earlier key, all do
        last = int(queries[-1])
        earlier = key_positions[key_positions < last]
        return bool(((earlier < self.sinks) | (earlier >= last - self.window)).all())

    def keep(self, candidates: Candidates) -> Tensor:
        pos = candidates.positions
        # the next query, at position length, sees sinks and length - window .. length
        return candidates.valid & ((pos < self.sinks) | (pos >= candidates.length - self.window))

    def rotate(self, keys: Tensor, delta: Tensor) -> Tensor:
        if self.rotary is None or not bool(delta.any()):
            return keys
        angle = delta.to(torch.float64)[:, None] * self.rotary.inv_freq.to(device=delta.device, dtype=torch.float64)
        compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
        cos, sin = angle.cos().to(compute), angle.sin().to(compute)  # (S, R)
        return apply_rotary(keys, cos, sin, interleaved=self.rotary.interleaved, rotary_dim=self.rotary.rotary_dim)

    def _describe(self) -> str:
        extra = "" if self.positions == "sequence" else f", positions='cache', rotary={self.rotary is not None}"
        return f"SinksAndWindow(sinks={self.sinks}, window={self.window}{extra})"
