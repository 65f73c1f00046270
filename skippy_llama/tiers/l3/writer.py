"""The background writer: a bounded queue of records and the one thread that writes them.

Records are queued without touching the disk (the request path never waits on it) and dropped,
counted, when the queue or the bytes it holds are full. A record's new pages may still be views
of the runtime's capture (:class:`~..records.PendingPayload`): the writer cuts them, then
releases the capture buffer back to the runtime. While a record waits, its new pages are
visible to planning (:meth:`Writer.queued` / :meth:`Writer.queued_children`), so a record planned
right after another reuses its pages instead of writing the shared tokens again.

When idle the thread runs the tier's housekeeping (storing hits and counters, a batch of
reconciliation). A storage fault while writing drops the record and is counted; an exception of
any other kind is a bug and is logged as an error (``health.fault`` tells them apart).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

from ..records import PrefixRecord
from .context import Parts

GiB = 1 << 30
#: Records waiting for the writer may hold at most this many payload bytes in RAM.
MAX_QUEUED_BYTES = 1 * GiB
#: How often the idle writer wakes for housekeeping.
IDLE_POLL_S = 0.25
#: The pause between two batches of a housekeeping job that has more to do (a reconciliation
#: walk): short, so a 50k-page walk ends in seconds, but a pause, so queued records go first.
BUSY_POLL_S = 0.005


def lower_thread_priority(nice: int) -> bool:
    """Lower the calling thread's scheduling priority by ``nice``; True when it was lowered.

    The writer compresses and writes while the caller's next request decodes: on a machine with
    few cores, at the same priority it takes CPU time from llama.cpp's threads. Linux schedules
    threads separately (``setpriority`` on a thread id touches that thread only); elsewhere
    this does nothing rather than renice the whole process.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        return False
    return True


class Writer:
    """Queue and thread; ``write`` writes one record, ``idle`` does a unit of housekeeping and
    says whether more is pending."""

    def __init__(
        self,
        parts: Parts,
        write: Callable[[PrefixRecord], None],
        idle: Callable[[], bool],
        *,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self.parts = parts
        self._write = write
        self._idle = idle
        self._max_bytes = max_queued_bytes
        # None is the stop signal (stop() wakes the writer instead of waiting for its poll)
        self._queue: queue.Queue[PrefixRecord | None] = queue.Queue(
            maxsize=parts.settings.writer_queue
        )
        self._lock = threading.Lock()
        self._bytes = 0
        self._pages: Counter[bytes] = Counter()  # new pages of queued records -> records
        self._kids: dict[bytes, dict[bytes, bytes]] = {}  # their child index
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def record(self, rec: PrefixRecord) -> bool:
        """Queue ``rec``; False (counted) when the queue or its byte bound is full."""
        size = rec.payload_bytes
        with self._lock:
            full = self._bytes + size > self._max_bytes
            if not full:
                try:
                    self._queue.put_nowait(rec)
                except queue.Full:
                    full = True
            if full:
                rec.drop()
                self.parts.counters.add("dropped_writes")
                self.parts.counters.add("dropped_queue_full")
                return False
            self._bytes += size
            for page in rec.pages:
                if page.payload is not None:
                    self._pages[page.key] += 1
                    self._kids.setdefault(page.parent, {})[page.key] = page.tokens
        self.start()
        return True

    def queued(self, key: bytes) -> bool:
        """True when page ``key`` belongs to a record waiting for the writer."""
        return key in self._pages

    def queued_children(self, parent: bytes) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return list(self._kids.get(parent, {}).items())

    def _unqueue(self, rec: PrefixRecord) -> None:
        with self._lock:
            self._bytes -= rec.payload_bytes
            for page in rec.pages:
                if page.payload is None:
                    continue
                self._pages[page.key] -= 1
                if self._pages[page.key] <= 0:
                    del self._pages[page.key]
                    kids = self._kids.get(page.parent, {})
                    kids.pop(page.key, None)
                    if not kids:
                        self._kids.pop(page.parent, None)

    def start(self) -> None:
        """Start the thread (idempotent; not after :meth:`stop`)."""
        if self._thread is not None or self._stop.is_set():
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="skippy-l3-writer", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        lower_thread_priority(self.parts.settings.writer_nice)
        busy = False
        while not self._stop.is_set():
            try:
                rec = self._queue.get(timeout=BUSY_POLL_S if busy else IDLE_POLL_S)
            except queue.Empty:
                busy = self._housekeeping()
                continue
            if rec is None:
                self._queue.task_done()
                break
            try:
                self._write(rec)
            except Exception as exc:  # the thread must not die; bugs are logged as errors
                self.parts.health.fault(exc, "record")
                self.parts.counters.add("dropped_writes")
            finally:
                rec.drop()  # the capture's buffer, where the write stopped before cutting
                self._unqueue(rec)
                self._queue.task_done()
            busy = self._housekeeping()

    def _housekeeping(self) -> bool:
        """One unit of housekeeping; True when more is pending."""
        try:
            return self._idle()
        except Exception as exc:
            self.parts.health.fault(exc, "housekeeping")
            return False

    def flush(self, timeout: float) -> bool:
        """Wait until the queued records are written; False on timeout (or no thread)."""
        deadline = time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                thread = self._thread
                if remaining <= 0 or thread is None or not thread.is_alive():
                    return False
                done.wait(min(remaining, 0.1))
        return True

    def stop(self) -> None:
        """Stop the thread after the record it is writing (call :meth:`flush` first)."""
        self._stop.set()
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._thread.join(timeout=2.0)
