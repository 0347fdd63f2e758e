"""``SlidingWindowKVCache``: a ring buffer holding what a ``sliding_window(window)`` mask can see.

A query at position ``p`` under ``causal() & sliding_window(window)`` sees positions
``p - window .. p``: ``window + 1`` tokens. The cache keeps the last ``window + 1`` tokens (plus
``extra``) in ``capacity`` slots, the token at position ``p`` in slot ``p % capacity``, so memory
stays fixed however long the sequence runs. Slots are not in position order; every slot carries
its token's position and the mask (:meth:`CacheRead.mask`) reads them::

    window=2, capacity 3, after 7 tokens:   slot  0  1  2
                                           holds p6 p4 p5

A one-token step writes its token first and attends over the ring (its oldest slot, the one
overwritten, was out of its window). The ring knows on the host which positions it holds, so such a
read names them (``CacheRead.held``): once the ring is full and the call's mask shows the query
every one of them (``sliding_window(window)`` itself, with ``extra=0``), the read needs no mask at
all, and the slots' positions are not evaluated into a row mask on every step. A step of several
tokens (chunked prefill, speculative verification) attends over the ring *and* its own tokens, then
keeps the newest ones; its first query still finds its ``window`` predecessors.

The ring holds what ``sliding_window(window)`` can see and nothing older, so the mask of a call
must not reach further back: ``sliding_window(w)`` with ``w <= window`` (alone or combined with
``causal()``, ``document(ids)``, ...) works, while ``causal()`` alone, a wider window, or no mask
at all is refused before anything is written (:meth:`KVCache.check_mask`, :func:`check_reach`)
instead of silently computing a narrower attention than the mask says.

Under autograd (backpropagating through cached steps) an update writes into copies of the ring,
so a one-token step, which reads the ring itself, never changes keys an earlier step saved.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.caches.base import (
    EMPTY_POSITION,
    CacheRead,
    KVCache,
    check_continuation,
    check_crop,
    check_indices,
    check_kv_held,
    under_autograd,
)

__all__ = ["SlidingWindowKVCache"]


class SlidingWindowKVCache(KVCache):
    """The last ``window + 1 + extra`` tokens of each row, in a ring: keys ``(B, Hkv, S, D)`` and
    values ``(B, Hkv, S, Dv)`` with ``S = window + 1 + extra`` slots.

    Args:
        window: the ``left`` of ``sliding_window(window)``: a query sees the ``window`` tokens
            before it and itself.
        batch_size, num_kv_heads, head_dim: ``B``, ``Hkv``, ``D``; ``value_dim``: ``Dv`` (default ``D``).
        extra: tokens kept beyond the window, so that :meth:`crop` may go back ``extra + 1``
            tokens (speculative decoding); 0 keeps exactly what the window can see. (With
            ``window=0`` a query sees no earlier token, so any crop is honoured.)
        dtype, device: of the stored keys and values.
    """

    window: int  # always set: the ring's reason to exist

    def __init__(
        self,
        window: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        extra: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        value_dim = head_dim if value_dim is None else value_dim
        for name, value, low in (
            ("window", window, 0),
            ("batch_size", batch_size, 1),
            ("num_kv_heads", num_kv_heads, 1),
            ("head_dim", head_dim, 1),
            ("value_dim", value_dim, 1),
            ("extra", extra, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SlidingWindowKVCache: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"SlidingWindowKVCache: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.window, self.extra = window, extra
        capacity = window + 1 + extra
        self.keys = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch_size, num_kv_heads, capacity, value_dim, dtype=dtype, device=device)
        self.positions = torch.full((capacity,), EMPTY_POSITION, dtype=torch.int64, device=self.keys.device)
        self._length = 0
        # The ring holds every position from max(_oldest, length - capacity) to length - 1 and no
        # other (kept on the host, so that a read can say so without reading its positions): 0
        # until a crop drops tokens a ring that saw fewer than its capacity still held.
        self._oldest = 0
        # (length, slots, keys, values, positions) overwritten by the last update (slots a slice
        # where they are consecutive in the ring); under autograd (slots None) the whole ring
        # before it, left untouched by the update
        self._undo: tuple[int, slice | Tensor | None, Tensor, Tensor, Tensor] | None = None

    # ------------------------------------------------------------------------------ state
    @property
    def capacity(self) -> int:
        """Slots of the ring: ``window + 1 + extra``."""
        return self.keys.shape[2]

    @property
    def length(self) -> int:
        """Tokens seen so far (the positions the next token continues from), not tokens held."""
        return self._length

    @property
    def lengths(self) -> Tensor:
        """``(B,)``: :attr:`length` in every row (tokens seen, not held), on the ring's device."""
        return torch.full((self.keys.shape[0],), self._length, dtype=torch.int64, device=self.keys.device)

    @property
    def batch_size(self) -> int:
        """``B``: the rows held (:meth:`reorder` may change it)."""
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))

    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        return torch.arange(self._length, self._length + new, device=device)

    def slots(self, new: int) -> int:
        return self.capacity if new == 1 else self.capacity + new

    def _reach_positions(self, new: int) -> range:
        return range(self._length, self._length + new)  # every row alike, on the host

    def _positions_held(self, length: int) -> range:
        """The positions the ring holds after ``length`` tokens (every row alike)."""
        return range(max(self._oldest, length - self.capacity, 0), length)

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        name = type(self).__name__
        B, Hkv, C, D = self.keys.shape
        held = f"SlidingWindowKVCache(window={self.window}, batch_size={B}, num_kv_heads={Hkv}, head_dim={D})"
        check_kv_held(name, k, v, self.keys, self.values, held=held)
        new = k.shape[2]
        expected = self.next_positions(new, self.keys.device)
        if positions is not None:
            check_continuation(name, positions, expected, B)
        read_k: Tensor | None = None
        read_v: Tensor | None = None
        read_pos: Tensor | None = None
        if new != 1:  # the ring as it is, then the new tokens: the first new query's predecessors are all there
            read_k, read_v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
            read_pos = torch.cat([self.positions, expected])
        kept = min(new, C)  # only the newest C tokens can stay
        kept_pos = expected[new - kept :]
        first = (self._length + new - kept) % C
        # consecutive in the ring (a one-token step always): slices, no index tensors
        slots: slice | Tensor = slice(first, first + kept) if first + kept <= C else kept_pos % C
        if under_autograd(k, v, self.keys, self.values):
            # Earlier steps saved the ring they read: write into copies, keep the old ring for rollback.
            self._undo = (self._length, None, self.keys, self.values, self.positions.clone())
            self.keys, self.values = self.keys.clone(), self.values.clone()
        else:
            self._undo = (
                self._length,
                slots,
                self.keys[:, :, slots].clone(),
                self.values[:, :, slots].clone(),
                self.positions[slots].clone(),
            )
        self.keys[:, :, slots] = k[:, :, new - kept :]
        self.values[:, :, slots] = v[:, :, new - kept :]
        self.positions[slots] = kept_pos
        self._length += new
        if new == 1:  # the one query is the newest position held: CacheRead.mask may answer on the host
            kept_range = self._positions_held(self._length)
            return CacheRead(self.keys, self.values, expected, self.positions.clone(), self.window, held=kept_range)
        assert read_k is not None and read_v is not None and read_pos is not None  # new != 1: read above
        return CacheRead(read_k, read_v, expected, read_pos, self.window)

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        self._length, slots, keys, values, positions = self._undo
        if slots is None:  # written into copies: the ring before the update is whole
            self.keys, self.values, self.positions = keys, values, positions
        else:
            self.keys[:, :, slots], self.values[:, :, slots], self.positions[slots] = keys, values, positions
        self._undo = None

    def crop(self, length: int | Tensor) -> None:
        name = type(self).__name__
        length = check_crop(name, length, None, per_row=False)
        assert isinstance(length, int)  # per_row=False refuses tensors
        length = min(length, self._length)  # row[:length]: a ring that saw fewer keeps them all
        # The next query (at `length`) sees the cached positions needed..length-1: none at all
        # with window=0 (or length=0), where any crop is honoured; the ones after it are written
        # from then on.
        needed = max(0, length - self.window)
        held = self._positions_held(self._length)
        oldest = held.start if held else 0
        if needed < min(length, oldest):  # a non-empty range needed..length-1 reaching below the ring
            raise ValueError(
                f"{name}.crop: going back to {length} tokens needs positions {needed}..{length - 1}, but "
                f"the ring (capacity {self.capacity}) only holds {oldest}..{self._length - 1}; "
                f"crop at most {self._length - self.window - oldest} tokens back (to length >= "
                f"{oldest + self.window}), or create the cache with a larger extra="
            )
        dropped = self.positions >= length  # (C,): slots of the tokens the crop drops
        if bool(dropped.any()):
            # Zeroed, not only marked empty: every read returns the whole ring, and its slots must
            # not hold the dropped tokens (docs/inference.md, "Crop, reorder, rollback, refusals").
            if under_autograd(None, None, self.keys, self.values):  # earlier steps saved the ring
                self.keys, self.values = self.keys.clone(), self.values.clone()
            self.keys[:, :, dropped] = 0.0
            self.values[:, :, dropped] = 0.0
            self.positions.masked_fill_(dropped, EMPTY_POSITION)
        # kept: held.start .. length - 1 (nothing when the crop went below the oldest held)
        self._oldest = min(held.start, length) if held else length
        self._length, self._undo = length, None

    def reorder(self, indices: Tensor) -> None:
        """Row ``i`` becomes the old row ``indices[i]``; ``B' = len(indices)`` rows from then on
        (every row shares the ring's positions, so only keys and values move)."""
        B = self.keys.shape[0]
        indices = check_indices(type(self).__name__, indices, B, self.keys.device)
        keys, values = self.keys.index_select(0, indices), self.values.index_select(0, indices)
        if indices.shape[0] == B and not under_autograd(None, None, self.keys, self.values):
            self.keys.copy_(keys)
            self.values.copy_(values)
        else:
            self.keys, self.values = keys, values
        self._undo = None

    def reset(self) -> None:
        self.positions.fill_(EMPTY_POSITION)
        if self.keys.requires_grad or self.values.requires_grad:  # let go of the last sequence's graph
            self.keys, self.values = torch.zeros_like(self.keys.detach()), torch.zeros_like(self.values.detach())
        else:  # the ring to zeros, as a crop of every token leaves it (every read returns the whole ring)
            self.keys.zero_()
            self.values.zero_()
        self._length, self._oldest, self._undo = 0, 0, None

    def __repr__(self) -> str:
        B, Hkv, C, D = self.keys.shape
        return (
            f"SlidingWindowKVCache(window={self.window}, capacity={C}, batch_size={B}, num_kv_heads={Hkv}, "
            f"head_dim={D}, length={self._length}, nbytes={self.nbytes})"
        )
