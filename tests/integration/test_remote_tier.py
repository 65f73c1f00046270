"""The remote tier against a real ``redis-server`` (no mocks): round trips, trust, the breaker,
a server killed, paused or restarted empty, ``maxmemory`` with eviction and without, and the
operator calls. Pages are synthetic bytes: nothing here needs a model.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from redisserver import RedisServer

from skippy_llama.config import RemoteSettings, load_settings
from skippy_llama.errors import ConfigError
from skippy_llama.identity import chain_key, token_bytes
from skippy_llama.tiers.base import RemoteMatch
from skippy_llama.tiers.records import PageBlob, PrefixRecord
from skippy_llama.tiers.remote import RemoteStore
from skippy_llama.tiers.remote import codec as remote_codec
from skippy_llama.tiers.remote.store import MAX_CHILDREN

PAGE_TOKENS = 16


class Clock:
    """A monotonic clock the test moves (the breaker's back-off without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def secret_file(tmp_path: Path, name: str = "remote.key", data: bytes | None = None) -> Path:
    path = tmp_path / name
    path.write_bytes(data if data is not None else os.urandom(32))
    path.chmod(0o600)
    return path


def make_store(
    url: str, secret: Path, clock: Clock | None = None, **settings: object
) -> RemoteStore:
    remote = RemoteSettings(url=url, secret_file=secret, **settings)  # type: ignore[arg-type]
    return RemoteStore(remote, clock=clock or Clock())


def page_bytes(rng: random.Random, size: int) -> bytes:
    # "SKPG": a page stored as it is (the codec's raw form), so fetch decodes it to itself
    return b"SKPG" + rng.randbytes(size - 4)


def make_record(
    root: bytes, seed: int, n_pages: int, page_size: int = 4096
) -> tuple[PrefixRecord, list[bytes], list[bytes]]:
    """A prefix record of ``n_pages`` new synthetic pages: (record, chain keys, payloads)."""
    rng = random.Random(seed)
    pages: list[PageBlob] = []
    keys: list[bytes] = []
    payloads: list[bytes] = []
    parent = root
    for _ in range(n_pages):
        tokens = [rng.randrange(50_000) for _ in range(PAGE_TOKENS)]
        key = chain_key(parent, tokens)
        payload = page_bytes(rng, page_size)
        pages.append(PageBlob(key, parent, PAGE_TOKENS, token_bytes(tokens), payload, PAGE_TOKENS))
        keys.append(key)
        payloads.append(payload)
        parent = key
    record = PrefixRecord(root.hex(), "model-a", "synthetic", PAGE_TOKENS * n_pages, tuple(pages))
    return record, keys, payloads


ROOT_A = bytes(range(16))
ROOT_B = bytes(range(16, 32))


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    return secret_file(tmp_path)


def test_round_trip_and_repeat_push_sends_no_page_bytes(
    redis_clean: RedisServer, secret: Path
) -> None:
    with make_store(redis_clean.url, secret) as tier:
        record, keys, payloads = make_record(ROOT_A, 1, 5)
        first = tier.push(record)
        assert (first.pages_sent, first.pages_present, first.manifest_sent) == (5, 0, True)
        assert first.bytes_sent == sum(len(p) + remote_codec.HEADER_BYTES for p in payloads)
        assert tier.match(ROOT_A, keys).depth == 5
        assert tier.holds(keys[0], root=ROOT_A)
        assert tier.fetch(keys, root=ROOT_A) == payloads
        # a longer prompt: the match stops at the first page the server lacks
        _other, other_keys, _ = make_record(ROOT_A, 2, 2)
        assert tier.match(ROOT_A, [*keys[:3], *other_keys]).depth == 3
        assert tier.match(ROOT_B, keys).depth == 0  # another cache identity never matches

        again = tier.push(record)
        assert (again.pages_sent, again.bytes_sent, again.pages_present) == (0, 0, 5)
        assert not again.manifest_sent
        status = tier.status()
        activity = status["activity"]
        assert activity["bytes_out"] == first.bytes_sent  # the repeat push added nothing
        assert activity["manifests_present"] == 1
        assert activity["hits"] == 2 and activity["misses"] == 1
        assert activity["pages_fetched"] == 5 and activity["internal_errors"] == 0
        assert status["breaker"]["state"] == "closed" and not status["failures"]


def test_a_second_instance_fetches_what_the_first_pushed(
    redis_clean: RedisServer, secret: Path
) -> None:
    """Two tier objects (two nodes, one secret): B restores A's pages; over the Unix socket."""
    record, keys, payloads = make_record(ROOT_A, 3, 4)
    with make_store(redis_clean.url, secret) as node_a:
        node_a.push(record)
    with make_store(redis_clean.unix_url, secret) as node_b:
        assert node_b.match(ROOT_A, keys).depth == 4
        assert node_b.fetch(keys, root=ROOT_A) == payloads


def test_a_wrong_secret_matches_nothing(
    redis_clean: RedisServer, secret: Path, tmp_path: Path
) -> None:
    record, keys, _ = make_record(ROOT_A, 4, 3)
    with make_store(redis_clean.url, secret) as tier:
        tier.push(record)
    stranger = secret_file(tmp_path, "other.key")
    with make_store(redis_clean.url, stranger) as other:
        assert other.match(ROOT_A, keys).depth == 0
        assert other.fetch(keys, root=ROOT_A) == []
        assert other.status()["bad_values"] == {"missing": 1}


def test_a_value_planted_without_the_secret_is_refused(
    redis_clean: RedisServer, secret: Path, tmp_path: Path
) -> None:
    """Someone who can write the server but lacks the secret writes under our key names (they
    are visible to anyone listing the server): a miss, counted, and the value deleted."""
    record, keys, _ = make_record(ROOT_A, 5, 2)
    with make_store(redis_clean.url, secret) as tier:
        forger = make_store(redis_clean.url, secret_file(tmp_path, "forger.key"))
        names = [tier.keys.page(ROOT_A.hex(), key) for key in keys]
        client = redis_clean.client()
        for name, page in zip(names, record.pages, strict=True):
            forged = remote_codec.pack(forger._signer, name, remote_codec.KIND_PAGE, 16, page.data)
            client.set(name, forged)
        assert tier.match(ROOT_A, keys).depth == 2  # present …
        assert tier.fetch(keys, root=ROOT_A) == []  # … but not authentic
        assert tier.status()["bad_values"] == {"unauthenticated": 1}
        assert not client.exists(names[0])  # deleted, so a real push can store it again
        assert tier.push(record).pages_sent == 1
        forger.close()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "digest"),  # a flipped bit in the body
        (lambda v: v[: len(v) // 2], "truncated"),  # cut short
        (lambda v: v[:10], "truncated"),  # cut inside the header
        (lambda v: b"\x80\x04\x95" + v[3:], "foreign"),  # a pickle's opening bytes
        (lambda v: v + b"extra", "foreign"),  # longer than it says
    ],
)
def test_damaged_values_are_misses_and_counted(
    redis_clean: RedisServer, secret: Path, damage: object, reason: str
) -> None:
    record, keys, payloads = make_record(ROOT_A, 6, 4)
    with make_store(redis_clean.url, secret) as tier:
        tier.push(record)
        name = tier.keys.page(ROOT_A.hex(), keys[2])
        client = redis_clean.client()
        value = client.get(name)
        assert isinstance(value, bytes)
        client.set(name, damage(value))  # type: ignore[operator]
        assert tier.fetch(keys, root=ROOT_A) == payloads[:2]  # served up to the bad page
        status = tier.status()
        assert status["bad_values"] == {reason: 1}
        assert status["activity"]["bad_values_deleted"] == 1
        assert status["activity"]["internal_errors"] == 0


