"""Crash semantics of L3 with real processes: SIGKILL mid-record, a full disk mid-write.

The kill loop uses a model-free writer (:mod:`l3_crash_worker`) that writes synthetic records
through ``DiskTier`` — the real writer thread, payload writes, commit transaction, pins and
eviction at the 64 MiB floor — so that two dozen kills fit in a minute on a small machine; a real
model run killed mid-record closes the file. Every fresh process first reads every record that
may be stored (no repair before it: reads alone must be safe), then reconciles with digests.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from l3_crash_worker import check, settings
from test_l3_runtime import (
    PROMPTS,
    clean_env,
    l3_env,
    reference,
    run_worker,
    spawn_worker,
    start,
)

from skippy_llama.tiers.disk import DiskTier

__all__ = ["reference"]  # a fixture, used by the real-model test below

WORKER = Path(__file__).with_name("l3_crash_worker.py")
MiB = 1 << 20
#: Kills, and how many of them land at start-up (open, crash reconciliation, the check).
ROUNDS = 24
STARTUP_KILLS = (5, 11, 17, 23)


def spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return spawn_worker(WORKER, spec, clean_env())


def line(proc: subprocess.Popen[str], key: str) -> Any:
    """The next JSON line of ``proc`` (it must be the ``key`` one)."""
    assert proc.stdout is not None
    raw = proc.stdout.readline()
    if not raw:
        proc.wait(30)
        assert proc.stderr is not None
        pytest.fail(f"worker ended ({proc.returncode}) before {key!r}: {proc.stderr.read()}")
    return json.loads(raw)[key]


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def repairs(rec: dict[str, Any]) -> int:
    names = ("orphan_pages_removed", "stale_pins_removed", "manifests_removed", "index_fixed")
    return sum(int(rec[n]) for n in names) + int(rec["quarantined"])


def fresh_check(store: Path, log: Path, big: dict[int, int] | None = None) -> dict[str, Any]:
    """Open the store as a fresh tier in this process: read every record that may be stored
    (before any repair), then reconcile with digests twice. What a kill left must be at most
    orphans and stale pins, never a page whose bytes differ from what was committed."""
    with DiskTier(settings(str(store)), reconcile=False, close_at_exit=False) as tier:
        reads = check(tier, [int(x) for x in log.read_text().split()], big or {})
        first = tier.reconcile(verify=True).to_json()
        second = tier.reconcile(verify=True).to_json()
        state = tier.state
    return {"reads": reads, "first": first, "second": second, "state": state}


def unreferenced_files(store: Path) -> list[str]:
    """Value files on disk that no database row names (a write interrupted before its row)."""
    with sqlite3.connect(f"file:{store / 'cache.db'}?mode=ro", uri=True) as db:
        named = {row[0] for row in db.execute("SELECT filename FROM Cache WHERE filename NOT NULL")}
    on_disk = {str(path.relative_to(store)) for path in store.rglob("*.val") if path.is_file()}
    return sorted(on_disk - named)


@pytest.mark.slow
def test_sigkill_during_records_never_serves_a_half_written_page(tmp_path: Path) -> None:
    store, log = tmp_path / "l3", tmp_path / "attempted.log"
    rng = random.Random(20261204)
    kills = while_writing = repaired = 0
    for round_ in range(ROUNDS):
        proc = spawn({"dir": str(store), "log": str(log), "start": 1000 * round_})
        if round_ in STARTUP_KILLS:
            time.sleep(rng.uniform(0.05, 1.2))  # somewhere in import, open or the check
            kill(proc)
            kills += 1
            continue
        check = line(proc, "check")
        # a fresh process after a kill: active, and every page it serves is exactly the page
        # that was recorded (a half-written payload would differ, or fail its size/digest)
        assert check["state"] == "active" and check["wrong"] == 0, check
        assert line(proc, "ready") is True
        time.sleep(rng.choice([0.0, 0.002, 0.01, 0.03]) + rng.uniform(0.0, 0.4))
        kill(proc)
        kills += 1
        while_writing += 1
        if round_ % 2:
            continue  # the next worker reads this kill's store unrepaired (and walks it)
        after = fresh_check(store, log)
        assert after["state"] == "active" and after["reads"]["wrong"] == 0, after
        assert after["first"]["quarantined"] == 0, after  # nothing committed was damaged
        assert repairs(after["second"]) == 0, after  # and after one walk: consistent
        repaired += repairs(after["first"])
    assert kills >= 20 and while_writing >= 16
    assert repaired > 0  # the kills did land mid-record (stale pins, orphan pages)
    attempted = len(log.read_text().split())
    assert attempted > 2 * ROUNDS  # several records per writer: kills landed at varied points

    # the store keeps serving: a last process checks everything, writes and exits normally.
    # Its budget is one no eviction reaches: at the floor, the reuse policy may evict a page
    # seen once (these ten are) as soon as it is written, and whether the loop above filled
    # the store depends on the machine's disk speed.
    spec = {"dir": str(store), "log": str(log), "start": 99_000, "count": 10, "budget": "4GiB"}
    proc = spawn(spec)
    check = line(proc, "check")
    assert check["wrong"] == 0 and check["served"] > 0
    assert line(proc, "ready") is True
    done = line(proc, "done")
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert all(done["recorded"]) and done["state"] == "active"
    assert done["check"]["served"] == 2 * 10 and done["check"]["wrong"] == 0
    assert done["activity"]["internal_errors"] == 0


def test_a_full_disk_mid_write_turns_l3_read_only_and_corrupts_nothing(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel fail a value file's write with EFBIG part way through (no
    filesystem has to fill up): the store turns read-only, keeps serving, and nothing is left
    half-written for another process."""
    store, log = tmp_path / "l3", tmp_path / "attempted.log"
    proc = spawn({"dir": str(store), "log": str(log), "start": 0, "count": 6})
    line(proc, "check")
    line(proc, "ready")
    healthy = line(proc, "done")
    proc.communicate(timeout=60)
    assert healthy["state"] == "active" and all(healthy["recorded"])

    big = {"8": 8 * MiB}  # record 8's question page cannot be written under a 4 MiB limit
    spec = {"dir": str(store), "log": str(log), "start": 6, "count": 6, "fsize": 4 * MiB}
    proc = spawn({**spec, "big": big})
    check = line(proc, "check")
    assert check["wrong"] == 0 and check["served"] == 2 * 6
    line(proc, "ready")
    full = line(proc, "done")
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert full["state"] == "read_only_low_space"
    assert full["recorded"][:3] == [True, True, True]  # 6, 7, and 8 (queued, then failed)
    assert full["recorded"][3:] == [False, False, False]  # refused once read-only
    activity = full["activity"]
    assert activity["storage_errors"] >= 1 and activity["dropped_low_space"] >= 3
    assert activity["internal_errors"] == 0
    # requests are still served, exactly: records 6 and 7 whole, 8 to 11 up to their shared
    # document page (stored before)
    assert full["check"]["wrong"] == 0 and full["check"]["served"] == 2 + 2 + 4 * 1

    assert unreferenced_files(store) == []  # the partial value file did not stay behind
    after = fresh_check(store, log, {8: 8 * MiB})
    assert after["state"] == "active" and after["reads"]["wrong"] == 0  # room: writes again
    assert after["first"]["quarantined"] == 0 and repairs(after["second"]) == 0
    proc = spawn({"dir": str(store), "log": str(log), "start": 12, "count": 2})
    check = line(proc, "check")
    assert check["wrong"] == 0 and check["served"] == 2 * 6 + 2 + 2 + 4 * 1
    line(proc, "ready")
    done = line(proc, "done")
    proc.communicate(timeout=60)
    assert all(done["recorded"]) and done["check"]["served"] == 4


