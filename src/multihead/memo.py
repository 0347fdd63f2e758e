"""The one bounded cache: what the library remembers between calls, never more than a fixed number.

Plans of repeated calls (:mod:`multihead.plans`), the ring's plans, a layer's combined masks: each
keeps what it decided for a key, and each must stay small whatever a program does (a decoding loop
meets a new signature at every step). :class:`BoundedCache` is a ``dict`` whose :meth:`put` drops
the oldest entries beyond ``maxsize``; reads are plain ``dict`` reads (``cache.get(key)``), so a
lookup costs what a dictionary's does.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["BoundedCache"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(dict[K, V]):
    """A ``dict`` of at most ``maxsize`` entries: :meth:`put` stores and then drops the oldest stored
    first (first in, first out: an entry stored again keeps its place). Thread-tolerant: when two
    threads trim at once, one gives way, and the cache holds at most ``maxsize`` entries afterwards
    anyway."""

    def __init__(self, maxsize: int):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"BoundedCache: maxsize must be a positive int, got {maxsize!r}")
        super().__init__()
        self.maxsize = maxsize

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` and return it, dropping the oldest entries beyond ``maxsize``."""
        self[key] = value
        while len(self) > self.maxsize:
            try:
                del self[next(iter(self))]
            except (KeyError, StopIteration, RuntimeError):  # another thread trimmed it first
                break
        return value

    def __repr__(self) -> str:
        return f"BoundedCache(maxsize={self.maxsize}, {len(self)} entries)"