def test_a_value_moved_to_another_key_does_not_verify(
    redis_clean: RedisServer, secret: Path
) -> None:
    """The tag covers the key a value is stored under: page 1's frame under page 0's key (or
    under another identity) is refused."""
    record, keys, _payloads = make_record(ROOT_A, 7, 2)
    with make_store(redis_clean.url, secret) as tier:
        tier.push(record)
        client = redis_clean.client()
        names = [tier.keys.page(ROOT_A.hex(), key) for key in keys]
        client.set(names[0], client.get(names[1]))  # type: ignore[arg-type]
        assert tier.fetch(keys, root=ROOT_A) == []
        moved = tier.keys.page(ROOT_B.hex(), keys[1])
        client.set(moved, client.get(names[1]))  # type: ignore[arg-type]
        assert tier.fetch([keys[1]], root=ROOT_B) == []
        assert tier.status()["bad_values"] == {"unauthenticated": 2}


def test_server_killed_mid_run_opens_the_breaker_then_restarted_empty_is_a_miss(
    redis_clean: RedisServer, secret: Path
) -> None:
    clock = Clock()
    record, keys, _ = make_record(ROOT_A, 8, 3)
    with make_store(redis_clean.url, secret, clock, breaker_failures=3) as tier:
        tier.push(record)
        assert tier.match(ROOT_A, keys).depth == 3
        redis_clean.kill()
        try:
            # every call fails open: misses, an empty fetch, a skipped push
            assert tier.match(ROOT_A, keys).depth == 0
            assert tier.fetch(keys, root=ROOT_A) == []
            assert tier.push(record).skipped == "failed"
            status = tier.status()
            assert status["failures"] == {"connection": 3}
            assert status["breaker"]["state"] == "open" and status["state"] == "off"
            assert status["breaker"]["open_until"] is not None
            # open: no socket work, so no new failures; the calls are counted as skipped
            assert tier.match(ROOT_A, keys).depth == 0
            assert tier.fetch(keys, root=ROOT_A) == []
            assert not tier.holds(keys[0], root=ROOT_A)
            assert tier.push(record).skipped == "breaker_open"
            status = tier.status()
            assert status["failures"] == {"connection": 3}
            assert status["activity"]["skipped_breaker_open"] == 4
            assert status["activity"]["misses"] == 2
        finally:
            redis_clean.start()  # back, empty
        clock.now += 10.0  # the back-off ends: the next call probes the server
        assert tier.match(ROOT_A, keys).depth == 0  # restarted empty: a miss, not an error
        assert tier.status()["breaker"]["state"] == "closed"
        assert tier.push(record).pages_sent == 3  # and it fills again
        assert tier.fetch(keys, root=ROOT_A) == [p.data for p in record.pages]


