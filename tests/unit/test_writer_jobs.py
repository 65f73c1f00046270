"""Jobs on the background writer (``Writer.job``, ``job_writer``): what the remote tier's restore
point pushes run on. In order, bounded by count and bytes (a full queue refuses at once), a
failing job is counted and the thread goes on, flush waits, a stopped writer refuses."""

from __future__ import annotations

import threading
from pathlib import Path

from skippy_llama.config import L3Settings
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.l3.writer import job_writer


def test_jobs_run_in_order_within_their_bounds() -> None:
    writer = job_writer("test-jobs", queue_size=2, max_queued_bytes=100)
    started, gate = threading.Event(), threading.Event()
    ran: list[int] = []

    def hold() -> None:
        started.set()
        gate.wait(60)

    try:
        assert writer.job(hold, 0) and started.wait(60)  # the thread is busy from here
        assert writer.job(lambda: ran.append(1), 60)
        assert not writer.job(lambda: ran.append(9), 50)  # 60 + 50 bytes > 100
        assert writer.job(lambda: ran.append(2), 40)
        assert not writer.job(lambda: ran.append(9), 0)  # two waiting: the queue is full
        gate.set()
        assert writer.flush(60)
        assert ran == [1, 2]
        # a bug in a job is counted and logged; the next job runs
        assert writer.job(lambda: 1 / 0, 0) and writer.job(lambda: ran.append(3), 0)
        assert writer.flush(60)
        assert ran == [1, 2, 3]
        assert writer.parts.counters.get("internal_errors") == 1
        assert writer.parts.counters.get("dropped_writes") == 0  # jobs are not L3's records
    finally:
        gate.set()
        writer.stop()
    assert not writer.job(lambda: ran.append(4), 0)  # stopped: refused, never run
    assert ran == [1, 2, 3]


def test_l3_defers_jobs_to_its_writer_and_refuses_once_closed(tmp_path: Path) -> None:
    settings = L3Settings(mode="fixed", budget="1GiB", directory=tmp_path, minimum_free="1GiB")
    tier = DiskTier(settings, disk_free=lambda _: 64 << 30)
    ran: list[str] = []
    try:
        assert tier.defer(lambda: ran.append(threading.current_thread().name), 10)
        assert tier.flush()
        assert ran == ["skippy-l3-writer"]
    finally:
        tier.close()
    assert not tier.defer(lambda: ran.append("late"), 10)
    assert ran == ["skippy-l3-writer"]
