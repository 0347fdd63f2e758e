"""``PagedKVCache``: keys and values in fixed-size pages from one pool, addressed by block tables.

Serving systems (vLLM, FlashInfer) keep every sequence's cache in pages of ``page_size`` tokens
taken from one preallocated pool, so memory is claimed as sequences grow and given back when they
finish, with no fragmentation and no copy when a sequence grows. Each batch row has a *block
table*, the list of its pages in order: token ``t`` of row ``b`` lives in page
``table[b][t // page_size]`` at offset ``t % page_size``::

    page_size 4, pool of 6 pages        row 0: 6 tokens -> pages [2, 5]
                                        row 1: 3 tokens -> pages [0]
                                        free:  [1, 3, 4]

An update claims pages from the free list as rows cross a page boundary, then writes every row's
new tokens with one scatter into the pool. :meth:`release` gives a finished row's pages back (the
row may then start a new sequence). A decode step reads a row's pages in table order through the
block table (``CacheRead.blocks``): a piece of a few pages at a time, a view of the pool where a
row's pages are consecutive and a copy that stays in cache where they are not, never a gather of
the whole cache (:mod:`multihead.backends.decode_blocks`). The pool is head-major,
``(Hkv, num_pages, page_size, D)``, so that consecutive pages of a head are one strided run. Other
calls (a prefill, weights, autograd) read ``CacheRead.keys``: every row's pages gathered into
``(B, Hkv, pages·page_size, D)``. Slots past a row's length are hidden by the mask
(:meth:`CacheRead.mask`). Running out of pages raises before anything is claimed or written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from multihead.backends.decode_blocks import KVBlocks
from multihead.caches.base import (
    EMPTY_POSITION,
    CacheRead,
    KVCache,
    check_continuation,
    check_crop,
    check_indices,
    check_kv,
    check_prefix,
    check_rows,
    check_writable,
)
from multihead.caches.policies.base import refuse_policy

__all__ = ["PagedKVCache"]

#: Slots a run of consecutive pages must hold to be read as a view of its own rather than gathered
#: with its neighbours into one piece: each piece costs a handful of ops.
_MIN_RUN = 1024


class PagedKVCache(KVCache):
    """``batch_size`` sequences sharing a pool of ``num_pages`` pages of ``page_size`` tokens: key pages
    ``(Hkv, num_pages, page_size, D)``, value pages ``(Hkv, num_pages, page_size, Dv)`` (head-major:
    a head's consecutive pages are one run); a read gives each row's slots as ``(B, Hkv, S, D)``,
    through the block table for a decode step.

    Args:
        num_pages, page_size: the pool: ``num_pages · page_size`` tokens in all.
        num_kv_heads, head_dim: ``Hkv``, ``D``; ``value_dim``: ``Dv`` (default ``D``).
        batch_size: the rows (sequences) this cache serves at once; each may hold any number of
            pages the pool can give.
        values_in_keys: the values are the first ``value_dim`` features of the keys, stored once
            (multi-head latent attention's rows ``[c_kv | k_rope]``: ``head_dim = C + R``,
            ``value_dim = C``, as in :class:`~multihead.caches.LatentKVCache`); an update's ``v``
            must then be ``k[..., :value_dim]``.
        dtype, device: of the pool.
        policy: refused (an eviction policy does not fit one block table per row: the reason is
            in the message and ``docs/inference.md``); ``DynamicKVCache(policy=...)`` takes one.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        batch_size: int = 1,
        value_dim: int | None = None,
        values_in_keys: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        policy: object = None,
    ):
        refuse_policy(type(self).__name__, policy)
        value_dim = head_dim if value_dim is None else value_dim
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("value_dim", value_dim),
            ("batch_size", batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        if not isinstance(values_in_keys, bool):
            raise TypeError(f"PagedKVCache: values_in_keys must be a bool, got {values_in_keys!r}")
        if values_in_keys and value_dim > head_dim:
            raise ValueError(
                f"PagedKVCache: with values_in_keys the values are the first value_dim features of "
                f"the keys, so value_dim <= head_dim; got value_dim={value_dim}, head_dim={head_dim}"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"PagedKVCache: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.page_size = page_size
        self.key_pages = torch.zeros(num_kv_heads, num_pages, page_size, head_dim, dtype=dtype, device=device)
        self.values_in_keys = values_in_keys
        self.value_pages = (
            self.key_pages[..., :value_dim]
            if values_in_keys
            else torch.zeros(num_kv_heads, num_pages, page_size, value_dim, dtype=dtype, device=device)
        )
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]  # each row's pages, in order
        self._lengths: list[int] = [0] * batch_size  # tokens per row: the host bookkeeping, with tables
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        # (tables, lengths, free) before the last update
        self._undo: tuple[list[list[int]], list[int], list[int]] | None = None

    # ------------------------------------------------------------------------------ state
    @property
    def num_pages(self) -> int:
        """Pages in the pool, free or claimed."""
        return self.key_pages.shape[1]

    @property
    def batch_size(self) -> int:
        """Rows (sequences) served at once, each with its block table."""
        return len(self.tables)

    @property
    def lengths(self) -> Tensor:
        """``(B,)`` on the pool's device, built from the host bookkeeping (block tables, free list
        and lengths live on the host, as a scheduler needs them)."""
        return torch.tensor(self._lengths, dtype=torch.int64, device=self.key_pages.device)

    @property
    def length(self) -> int:
        """The longest row's tokens (host bookkeeping: no synchronisation)."""
        return max(self._lengths, default=0)

    @property
    def nbytes(self) -> int:
        return self.key_pages.nbytes + (0 if self.values_in_keys else self.value_pages.nbytes)

    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        start = torch.tensor(self._lengths, dtype=torch.int64, device=device).view(-1, 1)
        return start + torch.arange(new, device=device)  # (B, new)

    def slots(self, new: int) -> int:
        # the read gathers the longest block table, at least one page (see _table_tensor)
        return self.page_size * max(1, max(self._pages_for(n + new) for n in self._lengths))

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _held(self) -> str:
        Hkv, N, ps, D = self.key_pages.shape
        return (
            f"PagedKVCache(num_pages={N}, page_size={ps}, num_kv_heads={Hkv}, head_dim={D}, "
            f"batch_size={self.batch_size})"
        )

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        name = type(self).__name__
        Hkv, N, ps, D = self.key_pages.shape
        B = self.batch_size
        check_kv(
            name,
            k,
            v,
            batch=B,
            heads=Hkv,
            head_dim=D,
            value_dim=self.value_pages.shape[3],
            dtype=self.key_pages.dtype,
            device=self.key_pages.device,
            held=self._held(),
            stored=self.key_pages,
        )
        if self.values_in_keys:
            check_prefix(name, k, v)
        new = k.shape[2]
        expected = self.next_positions(new, k.device)  # (B, new)
        if positions is not None:
            check_continuation(name, positions, expected, B)
        needed = [self._pages_for(n + new) - len(t) for n, t in zip(self._lengths, self.tables)]
        if sum(needed) > len(self.free):
            raise ValueError(
                f"{name}.update: {new} new tokens per row need {sum(needed)} more pages of "
                f"{ps} tokens but {len(self.free)} of {N} are free (rows hold {self._lengths} tokens); "
                f"hint: release() finished rows, or allocate a larger pool"
            )
        self._undo = ([list(t) for t in self.tables], list(self._lengths), list(self.free))
        claimed: list[int] = []
        for row_table, count in zip(self.tables, needed):
            pages = [self.free.pop() for _ in range(count)]
            row_table.extend(pages)
            claimed.extend(pages)
        if claimed:  # what an earlier sequence left in them must not reach this one's hidden slots
            self._clear(torch.tensor(claimed, dtype=torch.int64, device=self.key_pages.device))
        # Every new token's page and offset, then one scatter per tensor into the pool.
        table = self._table_tensor(k.device)  # (B, max pages), -1 padded
        page = table.gather(1, torch.div(expected, ps, rounding_mode="floor"))  # (B, new)
        flat = (page * ps + expected % ps).view(-1)  # (B·new,) slots of the pool seen as (N·ps)
        _scatter(self.key_pages, flat, k)
        if not self.values_in_keys:
            _scatter(self.value_pages, flat, v)
        self._lengths = [n + new for n in self._lengths]
        return self._read(expected, table)

    def _table_tensor(self, device: torch.device | str | None) -> Tensor:
        width = max(1, max(len(t) for t in self.tables))
        return torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int64, device=device)

    def _read(self, query_positions: Tensor, table: Tensor) -> CacheRead:
        """Each row's pages in table order, read through the block table (:class:`_PageBlocks`);
        ``keys (B, Hkv, pages·ps, D)`` gathered only when asked for."""
        B, width = table.shape
        slot = torch.arange(width * self.page_size, device=table.device).view(1, -1)  # (1, S): position of the slot
        lengths = torch.tensor(self._lengths, dtype=torch.int64, device=table.device).view(-1, 1)
        key_positions = torch.where(slot < lengths, slot, EMPTY_POSITION)  # (B, S)
        blocks = _PageBlocks(self.key_pages, self.value_pages, self.values_in_keys, table, self.tables)
        return CacheRead(None, None, query_positions, key_positions, blocks=blocks)

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        self.tables, self._lengths, self.free = self._undo
        self._undo = None

    def release(self, rows: int | Sequence[int] | Tensor) -> None:
        """Give the pages of ``rows`` (an int, a sequence of ints or a 1-D integer tensor; not a bool
        mask) back to the pool; those rows are empty again and may start new sequences."""
        ids = check_rows("PagedKVCache.release", rows, self.batch_size)
        for r in ids:
            self.free.extend(reversed(self.tables[r]))
            self.tables[r], self._lengths[r] = [], 0
        self._undo = None

    def crop(self, length: int | Tensor) -> None:
        """Row ``b`` keeps ``min(lengths[b], length)`` tokens (``length`` an int or ``(B,)``) and
        gives the pages it no longer needs back to the pool."""
        name = type(self).__name__
        length = check_crop(name, length, self.batch_size)
        wanted = [length] * self.batch_size if isinstance(length, int) else [int(n) for n in length.tolist()]
        target = [min(t, n) for t, n in zip(wanted, self._lengths)]
        # the last kept page of each row that drops tokens from it, and the first slot dropped
        partial = [
            (self.tables[r][self._pages_for(t) - 1], t % self.page_size)
            for r, t in enumerate(target)
            if t < self._lengths[r] and t % self.page_size
        ]
        if partial:
            check_writable(f"{name}.crop", self.key_pages)
        for page, start in partial:
            self._clear(torch.tensor([page], device=self.key_pages.device), start)
        for r, t in enumerate(target):
            keep = self._pages_for(t)
            self.free.extend(reversed(self.tables[r][keep:]))
            self.tables[r], self._lengths[r] = self.tables[r][:keep], t
        self._undo = None

    def _clear(self, pages: Tensor, start: int = 0) -> None:
        """Zero the slots ``start..`` of ``pages``. A read returns whole pages, and the slots of a
        row's last page past its length are hidden by the mask, but attention multiplies their
        values by a weight of 0: a NaN or inf left there (by the sequence that held the page
        before, or by dropped tokens) gives NaN, so every slot holding no token holds 0."""
        self.key_pages[:, pages, start:] = 0
        if not self.values_in_keys:
            self.value_pages[:, pages, start:] = 0

    def reorder(self, indices: Tensor) -> None:
        """Row ``i`` becomes a copy of the old row ``indices[i]``; ``batch_size`` becomes
        ``len(indices)`` (rows not taken give their pages back). A row taken twice needs its pages
        copied (pages are not shared): refused before any change when the pool lacks them."""
        name = type(self).__name__
        order: list[int] = check_indices(name, indices, self.batch_size, "cpu").tolist()
        taken: set[int] = set()
        copies: list[bool] = []  # the first use of a row keeps its pages
        for i in order:
            copies.append(i in taken)
            taken.add(i)
        needed = sum(len(self.tables[i]) for i, c in zip(order, copies) if c)
        freed = sum(len(t) for r, t in enumerate(self.tables) if r not in taken)
        if needed > len(self.free) + freed:
            raise ValueError(
                f"{name}.reorder: indices {order} copy rows taken more than once, which needs {needed} "
                f"pages, but {len(self.free) + freed} are free (rows not taken included); hint: "
                f"release() finished rows, or allocate a larger pool"
            )
        if needed:  # pages copied in place
            check_writable(f"{name}.reorder", self.key_pages)
        old_tables, old_lengths = self.tables, self._lengths
        for r in range(self.batch_size):
            if r not in taken:
                self.free.extend(reversed(old_tables[r]))
        tables: list[list[int]] = []
        for i, copy in zip(order, copies):
            if not copy:
                tables.append(list(old_tables[i]))
                continue
            pages = [self.free.pop() for _ in old_tables[i]]
            src = torch.tensor(old_tables[i], dtype=torch.int64, device=self.key_pages.device)
            dst = torch.tensor(pages, dtype=torch.int64, device=self.key_pages.device)
            self.key_pages[:, dst] = self.key_pages[:, src]
            if not self.values_in_keys:
                self.value_pages[:, dst] = self.value_pages[:, src]
            tables.append(pages)
        self.tables, self._lengths = tables, [old_lengths[i] for i in order]
        self._undo = None

    def reset(self) -> None:
        self.release(range(self.batch_size))

    def __repr__(self) -> str:
        return f"{self._held()[:-1]}, lengths={self._lengths}, free_pages={len(self.free)})"