def test_a_failed_probe_opens_the_breaker_again_for_longer(
    redis_clean: RedisServer, secret: Path
) -> None:
    clock = Clock()
    _, keys, _ = make_record(ROOT_A, 9, 2)
    with make_store(redis_clean.url, secret, clock, breaker_failures=2) as tier:
        redis_clean.kill()
        try:
            tier.match(ROOT_A, keys)
            tier.match(ROOT_A, keys)
            first = tier.status()["breaker"]
            assert first["state"] == "open" and first["opened"] == 1
            clock.now += 10.0
            tier.match(ROOT_A, keys)  # the probe fails: open again, twice as long
            second = tier.status()["breaker"]
            assert second["opened"] == 2 and second["state"] == "open"
            clock.now += 10.0
            assert tier.status()["breaker"]["state"] == "open"  # 20 s this time
            clock.now += 10.0
            assert tier.status()["breaker"]["state"] == "half_open"
        finally:
            redis_clean.start()


def test_a_paused_server_times_out_and_opens_the_breaker(
    redis_clean: RedisServer, secret: Path
) -> None:
    record, keys, _ = make_record(ROOT_A, 10, 2)
    with make_store(redis_clean.url, secret, timeout_ms=100, breaker_failures=2) as tier:
        tier.push(record)
        redis_clean.pause()
        try:
            assert tier.match(ROOT_A, keys).depth == 0
            assert tier.fetch(keys, root=ROOT_A) == []
            status = tier.status()
            assert status["failures"] == {"timeout": 2}
            assert status["breaker"]["state"] == "open"
        finally:
            redis_clean.resume()


def test_maxmemory_with_allkeys_lru_evicts_without_errors(
    redis_clean: RedisServer, secret: Path
) -> None:
    """A stream of prefixes four times the server's memory: no error, the server evicts, and
    what a match finds fetches and verifies."""
    client = redis_clean.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] + (8 << 20)))
    records = [make_record(bytes([i]) * 16, 100 + i, 4, 256 << 10) for i in range(32)]
    with make_store(redis_clean.url, secret) as tier:
        for record, _, _ in records:
            tier.push(record)
        assert client.info("stats")["evicted_keys"] > 0
        served = 0
        for i, (_, keys, payloads) in enumerate(records):
            root = bytes([i]) * 16
            depth = tier.match(root, keys).depth
            pages = tier.fetch(keys[:depth], root=root)
            assert pages == payloads[: len(pages)]  # what is served is right
            served += len(pages)
        status = tier.status()
        assert served > 0  # the pages that survived are hits
        assert not status["failures"]
        assert set(status["bad_values"]) <= {"missing"}  # evicted between match and fetch
        assert status["activity"]["internal_errors"] == 0


