"""Host buffers for KV bytes: small ones are bytearrays, large ones lazily zeroed mappings."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from skippy_llama.hostmem import MAPPED_BYTES, BufferPool, fit, host_buffer


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