def _scatter(pages: Tensor, flat: Tensor, x: Tensor) -> None:
    """Write ``x (B, Hkv, new, ·)`` to the pool's token slots ``flat (B·new,)`` (page · ps + offset)."""
    ps = pages.shape[2]
    tokens = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])  # (Hkv, B·new, ·), row-major like flat
    pages[:, flat // ps, flat % ps] = tokens  # advanced indices on (page, offset) after the heads


class _PageBlocks(KVBlocks):
    """The slots of a paged read, ``(B, Hkv, width·ps, ·)``, from the pool and the block tables as
    they were at the read. A piece is a run of whole pages: a view of the pool when the batch has
    one row and its pages in the piece are consecutive, else the pages copied, per row, into one
    buffer that every piece reuses (``index_select`` along the pool's page dim, no other copy)."""

    def __init__(
        self, key_pages: Tensor, value_pages: Tensor, values_in_keys: bool, table: Tensor, tables: list[list[int]]
    ):
        Hkv, N, ps, D = key_pages.shape
        B, width = table.shape
        self.key_pages, self.value_pages, self.values_in_keys = key_pages, value_pages, values_in_keys
        self.table = table.clamp(min=0)  # (B, width): padding reads page 0, hidden by the mask
        # a row's pages as host lists (a copy: the cache's own lists change with the next update)
        self.rows = [list(t) + [0] * (width - len(t)) for t in tables]
        self.ps = ps
        self.shape = (B, Hkv, width * ps, D, value_pages.shape[-1])
        self.dtype, self.device = key_pages.dtype, key_pages.device
        self.grad = torch.is_grad_enabled()  # dense() records autograd as the update that read would have

    def pieces(self, lo: int, hi: int, size: int) -> Iterator[tuple[int, Tensor, Tensor]]:
        B, Hkv, S, D, Dv = self.shape
        ps = self.ps
        first, last = lo // ps, -(-hi // ps)  # pages [first, last) hold the slots [lo, hi)
        per = max(1, size // ps)
        buffers: tuple[Tensor, Tensor] | None = None
        p0 = first
        while p0 < last:
            run = self._run(p0, last) if B == 1 else 0
            if run:  # one row, pages p0.. consecutive in the pool: a view, however long
                p1, page = p0 + run, self.rows[0][p0]
                k = self.key_pages[:, page : page + run].reshape(1, Hkv, run * ps, D)
                v = self.value_pages[:, page : page + run]
                v = k[..., :Dv] if self.values_in_keys else v.reshape(1, Hkv, run * ps, Dv)
            else:
                p1 = min(p0 + per, last)
                if B == 1:  # stop where a run long enough to be a view of its own starts
                    p1 = next((p for p in range(p0 + 1, p1) if self._run(p, last)), p1)
                m = p1 - p0
                if buffers is None or buffers[0].shape[2] != m * ps:
                    k_buf = self.key_pages.new_empty(B, Hkv, m * ps, D)
                    v_buf = k_buf if self.values_in_keys else self.value_pages.new_empty(B, Hkv, m * ps, Dv)
                    buffers = (k_buf, v_buf)
                k, v = buffers
                for b in range(B):  # (Hkv, m, ps, ·): row b's pages, gathered into its slice of the buffer
                    pages = self.table[b, p0:p1]
                    torch.index_select(self.key_pages, 1, pages, out=k[b].view(Hkv, m, ps, D))
                    if not self.values_in_keys:
                        torch.index_select(self.value_pages, 1, pages, out=v[b].view(Hkv, m, ps, Dv))
                if self.values_in_keys:
                    v = k[..., :Dv]
            s0, s1 = max(lo, p0 * ps), min(hi, p1 * ps)  # trim the first and last page to [lo, hi)
            yield s0, k[:, :, s0 - p0 * ps : s1 - p0 * ps], v[:, :, s0 - p0 * ps : s1 - p0 * ps]
            p0 = p1

    def _run(self, p0: int, last: int) -> int:
        """How many of row 0's pages from ``p0`` (before ``last``) follow each other in the pool,
        when at least a few do (shorter runs are gathered with their neighbours instead)."""
        row = self.rows[0]
        n = 1
        while p0 + n < last and row[p0 + n] == row[p0] + n:
            n += 1
        return n if n * self.ps >= _MIN_RUN else 0

    def dense(self) -> tuple[Tensor, Tensor]:
        with torch.set_grad_enabled(self.grad):
            return self._gather()

    def _gather(self) -> tuple[Tensor, Tensor]:
        B, Hkv, S, D, Dv = self.shape
        # (Hkv, B·width, ps, D) -> (B, Hkv, width·ps, D): every row's pages gathered, in table order
        keys = self.key_pages.index_select(1, self.table.reshape(-1)).view(Hkv, B, S, D).transpose(0, 1)
        if self.values_in_keys:
            values = keys[..., :Dv]
        else:
            values = self.value_pages.index_select(1, self.table.reshape(-1)).view(Hkv, B, S, Dv).transpose(0, 1)
        return keys, values
