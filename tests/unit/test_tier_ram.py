"""RamTier (L2): promotion rules, distinct-byte budget, LRU, digest checks, invalidation."""

from __future__ import annotations

import pytest

from skippy_llama.tiers.ram import LARGE_PREFIX_TOKENS, MAX_PAYLOAD_BYTES, PROMOTE_WINDOW_S, RamTier

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def dig(i: int) -> bytes:
    return (i + 7).to_bytes(16, "little")


def test_second_fill_within_window_promotes() -> None:
    clock = Clock()
    ram = RamTier(10 * MiB, clock=clock)
    payload = b"x" * 1000
    assert ram.fill(key(1), payload, dig(1), prefix_tokens=256) is False  # first fill
    assert key(1) not in ram
    clock.now += PROMOTE_WINDOW_S - 1
    assert ram.fill(key(1), payload, dig(1), prefix_tokens=256) is True
    assert ram.get(key(1), dig(1)) == payload
    status = ram.status()
    assert (status.first_fills, status.promotions, status.hits) == (1, 1, 1)


def test_second_fill_after_window_starts_over() -> None:
    clock = Clock()
    ram = RamTier(10 * MiB, clock=clock)
    assert not ram.fill(key(1), b"x", dig(1), prefix_tokens=10)
    clock.now += PROMOTE_WINDOW_S + 1
    assert not ram.fill(key(1), b"x", dig(1), prefix_tokens=10)
    clock.now += 1
    assert ram.fill(key(1), b"x", dig(1), prefix_tokens=10)


def test_large_prefix_promotes_on_first_fill() -> None:
    ram = RamTier(10 * MiB)
    assert ram.fill(key(1), b"x" * 10, dig(1), prefix_tokens=LARGE_PREFIX_TOKENS)
    assert not ram.fill(key(2), b"x" * 10, dig(2), prefix_tokens=LARGE_PREFIX_TOKENS - 1)


def test_payloads_over_64mib_never_promoted() -> None:
    ram = RamTier(1 << 30)
    huge = memoryview(bytearray(MAX_PAYLOAD_BYTES + 1))
    assert not ram.fill(key(1), huge, dig(1), prefix_tokens=1 << 20)
    assert not ram.fill(key(1), huge, dig(1), prefix_tokens=1 << 20)
    assert ram.status().rejected_too_large == 2 and len(ram) == 0


def test_budget_charged_by_distinct_bytes_with_lru_eviction() -> None:
    ram = RamTier(3000)
    big = LARGE_PREFIX_TOKENS
    for i in range(3):
        assert ram.fill(key(i), bytes(1000), dig(i), prefix_tokens=big)
    assert ram.fill(key(0), bytes(1000), dig(0), prefix_tokens=big)  # shared page: charged once
    assert ram.used_bytes == 3000 and len(ram) == 3
    assert ram.get(key(0), dig(0)) is not None  # key 0 becomes most recent
    assert ram.fill(key(3), bytes(1000), dig(3), prefix_tokens=big)
    assert key(1) not in ram and key(0) in ram  # LRU victim was key 1
    assert ram.used_bytes == 3000 and ram.status().evictions == 1
    assert not ram.fill(key(9), bytes(4000), dig(9), prefix_tokens=big)  # larger than the budget


def test_digest_mismatch_or_missing_in_l3_drops_the_copy() -> None:
    ram = RamTier(10 * MiB)
    ram.fill(key(1), b"a", dig(1), prefix_tokens=LARGE_PREFIX_TOKENS)
    ram.fill(key(2), b"b", dig(2), prefix_tokens=LARGE_PREFIX_TOKENS)
    assert ram.get(key(1), dig(99)) is None  # L3 holds other bytes now
    assert key(1) not in ram
    assert ram.get(key(2), None) is None  # L3 no longer has it
    assert key(2) not in ram and ram.used_bytes == 0
    status = ram.status()
    assert status.digest_mismatches == 1 and status.invalidations == 1 and status.misses == 2


def test_invalidate_and_reoffer_with_new_digest() -> None:
    ram = RamTier(10 * MiB)
    ram.fill(key(1), b"old", dig(1), prefix_tokens=LARGE_PREFIX_TOKENS)
    ram.invalidate(key(1))
    assert key(1) not in ram and ram.used_bytes == 0
    ram.fill(key(1), b"old", dig(1), prefix_tokens=LARGE_PREFIX_TOKENS)
    assert ram.fill(key(1), b"new!", dig(2), prefix_tokens=LARGE_PREFIX_TOKENS)
    assert ram.get(key(1), dig(2)) == b"new!" and ram.used_bytes == 4


def test_memoryview_payload_is_copied() -> None:
    ram = RamTier(10 * MiB)
    buf = bytearray(b"abcdef")
    ram.fill(key(1), memoryview(buf)[1:4], dig(1), prefix_tokens=LARGE_PREFIX_TOKENS)
    buf[1] = ord("Z")
    assert ram.get(key(1), dig(1)) == b"bcd"


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RamTier(0)