def test_maxmemory_without_eviction_suspends_writes_and_keeps_reads(
    redis_clean: RedisServer, secret: Path
) -> None:
    client = redis_clean.client()
    clock = Clock()
    with make_store(redis_clean.url, secret, clock) as tier:
        kept, kept_keys, kept_payloads = make_record(ROOT_A, 11, 2)
        tier.push(kept)
        client.config_set("maxmemory", str(client.info("memory")["used_memory"] + (1 << 20)))
        big, _, _ = make_record(ROOT_B, 12, 8, 512 << 10)
        result = tier.push(big)  # OOM part way: counted, not raised
        assert result.skipped == "failed"
        status = tier.status()
        assert status["failures"] == {"oom": 1}
        assert status["writes"]["state"] == "open"
        assert tier.push(big).skipped == "writes_suspended"
        # reads go on
        assert status["breaker"]["state"] == "closed"
        assert tier.fetch(kept_keys, root=ROOT_A) == kept_payloads


def tailed_record(
    root: bytes, seed: int, n_pages: int, tail: int
) -> tuple[PrefixRecord, list[bytes]]:
    """``make_record``'s pages and a last page of ``tail`` tokens after them: (record, keys)."""
    whole, keys, _ = make_record(root, seed, n_pages)
    rng = random.Random(seed + 1000)
    tokens = [rng.randrange(50_000) for _ in range(tail)]
    key = chain_key(keys[-1], tokens)
    page = PageBlob(key, keys[-1], tail, token_bytes(tokens), page_bytes(rng, 1024), tail)
    pages = (*whole.pages, page)
    record = PrefixRecord(root.hex(), "model-a", "synthetic", whole.n_tokens + tail, pages)
    return record, [*keys, key]


def test_a_records_tail_is_found_after_its_aligned_pages(
    redis_clean: RedisServer, secret: Path, tmp_path: Path
) -> None:
    """A page that ends off a page boundary has no aligned key: the push indexes it under its
    parent, one lookup returns it (authenticated), and a forged entry is a counted miss."""
    record, keys = tailed_record(ROOT_A, 21, 3, tail=5)
    tail = record.pages[-1]
    with make_store(redis_clean.url, secret) as tier:
        tier.push(record, index=[tail.key])
        found = tier.match(ROOT_A, keys[:3])
        assert (found.depth, found.children) == (3, ((tail.key, tail.tokens),))
        assert tier.fetch([tail.key], root=ROOT_A) == [tail.data]
        # a prompt whose aligned pages the server holds only in part: the second round trip
        # reads the children of the deepest one held (none here)
        other, other_keys = tailed_record(ROOT_A, 22, 2, tail=5)
        assert tier.match(ROOT_A, [*keys[:2], other_keys[1]]) == RemoteMatch(2)
        # someone without the secret adds an entry: refused and counted
        name = tier.keys.children(ROOT_A.hex(), keys[2])
        client = redis_clean.client()
        forged = other.pages[-1]
        client.hset(name, forged.key, b"\0" * remote_codec.TAG_BYTES + forged.tokens)
        client.hset(name, b"short", b"x")
        assert tier.match(ROOT_A, keys[:3]).children == ((tail.key, tail.tokens),)
        assert tier.status()["bad_values"] == {"unauthenticated_child": 1, "foreign_child": 1}
        # an instance with another secret finds nothing, the index included
        with make_store(redis_clean.url, secret_file(tmp_path, "other.key")) as stranger:
            assert stranger.match(ROOT_A, keys[:3]) == RemoteMatch(0)
        inventory = tier.server_status()["inventory"][ROOT_A.hex()]
        assert (inventory["pages"], inventory["child_entries"]) == (4, 3)
        assert tier.clear(ROOT_A.hex())["keys_removed"] == 6  # 4 pages, a manifest, an index
        assert tier.match(ROOT_A, keys[:3]) == RemoteMatch(0)


def test_a_busy_nodes_child_index_is_bounded(redis_clean: RedisServer, secret: Path) -> None:
    with make_store(redis_clean.url, secret) as tier:
        base, keys, _ = make_record(ROOT_A, 23, 1)
        tier.push(base)
        for n in range(MAX_CHILDREN + 1):
            tokens = [n, n + 1]
            key = chain_key(keys[0], tokens)
            page = PageBlob(key, keys[0], 2, token_bytes(tokens), b"SKPG" + bytes(60), 2)
            record = PrefixRecord(ROOT_A.hex(), "model-a", "synthetic", PAGE_TOKENS + 2,
                                  (*base.pages, page))  # fmt: skip
            tier.push(record, index=[key])
        children = tier.match(ROOT_A, keys).children
        assert children == ((key, token_bytes(tokens)),)  # over the bound: started over


