"""L3's trust boundary: planted rows written with sqlite3 into the real diskcache database,
foreign file names, unsafe directories, transient read errors, forged codec headers, stale pins.

Each case fails on a store that trusts its database (diskcache's default ``Disk``).
"""

from __future__ import annotations

import os
import pickle
import sqlite3
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from test_tier_disk import PLENTY, chain, keys_of, page_file, record_now, settings

from skippy_llama.codecs import decode, encode
from skippy_llama.errors import StateFormatError
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.l3.pins import HOST, PIN_LEASE_S, process_start
from skippy_llama.tiers.l3.schema import dump_json

# every read path: pages read one by one, and on the thread pool
pytestmark = pytest.mark.usefixtures("both_read_paths")

_META, _DATA = b"\x06", b"\x07"


class _Plant:
    """Unpickling this creates ``marker``: proof that a store row was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _db(directory: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(directory / "cache.db"))


def test_planted_pickle_rows_are_never_unpickled(tmp_path: Path, tier_at: Any) -> None:
    store, marker = tmp_path / "l3", tmp_path / "pwned"
    rec = chain(["a", "b"])
    record_now(tier_at(store), rec)
    payload = pickle.dumps(_Plant(marker))
    with _db(store) as db:
        # a pickled value under a key L3 reads (a page's metadata) …
        db.execute(
            "UPDATE Cache SET mode = 4, value = ? WHERE key = ?",
            (payload, sqlite3.Binary(_META + rec.pages[0].key)),
        )
        # … and a row whose key itself is a pickle (reconciliation walks every key)
        db.execute(
            "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count,"
            " tag, size, mode, filename, value) VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
            (payload, b"x"),
        )
    tier = tier_at(store)
    assert tier.state == "active"
    assert tier.read(keys_of(rec)) == []  # the planted page is a miss …
    tier.status()
    tier.reconcile()  # walks every row
    assert not marker.exists()  # … and nothing was ever unpickled
    assert tier.untrusted_rows >= 2
    assert tier.status().activity.untrusted_rows >= 2


def test_a_foreign_file_name_is_never_opened_nor_deleted(tmp_path: Path, tier_at: Any) -> None:
    store = tmp_path / "l3"
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"S" * 50_000)
    rec = chain(["a"], size=60_000)  # large enough to live in a value file
    tier = tier_at(store)
    record_now(tier, rec)
    tier.close()
    key = sqlite3.Binary(_DATA + rec.pages[0].key)
    with _db(store) as db:
        db.execute("UPDATE Cache SET filename = ? WHERE key = ?", (str(outside), key))
    tier = tier_at(store)
    assert tier.read(keys_of(rec)) == []
    assert tier.untrusted_rows == 1
    tier.clear()
    assert outside.read_bytes() == b"S" * 50_000


def test_the_store_directory_is_private_and_unsafe_ones_are_refused(
    tmp_path: Path, tier_at: Any
) -> None:
    fresh = tmp_path / "new" / "l3"
    assert tier_at(fresh).state == "active"
    assert fresh.stat().st_mode & 0o777 == 0o700

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    refused = tier_at(link)
    assert (refused.state, refused.reason) == ("degraded", "storage_untrusted")
    assert refused.error is not None and "symbolic link" in refused.error
    assert refused.read([b"k" * 16]) == [] and not refused.record(chain(["a"]))

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    assert tier_at(open_dir).reason == "storage_untrusted"
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    assert tier_at(group).reason == "storage_untrusted"
    assert tier_at(group, shared_group=True).state == "active"


def test_a_transient_read_error_keeps_the_page(tmp_path: Path, tier_at: Any) -> None:
    store = tmp_path / "l3"
    rec = chain(["a", "b"], size=60_000)
    tier = tier_at(store)
    record_now(tier, rec)
    path = page_file(store, rec.pages[0].key)
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()  # open() now fails with EISDIR: an I/O error, not absence
    assert tier.read(keys_of(rec)) == []
    path.rmdir()
    path.write_bytes(saved)
    assert len(tier.read(keys_of(rec))) == 2  # nothing was deleted or cut back


def test_a_forged_codec_header_cannot_claim_gigabytes() -> None:
    stored = bytearray(encode(b"SKPG" + bytes(4096), "zstd"))
    struct.pack_into("<I", stored, 4 + 4, 3 << 30)  # blosc's nbytes field
    with pytest.raises(StateFormatError, match="claims"):
        decode(bytes(stored), n_tokens=128)
    assert decode(encode(b"SKPG" + bytes(4096), "zstd"), n_tokens=1) == b"SKPG" + bytes(4096)


def test_pins_of_a_reused_pid_or_past_their_lease_do_not_hold_pages(
    tmp_path: Path, tier_at: Any
) -> None:
    tier = tier_at(tmp_path / "l3")
    record_now(tier, chain(["a"]))
    key = b"\x09" * 15  # + one letter of the pin's name: a 16-byte page key
    store = tier._parts.rw
    me, host = os.getpid(), HOST
    pins: dict[bytes, dict[str, Any]] = {
        b"\x01" + b"live": {"pid": me, "start": process_start(me), "host": host},
        b"\x01" + b"reused": {"pid": me, "start": "1", "host": host},  # same pid, other process
        b"\x01" + b"expired": {"pid": me, "start": process_start(me), "host": host},
    }
    for name, pin in pins.items():
        at = time.time() - (2 * PIN_LEASE_S if b"expired" in name else 0)
        store.set(name, dump_json({**pin, "at": at, "keys": [(key + name[1:2]).hex()]}))
    with tier._pins.local([b"\x0a" * 16]):
        remote_view = tier._pins.live(local=False)
        local_view = tier._pins.live(local=True)
    assert remote_view == {key + b"l"}  # only the live pin; this process's reads not included
    assert local_view == {key + b"l", b"\x0a" * 16}


class _BuggyPolicy:
    """An admission/eviction policy with a bug: the writer thread must log it as one."""

    name = "buggy"

    def admit(self, page: Any, now: float) -> bool:
        return bool(1 // 0)  # ZeroDivisionError: not a storage fault

    def priority(self, page: Any, now: float) -> float:
        return 0.0

    def evicted(self, page: Any, now: float) -> None:
        return None


def test_a_bug_in_the_writer_thread_is_an_error_not_a_storage_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(
        settings(tmp_path / "l3"),
        disk_free=lambda _p: PLENTY,
        close_at_exit=False,
        policy=_BuggyPolicy(),
    )
    try:
        with caplog.at_level("ERROR", logger="skippy_llama.tiers.l3"):
            rec = chain(["a"])
            assert tier.record(rec)
            assert tier.flush(10)
        activity = tier.status().process_activity
        assert activity.internal_errors == 1 and activity.storage_errors == 0
        assert activity.dropped_writes == 1
        assert tier.state == "active"  # a bug does not turn the store degraded …
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "internal error" in errors[0].getMessage()
        assert errors[0].exc_info is not None and errors[0].exc_info[0] is ZeroDivisionError
        assert tier.read(keys_of(rec)) == []  # … and nothing half-written is served
    finally:
        tier.close()
