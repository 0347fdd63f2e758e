"""ALiBi (Press et al., "Train Short, Test Long", 2022): a linear penalty on distance, one slope per head.

Query ``i`` and key ``j`` at aligned positions get ``bias = m_h · (j - i)``: ``0`` on the
diagonal, ``-m_h`` per step into the past. Head ``h`` of ``n`` (a power of two) has slope
``m_h = 2^(-8 (h + 1) / n)``: 8 heads give ``1/2, 1/4, ..., 1/256``. Other head counts take the
slopes of the closest smaller power of two ``p``, then every other slope of ``2p`` heads
(``2^(-4 (2t + 1) / p)`` for ``t = 0, 1, ...``) until there are ``n``, as the paper's code does.

Two forms::

    ALiBi(H)                    m_h · (j - i)      the paper's (causal) form; on the keys a causal
                                                   mask lets a query see it is -m_h · |i - j|
    ALiBi(H, symmetric=True)    -m_h · |j - i|     for bidirectional attention (encoders)

ALiBi is a :class:`~multihead.scores.relative.RelativeBias`: the ``blocksparse`` backend runs it
as a strided view of ``R + K - 1`` values per block, never an ``Lq x Lk`` tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.scores.relative import RelativeBias

__all__ = ["ALiBi", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> Tensor:
    """The paper's slopes for ``num_heads`` heads, ``(num_heads,)`` float64, largest first."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be a positive int, got {num_heads!r}")
    power = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / power) for h in range(power)]
    # The missing heads take the odd-numbered slopes of 2 * power heads: 2^(-8 (2t + 1) / (2 power)).
    slopes += [2.0 ** (-8.0 * (2 * t + 1) / (2 * power)) for t in range(num_heads - power)]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBi(RelativeBias):
    """ALiBi as a score modifier: ``attention(q, k, v, mask=causal(), score_mod=ALiBi(Hq))``.

    Args:
        num_heads: ``Hq``, the query heads (one slope each).
        slopes: optional explicit slopes ``(Hq,)`` (a tensor or a sequence of floats); default
            :func:`alibi_slopes`.
        symmetric: ``-m·|j - i|`` instead of ``m·(j - i)`` (bidirectional attention).
        align: ``"bottom_right"`` (default, as ``causal()``) or ``"top_left"``: which query
            position meets which key position when ``Lq != Lk`` (:mod:`multihead.scores.relative`).
    """

    slopes: Tensor  # (Hq,) float64 on CPU
    symmetric: bool

    def __init__(
        self,
        num_heads: int,
        *,
        slopes: Tensor | Sequence[float] | None = None,
        symmetric: bool = False,
        align: str = "bottom_right",
    ):
        super().__init__(num_heads, align)
        if slopes is None:
            slopes = alibi_slopes(num_heads)
        elif isinstance(slopes, Tensor):
            if slopes.requires_grad:
                raise ValueError(
                    "ALiBi: slopes that require grad are not supported (ALiBi's slopes are fixed); "
                    "write a trainable bias as a multihead.scores.RelativeBias subclass"
                )
            slopes = slopes.detach().to("cpu", torch.float64)
        else:
            slopes = torch.tensor([float(s) for s in slopes], dtype=torch.float64)
        if tuple(slopes.shape) != (num_heads,) or (
            not torch.compiler.is_compiling() and not bool(torch.isfinite(slopes).all())
        ):  # traced: no host read
            raise ValueError(
                f"ALiBi: slopes must be {num_heads} finite numbers (one per query head), "
                f"got shape {tuple(slopes.shape)}"
            )
        if not isinstance(symmetric, bool):
            raise TypeError(f"ALiBi: symmetric must be a bool, got {type(symmetric).__name__}")
        self._set(slopes=slopes, symmetric=symmetric)  # slopes (Hq,) float64 on CPU; moved where used

    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
        m = self.slopes.to(device=h.device, dtype=dtype)[h]
        d = distance.to(dtype)
        return -m * d.abs() if self.symmetric else m * d

    def _describe(self) -> str:
        extra = ", symmetric=True" if self.symmetric else ""
        extra += "" if self.align == "bottom_right" else f", align={self.align!r}"
        return f"ALiBi({self.num_heads}{extra})"
