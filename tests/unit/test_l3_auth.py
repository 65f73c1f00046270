"""``l3.secret_file``: pages, child-index entries and manifests tagged with an HMAC under a secret
the store does not hold. A record without a valid tag is a miss counted as ``unauthenticated``.

Stores are real diskcache directories; the attacker's rows are written with ``sqlite3`` or through
a tier without the secret, as another process sharing the directory would.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from test_tier_disk import ROOT, chain, keys_of, record_now

from skippy_llama.errors import ConfigError
from skippy_llama.tiers.disk import payload_digest
from skippy_llama.tiers.l3.auth import MIN_SECRET_BYTES, Signer
from skippy_llama.tiers.l3.schema import PageMeta

# every read path: pages read one by one, and on the thread pool
pytestmark = pytest.mark.usefixtures("both_read_paths")

_META, _DATA = b"\x06", b"\x07"


def secret_at(path: Path, data: bytes | None = None, mode: int = 0o600) -> Path:
    path.write_bytes(os.urandom(32) if data is None else data)
    path.chmod(mode)
    return path


def test_the_same_secret_serves_every_record(tmp_path: Path, tier_at: Any) -> None:
    secret = secret_at(tmp_path / "key")
    rec = chain(["a", "b"], tail_tokens=40)
    writer = tier_at(tmp_path / "l3", secret)
    record_now(writer, rec)
    writer.close()
    reader = tier_at(tmp_path / "l3", secret)
    assert reader.read(keys_of(rec)) == [p.payload for p in rec.pages]
    assert reader.children(ROOT) == [(rec.pages[0].key, rec.pages[0].tokens)]
    status = reader.status()
    assert status.usage.manifests == 1 and len(status.inventory) == 1
    assert status.activity.unauthenticated == 0


def test_a_tag_from_another_secret_is_a_miss(tmp_path: Path, tier_at: Any) -> None:
    rec = chain(["a", "b"])
    writer = tier_at(tmp_path / "l3", secret_at(tmp_path / "k1"))
    record_now(writer, rec)
    writer.close()
    other = tier_at(tmp_path / "l3", secret_at(tmp_path / "k2"))
    assert other.children(ROOT) == []  # the index entry is not authentic
    assert other.status().inventory == ()  # nor the manifest: not listed
    assert other.read(keys_of(rec)) == []  # nor the page
    status = other.status()
    assert status.process_activity.unauthenticated == 3  # index entry, manifest, page
    # the unauthentic page is out of service (not counted as corrupt); a record of the same
    # tokens under this secret writes it again, and then it serves
    assert status.usage.quarantined == 1 and status.process_activity.corrupt_entries == 0
    record_now(other, rec)
    assert other.read(keys_of(rec)) == [p.payload for p in rec.pages]
    assert other.children(ROOT) == [(rec.pages[0].key, rec.pages[0].tokens)]


def test_a_store_written_without_the_secret_is_not_served_with_it(
    tmp_path: Path, tier_at: Any
) -> None:
    rec = chain(["a"])
    plain = tier_at(tmp_path / "l3")
    record_now(plain, rec)
    plain.close()
    signed = tier_at(tmp_path / "l3", secret_at(tmp_path / "key"))
    assert signed.read(keys_of(rec)) == []
    assert signed.status().activity.unauthenticated >= 1
    # the tier keeps working: a record under the secret is served, the old one once re-recorded
    fresh = chain(["b"])
    record_now(signed, fresh)
    assert signed.read(keys_of(fresh)) == [fresh.pages[0].payload]
    record_now(signed, rec)
    assert signed.read(keys_of(rec)) == [rec.pages[0].payload]


def test_a_tampered_payload_with_a_matching_digest_is_a_miss(tmp_path: Path, tier_at: Any) -> None:
    """An attacker who can write the store replaces a page and fixes its digest and size (both
    live in the same database): without the secret the tag cannot follow."""
    secret = secret_at(tmp_path / "key")
    store = tmp_path / "l3"
    rec = chain(["a"], size=2000)  # small: the payload lives in the database row
    tier = tier_at(store, secret)
    record_now(tier, rec)
    tier.close()
    key = rec.pages[0].key
    forged = b"SKPG" + bytes(1996)
    with sqlite3.connect(str(store / "cache.db")) as db:
        (raw,) = db.execute("SELECT value FROM Cache WHERE key = ?", (_META + key,)).fetchone()
        meta = PageMeta.unpack(bytes(raw))
        meta.digest, meta.size = payload_digest(forged), len(forged)
        db.execute("UPDATE Cache SET value = ? WHERE key = ?", (meta.pack(), _META + key))
        db.execute("UPDATE Cache SET value = ? WHERE key = ?", (forged, _DATA + key))
    # without the secret the forgery is served: the digest cannot tell
    plain = tier_at(store)
    assert plain.read([key]) == [forged]
    plain.close()
    again = tier_at(store, secret)
    assert again.read([key]) == []
    status = again.status()
    assert status.process_activity.unauthenticated == 1
    assert status.usage.quarantined == 1  # out of service: the next record rewrites it


def test_signer_tags_differ_by_kind_key_and_secret() -> None:
    a, b = Signer(b"s" * 32), Signer(b"t" * 32)
    assert a.page(b"k" * 16, 4, b"x") != b.page(b"k" * 16, 4, b"x")
    assert a.page(b"k" * 16, 4, b"x") != a.page(b"j" * 16, 4, b"x")
    assert a.page(b"k" * 16, 4, b"x") != a.page(b"k" * 16, 5, b"x")
    assert a.child(b"p" * 16, b"k" * 16, b"x") != a.page(b"p" * 16, 0, b"k" * 16 + b"x")
    assert Signer().verify(bytes(16), b"anything")  # no secret: nothing to check


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("missing", "cannot read it"),
        ("short", f"a secret needs {MIN_SECRET_BYTES}"),
        ("world-readable", "others can read or write it"),
        ("directory", "not a regular file"),
    ],
)
def test_a_bad_secret_file_is_a_config_error_naming_the_setting(
    tmp_path: Path, tier_at: Any, case: str, match: str
) -> None:
    path = tmp_path / "key"
    if case == "short":
        secret_at(path, b"x" * (MIN_SECRET_BYTES - 1))
    elif case == "world-readable":
        secret_at(path, mode=0o644)
    elif case == "directory":
        path.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"l3\.secret_file") as err:
        tier_at(tmp_path / "l3", path)
    assert match in str(err.value)
    assert not (tmp_path / "l3").exists()  # refused before the store was touched
