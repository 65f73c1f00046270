"""The background writer: a bounded queue of records and the one thread that writes them.

Records are queued without touching the disk (the request path never waits on it) and dropped,
counted, when the queue or the bytes it holds are full. A record's new pages may still be views
of the runtime's capture (:class:`~..records.PendingPayload`): the writer cuts them, then
releases the capture buffer back to the runtime. While a record waits, its new pages are
visible to planning (:meth:`Writer.queued` / :meth:`Writer.queued_children`), so a record planned
right after another reuses its pages instead of writing the shared tokens again.

A page in flight stays servable (SGLang HiCache's rule: a prefix leaving the faster tier is
readable until its copy in the slower one is written). While its record waits in the queue, the
page is made from the capture it would be cut from (:meth:`Writer.read_waiting`, under the lock
the writer takes a record with, so the capture is never released mid-read); once the writer has
taken the record, a lookup waits for the write to end (:meth:`Writer.wait_written`) and reads
the store. So a lookup racing a write is a hit, never a cold prefill.

The same queue and thread run jobs (:meth:`Writer.job`): work that must leave the request path
and happen after the records queued before it, such as pushing a restore point to the remote
tier after L3 stored it. Jobs share the queue's bounds: a full queue refuses one, and its caller
counts the drop. :func:`job_writer` makes a writer with no store behind it, for jobs only (the
remote tier's pushes where there is no L3).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ...config import L3Settings
from ..records import PageBlob, PrefixRecord
from .auth import Signer
from .context import Parts
from .health import Health
from .stats import Counters

GiB = 1 << 30
#: Records waiting for the writer may hold at most this many payload bytes in RAM.
MAX_QUEUED_BYTES = 1 * GiB
#: How often the idle writer wakes for housekeeping.
IDLE_POLL_S = 0.25
#: The pause between two batches of a housekeeping job that has more to do (a reconciliation
#: walk): short, so a 50k-page walk ends in seconds, but a pause, so queued records go first.
BUSY_POLL_S = 0.005
#: The longest a lookup waits for the write of a record it needs (:meth:`Writer.wait_written`):
#: a write that takes longer (a store lock held by another process) is left, and the pages it
#: would have served are a miss.
WRITE_WAIT_S = 5.0


@dataclass(eq=False)
class _Queued:
    """A record (or a job: ``run``) in the queue; ``taken`` once the writer thread started
    writing it (from then on its capture may be released at any moment and is never read
    here). ``size``: the bytes it holds in RAM while it waits."""

    rec: PrefixRecord | None
    taken: bool = False
    new: dict[bytes, PageBlob] = field(default_factory=dict)  # its new pages by key
    run: Callable[[], object] | None = None
    size: int = 0


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
        name: str = "skippy-l3-writer",
    ) -> None:
        self.parts = parts
        self.name = name
        self._write = write
        self._idle = idle
        self._max_bytes = max_queued_bytes
        # None is the stop signal (stop() wakes the writer instead of waiting for its poll)
        self._queue: queue.Queue[_Queued | None] = queue.Queue(maxsize=parts.settings.writer_queue)
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # notified as each record leaves
        self._bytes = 0
        self._pages: dict[bytes, list[_Queued]] = {}  # new pages of queued records -> records
        self._kids: dict[bytes, dict[bytes, bytes]] = {}  # their child index
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def record(self, rec: PrefixRecord) -> bool:
        """Queue ``rec``; False (counted) when the queue or its byte bound is full."""
        new = {p.key: p for p in rec.pages if p.payload is not None}
        item = _Queued(rec, new=new, size=rec.payload_bytes)
        with self._lock:
            if not self._put(item):
                rec.drop()
                self.parts.counters.add("dropped_writes")
                self.parts.counters.add("dropped_queue_full")
                return False
            for page in item.new.values():
                self._pages.setdefault(page.key, []).append(item)
                self._kids.setdefault(page.parent, {})[page.key] = page.tokens
        self.start()
        return True

    def job(self, run: Callable[[], object], nbytes: int) -> bool:
        """Queue ``run`` to be called on the writer thread after the records and jobs queued
        before it; ``nbytes``: what it holds in RAM until then, charged to the queue's byte
        bound. False, and nothing queued, when the queue or that bound is full or the thread
        is stopped (the caller counts the drop; the request path never waits). ``run`` must
        not raise: an exception is a bug, logged and counted (``internal_errors``)."""
        if self._stop.is_set():
            return False
        with self._lock:
            if not self._put(_Queued(None, run=run, size=nbytes)):
                return False
        self.start()
        return True

    def _put(self, item: _Queued) -> bool:
        """Queue ``item`` within the queue's length and byte bounds (called under the lock);
        False, and nothing queued, when either is full."""
        if self._bytes + item.size > self._max_bytes:
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        self._bytes += item.size
        return True

    def queued(self, key: bytes) -> bool:
        """True when page ``key`` belongs to a record waiting for the writer."""
        return key in self._pages

    def queued_children(self, parent: bytes) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return list(self._kids.get(parent, {}).items())

    def read_waiting(self, keys: Sequence[bytes]) -> tuple[list[bytes], bool]:
        """The bytes of the leading ``keys`` that are new pages of records still waiting in the
        queue, made from their captures; and whether the next key belongs to a record the
        writer is writing now (:meth:`wait_written` for it, then read the store). A page that
        cannot be made at its announced size (a bug in the cutting, logged) ends the prefix.
        """
        out: list[bytes] = []
        with self._lock:  # the writer takes a record under this lock: no capture is released
            for key in keys:
                holders = self._pages.get(key)
                if not holders:
                    return out, False
                waiting = next((q for q in holders if not q.taken), None)
                if waiting is None:
                    return out, True
                try:
                    out.append(waiting.new[key].data)
                except ValueError as exc:
                    self.parts.health.fault(exc, "read")
                    return out, False
        return out, False

    def _writing(self, keys: Sequence[bytes]) -> bool:
        """Whether a page of ``keys`` is new only in records the writer has taken (lock held)."""
        return any(
            holders and all(q.taken for q in holders)
            for holders in (self._pages.get(key) for key in keys)
        )

    def wait_written(self, keys: Sequence[bytes], timeout: float = WRITE_WAIT_S) -> bool:
        """Wait until no page of ``keys`` is only in a record being written; False on timeout
        (or when the thread is gone)."""
        deadline = time.monotonic() + timeout
        with self._written:
            while self._writing(keys):
                remaining = deadline - time.monotonic()
                thread = self._thread
                if remaining <= 0 or thread is None or not thread.is_alive():
                    return False
                self._written.wait(min(remaining, 0.1))
        return True

    def _take(self, item: _Queued) -> None:
        with self._lock:
            item.taken = True

    def _unqueue(self, item: _Queued) -> None:
        with self._written:
            self._bytes -= item.size
            for page in item.new.values():
                holders = self._pages.get(page.key, [])
                if item in holders:
                    holders.remove(item)
                if not holders:
                    self._pages.pop(page.key, None)
                    kids = self._kids.get(page.parent, {})
                    kids.pop(page.key, None)
                    if not kids:
                        self._kids.pop(page.parent, None)
            self._written.notify_all()

    def start(self) -> None:
        """Start the thread (idempotent; not after :meth:`stop`)."""
        if self._thread is not None or self._stop.is_set():
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        lower_thread_priority(self.parts.settings.writer_nice)
        busy = False
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=BUSY_POLL_S if busy else IDLE_POLL_S)
            except queue.Empty:
                busy = self._housekeeping()
                continue
            if item is None:
                self._queue.task_done()
                break
            self._take(item)  # before cutting: lookups stop reading its capture
            try:
                if item.rec is not None:
                    self._write(item.rec)
                elif item.run is not None:
                    item.run()
            except Exception as exc:  # the thread must not die; bugs are logged as errors
                self.parts.health.fault(exc, "record" if item.rec is not None else "job")
                if item.rec is not None:
                    self.parts.counters.add("dropped_writes")
            finally:
                if item.rec is not None:
                    item.rec.drop()  # the capture's buffer, where the write stopped before cutting
                self._unqueue(item)
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


def job_writer(
    name: str, *, queue_size: int = 64, nice: int = 10, max_queued_bytes: int = MAX_QUEUED_BYTES
) -> Writer:
    """A writer with no store behind it, for :meth:`Writer.job` only (records are refused
    there: it has nothing to write them to): the same bounded queue and low-priority thread as
    L3's, for background work of a process that runs without L3."""
    settings = L3Settings(writer_queue=queue_size, writer_nice=nice)
    counters = Counters()
    parts = Parts(settings, Health(settings, counters), counters, Signer(None))

    def no_record(rec: PrefixRecord) -> None:
        raise RuntimeError("a job writer has no store for records (a bug)")

    return Writer(parts, no_record, lambda: False, max_queued_bytes=max_queued_bytes, name=name)
