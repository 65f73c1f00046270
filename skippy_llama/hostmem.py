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
benchmarks/README.md). On the freshly started H200 host huge pages made a 720 MB L3 restore 2.6×
faster than ``bytearray`` buffers; 4 KiB pages were not measured there.
"""

from __future__ import annotations

import contextlib
import mmap

#: What the runtime and the tiers fill with KV bytes and hand to llama.cpp (writable buffers).
HostBuffer = bytearray | mmap.mmap

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


def fit(buf: HostBuffer | None, size: int) -> HostBuffer:
    """``buf`` when it holds ``size`` bytes, else a fresh :func:`host_buffer` of ``size`` (the
    caller keeps the larger one, e.g. through ``memoryview.obj``)."""
    return buf if buf is not None and len(buf) >= size else host_buffer(size)
