"""A user's own score modifier: any function with FlexAttention's signature.

``attention(q, k, v, score_mod=fn)`` with ``fn(score, b, h, q_idx, kv_idx) -> score``: ``score``
is a block of scaled scores and the index tensors broadcast against it (shapes ``(B|1, 1, 1, 1)``,
``(1, H|1, 1, 1)``, ``(1, 1, rows, 1)``, ``(1, 1, 1, keys)`` here; scalars under flex), at absolute
positions of the whole attention. It is the general form of the labml tutorial's ``get_scores``
override. Written with tensor operations only (``torch.where``, not ``if``), one function serves
every backend that runs elementwise modifiers::

    def alibi(score, b, h, q_idx, kv_idx):           # the built-in positions.ALiBi, by hand
        return score + slopes[h] * (kv_idx - q_idx)

Tensors the function reads may require grad (a learned table): every backend that runs it
gives them their gradient (the reference, ``blocksparse`` one block at a time under activation
checkpointing; ``flex`` where the device has a backward). :meth:`UserScoreMod.tensors` finds
them in the function's closure, its globals, bound ``nn.Module`` and ``functools.partial``
arguments, so a backend without a backward can refuse instead of silently giving no gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from multihead.blocks import Extent
from multihead.scores.base import ELEMENTWISE, ScoreMod

__all__ = ["UserScoreMod"]


class UserScoreMod(ScoreMod):
    """A callable ``fn(score, b, h, q_idx, kv_idx) -> score`` as a modifier (compared by identity)."""

    kind = ELEMENTWISE
    fn: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]):
        if not callable(fn):
            raise TypeError(
                f"score_mod: expected a function fn(score, b, h, q_idx, kv_idx) -> score, got {type(fn).__name__}"
            )
        self._set(fn=fn)

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = self.fn(score, b, h, q_idx, kv_idx)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"score_mod {self._describe()} returned {type(out).__name__}; it must return the modified "
                f"scores, a tensor broadcastable to the scores it was given"
            )
        if out.shape != score.shape:
            try:
                fits = torch.broadcast_shapes(out.shape, score.shape) == score.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(
                    f"score_mod {self._describe()} returned shape {tuple(out.shape)} for scores of shape "
                    f"{tuple(score.shape)}; it must keep the shape of the scores"
                )
            out = out.expand(score.shape)
        # A function that reads a float64 table returns float64 scores: the block keeps its dtype.
        return out.to(score.dtype)

    def check(self, extent: Extent) -> None:
        """Run the function once on a 2 x 3 block of zeros (on the device of the tensors it reads),
        so a function that returns the wrong thing fails here, before any work or state change."""
        if torch.compiler.is_compiling():
            return
        devices = {t.device for t in self.tensors()}
        device = next(iter(devices)) if len(devices) == 1 else None

        def index(n: int, dim: int) -> Tensor:
            return torch.arange(n, device=device).view([n if d == dim else 1 for d in range(4)])

        with torch.no_grad():
            self(torch.zeros(1, 1, 2, 3, device=device), index(1, 0), index(1, 1), index(2, 2), index(3, 3))

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(_captured_tensors(self.fn))

    def _describe(self) -> str:
        fn = self.fn
        name = (
            getattr(fn, "__qualname__", None)
            or getattr(getattr(fn, "func", None), "__qualname__", None)
            or type(fn).__name__
        )
        return f"score_mod({name})"


def _captured_tensors(fn: object, depth: int = 0) -> list[Tensor]:
    """Tensors (and module parameters) ``fn`` reads through its closure, the globals its code
    names, a bound ``nn.Module``, or ``functools.partial`` arguments; by identity, no repeats."""
    found: dict[int, Tensor] = {}

    def visit(obj: object, level: int) -> None:
        if level > 3 or obj is None:
            return
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, nn.Module):
            for p in obj.parameters():
                found.setdefault(id(p), p)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o, level + 1)
        elif isinstance(obj, dict):
            for o in obj.values():
                visit(o, level + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, level + 1)
            visit(obj.args, level + 1)
            visit(obj.keywords, level + 1)
        elif hasattr(obj, "__func__") and hasattr(obj, "__self__"):  # a bound method
            visit(obj.__self__, level + 1)
            visit(obj.__func__, level + 1)
        elif hasattr(obj, "__code__"):  # a function: its closure and the globals it names
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, level + 1)
                except ValueError:  # an empty cell
                    pass
            names = obj.__code__.co_names
            glob = getattr(obj, "__globals__", {})
            for n in names:
                if n in glob and isinstance(glob[n], (Tensor, nn.Module)):
                    visit(glob[n], level + 1)

    visit(fn, depth)
    return list(found.values())
