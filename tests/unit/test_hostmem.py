"""Host buffers for KV bytes: small ones are bytearrays, large ones lazily zeroed mappings."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

from skippy_llama.hostmem import MAPPED_BYTES, BufferPool, HostBuffer, fit, host_buffer


def test_small_buffers_are_bytearrays_and_large_ones_zeroed_writable_mappings() -> None:
    assert isinstance(host_buffer(1000), bytearray) and len(host_buffer(1000)) == 1000
    big = host_buffer(MAPPED_BYTES + 1)
    assert isinstance(big, mmap.mmap) and len(big) == MAPPED_BYTES + 1
    arr = np.frombuffer(big, dtype=np.uint8)
    assert not arr.any()  # zeroed like bytearray(n)
    arr[-1] = 7
    # llama.cpp writes through ctypes, as into a bytearray
    (ctypes.c_uint8 * 4).from_buffer(big, 8)[:] = [1, 2, 3, 4]
    assert big[8:12] == b"\x01\x02\x03\x04" and big[-1] == 7


def test_fit_keeps_a_large_enough_buffer_and_replaces_a_small_one() -> None:
    buf = host_buffer(MAPPED_BYTES)
    assert fit(buf, 100) is buf and fit(buf, MAPPED_BYTES) is buf
    bigger = fit(buf, MAPPED_BYTES * 2)
    assert bigger is not buf and len(bigger) == MAPPED_BYTES * 2
    assert len(fit(None, 10)) == 10


def test_a_pool_hands_out_what_was_given_back_keeping_the_largest() -> None:
    pool = BufferPool(keep=1)
    assert pool.take() == bytearray()  # nothing given back yet: fit() will size one
    small, large = bytearray(10), bytearray(1000)
    pool.give(small)
    pool.give(large)
    assert pool.take() is large  # only the largest is kept
    assert pool.take() == bytearray()


def test_a_pool_lends_the_smallest_kept_buffer_that_fits() -> None:
    """A pipelined restore holds two chunk buffers while a capture may hold a large one: a
    small request must not take the large buffer the next large request needs."""
    pool = BufferPool(keep=2)  # as GPU builds keep
    large, chunk_a, chunk_b = bytearray(1000), bytearray(100), bytearray(120)
    pool.give(large)
    pool.give(chunk_a)  # kept beside large
    assert pool.take(90) is chunk_a
    pool.give(chunk_a)
    pool.give(chunk_b)  # three given back: the smallest (chunk_a) is dropped
    assert pool.take(90) is chunk_b and pool.take(90) is large
    pool.give(large)
    assert pool.take(0) is large  # size unknown (a capture): the largest


class _LedgerPinner:
    """Keeps the set of registered buffers (the contract CudaPinner keeps with libcudart)."""

    def __init__(self) -> None:
        self.pinned: list[HostBuffer] = []

    def pin(self, buf: HostBuffer) -> bool:
        if not any(b is buf for b in self.pinned):
            self.pinned.append(buf)
        return True

    def unpin(self, buf: HostBuffer) -> None:
        self.pinned = [b for b in self.pinned if b is not buf]

    def stats(self) -> dict[str, int | bool]:
        return {"pinned": len(self.pinned)}


def test_a_pinning_pool_locks_what_it_keeps_and_unlocks_before_letting_go() -> None:
    ledger = _LedgerPinner()
    pool = BufferPool(keep=1, pinner=ledger)
    first = pool.take(MAPPED_BYTES)
    assert isinstance(first, mmap.mmap) and not ledger.pinned  # pinned only once kept
    pool.give(first)
    pool.settle()  # registration runs on its own thread
    assert ledger.pinned == [first]
    assert pool.take(100) is first  # still pinned while lent: its next copy is fast
    pool.give(first)
    # outgrown: the kept buffer is unlocked before a larger one replaces it
    second = pool.take(MAPPED_BYTES * 2)
    assert second is not first and ledger.pinned == []
    pool.give(second)
    # a second buffer given back while the first is lent: the smaller is dropped, unlocked
    lent = pool.take(10)
    other = host_buffer(MAPPED_BYTES)
    pool.give(other)
    pool.settle()
    assert ledger.pinned == [second, other]
    pool.give(lent)
    assert ledger.pinned == [second]
    # a buffer a state call outgrew (the caller retires it) and close both unlock
    pool.retire(pool.take(0))
    assert ledger.pinned == []
    pool.give(second)
    pool.clear()
    assert ledger.pinned == [] and pool.take() == bytearray()


def test_take_waits_for_a_registration_still_running() -> None:
    started, release = threading.Event(), threading.Event()

    class SlowPinner(_LedgerPinner):
        def pin(self, buf: HostBuffer) -> bool:
            started.set()
            release.wait(5)
            return super().pin(buf)

    ledger = SlowPinner()
    pool = BufferPool(keep=1, pinner=ledger)
    buf = host_buffer(MAPPED_BYTES)
    pool.give(buf)  # returns at once: the registration runs on its own thread
    assert started.wait(5) and ledger.pinned == []
    threading.Timer(0.05, release.set).start()
    assert pool.take(1) is buf and ledger.pinned == [buf]  # take waited for it


def test_small_buffers_are_not_pinned() -> None:
    ledger = _LedgerPinner()
    pool = BufferPool(keep=1, pinner=ledger)
    pool.give(bytearray(1000))
    assert ledger.pinned == []


def test_no_pinner_off_cuda_or_without_offloaded_kv() -> None:
    from skippy_llama.pinned import cuda_pinner

    assert cuda_pinner("CPU", kv_offloaded=True) is None
    assert cuda_pinner("Vulkan", kv_offloaded=True) is None
    assert cuda_pinner("CUDA", kv_offloaded=False) is None


def test_commit_keeps_a_mapped_buffers_bytes_and_refuses_bytearrays() -> None:
    from skippy_llama.hostmem import commit

    buf = host_buffer(MAPPED_BYTES * 2)
    assert isinstance(buf, mmap.mmap)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[::4096] = 5  # half written, half never touched
    arr[: MAPPED_BYTES // 2] = 9
    before = arr.copy()
    committed = commit(buf)
    assert (arr == before).all()  # MADV_POPULATE_WRITE changes no byte
    del arr
    if committed:
        buf.close()  # the buffer's export ended: it can be closed
    assert commit(bytearray(100)) is False
