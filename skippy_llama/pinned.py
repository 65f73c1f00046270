"""Page-locked host buffers for state calls on CUDA builds (``cudaHostRegister``).

A capture (``llama_state_seq_get_data``) or a restore (``set_data``) on a CUDA build copies each
layer's K and V between VRAM and a host buffer. From pageable memory the driver stages every
copy through a small pinned bounce buffer of its own; from a registered (page-locked) buffer it
copies by DMA. Measured on an H100 (``benchmarks/experiments/pinned_probe.py``, a 1.1B F16 llama, all
layers offloaded, the same anonymous mapping before and after registering): a capture of 8k
tokens took 19.5 ms pageable and 4.3 ms pinned, a restore 27.3 and 6.2 ms; at 32k tokens 81.6 /
15.8 ms and 120 / 32 ms. Registering cost 53-62 ms (about one pageable capture) and
unregistering 4-20 ms, so only buffers that are used again are worth it:
:class:`~skippy_llama.hostmem.BufferPool` registers a buffer when it keeps one and unregisters
it before dropping it.

Registered memory stays resident (it cannot be swapped), so only the pool's kept buffers are
registered (two at most: a pipelined restore's chunk buffers, or one of them and the largest
capture or whole restore), L2's host arena and the two staging arenas a restore of L3 pages
copies through (``runtime/arena_setup.py``), never the L3 reader's per-thread buffers. Every failure (no CUDA
runtime, a refused registration) leaves the buffer pageable: pinning only ever changes how fast
a copy is, never what is copied.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from pathlib import Path

from .hostmem import HostBuffer

log = logging.getLogger("skippy_llama")

#: ``cudaHostRegisterPortable``: pinned for every CUDA context, not only the calling thread's
#: (llama.cpp may drive several devices, each from its own context).
_PORTABLE = 1


def _address(buf: HostBuffer) -> int:
    # the ctypes view exports the buffer only for this call: the mapping stays closable
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


class CudaPinner:
    """:class:`Pinner` on libcudart's ``cudaHostRegister`` / ``cudaHostUnregister``.

    Thread-safe: the pool registers on threads of its own and unregisters on the request or the
    L3 writer's thread. The first refused registration turns pinning off for the process (it
    means locked memory ran out, and every later one would fail the same way, paying the call).
    """

    def __init__(self, cudart: ctypes.CDLL) -> None:
        self._register = cudart.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = cudart.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._pinned: dict[int, int] = {}  # id(buffer) -> its registered address
        self._lock = threading.Lock()
        self.refused = False
        self.registered = 0
        self.unregistered = 0

    def pin(self, buf: HostBuffer) -> bool:
        with self._lock:
            if id(buf) in self._pinned:
                return True
            if self.refused or len(buf) == 0:
                return False
            address = _address(buf)
            rc = int(self._register(address, len(buf), _PORTABLE))
            if rc != 0:
                self.refused = True
                log.warning(
                    "skippy-llama: cudaHostRegister refused %d bytes (error %d); host buffers stay "
                    "pageable for this process (state copies are slower, not different)",
                    len(buf),
                    rc,
                )
                return False
            self._pinned[id(buf)] = address
            self.registered += 1
            return True

    def unpin(self, buf: HostBuffer) -> None:
        with self._lock:
            address = self._pinned.pop(id(buf), None)
            if address is not None:
                self._unregister(address)
                self.unregistered += 1

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            return {
                "pinned": len(self._pinned),
                "registered": self.registered,
                "unregistered": self.unregistered,
                "refused": self.refused,
            }


def load_cudart() -> ctypes.CDLL | None:
    """libcudart as llama.cpp's CUDA backend loaded it, or None (a CPU build; also what
    ``benchmarks/experiments/pinned_probe.py`` registers its buffers with)."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    names = [str(p) for p in sorted(lib_dir.glob("libcudart.so*"))]
    names += ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
    names.append(ctypes.util.find_library("cudart") or "")
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "cudaHostRegister") and hasattr(lib, "cudaHostUnregister"):
            return lib
    return None


def cuda_pinner(backend: str, kv_offloaded: bool) -> CudaPinner | None:
    """A :class:`CudaPinner` where state copies cross PCIe (a CUDA build with K/V on the GPU),
    else None (CPU, Metal's unified memory, Vulkan: nothing to register with)."""
    if backend != "CUDA" or not kv_offloaded:
        return None
    cudart = load_cudart()
    if cudart is None:
        log.info("skippy-llama: no libcudart beside the CUDA backend; host buffers stay pageable")
        return None
    return CudaPinner(cudart)