def test_clear_of_one_identity_leaves_the_others(
    redis_clean: RedisServer, secret: Path, tmp_path: Path
) -> None:
    with make_store(redis_clean.url, secret) as tier:
        rec_a, keys_a, _ = make_record(ROOT_A, 13, 3)
        rec_b, keys_b, payloads_b = make_record(ROOT_B, 14, 2)
        tier.push(rec_a)
        tier.push(rec_b)
        client = redis_clean.client()
        client.set(b"someone-else:key", b"theirs")
        result = tier.clear(ROOT_A.hex())
        assert result["keys_removed"] == 4  # three pages and a manifest
        assert tier.match(ROOT_A, keys_a).depth == 0
        assert tier.fetch(keys_b, root=ROOT_B) == payloads_b
        assert client.get(b"someone-else:key") == b"theirs"
        inventory = tier.server_status()["inventory"]
        assert set(inventory) == {ROOT_B.hex()}
        assert inventory[ROOT_B.hex()]["pages"] == 2
        assert inventory[ROOT_B.hex()]["models"] == {"model-a": "synthetic"}
        tier.clear()
        assert client.get(b"someone-else:key") == b"theirs"  # not in our namespace
        assert tier.server_status()["inventory"] == {}


def test_prune_removes_pages_after_a_gap_and_cuts_the_manifest(
    redis_clean: RedisServer, secret: Path
) -> None:
    with make_store(redis_clean.url, secret) as tier:
        record, keys, payloads = make_record(ROOT_A, 15, 4)
        tier.push(record)
        client = redis_clean.client()
        client.delete(tier.keys.page(ROOT_A.hex(), keys[1]))  # the server lost page 1
        result = tier.prune()
        assert result["manifests_cut"] == 1 and result["pages_removed"] == 2
        inventory = tier.server_status()["inventory"][ROOT_A.hex()]
        assert (inventory["pages"], inventory["manifests"]) == (1, 1)
        assert tier.fetch(keys, root=ROOT_A) == payloads[:1]
        # a push of the whole prefix fills the gap again
        assert tier.push(record).pages_sent == 3
        assert tier.fetch(keys, root=ROOT_A) == payloads


def test_ttl_expires_keys_and_a_repeat_push_refreshes_it(
    redis_clean: RedisServer, secret: Path
) -> None:
    with make_store(redis_clean.url, secret, ttl=3600) as tier:
        record, keys, _ = make_record(ROOT_A, 16, 2)
        tier.push(record)
        client = redis_clean.client()
        name = tier.keys.page(ROOT_A.hex(), keys[0])
        assert 0 < client.ttl(name) <= 3600
        client.expire(name, 100)
        assert tier.push(record).pages_sent == 0
        assert client.ttl(name) > 100


def test_the_secret_is_required_and_must_be_private(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"remote\.secret_file is not"):
        load_settings({"remote": {"url": "redis://127.0.0.1:1/0"}})
    loose = secret_file(tmp_path, "loose.key")
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match=r"remote\.secret_file.*others can read"):
        make_store("redis://127.0.0.1:1/0", loose)
    short = secret_file(tmp_path, "short.key", b"tiny")
    with pytest.raises(ConfigError, match=r"remote\.secret_file.*holds 4 bytes"):
        make_store("redis://127.0.0.1:1/0", short)
    with pytest.raises(ConfigError, match=r"remote\.secret_file.*cannot read"):
        make_store("redis://127.0.0.1:1/0", tmp_path / "absent.key")


# ---------------------------------------------------------------------- kv-cache --remote


def remote_flags(url: str, secret: Path) -> list[str]:
    return ["--remote-url", url, "--remote-secret-file", str(secret)]


