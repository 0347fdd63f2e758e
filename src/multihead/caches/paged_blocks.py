"""``PageBlocks``: the slots of a :class:`~multihead.caches.PagedKVCache` read, handed to the decode
path through the block table, in the order the pages lie in the pool.

Attention over a set of keys does not depend on their order, only on each key's mask, so a decode
step need not read a row's pages in table order. It reads them in *pool* order: pages that follow
each other in the pool, whatever their places in the block table, are one strided view of the
head-major pool ``(Hkv, num_pages, page_size, D)``, read with no copy. A fragmented table is often
a few long runs in pool order (pages are claimed from one free list)::

    table (row 0):  [7, 8, 2, 3, 4, 9]        pool order: 2 3 4 | 7 8 9
    slots:           0  1  2  3  4  5         runs:  pages 2..4 = table positions 2, 3, 4 (in order)
                                                     pages 7..9 = table positions 0, 1, 5 (out of order)

A run whose table positions are also consecutive is a piece over the slots ``start ..`` (trimmed to
the keys read, as any piece); any other run is a piece whose keys carry their slot numbers (a
``slots`` tensor), so the mask follows each key. Runs too short to be worth a piece of their own
(:data:`MIN_RUN` slots) are copied, a piece at a time, into one buffer with ``index_select`` along
the pool's page dim, in pool order. The slots of a row's last page past its length hold no token
(zeroed: the cache zeroes a page when it claims it and the slots a crop drops): where they lie
outside the keys read, the decode path masks them by their slot numbers; a page with *tokens*
outside the keys read (a window's first page) is read on its own, trimmed, so no such key is touched.

Batches of several rows are read in table order, every row's pages copied into the buffer per
piece; the dense read (:meth:`PageBlocks.dense`) gathers every page once, in table order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from multihead.backends import cpu_kernels
from multihead.backends.decode_blocks import KVBlocks

__all__ = ["PageBlocks", "MIN_RUN"]

#: Slots a run of consecutive pages must hold to be read as a view of its own rather than copied
#: with other short runs into one piece: each piece costs a handful of ops.
MIN_RUN = 1024


class PageBlocks(KVBlocks):
    """The slots of a paged read, ``(B, Hkv, S, ·)``, from the pool and the block tables as
    they were at the read: ``S = width·ps``, or the first ``slots`` of them (rows of one length:
    the filled slots only, a contiguous read).

    Args:
        key_pages, value_pages: the pool, ``(Hkv, num_pages, ps, D)`` and ``(Hkv, num_pages, ps, Dv)``.
        values_in_keys: the values are the first ``Dv`` features of the keys (stored once).
        table: ``(B, width)`` page of each row's table position; past a row's pages any page of
            the pool (the cache gives page 0), which the mask hides. Not changed after the read
            (the cache makes a new one when a table changes).
        tables, lengths: the same tables as host lists, and each row's tokens.
        slots: ``S`` when fewer than ``width·ps`` (``None``: all of them).
    """

    def __init__(
        self,
        key_pages: Tensor,
        value_pages: Tensor,
        values_in_keys: bool,
        table: Tensor,
        tables: list[list[int]],
        lengths: list[int],
        slots: int | None = None,
    ):
        Hkv, N, ps, D = key_pages.shape
        B, width = table.shape
        self.key_pages, self.value_pages, self.values_in_keys = key_pages, value_pages, values_in_keys
        self.table = table  # (B, width)
        # a row's pages as host lists (a copy: the cache's own lists change with the next update)
        self.rows = [list(t) + [0] * (width - len(t)) for t in tables]
        self.lengths = list(lengths)
        self.ps = ps
        self.shape = (B, Hkv, width * ps if slots is None else slots, D, value_pages.shape[-1])
        self.dtype, self.device = key_pages.dtype, key_pages.device
        self.grad = torch.is_grad_enabled()  # dense() records autograd as the update that read would have
        self._host: Tensor | None = None

    def pieces(self, lo: int, hi: int, size: int) -> Iterator[tuple[int | Tensor, Tensor, Tensor]]:
        if self.shape[0] == 1:
            yield from self._pool_order(lo, hi, size)
        else:
            yield from self._table_order(lo, hi, size)

    def partials(
        self, qg: Tensor, lo: int, hi: int, blocked: Tensor | None, scale: float, G: int, Lq: int
    ) -> list[tuple[Tensor, Tensor]] | None:
        """multihead's CPU kernel reads every row's pages through the block table where it is built:
        one call, no copy, whatever the layout (:mod:`multihead.backends.cpu_kernels`); ``None``
        (pieces, below) elsewhere."""
        B, Hkv, S, D, Dv = self.shape
        values = self.key_pages[..., :Dv] if self.values_in_keys else self.value_pages
        if not cpu_kernels.supports(qg, self.key_pages, values, blocked):
            return None
        return [cpu_kernels.decode_partial(qg, self.key_pages, values, scale, G, Lq, blocked, self.table, lo, hi - lo)]

    # ------------------------------------------------------------------------------ one row
    def _pool_order(self, lo: int, hi: int, size: int) -> Iterator[tuple[int | Tensor, Tensor, Tensor]]:
        """Row 0's pages ``[first, last)`` (those holding the slots ``[lo, hi)``) in pool order,
        planned with a few host tensor ops (a Python loop over thousands of pages costs more than
        the ops of a piece)."""
        ps = self.ps
        first, last = lo // ps, -(-hi // ps)
        pages = self._host_table()[first:last]  # (n,) the pool page of each table position
        if last - first == 1 or bool((pages[1:] - pages[:-1] == 1).all()):  # one run, in table order
            yield self._view(first, last - first, lo, hi)
            return
        # Pages with tokens outside [lo, hi) are read alone, trimmed, so no such key is touched.
        dirty = [t for t, cut in ((first, lo % ps), (last - 1, hi % ps and hi < self.lengths[0])) if cut]
        for t in dict.fromkeys(dirty):
            yield self._view(t, 1, lo, hi)
        keep = torch.ones(last - first, dtype=torch.bool)
        keep[[t - first for t in dirty]] = False
        order = keep.nonzero()[:, 0]  # relative table positions, sorted below by pool page
        order = order[torch.argsort(pages[order], stable=True)]
        pool = pages[order]  # (m,) ascending
        m = order.numel()
        starts = torch.ones(m, dtype=torch.bool)  # where a run of pages consecutive in the pool starts
        starts[1:] = pool[1:] != pool[:-1] + 1
        run = starts.cumsum(0) - 1  # (m,) run of each page
        begin = starts.nonzero()[:, 0]
        count = torch.diff(begin, append=torch.tensor([m]))  # pages per run
        stepped = torch.zeros(m, dtype=torch.bool)  # a page not one table position after the previous
        stepped[1:] = (order[1:] != order[:-1] + 1) & ~starts[1:]
        mixed = torch.zeros(count.numel(), dtype=torch.bool).index_put_((run[stepped],), torch.tensor(True))
        long = count * ps >= MIN_RUN
        for r in long.nonzero()[:, 0].tolist():
            b, n = int(begin[r]), int(count[r])
            if not mixed[r]:  # in table order too: the slots from its first page's on
                yield self._view(first + int(order[b]), n, lo, hi)
            else:  # out of order in the table: the keys carry their slots
                k, v = self._pool_view(int(pool[b]), n)
                yield self._slots(first + order[b : b + n]), k, v
        short = ~long[run]
        if bool(short.any()):  # pages of short runs, copied a piece at a time in pool order
            positions, chosen = first + order[short], pool[short]
            per = max(1, size // ps)
            buffers: tuple[Tensor, Tensor] | None = None
            for c in range(0, positions.numel(), per):
                buffers = self._copy(chosen[c : c + per], buffers)
                n = min(per, positions.numel() - c) * ps
                yield self._slots(positions[c : c + per]), buffers[0][:, :, :n], buffers[1][:, :, :n]

    def _host_table(self) -> Tensor:
        """Row 0's block table as a host ``int64`` tensor (made once per read)."""
        if self._host is None:
            self._host = self.table[0].cpu()
        return self._host

    def _view(self, t: int, count: int, lo: int, hi: int) -> tuple[int, Tensor, Tensor]:
        """Table positions ``t .. t + count`` of row 0, consecutive in the pool: one view, trimmed to
        the slots ``[lo, hi)``."""
        ps = self.ps
        k, v = self._pool_view(self.rows[0][t], count)
        s0, s1 = max(lo, t * ps), min(hi, (t + count) * ps)
        return s0, k[:, :, s0 - t * ps : s1 - t * ps], v[:, :, s0 - t * ps : s1 - t * ps]

    def _pool_view(self, page: int, count: int) -> tuple[Tensor, Tensor]:
        """Pages ``page .. page + count`` of the pool as ``(1, Hkv, count·ps, ·)`` views (no copy)."""
        B, Hkv, S, D, Dv = self.shape
        k = self.key_pages[:, page : page + count].reshape(1, Hkv, count * self.ps, D)
        if self.values_in_keys:
            return k, k[..., :Dv]
        return k, self.value_pages[:, page : page + count].reshape(1, Hkv, count * self.ps, Dv)

    def _slots(self, positions: Tensor) -> Tensor:
        """``(len(positions)·ps,)`` int64 on the host: the slot of each key of the pages at these
        table positions (a host tensor)."""
        return (positions.view(-1, 1) * self.ps + torch.arange(self.ps)).view(-1)

    def _copy(self, pages: Tensor, buffers: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """The pool's ``pages`` (a host tensor) copied into the buffers ``(1, Hkv, ≥ len·ps, ·)``:
        their first ``len(pages)·ps`` slots."""
        B, Hkv, S, D, Dv = self.shape
        m = pages.numel()
        if buffers is None or buffers[0].shape[2] < m * self.ps:
            k_buf = self.key_pages.new_empty(1, Hkv, m * self.ps, D)
            v_buf = k_buf if self.values_in_keys else self.value_pages.new_empty(1, Hkv, m * self.ps, Dv)
            buffers = (k_buf, v_buf)
        k_buf, v_buf = buffers
        pages = pages.to(self.device)
        torch.index_select(self.key_pages, 1, pages, out=k_buf[0, :, : m * self.ps].view(Hkv, m, self.ps, D))
        if self.values_in_keys:
            return k_buf, k_buf[..., :Dv]
        torch.index_select(self.value_pages, 1, pages, out=v_buf[0, :, : m * self.ps].view(Hkv, m, self.ps, Dv))
        return k_buf, v_buf

    # ------------------------------------------------------------------------------ several rows
    def _table_order(self, lo: int, hi: int, size: int) -> Iterator[tuple[int | Tensor, Tensor, Tensor]]:
        """Every row's pages ``[first, last)`` in table order, a piece of whole pages at a time, each
        row's copied into its slice of one buffer."""
        B, Hkv, S, D, Dv = self.shape
        ps = self.ps
        first, last = lo // ps, -(-hi // ps)
        per = max(1, size // ps)
        buffers: tuple[Tensor, Tensor] | None = None
        for p0 in range(first, last, per):
            p1 = min(p0 + per, last)
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

    # ------------------------------------------------------------------------------ dense
    def dense(self) -> tuple[Tensor, Tensor]:
        with torch.set_grad_enabled(self.grad):
            return self._gather()

    def _gather(self) -> tuple[Tensor, Tensor]:
        B, Hkv, S, D, Dv = self.shape
        W = self.table.shape[1] * self.ps  # every slot of the table, S of them kept
        # (Hkv, B·width, ps, D) -> (B, Hkv, width·ps, D): every row's pages gathered, in table order
        keys = self.key_pages.index_select(1, self.table.reshape(-1)).view(Hkv, B, W, D).transpose(0, 1)[:, :, :S]
        if self.values_in_keys:
            values = keys[..., :Dv]
        else:
            values = self.value_pages.index_select(1, self.table.reshape(-1)).view(Hkv, B, W, Dv).transpose(0, 1)
            values = values[:, :, :S]
        return keys, values
