"""``PrefixCache``: requests that share pages of a common prompt, copy-on-write, with an index
from token ids to pages and LRU eviction of pages no request holds.

Built on :class:`~multihead.caches.PagedKVCache`'s pool (its key/value pages and free list): a
request is a block table over that pool plus its token ids. What sharing adds:

* **reference counts**: ``refs[p]`` requests hold page ``p``; a page is written only while one
  request holds it and the index does not name it (its content is then nobody else's);
* **copy-on-write**: a write into a page that is shared or indexed (a fork's partial last page, a
  page cropped back into) first copies it to a fresh page, then writes the copy;
* **the index** (:class:`~multihead.caches.page_index.PageIndex`): every full page is registered
  under its chain key, so :meth:`admit` finds the longest run of full pages a new prompt shares
  with any earlier one (served or finished) and holds them instead of recomputing;
* **eviction**: a finished request's indexed pages stay cached until the pool needs them, least
  recently used first;
* **cascade attention** (:meth:`attend`): a batch whose requests begin with the same pages attends
  to that prefix once (:func:`multihead.cascade_attention`); :meth:`attend_ragged` runs a batch of
  requests with their own query lengths (prefill chunks beside decode tokens) as one call.

Every refused call (unknown request, tokens that do not match the keys, a pool too small even
after eviction) raises before any page, count or index entry changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from multihead.caches.page_index import PageIndex
from multihead.caches.paged import PagedKVCache, _scatter

__all__ = ["PrefixCache"]


@dataclass
class _Request:
    table: list[int] = field(default_factory=list)  # pages, in order
    tokens: list[int] = field(default_factory=list)  # token ids stored (the length is len(tokens))


class PrefixCache:
    """Pages of one pool shared between requests.

    Args:
        num_pages, page_size, num_kv_heads, head_dim, value_dim, dtype, device: the pool, as
            :class:`~multihead.caches.PagedKVCache` takes them (``pool``: that cache, whose
            head-major ``key_pages (Hkv, N, ps, D)``, ``value_pages`` and ``free`` list this one manages).

    A request: ``rid, cached = cache.admit(prompt_ids)`` holds the indexed pages the prompt starts
    with (``cached`` tokens, a multiple of ``page_size``, always fewer than the prompt: its last
    token is computed for the first logits); ``cache.append([rid], k, v, [ids])`` stores the keys
    and values of the rest, then of each generated token; ``cache.release(rid)`` ends it.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.pool = PagedKVCache(
            num_pages, page_size, num_kv_heads, head_dim, value_dim=value_dim, dtype=dtype, device=device
        )
        self.page_size = page_size
        self.refs = [0] * num_pages
        self.index = PageIndex()
        self._requests: dict[int, _Request] = {}
        self._next = 0

    # ------------------------------------------------------------------------------ state
    @property
    def free_pages(self) -> int:
        """Pages in the free list (not counting idle indexed pages eviction could give back)."""
        return len(self.pool.free)

    @property
    def available_pages(self) -> int:
        """Pages a request could take now: free ones and idle indexed ones."""
        return len(self.pool.free) + self.index.idle

    def requests(self) -> list[int]:
        """The ids of the live requests."""
        return list(self._requests)

    def length(self, rid: int) -> int:
        """Tokens stored for request ``rid``."""
        return len(self._request("length", rid).tokens)

    def table(self, rid: int) -> list[int]:
        """Request ``rid``'s pages, in order (a copy)."""
        return list(self._request("table", rid).table)

    def tokens(self, rid: int) -> list[int]:
        """Request ``rid``'s token ids (a copy)."""
        return list(self._request("tokens", rid).tokens)

    def read(self, rid: int, start: int = 0) -> tuple[Tensor, Tensor]:
        """Request ``rid``'s keys ``(1, Hkv, L - start, D)`` and values ``(1, Hkv, L - start, Dv)``
        from token ``start`` on, gathered (only the pages from ``start``'s on are read)."""
        request = self._request("read", rid)
        length = len(request.tokens)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= length:
            raise ValueError(f"PrefixCache.read: start must be an int in [0, {length}], got {start!r}")
        first = start // self.page_size
        keys, values = self._gather(request.table[first:], length - first * self.page_size)
        skip = start - first * self.page_size
        return keys[:, :, skip:], values[:, :, skip:]

    # ------------------------------------------------------------------------------ requests
    def admit(self, prompt: Sequence[int]) -> tuple[int, int]:
        """A new request for ``prompt`` (token ids): ``(rid, cached)``, holding the indexed pages
        of its longest run of full pages already stored (``cached`` tokens)."""
        ids = _check_ids("PrefixCache.admit", "prompt", prompt)
        if not ids:
            raise ValueError("PrefixCache.admit: prompt must hold at least one token id, got []")
        # the last prompt token is always computed (its query gives the first logits)
        pages = self.index.match(ids[:-1], self.page_size)
        rid, self._next = self._next, self._next + 1
        self._requests[rid] = _Request(list(pages), ids[: len(pages) * self.page_size])
        for page in pages:
            self._hold(page)
        return rid, len(pages) * self.page_size

    def fork(self, rid: int) -> int:
        """A new request holding every page of ``rid`` (parallel sampling, beams): nothing is
        copied until one of them writes into a shared page."""
        request = self._request("fork", rid)
        new, self._next = self._next, self._next + 1
        self._requests[new] = _Request(list(request.table), list(request.tokens))
        for page in request.table:
            self._hold(page)
        return new

    def release(self, rid: int) -> None:
        """End request ``rid``: its pages lose a holder; indexed ones stay cached (LRU), the rest
        go back to the pool."""
        request = self._request("release", rid)
        for page in reversed(request.table):
            self._drop(page)
        del self._requests[rid]

    def crop(self, rid: int, length: int) -> None:
        """Request ``rid`` keeps its first ``length`` tokens (rejected drafts); the pages past them
        lose a holder. A later write into a kept page that is shared is copied first."""
        request = self._request("crop", rid)
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"PrefixCache.crop: length must be an int >= 0, got {length!r}")
        keep = -(-length // self.page_size)
        for page in reversed(request.table[keep:]):
            self._drop(page)
        del request.table[keep:]
        del request.tokens[length:]

    # ------------------------------------------------------------------------------ writes
    def append(self, rids: Sequence[int], k: Tensor, v: Tensor, tokens: Sequence[Sequence[int]]) -> None:
        """Store new tokens of several requests, packed: ``k (1, Hkv, T, D)``, ``v (1, Hkv, T, Dv)``
        hold ``tokens[0]`` of ``rids[0]``, then ``tokens[1]`` of ``rids[1]``, ... (``T`` in all;
        any count per request, 0 included). Pages are taken (evicting idle ones, least recently
        used first), shared pages written into are copied first, and every page that fills is
        indexed. Refused before any change when the pool cannot hold the tokens."""
        where = "PrefixCache.append"
        requests, ids = self._check_append(where, rids, k, v, tokens)
        plan = [self._plan(r, len(t)) for r, t in zip(requests, ids)]
        needed = sum(copies + fresh for copies, fresh in plan)
        if needed > self.available_pages:
            raise ValueError(
                f"{where}: the tokens need {needed} more pages of {self.page_size} tokens but "
                f"{len(self.pool.free)} are free and {self.index.idle} cached pages could be evicted "
                f"(pool of {self.pool.num_pages}); hint: release() finished requests, or allocate a larger pool"
            )
        short = needed - len(self.pool.free)
        if short > 0:
            self.pool.free.extend(reversed(self.index.evict(short)))
        slots: list[Tensor] = []
        for request, new_ids, (copies, fresh) in zip(requests, ids, plan):
            if not new_ids:
                continue
            if copies:
                self._copy_last_page(request)
            request.table.extend(self._take() for _ in range(fresh))
            start = len(request.tokens)
            positions = torch.arange(start, start + len(new_ids))
            pages = torch.tensor(request.table, dtype=torch.int64)[positions // self.page_size]
            slots.append(pages * self.page_size + positions % self.page_size)  # slots of the pool as (N·ps)
            request.tokens.extend(new_ids)
        if slots:  # one scatter per tensor for every request's tokens
            flat = torch.cat(slots).to(self.pool.key_pages.device)
            _scatter(self.pool.key_pages, flat, k)
            _scatter(self.pool.value_pages, flat, v)
        for request in requests:
            self._index_full_pages(request)

    def _plan(self, request: _Request, new: int) -> tuple[int, int]:
        """``(copies, fresh)`` pages a write of ``new`` tokens takes: a copy of a shared last page
        it writes into, and new pages past it."""
        if new == 0:
            return 0, 0
        length = len(request.tokens)
        copies = int(length % self.page_size != 0 and not self._writable(request.table[-1]))
        fresh = -(-(length + new) // self.page_size) - len(request.table)
        return copies, fresh

    def _writable(self, page: int) -> bool:
        return self.refs[page] == 1 and page not in self.index

    def _copy_last_page(self, request: _Request) -> None:
        """Copy-on-write: the request's last page becomes a fresh copy only it holds."""
        old = request.table[-1]
        new = self._take()
        self.pool.key_pages[:, new] = self.pool.key_pages[:, old]  # the pool is head-major
        if not self.pool.values_in_keys:
            self.pool.value_pages[:, new] = self.pool.value_pages[:, old]
        request.table[-1] = new
        self._drop(old)

    def _take(self) -> int:
        page = self.pool.free.pop()
        self.refs[page] = 1
        return page

    def _hold(self, page: int) -> None:
        self.refs[page] += 1
        self.index.held(page)

    def _drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.index:
                self.index.released(page)
            else:
                self.pool.free.append(page)

    def _index_full_pages(self, request: _Request) -> None:
        """Index each full page of ``request`` whose parent is indexed (a chain only grows from
        indexed pages: a key naming a private page would outlive it)."""
        ps = self.page_size
        parent = -1
        for i in range(len(request.tokens) // ps):
            page = request.table[i]
            if page not in self.index and not self.index.insert(parent, request.tokens[i * ps : (i + 1) * ps], page):
                return  # the same content is indexed under another page: this chain stays private
            parent = page

    # ------------------------------------------------------------------------------ reads
    def _gather(self, table: list[int], length: int) -> tuple[Tensor, Tensor]:
        """The first ``length`` tokens of the pages ``table``: ``(1, Hkv, length, ·)``."""
        pages = torch.tensor(table, dtype=torch.int64, device=self.pool.key_pages.device)
        keys = self.pool.key_pages[:, pages]  # (Hkv, pages, ps, D): the pool is head-major
        values = self.pool.value_pages[:, pages]
        keys = keys.reshape(1, keys.shape[0], -1, keys.shape[3])[:, :, :length]
        values = values.reshape(1, values.shape[0], -1, values.shape[3])[:, :, :length]
        return keys, values

    def shared_prefix(self, rids: Sequence[int]) -> int:
        """Tokens at the start of every request in ``rids`` stored in the same full pages: a
        multiple of ``page_size``."""
        tables = [self._request("shared_prefix", r).table for r in rids]
        full = min(len(self._requests[r].tokens) for r in rids) // self.page_size
        pages = 0
        for column in zip(*tables):
            if pages == full or len(set(column)) != 1:
                break
            pages += 1
        return pages * self.page_size

    # ------------------------------------------------------------------------------ checks
    def _request(self, method: str, rid: object) -> _Request:
        if isinstance(rid, bool) or not isinstance(rid, int) or rid not in self._requests:
            raise ValueError(
                f"PrefixCache.{method}: no live request {rid!r}; live requests are {sorted(self._requests)[:8]}"
                f"{' ...' if len(self._requests) > 8 else ''}; hint: admit() returns the id"
            )
        return self._requests[rid]

    def _check_append(
        self, where: str, rids: Sequence[int], k: Tensor, v: Tensor, tokens: Sequence[Sequence[int]]
    ) -> tuple[list[_Request], list[list[int]]]:
        if isinstance(rids, (int, str)) or len(rids) != len(tokens):
            raise ValueError(f"{where}: rids and tokens must be sequences of one length, got {rids!r} and {tokens!r}")
        if len(set(rids)) != len(rids):
            raise ValueError(f"{where}: each request appears once per call, got rids {list(rids)}")
        requests = [self._request("append", r) for r in rids]
        ids = [_check_ids(where, f"tokens[{i}]", t) for i, t in enumerate(tokens)]
        Hkv, N, ps, D = self.pool.key_pages.shape  # head-major
        Dv = self.pool.value_pages.shape[3]
        T = sum(len(t) for t in ids)
        for name, t, want in (("k", k, (1, Hkv, T, D)), ("v", v, (1, Hkv, T, Dv))):
            if not isinstance(t, Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"{where}: {name} must be (1, Hkv, T, ·) = {want}, the {T} tokens packed in the order "
                    f"of rids, got {got}"
                )
            if t.dtype != self.pool.key_pages.dtype or t.device != self.pool.key_pages.device:
                raise TypeError(
                    f"{where}: {name} must be {self.pool.key_pages.dtype} on {self.pool.key_pages.device} "
                    f"(the pool's), got {t.dtype} on {t.device}"
                )
        return requests, ids


def _check_ids(where: str, name: str, ids: object) -> list[int]:
    if isinstance(ids, Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(
                f"{where}: {name} must be a 1-D integer tensor or a list of ints, got {ids.dtype} {tuple(ids.shape)}"
            )
        return [int(i) for i in ids.tolist()]
    if (
        not isinstance(ids, Sequence)
        or isinstance(ids, str)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise TypeError(f"{where}: {name} must be a list of int token ids, got {ids!r}")
    return list(ids)
