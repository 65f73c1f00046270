"""``kv-cache status|prune|clear`` on a damaged store, through the real CLI in a subprocess.

Rows are planted with ``sqlite3`` into the real diskcache database, as a crash, a disk error, an
older or newer release, or another user would leave them: manifests that are not JSON, untyped
JSON lists (the first release's format), a foreign version, wrong types, one stored under another
prefix's key; damaged page metadata, child index, counters, reconciliation record, lease, pin and
session rows; a pickled value. No command may end in a traceback; ``status`` writes nothing
(the database and the directory are byte-identical afterwards, mtimes included); ``prune`` and
``clear`` quarantine the damaged manifests and keep serving the healthy ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_kvcache_cli import KiB, cli, env, fill, flags, make_record

from skippy_llama.config import L3Settings
from skippy_llama.tiers.disk import DiskTier

_PIN, _INFO, _MAN, _KIDS, _META = b"\x01", b"\x03", b"\x04", b"\x05", b"\x06"


def plant(directory: Path, rows: dict[bytes, bytes], *, mode: int = 1) -> None:
    """Insert rows as another program would: raw keys, ``mode`` 1 (raw bytes) values."""
    with sqlite3.connect(str(directory / "cache.db")) as db:
        for key, value in rows.items():
            db.execute("DELETE FROM Cache WHERE key = ?", (sqlite3.Binary(key),))
            db.execute(
                "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, "
                "access_count, tag, size, mode, filename, value) "
                "VALUES (?, 1, 0, NULL, 0, 0, NULL, 0, ?, NULL, ?)",
                (sqlite3.Binary(key), mode, sqlite3.Binary(value)),
            )


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under the store: (size, mtime in ns, sha256), and the directories' mtimes.

    Not ``cache.db-shm``: SQLite's shared-memory index of the write-ahead log, where every
    reader, a read-only one included, takes its read mark; it holds no store data and any
    opener rebuilds it from the log.
    """
    out: dict[str, tuple[int, int, str]] = {}
    for folder, dirs, files in os.walk(directory):
        for name in dirs + files:
            if name == "cache.db-shm":
                continue
            path = Path(folder, name)
            info = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
            out[str(path.relative_to(directory))] = (info.st_size, info.st_mtime_ns, digest)
    info = directory.lstat()
    out["."] = (0, info.st_mtime_ns, "")
    return out


def damaged_store(directory: Path) -> list[bytes]:
    """A store with two healthy prefixes and one of every kind of damaged row; returns the
    healthy prefixes' page keys (the first one's)."""
    healthy = [make_record(["s", "a"], 100 * KiB), make_record(["x"], 100 * KiB, "m2")]
    fill(directory, [(["s", "a"], "m1"), (["x"], "m2")])
    good = healthy[0]
    body = {
        "v": 2,
        "id": "",
        "cache_identity": "c" * 32,
        "model_identity": "m1",
        "model_name": "Model m1",
        "n_tokens": 128,
        "root": "00" * 16,
        "pages": [[good.pages[0].key.hex(), 128, 1000, 128]],
        "created": 0.0,
        "last_used": 0.0,
    }
    mids = [bytes([0xA0 + i]) * 16 for i in range(6)]
    plant(
        directory,
        {
            _MAN + mids[0]: b"\xff\xfe not json",
            _MAN + mids[1]: json.dumps([["m1", 128], [good.pages[0].key.hex()]]).encode(),
            _MAN + mids[2]: json.dumps({**body, "v": 99, "id": mids[2].hex()}).encode(),
            _MAN + mids[3]: json.dumps({**body, "id": mids[3].hex(), "n_tokens": "x"}).encode(),
            # a well-formed manifest stored under another prefix's key
            _MAN + mids[4]: json.dumps({**body, "id": good.pages[0].key.hex()}).encode(),
            _META + b"\x0c" * 16: b"PM\x02 cut short",
            _KIDS + b"\x0d" * 16: b"K\x02\xff\xff\xff\xff",
            _INFO + b"activity": b"[1, 2, 3]",
            _INFO + b"reconciliation": b"{not json",
            _INFO + b"reconciler": json.dumps({"owner": 7, "phase": "x"}).encode(),
            _INFO + b"session:dead": b"\x00\x01",
            _PIN + b"\x0e" * 16: json.dumps({"v": 1, "pid": "me", "keys": 3}).encode(),
        },
    )
    plant(directory, {_MAN + mids[5]: pickle.dumps({"v": 2})}, mode=4)  # a pickle
    return [p.key for p in good.pages]


