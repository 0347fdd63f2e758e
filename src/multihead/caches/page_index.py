"""``PageIndex``: token ids to pages, one chain link per full page, with LRU eviction.

A page of ``page_size`` tokens is found by its *chain key*, the page before it in the sequence and
its own token ids: ``(parent page or -1, (t0, ..., t_{ps-1}))``. Two prompts that agree on their
first ``n · page_size`` tokens walk the same ``n`` keys to the same pages, and a key names the
whole prefix exactly (no hash can collide: the key holds the tokens, and the parent names
everything before them). It is a radix tree whose edges are whole pages::

    prompt A: [1 2 3 4 | 5 6 7 8 | 9 ...]        (-1, 1 2 3 4) -> page 7
    prompt B: [1 2 3 4 | 5 6 0 0 | ...]           (7, 5 6 7 8)  -> page 2    (A's)
                                                  (7, 5 6 0 0)  -> page 4    (B's)

Pages no request holds stay indexed, as a cache, until the pool needs them: the least recently
used goes first, with the pages indexed under it (a page's children are unreferenced whenever it
is: a request holding a child holds its parent too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PageIndex"]


class PageIndex:
    """Chain keys of full pages and the order in which unreferenced pages were last used."""

    def __init__(self) -> None:
        self._page_of: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._children: dict[int, set[int]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced indexed pages, oldest first

    def __contains__(self, page: int) -> bool:
        return page in self._key_of

    def __len__(self) -> int:
        return len(self._key_of)

    def key_of(self, page: int) -> tuple[int, tuple[int, ...]] | None:
        """The chain key ``page`` is indexed under (``None``: not indexed)."""
        return self._key_of.get(page)

    @property
    def idle(self) -> int:
        """Indexed pages no request holds: what eviction can give back."""
        return len(self._idle)

    def match(self, tokens: Sequence[int], page_size: int) -> list[int]:
        """The pages of the longest run of full pages of ``tokens`` that is indexed, in order."""
        pages: list[int] = []
        parent = -1
        for start in range(0, len(tokens) - page_size + 1, page_size):
            page = self._page_of.get((parent, tuple(tokens[start : start + page_size])))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def insert(self, parent: int, tokens: Sequence[int], page: int) -> bool:
        """Index ``page`` (full, holding ``tokens``) after ``parent`` (-1: the first page);
        ``False`` when that key already names another page (the page then stays private)."""
        key = (parent, tuple(tokens))
        if key in self._page_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        if parent >= 0:
            self._children.setdefault(parent, set()).add(page)
        return True

    def held(self, page: int) -> None:
        """A request holds ``page`` now: not evictable."""
        self._idle.pop(page, None)

    def released(self, page: int) -> None:
        """No request holds ``page`` any more: evictable, most recently used."""
        if page in self._key_of:
            self._idle[page] = None
            self._idle.move_to_end(page)

    def evict(self, count: int) -> list[int]:
        """Drop at least ``count`` idle pages (fewer only when there are not enough), least
        recently used first, each with the pages under it; the dropped pages, to free."""
        dropped: list[int] = []
        while len(dropped) < count and self._idle:
            oldest = next(iter(self._idle))
            dropped.extend(self._remove(oldest))
        return dropped

    def _remove(self, page: int) -> list[int]:
        removed = [page]
        for child in list(self._children.pop(page, ())):
            removed.extend(self._remove(child))
        parent, _ = key = self._key_of.pop(page)
        del self._page_of[key]
        if parent >= 0 and parent in self._children:
            self._children[parent].discard(page)
        self._idle.pop(page, None)
        return removed
