"""The one bounded cache (multihead.memo.BoundedCache)."""

from __future__ import annotations

import threading

import pytest

from multihead.memo import BoundedCache


def test_it_keeps_the_newest_entries_up_to_its_size_and_reads_like_a_dict():
    cache: BoundedCache[int, str] = BoundedCache(3)
    for i in range(5):
        assert cache.put(i, str(i)) == str(i)
    assert list(cache) == [2, 3, 4] and cache.get(4) == "4" and cache.get(0) is None
    cache.put(2, "again")  # stored again: keeps its place, so it is still the oldest
    cache.put(5, "5")
    assert list(cache) == [3, 4, 5]


def test_threads_storing_at_once_leave_it_within_its_size():
    cache: BoundedCache[tuple[int, int], int] = BoundedCache(8)

    def fill(t: int) -> None:
        for i in range(2000):
            cache.put((t, i), i)

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache) <= 8


@pytest.mark.parametrize("size", [0, -1, 2.5, True, None])
def test_a_size_that_is_not_a_positive_int_is_refused(size):
    with pytest.raises(ValueError, match=r"maxsize must be a positive int, got"):
        BoundedCache(size)
