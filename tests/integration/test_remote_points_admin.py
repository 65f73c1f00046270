"""Restore points on a real ``redis-server`` (no model), issue 46's remote gaps: pushes leave the
caller's thread on a bounded lane (dropped and counted when full, drained on close, a lookup
meanwhile served from the buffer or missed, never wrong), and ``kv-cache status|prune|clear
--remote`` cover points as they cover pages: prune removes the records that can never be served
(forged, damaged, or with a lost page), the pages only they named and the length entries left
over; clear and ``--model-identity`` reach an identity that has points and no manifest.

Composed points (attention pages + a recurrent tail) are built from ``statefixtures`` states, as
the L3 unit tests build them."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from redisserver import RedisServer
from statefixtures import Spec, build_state, make_content
from test_remote_tier import Clock, remote_flags, secret_file

from skippy_llama.config import RemoteSettings
from skippy_llama.restore_points import PointOwner, RestorePoint, page_keys, point_key
from skippy_llama.tiers.l3.points import PAGE_TOKENS
from skippy_llama.tiers.l3.writer import job_writer
from skippy_llama.tiers.remote import RemoteStore
from skippy_llama.tiers.remote.keys import length_tag
from skippy_llama.tiers.remote.points import JobLane, Lane, RemotePoints

ROOT = bytes(range(16))
OTHER_ROOT = bytes(range(16, 32))
OWNER = PointOwner("model-h", "hybrid")


def _points(url: str, secret: Path, lane: Lane | None = None, **kw: Any) -> RemotePoints:
    remote = RemoteSettings(url=url, secret_file=secret)
    return RemotePoints(RemoteStore(remote, clock=Clock()), lane, **kw)


def _whole(n: int, seed: int = 0) -> RestorePoint:
    """A point that travels whole (its state cannot be cut)."""
    rng = np.random.default_rng(seed)
    return RestorePoint(rng.integers(3, 50_000, size=n).astype(np.int32), rng.bytes(2048 + n))


def _hybrid(n: int, content: Any, seed: int = 0) -> RestorePoint:
    """A composed point: attention cells of ``n`` tokens (``statefixtures``) + a 300-byte
    recurrent tail; points of one ``content`` share their leading tokens and pages."""
    tail = np.random.default_rng(seed).bytes(300)
    tokens = np.arange(3, 3 + n, dtype=np.int32)
    return RestorePoint(tokens, build_state(content, n).data + tail, len(tail))


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    return secret_file(tmp_path)


def _same(got: RestorePoint | None, want: RestorePoint) -> bool:
    return got is not None and got.blob == want.blob and np.array_equal(got.tokens, want.tokens)


# ---------------------------------------------------------------------- the push lane


def test_pushes_wait_on_a_bounded_lane_and_close_drains_them(
    redis_clean: RedisServer, secret: Path
) -> None:
    lane = JobLane(job_writer("test-lane", queue_size=2))
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:  # keeps the lane's thread busy: what is queued after it waits
        started.set()
        gate.wait(60)

    a = _points(redis_clean.url, secret, lane, max_pending_bytes=20_000)
    b = _points(redis_clean.url, secret)
    try:
        assert lane.defer(hold, 0) and started.wait(60)
        p1, p2, p3 = _whole(40, 1), _whole(50, 2), _whole(60, 3)
        assert a.put_point(ROOT, p1, OWNER) and a.put_point(ROOT, p2, OWNER)
        assert a.put_point(ROOT, p1, OWNER)  # already waiting: not queued twice
        assert not a.put_point(ROOT, p3, OWNER)  # the queue (2) is full: dropped, not waited
        big = RestorePoint(p3.tokens, b"x" * 30_000)
        assert not a.put_point(ROOT, big, OWNER)  # over the buffer's bytes
        # nothing reached the server yet; this process answers from its buffer
        assert b.point_lengths(ROOT) == [] and b.get_point(ROOT, p1.tokens) is None
        assert sorted(a.point_lengths(ROOT)) == [40, 50]
        assert _same(a.get_point(ROOT, p1.tokens), p1)
        assert a.get_point(ROOT, p3.tokens) is None  # dropped: a miss
        queue = a.status()["point_queue"]
        assert queue["points"] == 2 and 0 < queue["bytes"] <= 20_000
        gate.set()
        a.close()  # drains the lane, then closes
        assert sorted(b.point_lengths(ROOT)) == [40, 50]
        assert _same(b.get_point(ROOT, p2.tokens), p2)
        assert b.get_point(ROOT, p3.tokens) is None
        activity = a.status()["activity"]
        assert activity["point_pushes_queued"] == 2 and activity["point_writes"] == 2
        assert activity["point_queue_full"] == 2 and activity["points_dropped"] == 2
        assert activity["point_pending_hits"] == 1 and activity["internal_errors"] == 0
        assert a.status()["point_queue"]["points"] == 0
    finally:
        gate.set()
        a.close()
        b.close()


def test_a_lookup_racing_pushes_is_the_point_or_a_miss(
    redis_clean: RedisServer, secret: Path
) -> None:
    """Lookups on the pushing node (buffer, then server) and on another node while the lane
    pushes: every answer is the exact point or None, never another state."""
    content = make_content(Spec(v_trans=True), 700)
    points = [_hybrid(130 + 20 * i, content, i) for i in range(12)] + [
        _whole(30 + i, 40 + i) for i in range(12)
    ]
    a = _points(redis_clean.url, secret, JobLane())
    b = _points(redis_clean.unix_url, secret)
    wrong: list[str] = []
    answers = {"point": 0, "miss": 0}
    done = threading.Event()

    def look() -> None:
        while not done.is_set():
            for node in (a, b):
                for p in points:
                    got = node.get_point(ROOT, p.tokens)
                    if got is None:
                        answers["miss"] += 1
                    elif _same(got, p):
                        answers["point"] += 1
                    else:
                        wrong.append(f"{p.n_tokens} tokens")

    reader = threading.Thread(target=look)
    reader.start()
    try:
        for p in points:
            assert a.put_point(ROOT, p, OWNER)
        assert a.flush()
    finally:
        done.set()
        reader.join(60)
    try:
        assert wrong == []
        for p in points:  # all landed
            assert _same(b.get_point(ROOT, p.tokens), p)
        assert a.status()["activity"]["point_writes"] == len(points)
        assert b.status()["activity"]["internal_errors"] == 0
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------- prune, status, clear


def test_prune_removes_the_points_that_can_never_be_served(
    redis_clean: RedisServer, secret: Path
) -> None:
    content = make_content(Spec(v_trans=True), 700)
    short, long_ = _hybrid(300, content, 1), _hybrid(600, content, 2)
    whole, other = _whole(40), _whole(50, 7)
    tier = _points(redis_clean.url, secret)
    store = tier.store
    client = redis_clean.client()
    ident = ROOT.hex()
    try:
        for p in (short, long_, whole):
            assert tier.put_point(ROOT, p, OWNER)
        assert tier.put_point(OTHER_ROOT, other, PointOwner("model-o", "other"))
        inventory = store.server_status()["inventory"][ident]
        # pages [0, 256) shared: short's 3 pages and long's 3 more
        assert (inventory["restore_points"], inventory["restore_point_pages"]) == (3, 6)
        assert inventory["restore_point_lengths"] == 3
        assert inventory["models"] == {"model-h": "hybrid"}  # from the points' owner
        # the server lost a page only the long point has
        long_pages = page_keys(long_.tokens, ROOT, PAGE_TOKENS)
        client.delete(store.keys.point_page(ident, long_pages[3]))
        # a damaged whole record; a forged and a stale length entry; a key that is not ours
        wname = store.keys.point(ident, point_key(ROOT, whole.tokens))
        value = client.get(wname)
        assert isinstance(value, bytes)
        raw = bytearray(value)
        raw[-5] ^= 0x10
        client.set(wname, bytes(raw))
        lengths = store.keys.point_lengths(ident)
        client.hset(lengths, b"77", b"0" * 16)
        client.hset(lengths, b"88", length_tag(store._signer, lengths, b"88"))
        foreign = store.keys.point(ident, b"\0" * 16)[:-32] + b"not-hex"
        client.set(foreign, b"x")

        result = store.prune(ident)
        assert result["points_checked"] == 3 and result["foreign_keys"] == 1
        assert result["points_removed_bad"] == 1 and result["points_removed_unservable"] == 1
        # long's own pages 2 and 4 (3 is lost; 0 and 1 stay for short)
        assert result["point_pages_removed"] == 2
        # 77 (forged), 88 (no record), 600 (unservable), 40 (damaged)
        assert result["point_lengths_removed"] == 4
        assert client.exists(foreign)  # skipped, never touched
        assert store.status()["bad_values"]["digest"] == 1

        reader = _points(redis_clean.url, secret)
        try:
            assert reader.point_lengths(ROOT) == [300]
            assert _same(reader.get_point(ROOT, short.tokens), short)
            assert reader.get_point(ROOT, long_.tokens) is None
            assert _same(reader.get_point(OTHER_ROOT, other.tokens), other)  # not selected
        finally:
            reader.close()
        inventory = store.server_status()["inventory"][ident]
        assert (inventory["restore_points"], inventory["restore_point_pages"]) == (1, 3)
        # a prune of what is servable removes nothing
        again = store.prune()
        assert again["points_checked"] == 2 and again["points_removed_bad"] == 0
        assert again["points_removed_unservable"] == 0 and again["point_pages_removed"] == 0
        assert again["point_lengths_removed"] == 0
    finally:
        client.close()
        tier.close()


def test_prune_skips_values_of_another_type_and_forged_owners(
    redis_clean: RedisServer, secret: Path, tmp_path: Path
) -> None:
    tier = _points(redis_clean.url, secret)
    store = tier.store
    client = redis_clean.client()
    ident = ROOT.hex()
    try:
        p = _whole(30)
        assert tier.put_point(ROOT, p, OWNER)
        # another type under a record key and under the length index; an owner signed under
        # another secret (another deployment on the same server)
        client.rpush(store.keys.point(ident, b"\1" * 16), b"x")
        stranger = _points(redis_clean.url, secret_file(tmp_path, "other.key"))
        try:
            assert stranger.put_point(OTHER_ROOT, p, OWNER)
            forged = client.get(stranger.store.keys.point_owner(OTHER_ROOT.hex()))
        finally:
            stranger.close()
        assert isinstance(forged, bytes)
        client.set(store.keys.point_owner(OTHER_ROOT.hex()), forged)
        client.delete(store.keys.point_lengths(OTHER_ROOT.hex()))
        client.sadd(store.keys.point_lengths(OTHER_ROOT.hex()), b"x")
        inventory = store.server_status()["inventory"]
        assert inventory[OTHER_ROOT.hex()]["models"] == {}  # a forged owner names nothing
        result = store.prune()
        assert result["points_checked"] == 2 and result["points_removed_bad"] == 1
        assert result["point_owners_removed_bad"] == 1
        assert result["point_lengths_removed"] == 1  # the set where an index belongs
        assert _same(tier.get_point(ROOT, p.tokens), p)
        bad = store.status()["bad_values"]
        assert bad["foreign"] >= 2 and bad["unauthenticated"] >= 1
    finally:
        client.close()
        tier.close()


def test_kv_cache_cli_covers_points_of_an_identity_without_manifests(
    redis_clean: RedisServer, secret: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skippy_llama.cli.main import main

    content = make_content(Spec(v_trans=True), 400)
    tier = _points(redis_clean.url, secret)
    client = redis_clean.client()
    try:
        points = [_hybrid(300, content, 1), _whole(40)]
        for p in points:
            assert tier.put_point(ROOT, p, OWNER)
        assert tier.put_point(OTHER_ROOT, _whole(50, 3), PointOwner("model-o", "other"))
        client.delete(tier.store.keys.point(ROOT.hex(), point_key(ROOT, points[1].tokens)))
    finally:
        tier.close()
    flags = remote_flags(redis_clean.url, secret)
    assert main(["kv-cache", "status", "--remote", "--json", *flags]) == 0
    entry = json.loads(capsys.readouterr().out)["server"]["inventory"][ROOT.hex()]
    assert entry["restore_points"] == 1 and entry["restore_point_pages"] == 3
    assert entry["models"] == {"model-h": "hybrid"}
    assert main(["kv-cache", "status", "--remote", *flags]) == 0
    text = capsys.readouterr().out
    assert "restore points: 1 records, 3 pages" in text and "model-h (hybrid)" in text
    # by model: the identity is found by its points' owner; the evicted record's length goes
    argv = ["kv-cache", "prune", "--remote", "--model-identity", "model-h", "--yes", "--json"]
    assert main([*argv, *flags]) == 0
    (pruned,) = json.loads(capsys.readouterr().out)
    assert pruned["identity"] == ROOT.hex() and pruned["points_checked"] == 1
    assert pruned["point_lengths_removed"] == 1 and pruned["points_removed_unservable"] == 0
    argv = ["kv-cache", "prune", "--remote", "--model-identity", "model-h", "--yes"]
    assert main([*argv, *flags]) == 0
    assert "restore points: 1 checked, 0 removed" in capsys.readouterr().out
    argv = ["kv-cache", "clear", "--remote", "--model-identity", "model-h", "--yes"]
    assert main([*argv, *flags]) == 0
    # record, 3 pages, the length index and the owner
    out = capsys.readouterr().out
    assert "cleared 6 remote keys" in out and "1 restore points and 3 of their pages" in out
    assert main(["kv-cache", "status", "--remote", "--json", *flags]) == 0
    inventory = json.loads(capsys.readouterr().out)["server"]["inventory"]
    assert set(inventory) == {OTHER_ROOT.hex()}  # the other model's points stay
