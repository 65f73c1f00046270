"""Large host buffers for KV bytes: restore blobs, captures and L3 read buffers.

``bytearray(n)`` zero-fills all ``n`` bytes on the calling thread before anything is written:
for the 720 MB of a 32k-token prefix of a 1B model that is hundreds of milliseconds of page
faults on one core, paid again by every fresh buffer. An anonymous mapping costs nothing until
it is written; the kernel then supplies zeroed pages where they are first touched, by the pool
threads that fill the buffer in parallel.

Huge pages (``MADV_HUGEPAGE``, one fault per 2 MiB) are not asked for: where memory is
fragmented the kernel compacts it inside the fault (``defrag=madvise``, the common default). On
this 2-core machine a fresh SmolLM2 process's first L3 restore of 3,500 tokens took 46-49 ms
with 4 KiB pages, 66-86 ms with ``bytearray`` buffers and 180-209 ms with huge pages, and its
first capture 115-137 / 109-125 / 219-263 ms (``bench_gpu.py --buffers``, see
benchmarks/experiments/NOTEBOOK.md). On the freshly started H200 host huge pages made a 720 MB L3 restore 2.6×
faster than ``bytearray`` buffers; 4 KiB pages were not measured there.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import threading
from typing import Any, Protocol

#: What the runtime and the tiers fill with KV bytes and hand to llama.cpp (writable buffers).
HostBuffer = bytearray | mmap.mmap


class Pinner(Protocol):
    """Registers host buffers with a device runtime (``pinned.py`` holds the CUDA one)."""

    def pin(self, buf: HostBuffer) -> bool:
        """Page-lock ``buf``; True when it is (or already was) registered."""
        ...

    def unpin(self, buf: HostBuffer) -> None:
        """Undo :meth:`pin` (nothing when ``buf`` is not registered). Must precede freeing it."""
        ...

    def stats(self) -> dict[str, int | bool]:
        """Counts for ``cache_status``: buffers pinned now, registered and unregistered so far,
        and whether a registration was refused."""
        ...


#: Below this a mapping is not worth its system calls: a plain ``bytearray``.
MAPPED_BYTES = 4 << 20
#: Ask for transparent huge pages (see the module docstring; ``bench_gpu.py --buffers huge``).
HUGE_PAGES = False


def host_buffer(size: int) -> HostBuffer:
    """A writable buffer of at least ``size`` bytes, zeroed lazily (see the module docstring)."""
    if size < MAPPED_BYTES:
        return bytearray(size)
    flags = getattr(mmap, "MAP_PRIVATE", None)
    buf = mmap.mmap(-1, size) if flags is None else mmap.mmap(-1, size, flags=flags)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and HUGE_PAGES:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            buf.madvise(advice)
    return buf


#: ``MADV_POPULATE_WRITE`` (Linux 5.14): commit pages writable without changing their bytes.
#: Python 3.11's ``mmap`` does not name it.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@functools.cache
def madvise_call() -> Any:
    """libc's ``madvise`` through ctypes (which lets the GIL go while the kernel works, unlike
    ``mmap.madvise``). Raises OSError or AttributeError where there is none."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def commit(buf: HostBuffer) -> bool:
    """Commit a mapped buffer's memory now (``MADV_POPULATE_WRITE``: its bytes stay as they
    are), so that the thread that first writes it later takes no page faults; False where the
    kernel cannot (before 5.14) or ``buf`` is a ``bytearray`` (zero-filled, so committed, when
    made). Never raises."""
    if not isinstance(buf, mmap.mmap) or len(buf) == 0:
        return False
    try:
        madvise = madvise_call()
    except (OSError, AttributeError):
        return False
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    try:
        return int(madvise(ctypes.addressof(view), len(buf), MADV_POPULATE_WRITE)) == 0
    finally:
        del view  # the buffer's export ends here: it can be closed again