def test_kv_cache_status_prune_and_clear_act_on_the_remote_tier(
    redis_clean: RedisServer, secret: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from skippy_llama.cli.main import main

    rec_a, keys_a, _ = make_record(ROOT_A, 20, 3)
    rec_b, keys_b, payloads_b = make_record(ROOT_B, 21, 2)
    rec_b = PrefixRecord(rec_b.cache_identity, "model-b", "other", rec_b.n_tokens, rec_b.pages)
    with make_store(redis_clean.url, secret) as tier:
        tier.push(rec_a)
        tier.push(rec_b)
    flags = remote_flags(redis_clean.url, secret)
    assert main(["kv-cache", "status", "--remote", "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    inventory = report["server"]["inventory"]
    assert inventory[ROOT_A.hex()]["pages"] == 3 and inventory[ROOT_B.hex()]["manifests"] == 1
    assert report["tier"]["breaker"]["state"] == "closed"
    assert main(["kv-cache", "status", "--remote", *flags]) == 0
    assert "remote tier: redis://" in capsys.readouterr().out

    # the server lost a page of A's prefix: prune removes the pages after it
    client = redis_clean.client()
    with make_store(redis_clean.url, secret) as tier:
        client.delete(tier.keys.page(ROOT_A.hex(), keys_a[1]))
    assert main(["kv-cache", "prune", "--remote", "--yes", "--json", *flags]) == 0
    (pruned,) = json.loads(capsys.readouterr().out)
    assert pruned["pages_removed"] == 1 and pruned["manifests_cut"] == 1

    # clear one model's keys: the other's stay
    argv = ["kv-cache", "clear", "--remote", "--model-identity", "model-a", "--yes", *flags]
    assert main(argv) == 0
    assert "cleared 2 remote keys" in capsys.readouterr().out  # page 0 and the cut manifest
    with make_store(redis_clean.url, secret) as tier:
        assert tier.match(ROOT_A, keys_a).depth == 0
        assert tier.fetch(keys_b, root=ROOT_B) == payloads_b
    argv = ["kv-cache", "clear", "--remote", "--cache-identity", ROOT_B.hex(), "--yes", *flags]
    assert main(argv) == 0
    assert "cleared 3 remote keys" in capsys.readouterr().out


def test_kv_cache_remote_errors_name_what_is_wrong(
    redis_clean: RedisServer, secret: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skippy_llama.cli.main import main

    assert main(["kv-cache", "status", "--remote"]) == 2
    assert "remote.url is not set" in capsys.readouterr().err
    assert main(["kv-cache", "status", "--remote", "--remote-url", redis_clean.url]) == 2
    assert "remote.secret_file" in capsys.readouterr().err
    flags = remote_flags(redis_clean.url, secret)
    assert main(["kv-cache", "clear", "--remote", "--model-identity", "nope", "--yes", *flags]) == 2
    assert "unknown model identity 'nope'" in capsys.readouterr().err
    assert main(["kv-cache", "clear", "--cache-identity", ROOT_A.hex(), "--yes"]) == 2
    assert "with --remote" in capsys.readouterr().err
    redis_clean.kill()
    try:
        assert main(["kv-cache", "status", "--remote", *flags]) == 2
        assert "unavailable: connection" in capsys.readouterr().err
    finally:
        redis_clean.start()


def test_push_takes_l3_stored_bytes_and_loads_reused_pages(
    redis_clean: RedisServer, secret: Path
) -> None:
    """What the L3 writer hands over: ``stored`` (the compressed bytes L3 wrote, fetched back
    as the page itself), and reused pages (no payload in the record) loaded from L3 or, without
    a loader, the prefix pushed up to them."""
    from skippy_llama.codecs import encode

    record, keys, payloads = make_record(ROOT_A, 30, 4)
    stored = {page.key: encode(page.data, "zstd") for page in record.pages}
    # the same prefix as a later record sees it: pages 0-1 reused (stored earlier), 2-3 new
    reused = tuple(
        PageBlob(p.key, p.parent, p.n_tokens, p.tokens, None if i < 2 else p.payload, p.used)
        for i, p in enumerate(record.pages)
    )
    later = PrefixRecord(
        record.cache_identity, record.model_identity, "synthetic", record.n_tokens, reused
    )
    with make_store(redis_clean.url, secret) as tier:
        cut = tier.push(later)  # page 0 has no bytes here: nothing can be pushed
        assert (cut.pages_sent, cut.manifest_sent) == (0, False)
        assert tier.status()["activity"]["pages_without_bytes"] == 1
        full = tier.push(later, stored=stored)
        assert full.pages_sent == 4 and full.manifest_sent
        # the bytes L3 stored (the zstd frames) went out, not the pages again
        assert full.bytes_sent == sum(len(v) + remote_codec.HEADER_BYTES for v in stored.values())
        assert tier.fetch(keys, root=ROOT_A) == payloads
        tier.clear()
        by_load = tier.push(later, load=dict(zip(keys, payloads, strict=True)).get)
        assert by_load.pages_sent == 4
        assert tier.fetch(keys, root=ROOT_A) == payloads