def run_ok(*args: str) -> subprocess.CompletedProcess[str]:
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return done


def test_status_on_a_damaged_store_reports_and_writes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    damaged_store(store)
    before = snapshot(store)
    report = json.loads(run_ok("kv-cache", "status", "--json", *flags(store)).stdout)
    human = run_ok("kv-cache", "status", *flags(store)).stdout
    assert snapshot(store) == before  # not a byte, not an mtime
    usage = report["usage"]
    assert usage["manifests"] == 2  # the healthy ones
    assert usage["skipped_manifests"] == 6  # 5 damaged or foreign, 1 pickled
    assert report["activity"]["hits"] == 0  # the damaged counters row reads as empty
    assert report["reconciliation"]["ran"] is False  # the damaged record reads as none
    assert "6 prefixes skipped (damaged or unauthentic)" in human
    assert {e["model_identity"] for e in report["inventory"]} == {"m1", "m2"}


def test_status_of_a_missing_store_creates_nothing(tmp_path: Path) -> None:
    store = tmp_path / "nowhere" / "l3"
    report = json.loads(run_ok("kv-cache", "status", "--json", *flags(store)).stdout)
    assert report["usage"]["manifests"] == 0
    assert not store.parent.exists()


def test_prune_and_clear_quarantine_damaged_manifests_and_keep_serving(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    keys = damaged_store(store)
    pruned = json.loads(run_ok("kv-cache", "prune", "--yes", "--json", *flags(store)).stdout)
    assert pruned["manifests_removed"] == 0  # within budget: nothing healthy goes
    status = json.loads(run_ok("kv-cache", "status", "--json", *flags(store)).stdout)
    assert status["usage"]["skipped_manifests"] == 0
    assert status["usage"]["quarantined"] == 5  # the pickled row was dropped, not quarantined
    assert status["activity"]["damaged_manifests"] == 5
    assert status["activity"]["untrusted_rows"] >= 1
    assert status["usage"]["manifests"] == 2

    # a fresh process serves the healthy prefix from the repaired store
    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=store, minimum_free="1GiB", compression="none"
    )
    with DiskTier(settings, reconcile=False, close_at_exit=False) as tier:
        assert len(tier.read(keys)) == 2

    run_ok("kv-cache", "prune", "--model-identity", "m2", "--yes", *flags(store))
    cleared = json.loads(run_ok("kv-cache", "clear", "--yes", "--json", *flags(store)).stdout)
    assert cleared["manifests_left"] == 0
    status = json.loads(run_ok("kv-cache", "status", "--json", *flags(store)).stdout)
    assert (status["usage"]["manifests"], status["usage"]["pages"]) == (0, 0)


def test_a_damaged_store_opened_by_a_worker_is_repaired_in_the_background(tmp_path: Path) -> None:
    """A process opening the damaged store (the reconciliation record is unreadable, so a walk
    is due) serves at once and quarantines the damaged manifests in the background."""
    store = tmp_path / "l3"
    keys = damaged_store(store)
    code = (
        "import json, sys, time\n"
        "from skippy_llama.config import L3Settings\n"
        "from skippy_llama.tiers.disk import DiskTier\n"
        "s = L3Settings(mode='fixed', budget='1GiB', directory=sys.argv[1],"
        " minimum_free='1GiB', compression='none')\n"
        "t = DiskTier(s)\n"
        "served = len(t.read([bytes.fromhex(k) for k in json.loads(sys.argv[2])]))\n"
        "deadline = time.monotonic() + 60\n"
        "while not t.reconciliation.ran and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print(json.dumps({'served': served, 'rec': t.reconciliation.to_json(),"
        " 'activity': t.status().process_activity.to_json()}))\n"
        "t.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(store), json.dumps([k.hex() for k in keys])],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert out["served"] == 2
    assert out["rec"]["ran"] is True and out["rec"]["manifests_quarantined"] == 5
    assert out["rec"]["untrusted_rows"] >= 1 and out["rec"]["stale_pins_removed"] >= 1
    assert out["activity"]["internal_errors"] == 0


def test_a_database_that_is_not_sqlite_is_reported_not_raised(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    store.mkdir(mode=0o700)
    (store / "cache.db").write_bytes(b"this is not a database " * 200)
    report = json.loads(run_ok("kv-cache", "status", "--json", *flags(store)).stdout)
    assert (report["effective"]["state"], report["effective"]["reason"]) == (
        "degraded",
        "storage_unavailable",
    )
    for command in ("prune", "clear"):
        done = cli("kv-cache", command, "--yes", *flags(store))
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert "unavailable" in done.stderr
