"""Restore points through the remote tier (a real ``redis-server``): a point one host stored is
restored by another host whose L3 is empty, in a new process too, and the continuation equals a
cold prefill bit for bit (tokens and logits) on every synthetic family and Gemma 3 270M; a
damaged, missing or forged snapshot or page on the server is a miss and a counter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from redisserver import RedisServer
from test_remote_tier import secret_file
from test_restore_point_tiers import _check, _doc
from test_restore_points import _FAMILIES, SWA_PROMISED, _cold, _skippy, points_or_skip

from skippy_llama.config import RemoteSettings, Settings
from skippy_llama.restore_points import page_keys, point_key
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.l3.points import PAGE_TOKENS
from skippy_llama.tiers.remote import RemoteStore
from skippy_llama.tiers.remote.points import RemotePoints

pytestmark = pytest.mark.model


def _settings(l3: Path, url: str, secret: Path, *, l3_on: bool = True) -> Settings:
    disk: dict[str, Any] = {
        "mode": "fixed",
        "budget": "1GiB",
        "directory": str(l3),
        "minimum_free": "1GiB",
    }
    return Settings(
        l3=disk if l3_on else {"mode": "off"},
        remote={"url": url, "secret_file": str(secret)},
    )


def _remote(llm: Any) -> RemotePoints:
    points = llm.restore_points
    assert points is not None and (points.tiers[-1].name, points.tiers[-1].role) == (
        "remote",
        "shared",
    )
    tier = points.tiers[-1]
    assert isinstance(tier, RemotePoints)
    return tier


def _gemma_doc() -> list[int]:
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.integers(3, 200_000, size=600)]


def _push(path: Path, l3: Path, url: str, secret: Path, doc: list[int], n_ctx: int) -> None:
    """Host A: serve ``doc`` (cold), which stores its points in L3 and on the server."""
    llm = _skippy(path, _settings(l3, url, secret), n_ctx=n_ctx)
    try:
        points_or_skip(llm, path.stem, swa="gemma" in path.stem)
        assert _check(path, llm, doc) == ("cold", 0)
        tier = _remote(llm)
        assert tier.flush()  # pushes run on L3's background writer, off the request
        activity = tier.status()["activity"]
        assert activity["point_writes"] >= 1 and activity["points_dropped"] == 0
    finally:
        llm.close()


def test_a_host_with_an_empty_l3_restores_from_remote(
    synthetic_models: dict[str, Path], redis_clean: RedisServer, tmp_path: Path
) -> None:
    path = synthetic_models["lfm2"]
    secret = secret_file(tmp_path)
    doc = _doc()
    _push(path, tmp_path / "a", redis_clean.url, secret, doc, 512)
    # host B: its own, empty L3; over the Unix socket
    llm = _skippy(path, _settings(tmp_path / "b", redis_clean.unix_url, secret))
    try:
        # every prompt leaves two tokens or more after its point: the stock build decodes no
        # lone token after a restore (lone_free_points), and these prompts are served alike
        assert _check(path, llm, [*doc, 7, 8]) == ("remote", 90)
        # promoted into B's L3 and L1 (not pushed back: the server has it)
        assert _check(path, llm, [*doc, 7, 8, 9, 10]) == ("l1", 92)
        llm.restore_points.store.clear()  # type: ignore[union-attr]
        assert _check(path, llm, [*doc, 5, 6]) == ("l3", 90)
        activity = _remote(llm).status()["activity"]
        assert activity["point_hits"] == 1 and activity["point_misses"] == 0
    finally:
        llm.close()
    # B pushed its own points after its L3 stored them (92 and 94 tokens: [*doc, 7, 8, 9, 10]);
    # without L3 the remote tier takes every point itself
    llm = _skippy(path, _settings(tmp_path / "c", redis_clean.url, secret, l3_on=False))
    try:
        assert [t.name for t in llm.restore_points.tiers] == ["remote"]  # type: ignore[union-attr]
        assert _check(path, llm, [*doc, 7, 8, 9, 10, 11, 12]) == ("remote", 94)
        assert _check(path, llm, [*doc, 7, 8, 9, 10, 11, 12, 13, 14]) == ("l1", 96)
        assert _remote(llm).flush()  # without L3, on a writer of the tier's own
        assert _remote(llm).status()["activity"]["point_writes"] == 2
    finally:
        llm.close()


def test_a_damaged_or_evicted_remote_snapshot_is_a_cold_miss(
    synthetic_models: dict[str, Path], redis_clean: RedisServer, tmp_path: Path
) -> None:
    path = synthetic_models["lfm2"]
    secret = secret_file(tmp_path)
    doc = _doc()
    _push(path, tmp_path / "a", redis_clean.url, secret, doc, 512)
    client = redis_clean.client()
    llm = _skippy(path, _settings(tmp_path / "b", redis_clean.url, secret))
    try:
        tier = _remote(llm)
        root = llm.restore_points.store.root  # type: ignore[union-attr]
        name = tier.store.keys.point(root.hex(), point_key(root, doc))
        pages = sorted(client.keys(tier.store.keys.point_page(root.hex(), b"\0" * 16)[:-32] + b"*"))
        assert pages  # lfm2's attention cells travel as pages next to the snapshot
        record = client.get(name)
        assert isinstance(record, bytes)
        # the snapshot (the record's last bytes: the recurrent state) damaged
        damaged = bytearray(record)
        damaged[-3] ^= 0x40
        client.set(name, bytes(damaged))
        assert _check(path, llm, [*doc, 1, 2]) == ("cold", 0)
        assert not client.exists(name)  # deleted: never servable
        # an attention page damaged under a valid record
        client.set(name, record)
        page = client.get(pages[0])
        assert isinstance(page, bytes)
        client.set(pages[0], page[:-1] + bytes([page[-1] ^ 1]))
        assert _check(path, llm, [*doc, 2, 3]) == ("cold", 0)
        # an attention page evicted by the server
        client.delete(*pages)
        assert _check(path, llm, [*doc, 3, 4]) == ("cold", 0)
        status = tier.status()
        assert status["activity"]["point_misses"] == 3 and status["activity"]["point_hits"] == 0
        assert status["bad_values"]["digest"] == 2
        assert status["bad_values"]["point_page_missing"] == 1
        assert status["activity"]["internal_errors"] == 0
    finally:
        client.close()
        llm.close()


def test_the_push_leaves_the_request_thread(
    synthetic_models: dict[str, Path], redis_clean: RedisServer, tmp_path: Path
) -> None:
    """With L3's writer held busy a request is still served (exactly) and its point reaches
    the server only once the writer runs: the push is not on the request's thread."""
    path = synthetic_models["lfm2"]
    secret = secret_file(tmp_path)
    doc = _doc()
    llm = _skippy(path, _settings(tmp_path / "a", redis_clean.url, secret))
    client = redis_clean.client()
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(120)

    try:
        points_or_skip(llm, path.stem)
        tier = _remote(llm)
        disk = llm.restore_points.tiers[-2]  # type: ignore[union-attr]
        assert isinstance(disk, DiskTier) and isinstance(tier.lane, DiskTier)
        assert disk.defer(hold, 0) and started.wait(120)
        assert _check(path, llm, doc) == ("cold", 0)
        root = llm.restore_points.store.root  # type: ignore[union-attr]
        name = tier.store.keys.point(root.hex(), point_key(root, doc))
        assert not client.exists(name)  # queued behind the held writer
        assert tier.status()["point_queue"]["points"] == 1
        gate.set()
        assert tier.flush()
        assert client.exists(name) and tier.status()["activity"]["point_writes"] == 1
    finally:
        gate.set()
        client.close()
        llm.close()


