"""Measured costs kept with the store (``costs.py`` + ``learned.py``): the book's byte format, its
validation of untrusted bytes, and a real diskcache store handing one tier's measurements to the
next tier opened on it (as a restarted process would see them)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from test_admission import measured
from test_tier_disk import PLENTY, chain, record_now, settings

from skippy_llama.admission import AdmissionPolicy, CostModel
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.l3.costs import MAX_BOOK_BYTES, CostBook, CostRates
from skippy_llama.tiers.l3.schema import COSTS, NO_TAG

MODEL, BACKEND = "model-a", "CPU"


def test_a_book_round_trips_exactly() -> None:
    book = CostBook()
    book.learn(MODEL, BACKEND, measured(0.004, 1e-9), now=100.0)
    book.put("model-b", "CUDA0", CostRates(2e-4, {}, 50.0))
    again = CostBook.from_bytes(book.to_bytes())
    assert again.dropped == 0 and len(again) == 2
    assert again.get(MODEL, BACKEND) == book.get(MODEL, BACKEND)
    assert again.get("model-b", "CUDA0") == CostRates(2e-4, {}, 50.0)
    fresh = CostModel()
    assert again.seed(MODEL, BACKEND, fresh)
    assert fresh.prefill_seconds_per_token == pytest.approx(0.004)
    assert fresh.restore_rate("l3") == pytest.approx(1e-9)
    assert not again.seed(MODEL, "Metal", CostModel())


def test_seed_keeps_what_this_process_measured() -> None:
    book = CostBook()
    book.learn(MODEL, BACKEND, measured(0.004, 1e-9), now=1.0)
    costs = CostModel()
    costs.observe_prefill(100, 0.1)
    book.seed(MODEL, BACKEND, costs)
    assert costs.prefill_seconds_per_token == pytest.approx(0.001)
    assert costs.restore_rate("l3") == pytest.approx(1e-9)


def _entry(**kw: Any) -> dict[str, Any]:
    base = {
        "model_identity": MODEL,
        "backend": BACKEND,
        "prefill_s_per_token": 0.004,
        "restore_s_per_byte": 1e-9,
        "updated": 1.0,
    }
    base.update(kw)
    return base


def _book(*entries: Any, v: Any = 1) -> bytes:
    return json.dumps({"v": v, "entries": list(entries)}).encode()


@pytest.mark.parametrize(
    "raw, kept, dropped",
    [
        (b"", 0, 0),
        (b"\xff\xfe not json", 0, 1),
        (b"[" * 100_000 + b"]" * 100_000, 0, 1),  # nesting deep enough to hit the recursion limit
        (b'"a string"', 0, 1),
        (_book(_entry(), v=3), 0, 1),
        (_book(_entry(), v=True), 0, 1),
        (b" " * (MAX_BOOK_BYTES + 1), 0, 1),
        (json.dumps({"v": 1, "entries": {"not": "a list"}}).encode(), 0, 0),
        (_book(_entry(), "not an object", 7, None), 1, 3),
        (_book(_entry(model_identity=""), _entry(model_identity=5)), 0, 2),
        (_book(_entry(backend=None), _entry(backend="x" * 600)), 0, 2),
        (_book(_entry(prefill_s_per_token=None, restore_s_per_byte=None)), 0, 1),
        (_book(_entry(prefill_s_per_token=-1.0, restore_s_per_byte=True)), 0, 1),
        (_book(_entry(prefill_s_per_token="0.1", restore_s_per_byte=1e9)), 0, 1),
        (
            b'{"v":1,"entries":[{"model_identity":"m","backend":"b","prefill_s_per_token":NaN}]}',
            0,
            1,
        ),
        (
            b'{"v":1,"entries":[{"model_identity":"m","backend":"b","restore_s_per_byte":Infinity}]}',
            0,
            1,
        ),
    ],
)
def test_damaged_books_are_ignored_and_counted(raw: bytes, kept: int, dropped: int) -> None:
    book = CostBook.from_bytes(raw)
    assert (len(book), book.dropped) == (kept, dropped)


def test_an_implausible_rate_is_dropped_alone() -> None:
    book = CostBook.from_bytes(_book(_entry(prefill_s_per_token=1e6)))
    rates = book.get(MODEL, BACKEND)
    assert rates is not None and rates.prefill_s_per_token is None
    assert rates.restore_s_per_byte["l3"] == pytest.approx(1e-9)


def test_a_version_1_book_is_read_as_l3_rates() -> None:
    # books written before rates were keyed by tier held one restore rate: L3's
    book = CostBook.from_bytes(_book(_entry()))
    assert book.dropped == 0
    rates = book.get(MODEL, BACKEND)
    assert rates is not None and rates.restore_s_per_byte == {"l3": pytest.approx(1e-9)}
    assert b'"v":2' in book.to_bytes() and b'"restore_s_per_byte":{"l3":' in book.to_bytes()


@pytest.mark.parametrize(
    "restore, kept",
    [
        ({"l3": 1e-9, "remote": 2e-8}, {"l3": 1e-9, "remote": 2e-8}),
        ({"l3": 1e-9, "": 1e-9, "x" * 65: 1e-9, "l2": -1.0, "remote": "fast"}, {"l3": 1e-9}),
        ({f"t{i}": 1e-9 for i in range(17)}, {}),  # more tiers than a book holds: none kept
        (1e-9, {}),  # a version 2 entry's rates are a map
        (["l3", 1e-9], {}),
    ],
)
def test_a_version_2_books_tier_rates_are_validated_one_by_one(
    restore: Any, kept: dict[str, float]
) -> None:
    book = CostBook.from_bytes(_book(_entry(restore_s_per_byte=restore), v=2))
    rates = book.get(MODEL, BACKEND)  # the valid prefill rate keeps the entry
    assert rates is not None and book.dropped == 0
    assert rates.restore_s_per_byte == kept
    empty = CostBook.from_bytes(
        _book(_entry(prefill_s_per_token=None, restore_s_per_byte=restore), v=2)
    )
    assert len(empty) == (1 if kept else 0)


def test_l3s_book_keeps_l3s_restore_rate_and_never_another_tiers() -> None:
    costs = CostModel()
    costs.observe_prefill(100, 0.1)
    costs.observe_restore(10**6, 0.5, tier="remote")  # a slow network
    costs.observe_restore(10**6, 0.001, tier="l2")
    book = CostBook()
    book.learn(MODEL, BACKEND, costs, now=1.0)
    rates = book.get(MODEL, BACKEND)
    assert rates is not None and rates.restore_s_per_byte == {}
    costs.observe_restore(10**6, 0.01, tier="l3")
    book.learn(MODEL, BACKEND, costs, now=2.0)
    rates = book.get(MODEL, BACKEND)
    assert rates is not None and rates.restore_s_per_byte == {"l3": pytest.approx(1e-8)}
    fresh = CostModel()
    assert book.seed(MODEL, BACKEND, fresh)
    assert fresh.restore_rates == {"l3": pytest.approx(1e-8)}


def test_flipped_bytes_never_raise() -> None:
    book = CostBook()
    for i in range(20):
        book.put(f"model-{i}", BACKEND, CostRates(1e-3 * (i + 1), {"l3": 1e-9}, float(i)))
    good = book.to_bytes()
    rng = random.Random(0)
    for _ in range(500):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        parsed = CostBook.from_bytes(bytes(raw))
        for i in range(20):
            rates = parsed.get(f"model-{i}", BACKEND)
            assert (
                rates is None or rates.prefill_s_per_token is None or rates.prefill_s_per_token > 0
            )


# ------------------------------------------------------------------ with a real store


def tier(directory: Path, key: tuple[str, str] = (MODEL, BACKEND), **kw: Any) -> DiskTier:
    return DiskTier(
        settings(directory, **kw),
        admission=AdmissionPolicy(),
        disk_free=lambda _p: PLENTY,
        close_at_exit=False,
        cost_key=key,
    )


def closed(t: DiskTier) -> DiskTier:
    t.close()
    assert t._parts.counters.get("internal_errors") == 0
    return t


def test_a_reopened_store_starts_with_the_costs_measured_before(tmp_path: Path) -> None:
    first = tier(tmp_path / "l3")
    assert first.admission is not None and first.learned is not None
    assert not first.learned.loaded and not first.admission.costs.measured
    first.admission.costs.observe_prefill(512, 2.0)
    first.admission.costs.observe_restore(10**7, 0.01, tier="l3")
    record_now(first, chain(["a", "b"]))  # flush runs the housekeeping that saves them
    learned = (
        first.admission.costs.prefill_seconds_per_token,
        first.admission.costs.restore_rate("l3"),
    )
    closed(first)

    second = tier(tmp_path / "l3")
    assert second.admission is not None and second.learned is not None
    assert second.learned.loaded and second.admission.costs.measured
    costs = second.admission.costs
    assert (costs.prefill_seconds_per_token, costs.restore_rate("l3")) == learned
    # decisions use them at once: no write-through fallback for the first record
    record_now(second, chain(["c"]))
    assert second.admission.counters.fallback == 0
    closed(second)

    other = tier(tmp_path / "l3", key=(MODEL, "CUDA0"))  # another backend learns on its own
    assert other.learned is not None and not other.learned.loaded
    assert other.admission is not None and not other.admission.costs.measured
    other.admission.costs.observe_prefill(512, 0.05)
    assert other.flush(10)
    closed(other)
    third = tier(tmp_path / "l3")  # the first backend's entry survived the other's save
    assert third.admission is not None
    assert third.admission.costs.prefill_seconds_per_token == learned[0]
    closed(third)


def test_a_later_measurement_replaces_the_stored_one(tmp_path: Path) -> None:
    first = tier(tmp_path / "l3")
    assert first.admission is not None
    first.admission.costs.observe_prefill(100, 1.0)
    assert first.flush(10)
    first.admission.costs.observe_prefill(100, 3.0)
    assert first.flush(10)
    expected = first.admission.costs.prefill_seconds_per_token
    closed(first)
    second = tier(tmp_path / "l3")
    assert second.admission is not None
    assert second.admission.costs.prefill_seconds_per_token == expected
    closed(second)


def plant(t: DiskTier, value: bytes) -> None:
    store = t._parts.rw
    with t._parts.lock, store.transact():
        store.set(COSTS, value)


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"short",
        NO_TAG + b"{not json",
        NO_TAG + _book(_entry(prefill_s_per_token=-5.0, restore_s_per_byte=float("nan"))),
        os.urandom(4096),
    ],
)
def test_a_damaged_stored_book_is_ignored_counted_and_replaced(
    tmp_path: Path, value: bytes
) -> None:
    planter = tier(tmp_path / "l3")
    plant(planter, value)
    closed(planter)
    t = tier(tmp_path / "l3")
    assert t.admission is not None and t.learned is not None
    assert not t.learned.loaded and not t.admission.costs.measured
    assert t.status().process_activity.damaged_costs == 1
    t.admission.costs.observe_prefill(100, 1.0)
    assert t.flush(10)
    closed(t)
    again = tier(tmp_path / "l3")
    assert again.admission is not None and again.learned is not None and again.learned.loaded
    closed(again)


def secret(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def test_with_a_secret_only_an_authentic_book_is_used(tmp_path: Path) -> None:
    key = secret(tmp_path / "key")
    writer = tier(tmp_path / "l3", secret_file=key)
    assert writer.admission is not None
    writer.admission.costs.observe_prefill(100, 1.0)
    assert writer.flush(10)
    closed(writer)
    reader = tier(tmp_path / "l3", secret_file=key)
    assert reader.learned is not None and reader.learned.loaded
    closed(reader)

    # a process without the secret (or an attacker) plants a book of its own: not used
    forger = tier(tmp_path / "l3")
    plant(forger, NO_TAG + _book(_entry(prefill_s_per_token=1e-9)))
    closed(forger)
    victim = tier(tmp_path / "l3", secret_file=key)
    assert victim.admission is not None and victim.learned is not None
    assert not victim.learned.loaded and victim.admission.costs.prefill_seconds_per_token is None
    assert victim.status().process_activity.damaged_costs == 1
    closed(victim)
