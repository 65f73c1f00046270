"""The load-time bus probe: what moving K/V bytes to where the cells live costs at best.

A page restore ends by copying its bytes from host memory into the KV cells: over PCIe on a
CUDA build with the cache offloaded, a memory copy on the CPU. No restore can be faster than
that copy, so the cost model plans a page tier it has not measured yet at this rate and starts
the tier's moving average from it (``costs.CostModel.observe_bus``): a process's first restore is
planned from what the hardware can do, and the one-time costs it alone pays do not make the
planner refuse the tier for good (issue 45: an H100's first L3 restore took 1.61× a cold
prefill and L3 was then refused for that prefix).

The probe copies ``PROBE_BYTES`` a few times and keeps the fastest: on the CPU one host buffer
into another (the first copy pays the page faults, the fastest does not); on CUDA builds a host
buffer (page-locked where the runtime pins its buffers) into device memory through libcudart.
The host copy runs on every build: its fastest copy is the host's rate (the passes a restore
from storage makes before the bus: read, verify), and its first copy less the fastest is what
committing fresh host memory costs (its page faults), to which a pinned probe adds the time
its registration took: a process's first restore pays both (``CostModel.observe_host``).
It runs once per process and kind of copy (:func:`bus_rate` keeps the answer): a few
milliseconds. Every failure is an unprobed bus (None), never an error: the cost model then
behaves as without a probe.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..costs import CostModel
from ..hostmem import HostBuffer, host_buffer
from ..pinned import load_cudart
from ..state import KVLayout

log = logging.getLogger("skippy_llama")

#: Bytes each probe copy moves. A copy that fits a core's caches runs faster than a restore's
#: (their last level can hold more: 260 MiB on this project's 2-core VM), so the rate is a floor
#: under restore costs, as the cost model uses it; larger copies cost the probe more in page
#: faults than in copying (4 MiB: ~5-9 ms in all there, at 13 GB/s; 64 MiB: 230 ms).
PROBE_BYTES = 4 << 20
#: Copies timed; the fastest counts (the first also pays the destination's page faults).
PROBE_REPEATS = 4
#: ``cudaMemcpyHostToDevice``
_HOST_TO_DEVICE = 1


@dataclass(frozen=True)
class BusRate:
    """The fastest of the probe's copies.

    Attributes:
        method: ``memcpy`` (host to host, the CPU's cells) or ``cuda_h2d`` / ``cuda_h2d_pinned``
            (host to device memory, from a pageable or a page-locked buffer).
        n_bytes: bytes one copy moved.
        seconds: the fastest copy's time.
        probe_s: the whole probe's time, allocations included (what loading paid).
        host_seconds: the fastest host-to-host copy of ``n_bytes`` (``seconds`` on the CPU).
        first_touch_seconds: committing ``n_bytes`` of fresh host memory: the host copy's
            page faults (its first copy less its fastest), plus registering them where the
            probe's buffer was pinned.
    """

    method: str
    n_bytes: int
    seconds: float
    probe_s: float
    host_seconds: float = 0.0
    first_touch_seconds: float = 0.0

    @property
    def seconds_per_byte(self) -> float:
        return self.seconds / self.n_bytes

    @property
    def gb_per_s(self) -> float:
        """Decimal gigabytes per second, as bus figures are quoted."""
        return self.n_bytes / self.seconds / 1e9

    @property
    def host_gb_per_s(self) -> float | None:
        return self.n_bytes / self.host_seconds / 1e9 if self.host_seconds > 0 else None

    def to_json(self) -> dict[str, float | int | str | None]:
        host = self.host_gb_per_s
        return {
            "method": self.method,
            "bytes": self.n_bytes,
            "copy_s": round(self.seconds, 6),
            "gb_per_s": round(self.gb_per_s, 2),
            "probe_s": round(self.probe_s, 6),
            "host_gb_per_s": round(host, 2) if host is not None else None,
            "first_touch_s": round(self.first_touch_seconds, 6),
        }


_probed: dict[tuple[str, bool, bool], BusRate | None] = {}
_lock = threading.Lock()


def bus_rate(backend: str, *, kv_offloaded: bool, pinned: bool) -> BusRate | None:
    """The bus's rate for a context whose K/V lives on ``backend`` (in device memory when
    ``kv_offloaded``), copied from page-locked buffers when ``pinned``: probed on the first
    call for these three, then the kept answer (None: the probe failed).
    """
    device = backend == "CUDA" and kv_offloaded
    key = (backend if device else "host", device, pinned and device)
    with _lock:
        if key not in _probed:
            _probed[key] = _probe(device=device, pinned=pinned and device)
        return _probed[key]


def forget() -> None:
    """Drop the kept answers (tests, and benchmarks that measure the probe itself)."""
    with _lock:
        _probed.clear()


def _probe(*, device: bool, pinned: bool) -> BusRate | None:
    started = time.perf_counter()
    try:
        host = _timed("memcpy", _memcpy_copier(), started)
        if device:
            rate = _cuda_probe(pinned)
            if rate is not None:
                return dataclasses.replace(
                    rate,
                    host_seconds=host.seconds,
                    first_touch_seconds=host.first_touch_seconds + rate.first_touch_seconds,
                    probe_s=time.perf_counter() - started,
                )
        return dataclasses.replace(host, probe_s=time.perf_counter() - started)
    except Exception as exc:  # a probe never fails a load
        log.warning("skippy-llama: the bus probe failed (%s); restores are planned unprobed", exc)
        return None


def _timed(method: str, copy: Callable[[], None], started: float, pin_s: float = 0.0) -> BusRate:
    """``copy`` timed ``PROBE_REPEATS`` times: the fastest is the rate; on the host, the first
    less the fastest is the page faults of the copy's fresh destination."""
    times = []
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    best = max(min(times), 1e-9)
    faults = max(times[0] - best, 0.0) if method == "memcpy" else 0.0
    return BusRate(
        method,
        PROBE_BYTES,
        best,
        time.perf_counter() - started,
        host_seconds=best if method == "memcpy" else 0.0,
        first_touch_seconds=faults + pin_s,
    )


