"""Reading a ``score_mod=`` argument: a modifier, a function, a list of them, or ``None``, as one
:class:`~multihead.scores.base.ScoreMod` (what :func:`multihead.attention` and the layers accept).

It sits apart from :mod:`multihead.scores.base` because it builds a
:class:`~multihead.scores.user.UserScoreMod`, a subclass defined on top of the base: in the base
it was an import cycle.
"""

from __future__ import annotations

from torch import Tensor

from multihead.scores.base import Chain, ScoreMod
from multihead.scores.user import UserScoreMod

__all__ = ["as_score_mod"]


def as_score_mod(score_mod: object, name: str = "score_mod") -> ScoreMod | None:
    """``None``, a :class:`ScoreMod`, a function ``fn(score, b, h, q_idx, kv_idx) -> score``
    (:class:`~multihead.scores.user.UserScoreMod`), or a sequence of them (applied in order), as
    one modifier."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if isinstance(score_mod, (list, tuple)):
        mods: list[ScoreMod] = []
        for i, m in enumerate(score_mod):
            if isinstance(m, ScoreMod):
                mods.append(m)
            elif callable(m) and not isinstance(m, Tensor):
                mods.append(UserScoreMod(m))
            else:
                hint = "; for a bias tensor use multihead.scores.bias(tensor)" if isinstance(m, Tensor) else ""
                raise TypeError(
                    f"{name}[{i}] must be a multihead.scores modifier or a function "
                    f"fn(score, b, h, q_idx, kv_idx) -> score, got {type(m).__name__}{hint}"
                )
        return None if not mods else (mods[0] if len(mods) == 1 else Chain(mods))
    if callable(score_mod) and not isinstance(score_mod, Tensor):
        return UserScoreMod(score_mod)
    hint = "; for a bias tensor use multihead.scores.bias(tensor)" if isinstance(score_mod, Tensor) else ""
    raise TypeError(
        f"{name} must be a multihead.scores modifier, a function fn(score, b, h, q_idx, kv_idx) -> "
        f"score, a list of them, or None; got {type(score_mod).__name__}{hint}"
    )
