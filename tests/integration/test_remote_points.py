"""Restore points on a real ``redis-server`` (no model): a record pushed by one node is served
to another, verified on every read; a damaged, foreign, forged or truncated value, or a server
that is down, is a miss and a counter, never an exception or another point's state.

Composed points (pages + snapshot) need a real state to cut and are tested on the synthetic
models in ``test_restore_point_remote.py``; here the points travel whole."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from redisserver import RedisServer
from test_remote_tier import Clock, secret_file

from skippy_llama.config import RemoteSettings
from skippy_llama.restore_points import PointOwner, RestorePoint, point_key
from skippy_llama.tiers.remote import RemoteStore
from skippy_llama.tiers.remote import codec as remote_codec
from skippy_llama.tiers.remote.points import MAX_LENGTHS, RemotePoints

ROOT = bytes(range(16))
OTHER_ROOT = bytes(range(16, 32))
OWNER = PointOwner("model-a", "synthetic")


def _points(url: str, secret: Path, **settings: object) -> RemotePoints:
    remote = RemoteSettings(url=url, secret_file=secret, **settings)  # type: ignore[arg-type]
    return RemotePoints(RemoteStore(remote, clock=Clock()))


def _point(n: int, seed: int = 0) -> RestorePoint:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 50_000, size=n).astype(np.int32)
    return RestorePoint(tokens, rng.bytes(4096 + n))


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    return secret_file(tmp_path)


def test_a_point_pushed_by_one_node_is_served_to_another(
    redis_clean: RedisServer, secret: Path
) -> None:
    a, b = _points(redis_clean.url, secret), _points(redis_clean.unix_url, secret)
    try:
        short, long = _point(40), _point(90, seed=1)
        assert a.put_point(ROOT, short, OWNER) and a.put_point(ROOT, long, OWNER)
        assert sorted(b.point_lengths(ROOT)) == [40, 90]
        got = b.get_point(ROOT, long.tokens)
        assert got is not None and got.blob == long.blob
        assert np.array_equal(got.tokens, long.tokens)
        # other tokens of a listed length, another identity: absent, not a wrong state
        assert b.get_point(ROOT, _point(90, seed=2).tokens) is None
        assert b.get_point(OTHER_ROOT, long.tokens) is None
        assert b.point_lengths(OTHER_ROOT) == []
        # a repeat push sends nothing but the length entry
        assert a.put_point(ROOT, long, OWNER)
        activity = a.status()["activity"]
        assert activity["point_values_sent"] == 2 and activity["point_values_present"] == 1
        assert b.status()["activity"]["point_hits"] == 1
        server = b.store.server_status()["inventory"][ROOT.hex()]
        assert server["restore_points"] == 2 and server["restore_point_bytes"] > 8192
    finally:
        a.close()
        b.close()


def test_damaged_and_forged_records_are_misses(
    redis_clean: RedisServer, secret: Path, tmp_path: Path
) -> None:
    tier = _points(redis_clean.url, secret)
    client = redis_clean.client()
    try:
        point = _point(64)
        assert tier.put_point(ROOT, point, OWNER)
        name = tier.store.keys.point(ROOT.hex(), point_key(ROOT, point.tokens))
        good = client.get(name)
        assert isinstance(good, bytes)
        # a flipped byte in the body: the frame's digest
        bad = bytearray(good)
        bad[-10] ^= 0x01
        client.set(name, bytes(bad))
        assert tier.get_point(ROOT, point.tokens) is None
        assert not client.exists(name)  # never servable: deleted, the next push stores it
        # truncated (a client cut off mid-write)
        client.set(name, good[: len(good) // 2])
        assert tier.get_point(ROOT, point.tokens) is None
        # another point's authentic record copied under this key: the tag is over the key
        other = _point(64, seed=5)
        assert tier.put_point(ROOT, other, OWNER)
        other_name = tier.store.keys.point(ROOT.hex(), point_key(ROOT, other.tokens))
        copied = client.get(other_name)
        assert isinstance(copied, bytes)
        client.set(name, copied)
        assert tier.get_point(ROOT, point.tokens) is None
        # a record signed under another secret (another deployment on the same server)
        stranger = _points(redis_clean.url, secret_file(tmp_path, "other.key"))
        forged = remote_codec.pack(
            stranger.store._signer, name, remote_codec.KIND_POINT, 64, b"x" * 100
        )
        stranger.close()
        client.set(name, forged)
        assert tier.get_point(ROOT, point.tokens) is None
        # garbage of another type under the key
        client.delete(name)
        client.rpush(name, b"x")
        assert tier.get_point(ROOT, point.tokens) is None
        status = tier.status()
        assert status["activity"]["point_misses"] == 5 and status["activity"]["point_hits"] == 0
        bad_values = status["bad_values"]
        assert bad_values["digest"] == 1 and bad_values["truncated"] == 1
        assert bad_values["unauthenticated"] == 2
        assert status["activity"]["internal_errors"] == 0
        # pushed again: served again
        client.delete(name)
        assert tier.put_point(ROOT, point, OWNER)
        got = tier.get_point(ROOT, point.tokens)
        assert got is not None and got.blob == point.blob
    finally:
        client.close()
        tier.close()


def test_forged_length_entries_are_ignored_and_the_index_is_bounded(
    redis_clean: RedisServer, secret: Path
) -> None:
    tier = _points(redis_clean.url, secret)
    client = redis_clean.client()
    try:
        assert tier.put_point(ROOT, _point(30), OWNER)
        name = tier.store.keys.point_lengths(ROOT.hex())
        client.hset(name, b"77", b"0" * 16)  # not tagged under the secret
        client.hset(name, b"x", b"y")
        assert tier.point_lengths(ROOT) == [30]
        assert tier.status()["bad_values"]["unauthenticated_length"] == 2
        client.delete(name)
        pipe = client.pipeline()
        signer = tier.store._signer
        for n in range(1, MAX_LENGTHS + 1):
            field = str(n).encode()
            pipe.hset(name, field, signer.value(b"remote-point-length", name, field))
        pipe.execute()
        assert tier.put_point(ROOT, _point(MAX_LENGTHS + 5), OWNER)
        assert tier.point_lengths(ROOT) == [MAX_LENGTHS + 5]  # started over
    finally:
        client.close()
        tier.close()


def test_a_server_that_is_down_is_a_miss_and_a_dropped_push(
    redis_clean: RedisServer, secret: Path
) -> None:
    tier = _points(redis_clean.url, secret, breaker_failures=1)
    point = _point(20)
    try:
        assert tier.put_point(ROOT, point, OWNER)
        redis_clean.kill()
        assert tier.point_lengths(ROOT) == []
        assert tier.get_point(ROOT, point.tokens) is None  # the breaker is open: no call
        assert not tier.put_point(ROOT, point, OWNER)
        status = tier.status()
        assert status["breaker"]["state"] == "open"
        assert status["failures"]["connection"] == 1
        assert status["activity"]["points_dropped"] == 1
    finally:
        tier.close()
        redis_clean.start()
