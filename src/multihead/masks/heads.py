"""A mask restricted to a range of query heads: :func:`head_range`.

Head-parallel attention (:func:`multihead.distributed.ulysses_attention`) gives each rank a
contiguous range of query heads and calls attention on those alone, so the local call's head
``h`` is head ``first + h`` of the whole attention. Heads are positions like queries and keys
(a mask's meaning never depends on the block it is evaluated on), so the mask of the whole
attention is read at the heads of the block::

    whole (Hq = 4)        head_range(mask, first=2, count=2, num_heads=4)
    head 0 1 2 3          local head 0 1   (= heads 2 and 3 of the whole)
"""

from __future__ import annotations

from torch import Tensor

from multihead.blocks import Block, Extent, check_head_range
from multihead.masks.base import BlockState, Mask
from multihead.masks.tensor import TensorMask

__all__ = ["head_range", "HeadRange"]


def head_range(mask: Mask | None, first: int, count: int, num_heads: int) -> Mask | None:
    """``mask`` of an attention of ``num_heads`` query heads, read for heads ``[first, first +
    count)`` as the heads ``0 .. count - 1`` of a call of ``count`` heads.

    A mask whose meaning cannot depend on the head (band, padding, documents) comes back as it
    is; a bool tensor with one pattern per head is sliced (``(B|1, count, Lq|1, Lk|1)``); any
    other mask that may read the head (a tensor broadcast over heads is neither, a ``custom``
    ``mask_mod`` is) becomes a :class:`HeadRange`.
    """
    check_head_range("head_range", first, count, num_heads)
    if mask is None or not (mask.kinds() & {"tensor", "custom"}):
        return mask
    if isinstance(mask, TensorMask) and mask.tensor.shape[1] in (1, num_heads):
        if mask.tensor.shape[1] == 1:
            return mask
        return TensorMask(mask.tensor[:, first : first + count], name=mask.name)  # (B|1, count, Lq|1, Lk|1)
    return HeadRange(mask, first, count, num_heads)


class HeadRange(Mask):
    """``inner`` (a mask of ``num_heads`` heads) with head ``h`` read as head ``first + h``, for
    a call of ``count`` heads. Built by :func:`head_range`."""

    kind = "custom"  # read element by element through _mod, as a custom mask_mod is
    inner: Mask
    first: int
    count: int
    num_heads: int

    def __init__(self, inner: Mask, first: int, count: int, num_heads: int):
        self._set(inner=inner, first=first, count=count, num_heads=num_heads)

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self.inner._mod(b, h + self.first, q, kv, q_len, kv_len)

    def _describe(self) -> str:
        heads = f"first={self.first}, count={self.count}, num_heads={self.num_heads}"
        return f"head_range({self.inner._describe()}, {heads})"

    def check(self, extent: Extent) -> None:
        heads = extent.heads
        if heads != self.count:
            raise ValueError(
                f"head_range: a mask of heads [{self.first}, {self.first + self.count}) is read by a call of "
                f"{heads} heads; expected {self.count}"
            )
        self.inner.check(extent.with_heads(self.num_heads))

    def depends_on_lengths(self) -> bool:
        return self.inner.depends_on_lengths()

    def extent(self) -> tuple[int | None, int | None]:
        return self.inner.extent()

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        return self.inner._key_range(extent, block)  # covers every head: ours too

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        # The inner answer over every head up to ours is true of ours: conservative, never wrong.
        return self.inner.block_state(extent.with_heads(extent.heads + self.first), block)
