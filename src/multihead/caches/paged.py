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
new tokens into the pool: a decode step's few tokens as slices (page and offset known on the host),
more as one scatter. :meth:`release` gives a finished row's pages back (the row may then start a
new sequence). A decode step reads a row's pages through the block table (``CacheRead.blocks``,
:mod:`multihead.caches.paged_blocks`) in pool order: a view of the pool for each run of pages
consecutive there, whatever their order in the table, and a copy that stays in cache for the pages
in short runs, never a gather of the whole cache. The pool is head-major, ``(Hkv, num_pages,
page_size, D)``, so that consecutive pages of a head are one strided run. Other calls (a prefill,
weights, autograd) read ``CacheRead.keys``: every row's pages gathered into ``(B, Hkv, S, D)``.
Rows of one length read their filled slots, in order (a contiguous read, as a static cache gives:
the causal rule is ``causal()``, no mask tensor); rows of several lengths read every slot of the
longest table, the slots past a row's length hidden by the mask (:meth:`CacheRead.mask`). Running
out of pages raises before anything is claimed or written; :meth:`rollback` undoes an update from
a record of what it changed (its pages go back to the free list in the order they left it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

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
from multihead.caches.paged_blocks import PageBlocks
from multihead.caches.policies.base import refuse_policy

__all__ = ["PagedKVCache"]

#: Writes of an update made as slices (a row's tokens within one page: one copy per tensor) up to
#: this many; beyond (a prefill, a large batch) one scatter per tensor costs less than the copies.
_SLICED_WRITES = 4


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
        # each row's pages, in order; changed only by this cache's methods, which drop _table
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self._lengths: list[int] = [0] * batch_size  # tokens per row: the host bookkeeping, with tables
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        # The last update's undo record, (lengths, pages per row) before it: the pages it claimed are
        # each row's table past that count, popped from the free list's end (a copy of the tables and
        # free list per step cost O(pool) on the host).
        self._undo: tuple[list[int], list[int]] | None = None
        # The tables as a (B, width) tensor on the pool's device for the reads, made when a table
        # changes (a step that stays in its pages reuses it); past a row's pages, page 0.
        self._table: Tensor | None = None

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
        # (B, new) from the host lengths, one op
        return torch.tensor([list(range(n, n + new)) for n in self._lengths], dtype=torch.int64, device=device)

    def slots(self, new: int) -> int:
        """Rows of one length ``T``: the ``T + new`` filled slots, in order (a contiguous read, as
        a static cache gives); rows of several lengths: every slot of the longest block table, at
        least one page (see :meth:`_read`)."""
        T = self._uniform_length()
        if T is not None:
            return T + new
        return self.page_size * max(1, max(self._pages_for(n + new) for n in self._lengths))

    def _uniform_length(self) -> int | None:
        """``T`` when every row holds ``T`` tokens, else ``None``."""
        T = self._lengths[0]
        return T if all(n == T for n in self._lengths) else None

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
        uniform = self._uniform_length()
        expected: Tensor | None = None  # (B, new), made where needed
        if positions is not None or uniform is None:  # rows of several lengths: the read's query positions
            expected = self.next_positions(new, k.device)
        if positions is not None:
            assert expected is not None
            check_continuation(name, positions, expected, B)
        needed = [self._pages_for(n + new) - len(t) for n, t in zip(self._lengths, self.tables)]
        if sum(needed) > len(self.free):
            raise ValueError(
                f"{name}.update: {new} new tokens per row need {sum(needed)} more pages of "
                f"{ps} tokens but {len(self.free)} of {N} are free (rows hold {self._lengths} tokens); "
                f"hint: release() finished rows, or allocate a larger pool"
            )
        self._undo = (list(self._lengths), [len(t) for t in self.tables])
        claimed: list[int] = []
        for row_table, count in zip(self.tables, needed):
            pages = [self.free.pop() for _ in range(count)]
            row_table.extend(pages)
            claimed.extend(pages)
        if claimed:  # what an earlier sequence left in them must not reach this one's hidden slots
            self._table = None
            self._clear(claimed)
        self._write(k, v, expected)
        self._lengths = [n + new for n in self._lengths]
        return self._read(new, uniform, expected)

    def _write(self, k: Tensor, v: Tensor, expected: Tensor | None) -> None:
        """Every row's new tokens into their pages: a slice per page a row's tokens fall in where
        they are a few (a decode step: one copy per tensor, page and offset known on the host),
        else one scatter per tensor over every token's slot."""
        ps, new = self.page_size, k.shape[2]
        runs: list[tuple[int, int, int, int, int]] = []  # (row, page, offset, first new token, count)
        for b, (n, table) in enumerate(zip(self._lengths, self.tables)):
            i = 0
            while i < new and len(runs) <= _SLICED_WRITES:
                t = n + i
                count = min(ps - t % ps, new - i)
                runs.append((b, table[t // ps], t % ps, i, count))
                i += count
        if len(runs) <= _SLICED_WRITES:
            for b, page, offset, i, count in runs:
                self.key_pages[:, page, offset : offset + count] = k[b, :, i : i + count]
                if not self.values_in_keys:
                    self.value_pages[:, page, offset : offset + count] = v[b, :, i : i + count]
            return
        if expected is None:
            expected = self.next_positions(new, k.device)
        # Every new token's page and offset, then one scatter per tensor into the pool.
        pages = self._table_tensor().gather(1, torch.div(expected, ps, rounding_mode="floor"))  # (B, new)
        flat = (pages * ps + expected % ps).view(-1)  # (B·new,) slots of the pool seen as (N·ps)
        _scatter(self.key_pages, flat, k)
        if not self.values_in_keys:
            _scatter(self.value_pages, flat, v)

    def _table_tensor(self) -> Tensor:
        """The block tables as ``(B, width)`` on the pool's device, page 0 past a row's pages (a read
        masks those slots); made once per change of the tables."""
        if self._table is None:
            width = max(1, max(len(t) for t in self.tables))
            rows = [t + [0] * (width - len(t)) for t in self.tables]
            self._table = torch.tensor(rows, dtype=torch.int64, device=self.key_pages.device)
        return self._table

    def _read(self, new: int, uniform: int | None, expected: Tensor | None) -> CacheRead:
        """Each row's pages, read through the block table (:class:`~multihead.caches.paged_blocks.PageBlocks`);
        ``keys (B, Hkv, S, D)`` gathered only when asked for. Rows of one length ``T + new`` read
        their filled slots only, in order: a contiguous read (no slot positions, no mask tensor:
        ``causal()`` serves, as for a static cache); rows of several lengths read every slot of
        the longest table, those past a row's length empty."""
        table = self._table_tensor()
        device = table.device
        if uniform is not None:
            T = uniform
            blocks = PageBlocks(
                self.key_pages, self.value_pages, self.values_in_keys, table, self.tables, self._lengths, T + new
            )
            return CacheRead(None, None, torch.arange(T, T + new, device=device), blocks=blocks)
        assert expected is not None  # made by update for rows of several lengths
        B, width = table.shape
        slot = torch.arange(width * self.page_size, device=device).view(1, -1)  # (1, S): position of the slot
        lengths = torch.tensor(self._lengths, dtype=torch.int64, device=device).view(-1, 1)
        key_positions = torch.where(slot < lengths, slot, EMPTY_POSITION)  # (B, S)
        blocks = PageBlocks(self.key_pages, self.value_pages, self.values_in_keys, table, self.tables, self._lengths)
        return CacheRead(None, None, expected, key_positions, blocks=blocks)

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        lengths, counts = self._undo
        # The update's tokens in the pages the rows keep (each row's last page, from its old length
        # on) back to zeros, as crop and the static caches do: a read returns whole pages, and a NaN
        # left there reaches the output through its weight of 0 (see _clear). The pages the update
        # claimed go back to the free list, in the order they left it, and are cleared when claimed
        # again.
        ps = self.page_size
        partial = [(t[c - 1], n % ps) for t, n, c in zip(self.tables, lengths, counts) if n % ps]
        if partial:
            check_writable(f"{type(self).__name__}.rollback", self.key_pages)
        for page, start in partial:
            self._clear([page], start)
        for row_table, count in zip(reversed(self.tables), reversed(counts)):
            if len(row_table) > count:
                self.free.extend(reversed(row_table[count:]))
                del row_table[count:]
                self._table = None
        self._lengths = lengths
        self._undo = None

    def release(self, rows: int | Sequence[int] | Tensor) -> None:
        """Give the pages of ``rows`` (an int, a sequence of ints or a 1-D integer tensor; not a bool
        mask) back to the pool; those rows are empty again and may start new sequences."""
        ids = check_rows("PagedKVCache.release", rows, self.batch_size)
        for r in ids:
            self.free.extend(reversed(self.tables[r]))
            self.tables[r], self._lengths[r] = [], 0
        self._undo, self._table = None, None

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
            self._clear([page], start)
        for r, t in enumerate(target):
            keep = self._pages_for(t)
            self.free.extend(reversed(self.tables[r][keep:]))
            self.tables[r], self._lengths[r] = self.tables[r][:keep], t
        self._undo, self._table = None, None

    def _clear(self, pages: list[int], start: int = 0) -> None:
        """Zero the slots ``start..`` of ``pages``. A read returns whole pages, and the slots of a
        row's last page past its length are hidden by the mask, but attention multiplies their
        values by a weight of 0: a NaN or inf left there (by the sequence that held the page
        before, or by dropped tokens) gives NaN, so every slot holding no token holds 0. One page
        (a step's) is a slice; several, one indexed write per tensor."""
        index: int | Tensor = (
            pages[0] if len(pages) == 1 else torch.tensor(pages, dtype=torch.int64, device=self.key_pages.device)
        )
        self.key_pages[:, index, start:] = 0
        if not self.values_in_keys:
            self.value_pages[:, index, start:] = 0

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
        self._undo, self._table = None, None

    def reset(self) -> None:
        self.release(range(self.batch_size))

    def __repr__(self) -> str:
        return f"{self._held()[:-1]}, lengths={self._lengths}, free_pages={len(self.free)})"


def _scatter(pages: Tensor, flat: Tensor, x: Tensor) -> None:
    """Write ``x (B, Hkv, new, ·)`` to the pool's token slots ``flat (B·new,)`` (page · ps + offset)."""
    ps = pages.shape[2]
    tokens = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])  # (Hkv, B·new, ·), row-major like flat
    pages[:, flat // ps, flat % ps] = tokens  # advanced indices on (page, offset) after the heads