def fit(buf: HostBuffer | None, size: int) -> HostBuffer:
    """``buf`` when it holds ``size`` bytes, else a fresh :func:`host_buffer` of ``size`` (the
    caller keeps the larger one, e.g. through ``memoryview.obj``)."""
    return buf if buf is not None and len(buf) >= size else host_buffer(size)


class BufferPool:
    """Host buffers passed between threads: :meth:`take` one, :meth:`give` it back when done.

    The runtime captures a record into a buffer and hands it to the L3 writer, which cuts the
    pages out of it later; the next capture or restore must not write into it meanwhile. A
    pipelined restore holds two at once: the chunk being imported and the next one being
    assembled (GPU builds keep two for it). The pool keeps the ``keep`` largest buffers given
    back, so in the steady state a process reuses warm buffers (written again without page
    faults) instead of mapping fresh ones.

    With a ``pinner`` (CUDA builds, :mod:`skippy_llama.pinned`) the buffers the pool keeps are
    page-locked, so their next state copy runs at DMA speed, and are unlocked before the pool
    lets go of them (:meth:`retire`, :meth:`clear`). Registering a buffer costs about as much as
    one pageable copy of it (~60 ms for 720 MB on an H100), so it runs on a thread of its own
    after :meth:`give`, off the request that gave the buffer back; :meth:`take` waits for it
    only when the next request comes sooner.
    """

    def __init__(self, keep: int = 1, pinner: Pinner | None = None) -> None:
        self._keep = keep
        self._free: list[HostBuffer] = []
        self._lock = threading.Lock()
        self.pinner = pinner
        self._locked: set[int] = set()  # id() of kept buffers handed to the pinner
        self._pinning: dict[int, threading.Thread] = {}  # id() -> its registration, running

    def take(self, size: int = 0) -> HostBuffer:
        """The smallest kept buffer that holds ``size`` bytes (the largest when ``size`` is 0),
        else a fresh one of ``size`` (the largest kept one, too small, is retired); an empty
        one when ``size`` is 0 and none is kept (:func:`fit` replaces it)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= size]
            # the list is largest first: the last that fits is the smallest
            at = fits[-1] if fits and size else 0
            buf = self._free.pop(at) if self._free else None
        if buf is not None and len(buf) >= size:
            self._settle(buf)  # a state copy must not race the buffer's registration
            return buf
        if buf is not None:
            self.retire(buf)
        return host_buffer(size) if size else bytearray()

    def give(self, buf: HostBuffer) -> None:
        """Return ``buf``: its owner no longer reads or writes it."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)
            dropped = self._free[self._keep :]
            del self._free[self._keep :]
            pin = (
                self.pinner is not None
                and len(buf) >= MAPPED_BYTES
                and id(buf) not in self._locked
                and any(b is buf for b in self._free)
            )
            if pin:
                assert self.pinner is not None
                job = threading.Thread(
                    target=self.pinner.pin, args=(buf,), name="skippy-pin", daemon=True
                )
                self._locked.add(id(buf))
                self._pinning[id(buf)] = job
                job.start()
        for old in dropped:
            self.retire(old)

    def retire(self, buf: HostBuffer) -> None:
        """Let go of ``buf`` (taken and not given back): unlocked first when it was pinned."""
        self._settle(buf)
        if self.pinner is not None:
            with self._lock:
                self._locked.discard(id(buf))
            self.pinner.unpin(buf)

    def clear(self) -> None:
        """Drop every kept buffer (on close)."""
        with self._lock:
            dropped, self._free = self._free, []
        for old in dropped:
            self.retire(old)

    def settle(self) -> None:
        """Wait for every registration still running."""
        with self._lock:
            jobs = list(self._pinning.values())
            self._pinning.clear()
        for job in jobs:
            job.join()

    def _settle(self, buf: HostBuffer) -> None:
        with self._lock:
            job = self._pinning.pop(id(buf), None)
        if job is not None:
            job.join()