@pytest.mark.slow
@pytest.mark.model
def test_a_real_writer_killed_mid_record_leaves_a_store_that_serves_exactly(
    smollm2_path: Path, reference: list[str], tmp_path: Path
) -> None:
    store = tmp_path / "l3"
    proc = start(smollm2_path, l3_env(store), PROMPTS)
    database = store / "cache.db"
    deadline = time.monotonic() + 240
    payloads = 0
    while payloads == 0 and proc.poll() is None:  # the first payload row: mid-record
        assert time.monotonic() < deadline, "the worker wrote no page"
        time.sleep(0.01)
        if database.exists():
            try:
                with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=1) as db:
                    (payloads,) = db.execute(
                        "SELECT COUNT(*) FROM Cache WHERE key >= X'07' AND key < X'08'"
                    ).fetchone()
            except sqlite3.Error:
                payloads = 0  # the schema is being created
    assert proc.poll() is None, "the worker finished before it could be killed"
    kill(proc)

    after = run_worker(smollm2_path, l3_env(store), PROMPTS)
    assert after["outputs"] == reference[:3]  # equal to a cold run
    assert after["status"]["effective"]["state"] == "active"
    assert after["status"]["process_activity"]["corrupt_entries"] == 0
    again = run_worker(smollm2_path, l3_env(store), PROMPTS)
    assert again["outputs"] == reference[:3]
    assert again["events"][0]["tier"] == "l3" and again["events"][0]["cached_tokens"] > 0
