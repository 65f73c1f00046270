"""The restore-point store: deepest proper prefix, chain keys, LRU within a byte budget."""

from __future__ import annotations

import pytest

from skippy_llama.identity import chain_key
from skippy_llama.restore_points import RestorePointStore


def test_best_is_the_deepest_proper_prefix() -> None:
    store = RestorePointStore(root=b"r", max_bytes=100)
    assert store.put([1, 2], b"a")
    assert store.put([1, 2, 3, 4], b"b")
    assert store.put([1, 9, 9], b"c")
    point = store.best([1, 2, 3, 4, 5])
    assert point is not None and point.blob == b"b" and point.n_tokens == 4
    # a prompt equal to a point leaves nothing to decode: the shorter point serves
    point = store.best([1, 2, 3, 4])
    assert point is not None and point.blob == b"a"
    assert store.best([2, 1, 3]) is None
    assert store.best([1]) is None


def test_keys_chain_from_the_root() -> None:
    store = RestorePointStore(root=b"model-a", max_bytes=100)
    store.put([5, 6], b"x")
    assert chain_key(b"model-a", [5, 6]) in store._points
    other = RestorePointStore(root=b"model-b", max_bytes=100)
    other.put([5, 6], b"x")
    assert set(other._points) != set(store._points)


def test_lru_eviction_within_budget() -> None:
    store = RestorePointStore(root=b"r", max_bytes=10)
    store.put([1], b"aaaa")
    store.put([2], b"bbbb")
    assert store.best([1, 0]) is not None  # [1] is now the most recently used
    store.put([3], b"cccc")  # 12 bytes > 10: the least recently used ([2]) goes
    assert store.best([2, 0]) is None
    assert store.best([1, 0]) is not None and store.best([3, 0]) is not None
    assert store.bytes == 8 and len(store) == 2


def test_oversized_and_empty_points_are_refused() -> None:
    store = RestorePointStore(root=b"r", max_bytes=4)
    assert not store.put([1], b"too big")
    assert not store.put([], b"a")
    assert len(store) == 0 and store.bytes == 0


def test_replacing_a_point_keeps_the_byte_count() -> None:
    store = RestorePointStore(root=b"r", max_bytes=100)
    store.put([1, 2], b"aaaa")
    store.put([1, 2], b"bb")
    assert store.bytes == 2 and len(store) == 1
    point = store.best([1, 2, 3])
    assert point is not None and point.blob == b"bb"
    store.clear()
    assert store.bytes == 0 and store.best([1, 2, 3]) is None


@pytest.mark.parametrize("n", [1, 7])
def test_collision_is_a_miss(n: int) -> None:
    """A stored point under a prompt's key but with other tokens is never returned."""
    store = RestorePointStore(root=b"r", max_bytes=100)
    tokens = list(range(n))
    store.put(tokens, b"s")
    key = next(iter(store._points))
    forged = store._points[key].__class__(tokens=store._points[key].tokens + 1, blob=b"s")
    store._points[key] = forged
    assert store.best([*tokens, 99]) is None