def test_prune_keeps_servable_points_and_removes_one_that_lost_a_page(
    synthetic_models: dict[str, Path], redis_clean: RedisServer, tmp_path: Path
) -> None:
    """``prune --remote`` on a real model's composed points: a servable point is kept (another
    host restores it exactly), one whose page the server lost is removed with its length."""
    path = synthetic_models["lfm2"]
    secret = secret_file(tmp_path)
    doc = _doc()
    _push(path, tmp_path / "a", redis_clean.url, secret, doc, 512)
    longer = [*doc, *doc[:60]]
    llm = _skippy(path, _settings(tmp_path / "a2", redis_clean.url, secret))
    try:  # restores the 90-token point from the server, pushes one at 150
        assert _check(path, llm, longer) == ("remote", len(doc))
        assert _remote(llm).flush()
    finally:
        llm.close()
    store = RemoteStore(RemoteSettings(url=redis_clean.url, secret_file=secret))
    client = redis_clean.client()
    try:
        kept = store.prune()
        assert kept["points_checked"] == 2 and kept["points_removed_bad"] == 0
        assert kept["points_removed_unservable"] == 0 and kept["point_lengths_removed"] == 0
        (ident,) = store.server_status()["inventory"]
        root = bytes.fromhex(ident)
        # the longer point's pages (0-127, 128-149) are its own (the 90-token point's one
        # page ends at 90): the server loses the last, prune removes the point and the other
        long_pages = page_keys(np.asarray(longer, dtype=np.int32), root, PAGE_TOKENS)
        assert client.delete(store.keys.point_page(ident, long_pages[-1])) == 1
        pruned = store.prune()
        assert pruned["points_checked"] == 2 and pruned["points_removed_unservable"] == 1
        assert pruned["point_lengths_removed"] == 1 and pruned["point_pages_removed"] == 1
    finally:
        client.close()
        store.close()
    llm = _skippy(path, _settings(tmp_path / "b", redis_clean.url, secret))
    try:
        assert _check(path, llm, [*longer, 5, 6]) == ("remote", len(doc))
    finally:
        llm.close()


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_restore_point_tiers import _greedy
from test_restore_points import _skippy
from test_restore_point_remote import _settings
out = {{}}
for name, (model, prompt, n_ctx) in {jobs!r}.items():
    llm = _skippy(Path(model), _settings(Path({l3!r}) / name, {url!r}, Path({secret!r})),
                  n_ctx=n_ctx)
    tokens, logits = _greedy(llm, prompt, 5)
    event = llm.last_cache_event
    out[name] = {{"tokens": tokens, "logits": logits.tolist(), "tier": event.tier,
                 "cached": event.cached_tokens}}
    llm.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_new_process_with_an_empty_l3_restores_every_family_from_remote(
    synthetic_models: dict[str, Path],
    gemma3_path: Path,
    redis_clean: RedisServer,
    tmp_path: Path,
) -> None:
    """The target of issue 46 for the remote tier: host A stores, a new process on host B
    (empty L3) restores from the server, and equals a cold prefill bit for bit."""
    secret = secret_file(tmp_path)
    doc, gdoc = _doc(), _gemma_doc()
    jobs: dict[str, tuple[str, list[int], int]] = {}
    expected: dict[str, int] = {}
    for family in _FAMILIES:
        path = synthetic_models[family]
        _push(path, tmp_path / "a" / family, redis_clean.url, secret, doc, 512)
        jobs[family] = (str(path), [*doc, 11, 12, 13], 512)
        expected[family] = len(doc)
    if SWA_PROMISED:
        # Gemma 3: points on multiples of 512 (SWA_ALIGN and n_ubatch): the prefill's at 512
        _push(gemma3_path, tmp_path / "a" / "gemma3", redis_clean.url, secret, [*gdoc, 1, 2], 1024)
        jobs["gemma3"] = (str(gemma3_path), [*gdoc, 6], 1024)
    code = _CHILD.format(
        tests=str(Path(__file__).parent),
        jobs=jobs,
        l3=str(tmp_path / "b"),
        url=redis_clean.url,
        secret=str(secret),
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (model, prompt, n_ctx) in jobs.items():
        cold_tokens, cold_logits = _cold(Path(model), prompt, 5, n_ctx=n_ctx)
        row = got[name]
        assert row["tier"] == "remote", name
        if name != "gemma3":
            assert row["cached"] == expected[name], name
        else:
            assert row["cached"] > 0 and row["cached"] % 256 == 0
        assert row["tokens"] == cold_tokens, name
        assert np.array_equal(np.asarray(row["logits"], dtype=np.float32), cold_logits), name
