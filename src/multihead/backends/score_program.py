"""A score modifier as what the ``triton_blocks`` kernels apply per element: a relative bias as one
vector per head over every index distance, and a softcap, in the order the modifier gives::

    s = scale · q·k  ->  [softcap]  ->  + bias[h, kv - q + Lq - 1]  ->  [softcap]  ->  blocked: -inf

A relative bias (ALiBi, T5's bucketed bias, any :class:`~multihead.scores.RelativeBias`, and
``Chain``'s of them) depends on the head and the distance only, so ``(H|1, Lq + Lk - 1)`` values
hold all of it (``ScoreMod.distance_bias``); the kernel gathers a tile's values from it, never
an ``Lq x Lk`` tensor. A trainable bias is refused by the backend's capabilities (no gradient
for it in the kernels). Any other modifier (a tensor bias, a user function) has no program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.scores import Chain, ScoreMod, Softcap

__all__ = ["ScoreProgram", "score_program"]


@dataclass(frozen=True)
class ScoreProgram:
    """``relative (H|1, Lq + Lk - 1)`` fp32 (the bias at index distance ``d = kv - q`` is entry
    ``d + Lq - 1``; ``None``: no bias), ``cap`` (0: no softcap) and whether it comes first."""

    relative: Tensor | None = None
    cap: float = 0.0
    cap_first: bool = False

    def to(self, device: torch.device) -> ScoreProgram:
        rel = None if self.relative is None else self.relative.to(device)
        return ScoreProgram(rel, self.cap, self.cap_first)


def score_program(mod: ScoreMod | None, q_len: int, kv_len: int) -> ScoreProgram | str:
    """The program of ``mod`` (already bound to the call's lengths, as every call's is), or the
    reason there is none."""
    if mod is None:
        return ScoreProgram()
    parts = mod.mods if isinstance(mod, Chain) else (mod,)
    before: list[ScoreMod] = []
    after: list[ScoreMod] = []
    cap: Softcap | None = None
    for part in parts:
        if isinstance(part, Softcap):
            if cap is not None:
                return "two softcaps in one modifier; the kernel applies one"
            cap = part
        elif part.relative:
            (after if cap is not None else before).append(part)
        else:
            return (
                f"score modifier {part._describe()} has no per-element formula in the kernel "
                "(it runs relative biases and softcap)"
            )
    if cap is not None and before and after:
        return "relative biases on both sides of a softcap; the kernel adds them on one side"
    relatives = before + after
    relative = None
    if relatives:
        d0, d1 = -(q_len - 1), kv_len  # every index distance kv - q of the call
        vectors = [part.distance_bias(d0, d1, dtype=torch.float32) for part in relatives]
        total = vectors[0]
        for vec in vectors[1:]:
            assert total is not None and vec is not None  # ScoreMod.relative: distance_bias gives it
            total = total + vec
        assert total is not None
        relative = total.detach().float().contiguous()
    return ScoreProgram(relative, 0.0 if cap is None else cap.cap, cap is not None and not before and bool(after))
