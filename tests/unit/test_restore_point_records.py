"""Restore points beyond the process: the record format, L2 (RAM) and L3 (real diskcache
directories), including restarts and damaged records. No model needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skippy_llama.errors import StoreDataError
from skippy_llama.restore_points import (
    PointOwner,
    RamPoints,
    RestorePoint,
    pack_point,
    point_key,
    unpack_point,
)
from skippy_llama.tiers.l3.schema import POINT, QUAR

ROOT = b"\x01" * 16
OWNER = PointOwner("model-id", "model-name")


def point(n: int, size: int = 1000, seed: int = 0) -> RestorePoint:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 400, size=n).astype(np.int32)
    return RestorePoint(tokens, rng.bytes(size))


def test_record_round_trip_and_checks() -> None:
    p = point(7)
    raw = pack_point(p, ROOT)
    key = point_key(ROOT, p.tokens)
    back = unpack_point(raw, root=ROOT, key=key)
    assert np.array_equal(back.tokens, p.tokens) and back.blob == p.blob
    # another identity, another prefix, a flipped byte, a cut, a foreign header: all refused
    with pytest.raises(StoreDataError, match="identity"):
        unpack_point(raw, root=b"\x02" * 16, key=point_key(b"\x02" * 16, p.tokens))
    with pytest.raises(StoreDataError, match="other tokens"):
        unpack_point(raw, root=ROOT, key=point_key(ROOT, p.tokens[:-1]))
    flipped = bytearray(raw)
    flipped[-1] ^= 1
    with pytest.raises(StoreDataError, match="digest"):
        unpack_point(bytes(flipped), root=ROOT, key=key)
    with pytest.raises(StoreDataError, match="length"):
        unpack_point(raw[:-1], root=ROOT, key=key)
    with pytest.raises(StoreDataError, match="magic"):
        unpack_point(b"PK" + raw[2:], root=ROOT, key=key)
    with pytest.raises(StoreDataError, match="shorter"):
        unpack_point(raw[:10], root=ROOT, key=key)


def test_ram_points_serve_one_root() -> None:
    l2 = RamPoints(max_bytes=1 << 20)
    p = point(5)
    assert l2.put_point(ROOT, p, OWNER)
    assert l2.point_lengths(ROOT) == [5]
    got = l2.get_point(ROOT, p.tokens)
    assert got is not None and got.blob == p.blob
    assert l2.get_point(ROOT, p.tokens[:4]) is None
    assert not l2.put_point(b"\x02" * 16, p, OWNER)  # another model's point is refused
    assert l2.point_lengths(b"\x02" * 16) == []


def test_l3_points_survive_a_restart(tier_at: Any, tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    first = tier_at(directory)
    short, long_ = point(9, seed=1), point(30, seed=2)
    assert first.put_point(ROOT, short, OWNER)
    assert first.put_point(ROOT, long_, OWNER)
    first.close()
    again = tier_at(directory)
    assert sorted(again.point_lengths(ROOT)) == [9, 30]
    assert again.point_lengths(b"\x02" * 16) == []
    got = again.get_point(ROOT, long_.tokens)
    assert got is not None and got.blob == long_.blob
    assert again.get_point(ROOT, short.tokens[:8]) is None  # no point at 8 tokens
    status = again.status()
    assert status.usage.restore_points == 2
    (entry,) = status.restore_points
    assert entry.model_identity == "model-id" and entry.points == 2
    assert [n for n, _ in entry.sizes] == [9, 30]
    assert status.usage.restore_point_bytes == entry.bytes > len(short.blob) + len(long_.blob)
    assert status.to_json()["restore_points"][0]["points"] == 2
    assert again._parts.counters.get("point_hits") == 1


def test_a_damaged_record_is_a_miss_quarantined_and_counted(tier_at: Any, tmp_path: Path) -> None:
    tier = tier_at(tmp_path / "l3")
    p = point(12)
    assert tier.put_point(ROOT, p, OWNER)
    store = tier._parts.rw
    (key,) = store.keys(POINT)
    raw = bytearray(store.get(key) or b"")
    raw[-5] ^= 0xFF  # one flipped bit of the state
    store.set(key, bytes(raw))
    assert tier.get_point(ROOT, p.tokens) is None
    assert tier._parts.counters.get("corrupt_points") == 1
    assert tier.point_lengths(ROOT) == []  # record and metadata are gone
    assert store.get(QUAR + key) is not None
    # a record stored under another point's key (a swap) is refused as well
    a, b = point(4, seed=3), point(5, seed=4)
    tier.put_point(ROOT, a, OWNER)
    tier.put_point(ROOT, b, OWNER)
    key_a = next(k for k in store.keys(POINT) if int.from_bytes(k[17:21], "big") == 4)
    key_b = next(k for k in store.keys(POINT) if int.from_bytes(k[17:21], "big") == 5)
    store.set(key_a, store.get(key_b))
    assert tier.get_point(ROOT, a.tokens) is None
    assert tier._parts.counters.get("corrupt_points") == 2
    got = tier.get_point(ROOT, b.tokens)
    assert got is not None and got.blob == b.blob


def test_points_stay_within_their_share_of_the_budget(tier_at: Any, tmp_path: Path) -> None:
    # 64 MiB budget (the entry floor): points may hold 32 MiB; three of 12 MiB do not fit
    tier = tier_at(tmp_path / "l3", budget="64MiB")
    points = [point(10 + i, size=12 << 20, seed=i) for i in range(3)]
    for p in points[:2]:
        assert tier.put_point(ROOT, p, OWNER)
    assert tier.get_point(ROOT, points[0].tokens) is not None  # the first is now most recent
    assert tier.put_point(ROOT, points[2], OWNER)
    assert sorted(tier.point_lengths(ROOT)) == [10, 12]
    assert tier._parts.counters.get("points_evicted") == 1
    # one larger than the whole share is refused, nothing evicted for it
    assert not tier.put_point(ROOT, point(40, size=33 << 20), OWNER)
    assert sorted(tier.point_lengths(ROOT)) == [10, 12]


def test_clear_removes_points(tier_at: Any, tmp_path: Path) -> None:
    tier = tier_at(tmp_path / "l3")
    tier.put_point(ROOT, point(6), OWNER)
    tier.clear()
    assert tier.point_lengths(ROOT) == []
    assert tier.status().usage.restore_points == 0


def test_simulate_counts_snapshot_bytes_and_serves_only_at_points(tmp_path: Path) -> None:
    from skippy_llama.tiers.l3.simulate import format_table, simulate
    from skippy_llama.tiers.l3.trace import (
        LookupEvent,
        RecordEvent,
        TraceWriter,
        page_keys,
        read_trace,
    )

    root = b"\x03" * 16
    tokens = np.arange(3, 3 + 600, dtype=np.int32)
    trace = TraceWriter(tmp_path / "trace.jsonl", page_tokens=128)
    trace.point_lookup(root, tokens[:300], 0, "cold")
    trace.point_record(root, tokens[:256], 0, 5000)  # a point at a page boundary
    trace.point_record(root, tokens[:300], 0, 7000)  # a prompt end inside a page
    trace.point_lookup(root, tokens[:400], 256, "l1")
    trace.close()
    events = list(read_trace(tmp_path / "trace.jsonl"))
    assert [type(e) for e in events] == [LookupEvent, RecordEvent, RecordEvent, LookupEvent]
    assert events[0].points and events[1].snapshot_bytes == 5000  # type: ignore[union-attr]
    result = simulate(events, 1 << 20, "lru")
    assert result.snapshot_bytes_written == 12000
    # the second lookup finds the pages up to 256 (the 300-token point ends inside a page)
    assert result.saved_tokens == 256
    assert "snapshots" in format_table([result])
    # a trace without points reads and replays as before: no snapshot column
    keys, counts = page_keys(root, tokens, 256, 128)
    plain: list[LookupEvent | RecordEvent] = [
        RecordEvent(0.0, keys, counts, (10, 10), 256),
        LookupEvent(0.0, keys, counts, 300),
    ]
    plain_result = simulate(plain, 1 << 20, "lru")
    assert plain_result.saved_tokens == 256 and plain_result.snapshot_bytes_written == 0
    assert "snapshots" not in format_table([plain_result])


def test_prefill_points_double_then_take_the_deepest() -> None:
    from skippy_llama.restore_points import prefill_points

    assert prefill_points(0, 2020, 256) == [256, 512, 1024, 1792]
    assert prefill_points(0, 2049, 256) == [256, 512, 1024, 2048]
    assert prefill_points(300, 2020, 256) == [512, 1024, 1792]  # after a restore at 300
    assert prefill_points(1792, 2040, 256) == []  # restored at the deepest already
    assert prefill_points(0, 256, 256) == []  # the prompt's end is not a chunk's
    assert prefill_points(0, 257, 256) == [256]
    assert prefill_points(0, 9000, 0) == []


def test_lone_micro_batches_follow_llama_evals_and_llama_cpps_splits() -> None:
    from skippy_llama.restore_points import lone_ubatch

    assert lone_ubatch(1, 512, 512) and not lone_ubatch(2, 512, 512)
    assert not lone_ubatch(0, 512, 512) and not lone_ubatch(512, 512, 512)
    assert lone_ubatch(513, 512, 512) and lone_ubatch(1025, 512, 512)
    # Llama.eval's batches of 512, each cut into micro-batches of 64: 65 leaves one
    assert lone_ubatch(65, 512, 64) and not lone_ubatch(66, 512, 64)
    assert lone_ubatch(512 + 65, 512, 64) and not lone_ubatch(512 + 64, 512, 64)
    assert lone_ubatch(2, 64, 1)  # every micro-batch a single token
    assert lone_ubatch(513, 512, 1024)  # llama.cpp's n_ubatch is at most n_batch


def test_lone_free_points_drop_stops_that_leave_a_single_token() -> None:
    from skippy_llama.restore_points import lone_free_points

    assert lone_free_points(0, 2020, [256, 512, 1024, 1792], 512, 512) == [256, 512, 1024, 1792]
    assert lone_free_points(0, 514, [256, 513], 512, 512) == [256]  # 513 would leave 1
    assert lone_free_points(255, 600, [256, 512], 512, 512) == [512]  # [255, 256) is one
    # the last piece decides: a stop is given up so the rest is no single token
    assert lone_free_points(0, 1026, [512, 1025], 512, 512) == [512]
    assert lone_free_points(90, 91, [], 512, 512) is None  # a restore at 90 leaves one
    # [0, 256) and [256, 513) avoid the single token that one Llama.eval of 513 decodes (the
    # runtime then serves the prompt as cold does: no split matches it)
    assert lone_free_points(0, 513, [256, 512], 512, 512) == [256]


def _hybrid(n: int, content: Any, seed: int = 0) -> RestorePoint:
    """A point whose state is attention cells (``statefixtures``, v_trans like llama.cpp with
    flash attention off) followed by a 300-byte recurrent part."""
    from statefixtures import build_state

    tail = np.random.default_rng(seed).bytes(300)
    tokens = np.arange(3, 3 + n, dtype=np.int32)
    return RestorePoint(tokens, build_state(content, n).data + tail, len(tail))


def _content(n: int) -> Any:
    from statefixtures import Spec, make_content

    return make_content(Spec(v_trans=True), n)


def test_compose_cuts_attention_pages_and_rebuilds_the_state() -> None:
    from skippy_llama.restore_points import compose_point, recompose_point

    p = _hybrid(300, _content(300))
    composed = compose_point(p, 128)
    assert composed is not None and len(composed.pages) == 3 and composed.head == b""
    assert recompose_point(composed.pages, composed.head, composed.tail) == p.blob
    # purely recurrent: no attention cells, the 8-byte header and the state
    only = RestorePoint(p.tokens, p.blob[:8] + p.blob[-300:], 300)
    whole = compose_point(only, 128)
    assert whole is not None and whole.pages == () and len(whole.head) == 8
    # an unknown split or a split that is not the attention section's end: not composed
    assert compose_point(RestorePoint(p.tokens, p.blob), 128) is None
    assert compose_point(RestorePoint(p.tokens, p.blob, 299), 128) is None


def test_l3_composed_points_share_pages_and_evict_them_with_the_last_user(
    tier_at: Any, tmp_path: Path
) -> None:
    from skippy_llama.tiers.l3.schema import POINT_PAGE

    content = _content(700)
    tier = tier_at(tmp_path / "l3")
    short, long_ = _hybrid(300, content, 1), _hybrid(600, content, 2)
    assert tier.put_point(ROOT, short, OWNER)
    assert tier.put_point(ROOT, long_, OWNER)
    store = tier._parts.rw
    # pages [0, 256) are shared; the short point's [256, 300) and the long one's 3 more are not
    assert store.count(POINT_PAGE) == 2 + 1 + 3
    assert tier._parts.counters.get("point_pages_shared") == 2
    for p in (short, long_):
        got = tier.get_point(ROOT, p.tokens)
        assert got is not None and got.blob == p.blob and got.recurrent == 300
    metas = {m.n_tokens: m for m in tier._points.metas()}
    page = metas[300].pages[0][1]  # a whole page's stored bytes (the shared ones are whole)
    # each point is charged its record and the pages it added: the long one 3 pages, not 5
    assert metas[600].size < metas[300].size + 3 * page + 400
    assert tier.status().usage.restore_point_bytes == metas[300].size + metas[600].size
    # evicting the short point keeps the shared pages (now charged to the long one)
    with tier._parts.lock, store.transact():
        others = {m.suffix: m for m in metas.values() if m.n_tokens == 600}
        tier._points._remove(metas[300], others)
    assert store.count(POINT_PAGE) == 2 + 3
    (left,) = tier._points.metas()
    assert left.size == metas[600].size + 2 * page
    got = tier.get_point(ROOT, long_.tokens)
    assert got is not None and got.blob == long_.blob
    # a damaged shared page: the point is a miss, quarantined, its pages removed
    key = store.keys(POINT_PAGE)[0]
    raw = bytearray(store.get(key) or b"")
    raw[-1] ^= 1
    store.set(key, bytes(raw))
    assert tier.get_point(ROOT, long_.tokens) is None
    assert tier._parts.counters.get("corrupt_points") == 1
    assert store.count(POINT_PAGE) == 0 and tier.point_lengths(ROOT) == []


def test_composed_record_checks() -> None:
    from skippy_llama.restore_points import ComposedRecord, pack_composed, unpack_composed

    tokens = np.arange(5, dtype=np.int32)
    rec = ComposedRecord(tokens, ((b"k" * 16, b"d" * 16),), b"", b"tail")
    raw = pack_composed(rec, ROOT)
    key = point_key(ROOT, tokens)
    back = unpack_composed(raw, root=ROOT, key=key)
    assert back.refs == rec.refs and back.tail == b"tail"
    with pytest.raises(StoreDataError, match="identity"):
        unpack_composed(raw, root=b"\x02" * 16, key=key)
    with pytest.raises(StoreDataError, match="digest"):
        unpack_composed(raw[:-1] + b"X", root=ROOT, key=key)
    with pytest.raises(StoreDataError, match="length"):
        unpack_composed(raw + b"X", root=ROOT, key=key)


def test_signed_points_need_the_secret(tier_at: Any, tmp_path: Path) -> None:
    from test_l3_auth import secret_at

    content = _content(300)
    p = _hybrid(300, content)
    key = secret_at(tmp_path / "key")
    signed = tier_at(tmp_path / "l3", key)
    assert signed.put_point(ROOT, p, OWNER)
    again = tier_at(tmp_path / "l3", key)
    got = again.get_point(ROOT, p.tokens)
    assert got is not None and got.blob == p.blob
    other = tier_at(tmp_path / "l3", secret_at(tmp_path / "other", b"another secret " * 4))
    assert other.get_point(ROOT, p.tokens) is None  # another secret's tags: a miss
    assert other._parts.counters.get("corrupt_points") == 1


def test_random_damage_is_always_a_miss(tier_at: Any, tmp_path: Path) -> None:
    """Any flipped byte of a stored record or page: a miss, never a wrong state or a crash."""
    from skippy_llama.tiers.l3.schema import POINT_PAGE

    content = _content(300)
    rng = np.random.default_rng(5)
    for trial in range(12):
        tier = tier_at(tmp_path / f"l3-{trial}")
        p = _hybrid(300, content, trial)
        assert tier.put_point(ROOT, p, OWNER)
        store = tier._parts.rw
        rows = store.keys(POINT) + store.keys(POINT_PAGE)
        row = rows[int(rng.integers(len(rows)))]
        raw = bytearray(store.get(row) or b"")
        raw[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
        store.set(row, bytes(raw))
        got = tier.get_point(ROOT, p.tokens)
        # a flip in the tag bytes of an unsigned store is ignored (no secret, nothing to
        # check there); anything else is a miss
        assert got is None or got.blob == p.blob
        assert got is None or tier._parts.counters.get("corrupt_points") == 0
