"""``StaticKVCache``: preallocated slots, one length per batch row, fixed shapes for ``torch.compile``.

Slot ``j`` of row ``b`` holds the token at position ``j`` of that row's sequence; row ``b`` has
``lengths[b]`` tokens (a tensor on the cache's device, FlashAttention's ``cache_seqlens``). An
update writes row ``b``'s new tokens at slots ``lengths[b], lengths[b] + 1, ...`` with one
indexed write (``index_put_``, done in place under ``torch.compile``) and returns *all*
``max_len`` slots; the mask (:meth:`CacheRead.mask`) hides the slots a query may not see, so
causal and window masks align to each row's own length::

    lengths = [3, 1], one new token each (x = new, . = hidden)
    row 0:  k0 k1 k2 x  .  .      row 1:  k0 x  .  .  .  .

A decode step therefore has the same shapes whatever the lengths, with no ``.item()`` and no
Python branch on data: compiled once, it never recompiles. In eager mode, while every row has one
length known on the host, a step reads only the filled slots in order (like a dynamic cache, with
``causal()`` instead of a mask tensor); the result is the same, and :meth:`slots` says which read
the next step makes, so a mask tensor over ``slots(Lq)`` columns fits it. The checks that need
the lengths on the host (writing past ``max_len``, positions that do not continue a row) run in
eager mode and are skipped while compiling.

Rows of different lengths come from a padded prefill: run the prompts right-padded to one length,
then :meth:`crop` each row to its real length (the pads sit after the real tokens, so no real
token saw them; the crop zeroes their slots, as :meth:`rollback` zeroes the slots of the update
it undoes, since a read returns slots past a row's length).

Under autograd (keys that require grad: backpropagating through cached steps) an update writes
into a copy of the buffers instead of into them, so no step's saved keys change under it (an
in-place write would fail the backward with PyTorch's "modified by an inplace operation").
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
from multihead.caches.policies.base import refuse_policy

__all__ = ["StaticKVCache"]


class StaticKVCache(KVCache):
    """Keys ``(B, Hkv, max_len, D)`` and values ``(B, Hkv, max_len, Dv)``, allocated once.

    Args:
        batch_size, max_len, num_kv_heads, head_dim: ``B``, the slots per row, ``Hkv`` and ``D``.
        value_dim: ``Dv``; default ``head_dim``.
        dtype, device: of the stored keys and values.
        policy: refused (an eviction policy does not fit fixed shapes: the reason is in the message
            and ``docs/inference.md``); ``DynamicKVCache(policy=...)`` takes one.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        policy: object = None,
    ):
        refuse_policy(type(self).__name__, policy)
        for name, value in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("value_dim", head_dim if value_dim is None else value_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticKVCache: {name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"StaticKVCache: dtype must be a floating-point torch.dtype, got {dtype!r}")
        value_dim = head_dim if value_dim is None else value_dim
        self.keys = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch_size, num_kv_heads, max_len, value_dim, dtype=dtype, device=device)
        self._lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.keys.device)  # (B,)
        self.max_len = max_len
        # the last update: (the lengths before it, tokens written, the buffers before it when it wrote into copies)
        self._undo: tuple[Tensor, int, tuple[Tensor, Tensor] | None] | None = None
        # The lengths as host ints while eager code knows them (None: unknown, e.g. after compiled
        # steps): an eager step with every row at one length reads only the filled slots, in order.
        self._host: list[int] | None = [0] * batch_size
        self._slots = torch.arange(max_len, device=self.keys.device)  # (max_len,): slot j holds position j

    # ------------------------------------------------------------------------------ state
    @property
    def lengths(self) -> Tensor:
        """``(B,)`` on the cache's device: a copy of the buffer (a device copy, no synchronisation).
        The buffer itself would let a write such as ``cache.lengths[b] = n`` change the lengths
        behind the host copy that eager steps read, and those steps then wrote and read the wrong
        slots with no error."""
        return self._lengths.clone()

    @property
    def length(self) -> int:
        """``max(lengths)``: from the host copy while eager code knows it, else read back from the
        device (a synchronisation: eager use only)."""
        if self._host is not None and not torch.compiler.is_compiling():
            return max(self._host)
        return int(self._lengths.max())

    @property
    def batch_size(self) -> int:
        """``B``: the rows held (:meth:`reorder` may change it)."""
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self._lengths))

    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        return self._lengths.view(-1, 1) + torch.arange(new, device=self._lengths.device)  # (B, new)

    def slots(self, new: int) -> int:
        """The slots the next :meth:`update` of ``new`` tokens returns, in the mode it runs in: the
        ``T + new`` filled ones in an eager step while every row holds ``T`` tokens, else (rows
        that differ, or under ``torch.compile``) all ``max_len``."""
        T = self._uniform_length(new)
        return self.max_len if T is None else T + new

    def _uniform_length(self, new: int) -> int | None:
        """``T`` when an update of ``new`` tokens reads only the filled slots: eager, every row at
        length ``T`` (known on the host) and room for the new tokens; ``None`` otherwise. The one
        decision behind :meth:`slots` and :meth:`update`, so a mask over ``slots(new)`` fits."""
        if torch.compiler.is_compiling():
            return None
        if self._host is None:
            self._host = self._lengths.tolist()  # one synchronisation, eager only
        T = self._host[0]
        return T if all(n == T for n in self._host) and T + new <= self.max_len else None

    def _held(self) -> str:
        B, Hkv, S, D = self.keys.shape
        return f"StaticKVCache(batch_size={B}, max_len={S}, num_kv_heads={Hkv}, head_dim={D})"

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        name = type(self).__name__
        B, Hkv, S, D = self.keys.shape
        check_kv_held(name, k, v, self.keys, self.values, held=self._held())
        new = k.shape[2]
        if positions is not None:  # given positions must continue each row, so they never change the read
            check_continuation(name, positions, self.next_positions(new), B)  # the value comparison: eager only
        T = self._uniform_length(new)
        if T is not None:
            return self._update_uniform(k, v, T, new)
        expected = self.next_positions(new)  # (B, new)
        if not torch.compiler.is_compiling():
            longest = int(self._lengths.max())
            if longest + new > S:
                raise ValueError(
                    f"{name}.update: writing {new} tokens after the {longest} stored in the longest row "
                    f"would pass max_len={S}; hint: allocate a larger cache or crop it first"
                )
        # Row b's tokens go to slots lengths[b].. as one index_put_ per tensor (not scatter_): under
        # torch.compile, Inductor writes an index_put_ into the cache in place, while a scatter_ on a
        # graph input became a copy of the whole cache, written back after the step (five passes
        # over max_len slots per step; docs/inference.md, "Compiled decoding reads every slot").
        rows = torch.arange(B, device=self.keys.device).view(B, 1).expand(B, new)  # (B, new)
        keys, values = self._writable(k, v)
        keys[rows, :, expected] = k.transpose(1, 2)  # (B, new, Hkv, D) at [b, :, slot]
        values[rows, :, expected] = v.transpose(1, 2)
        self._undo = (self._lengths.clone(), new, None if keys is self.keys else (self.keys, self.values))
        self.keys, self.values = keys, values
        self._lengths += new
        self._host = None if torch.compiler.is_compiling() or self._host is None else [n + new for n in self._host]
        stored = torch.where(self._slots < self._lengths.view(-1, 1), self._slots, EMPTY_POSITION)  # (B, S)
        return CacheRead(self.keys, self.values, expected, stored)

    def _update_uniform(self, k: Tensor, v: Tensor, T: int, new: int) -> CacheRead:
        """Every row at length ``T`` (known on the host): write the slots ``T..T+new`` and read the
        filled ones in order, like a dynamic cache (no mask tensor: ``causal()`` serves)."""
        keys, values = self._writable(k, v)
        keys[:, :, T : T + new] = k
        values[:, :, T : T + new] = v
        self._undo = (self._lengths.clone(), new, None if keys is self.keys else (self.keys, self.values))
        self.keys, self.values = keys, values
        self._lengths += new
        self._host = [T + new] * self._lengths.shape[0]
        positions = torch.arange(T, T + new, device=k.device)
        return CacheRead(self.keys[:, :, : T + new], self.values[:, :, : T + new], positions)

    def _writable(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The buffers an update writes into: the cache's own, or copies under autograd. An
        earlier step's attention saved the keys it read (these buffers, or views of them) for its
        backward, so writing into them would change what that backward reads."""
        if under_autograd(k, v, self.keys, self.values):
            return self.keys.clone(), self.values.clone()
        return self.keys, self.values

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        before, new, originals = self._undo
        if originals is not None:  # written into copies: the buffers before the update are whole
            self.keys, self.values = originals
        elif new:
            # The written slots back to zeros: a read returns slots past a row's length (rows of other
            # lengths; every slot under torch.compile, where the decode path needs them finite), and
            # those must not hold the dropped tokens (docs/inference.md, "Crop, reorder, rollback").
            B = self.keys.shape[0]
            rows = torch.arange(B, device=self.keys.device).view(B, 1).expand(B, new)  # (B, new)
            slots = before.view(B, 1) + torch.arange(new, device=self.keys.device)  # (B, new)
            self.keys[rows, :, slots] = 0.0
            self.values[rows, :, slots] = 0.0
        self._lengths.copy_(before)
        self._undo, self._host = None, None

    def crop(self, length: int | Tensor) -> None:
        """Row ``b`` keeps ``min(lengths[b], length)`` tokens (``length`` an int or ``(B,)``), the
        dropped slots zeroed (as :meth:`rollback` does); no host synchronisation under
        ``torch.compile``, so a compiled loop may crop too."""
        B = self.keys.shape[0]
        length = check_crop(type(self).__name__, length, B)
        old = self._lengths.clone()
        if isinstance(length, int):
            host = None if self._host is None else [min(n, length) for n in self._host]
            self._lengths.clamp_(max=length)
        else:
            host = None
            torch.minimum(self._lengths, length.to(self._lengths.device, torch.int64), out=self._lengths)
        self._wipe(old)
        self._undo, self._host = None, host

    def _wipe(self, old: Tensor) -> None:
        """Zero row ``b``'s slots ``lengths[b] .. old[b]`` (the tokens a crop dropped): one slice per
        row that lost tokens, read on the host eagerly; traced, one masked pass over the slots."""
        compiling = torch.compiler.is_compiling()
        cut = (
            []
            if compiling
            else [(r, a, b) for r, (a, b) in enumerate(zip(self._lengths.tolist(), old.tolist())) if a < b]
        )
        if not compiling and not cut:
            return
        if under_autograd(None, None, self.keys, self.values):  # earlier steps saved these buffers: no write into them
            self.keys, self.values = self.keys.clone(), self.values.clone()
        if compiling:
            dropped = (self._slots >= self._lengths.view(-1, 1)) & (self._slots < old.view(-1, 1))  # (B, S)
            self.keys.masked_fill_(dropped[:, None, :, None], 0.0)
            self.values.masked_fill_(dropped[:, None, :, None], 0.0)
        for row, kept, held in cut:
            self.keys[row, :, kept:held] = 0.0
            self.values[row, :, kept:held] = 0.0

    def reorder(self, indices: Tensor) -> None:
        """Row ``i`` becomes the old row ``indices[i]``; ``B' = len(indices)`` rows from then on.
        With ``B' = B`` (and no autograd) the buffers are rewritten in place, so a compiled step
        keeps reading the same memory; another ``B'`` allocates ``B'`` rows of ``max_len`` slots
        (a new shape for a compiled step)."""
        B = self.keys.shape[0]
        indices = check_indices(type(self).__name__, indices, B, self.keys.device)
        keys, values = self.keys.index_select(0, indices), self.values.index_select(0, indices)
        if indices.shape[0] == B and not under_autograd(None, None, self.keys, self.values):
            self.keys.copy_(keys)
            self.values.copy_(values)
            self._lengths.copy_(self._lengths.index_select(0, indices))
        else:
            self.keys, self.values = keys, values
            self._lengths = self._lengths.index_select(0, indices)
        self._undo, self._host = None, None

    def reset(self) -> None:
        self._lengths.zero_()
        if self.keys.requires_grad or self.values.requires_grad:  # let go of the last sequence's graph
            self.keys, self.values = torch.zeros_like(self.keys.detach()), torch.zeros_like(self.values.detach())
        else:  # the slots to zeros, as a crop of every token leaves them (reads return slots past a length)
            self.keys.zero_()
            self.values.zero_()
        self._undo, self._host = None, [0] * self._lengths.shape[0]

    def __repr__(self) -> str:
        return f"{self._held()[:-1]}, lengths={self._lengths.tolist()}, nbytes={self.nbytes})"