def _memcpy_copier() -> Callable[[], None]:
    src = np.frombuffer(host_buffer(PROBE_BYTES), dtype=np.uint8)[:PROBE_BYTES]
    dst = np.frombuffer(host_buffer(PROBE_BYTES), dtype=np.uint8)[:PROBE_BYTES]
    src.fill(1)  # written: reading untouched pages would read the kernel's one zero page

    def copy() -> None:
        np.copyto(dst, src)

    return copy


def _cuda_probe(pinned: bool) -> BusRate | None:
    """Host-to-device copies through libcudart (None where it cannot be loaded or refuses)."""
    cudart = load_cudart()
    if cudart is None or not hasattr(cudart, "cudaMalloc"):
        return None
    malloc, memcpy, free = cudart.cudaMalloc, cudart.cudaMemcpy, cudart.cudaFree
    malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    free.argtypes = [ctypes.c_void_p]
    for fn in (malloc, memcpy, free):
        fn.restype = ctypes.c_int
    started = time.perf_counter()
    buf: HostBuffer = host_buffer(PROBE_BYTES)
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:PROBE_BYTES] = 1
    handle = ctypes.c_char.from_buffer(buf)
    src = ctypes.addressof(handle)
    registered = False
    dst = ctypes.c_void_p()
    try:
        pin_s = 0.0
        if pinned:
            register = cudart.cudaHostRegister
            register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            register.restype = ctypes.c_int
            t0 = time.perf_counter()
            registered = int(register(src, PROBE_BYTES, 1)) == 0
            # a first restore into buffers pinned on demand waits for this much per byte
            pin_s = time.perf_counter() - t0 if registered else 0.0
        if int(malloc(ctypes.byref(dst), PROBE_BYTES)) != 0 or not dst.value:
            return None
        try:
            failed: list[int] = []

            def copy() -> None:
                rc = int(memcpy(dst, src, PROBE_BYTES, _HOST_TO_DEVICE))
                if rc:
                    failed.append(rc)

            rate = _timed("cuda_h2d_pinned" if registered else "cuda_h2d", copy, started, pin_s)
            return None if failed else rate
        finally:
            free(dst)
    finally:
        if registered:
            cudart.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            cudart.cudaHostUnregister(src)
        del handle


def seed_costs(
    costs: CostModel, layout: KVLayout | None, backend: str, *, kv_offloaded: bool, pinned: bool
) -> BusRate | None:
    """Probe the bus where pages may be restored (a pageable ``layout``) and plan page tiers
    not yet measured at its rate (``CostModel.observe_bus``), with the host's copy and first-touch
    rates for a first restore (``CostModel.observe_host``); the rate, or None."""
    if layout is None or not layout.pageable:
        return None
    rate = bus_rate(backend, kv_offloaded=kv_offloaded, pinned=pinned)
    if rate is not None:
        costs.observe_bus(rate.n_bytes, rate.seconds)
        if rate.host_seconds > 0:
            costs.observe_host(rate.n_bytes, rate.host_seconds, rate.first_touch_seconds)
    return rate
