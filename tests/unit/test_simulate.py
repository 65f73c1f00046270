"""The replay simulator on small traces with known answers, and the policies' targets on the
synthetic workloads (no model, no diskcache)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from skippy_llama.admission import CostModel
from skippy_llama.tiers.l3 import synthetic
from skippy_llama.tiers.l3.costs import CostBook, CostRates
from skippy_llama.tiers.l3.policies import ReusePolicy
from skippy_llama.tiers.l3.policy_api import LruPolicy, PageStats
from skippy_llama.tiers.l3.simulate import (
    OptimalPolicy,
    Simulator,
    format_table,
    plot,
    simulate,
    sweep,
)
from skippy_llama.tiers.l3.trace import (
    LookupEvent,
    RecordEvent,
    TraceEvent,
    TraceFormatError,
    TraceWriter,
    read_trace,
    write_trace,
)

MiB = 1 << 20


def single_page_requests(names: str) -> list[TraceEvent]:
    """One one-page prompt per letter: a lookup, then a record of that page (1 byte, 1 token)."""
    out: list[TraceEvent] = []
    for name in names:
        out.append(LookupEvent(0.0, (name,), (1,), 2))
        out.append(RecordEvent(0.0, (name,), (1,), (1,), 1))
    return out


def test_known_answers_lru_and_belady() -> None:
    """Budget of two pages, requests A B C A D A B (worked by hand in the comments)."""
    trace = single_page_requests("ABCADAB")
    # LRU: C evicts A, A evicts B, D evicts C; only the second-to-last A hits.
    lru = simulate(trace, 2, "lru", low_watermark=1.0)
    assert (lru.hit_lookups, lru.saved_tokens, lru.pages_written) == (1, 1, 6)
    # Belady: C and D are never used again (bypassed); A hits twice, B once.
    best = simulate(trace, 2, "optimal", low_watermark=1.0)
    assert (best.hit_lookups, best.pages_written, best.pages_refused) == (3, 2, 2)
    assert best.hit_ratio == pytest.approx(3 / 7)


def test_loop_larger_than_budget_lru_gets_nothing_optimum_keeps_a_subset() -> None:
    trace = single_page_requests("ABCD" * 5)
    assert simulate(trace, 3, "lru", low_watermark=1.0).hit_lookups == 0
    # Belady keeps A, B, C-style subsets: at least two hits per later round of four
    assert simulate(trace, 3, "optimal", low_watermark=1.0).hit_lookups >= 8


def chain(*keys: str, size: int = 10) -> tuple[LookupEvent, RecordEvent]:
    n = len(keys)
    return (
        LookupEvent(0.0, keys, (4,) * n, 4 * n + 1),
        RecordEvent(0.0, keys, (4,) * n, (size,) * n, 4 * n),
    )


def test_prefix_hits_stop_at_first_missing_page_and_sharers_are_counted() -> None:
    sim = Simulator(10_000, LruPolicy())
    for event in (*chain("s", "a1", "a2"), *chain("s", "b1")):
        sim.step(event)
    assert sim.pages["s"].ends == 2  # two recorded prefixes run through the system page
    assert sim.pages["a2"].ends == 1
    lookup, _ = chain("s", "a1", "x", "a2")
    assert sim.step(lookup) == 8  # s and a1: the walk stops at the missing x


def test_evicting_a_page_takes_the_pages_after_it() -> None:
    class EvictRootFirst(LruPolicy):
        def priority(self, page, now):  # type: ignore[no-untyped-def]
            return 0.0 if page.key == b"s" else 1.0

    sim = Simulator(35, EvictRootFirst(), low_watermark=1.0)
    for event in chain("s", "a1", "a2"):
        sim.step(event)
    assert sim.used == 30
    for event in chain("t", "b1"):  # 50 > 35: the root goes, and with it a1 and a2
        sim.step(event)
    assert set(sim.pages) == {"t", "b1"}
    assert sim.used == 20
    assert sim.pages["t"].ends == 1


def test_optimal_next_use_and_bypass() -> None:
    trace = single_page_requests("ABA")
    opt = OptimalPolicy(trace)
    assert opt.next_use("A", 1.0) == 4.0  # the third lookup is event 4
    assert opt.next_use("B", 3.0) == float("inf")


class AdmitOnly(LruPolicy):
    """LRU that writes only the named pages (an online policy that happens to bypass well)."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def admit(self, page: PageStats, now: float) -> bool:
        return page.key.decode() in self.keys


def test_optimal_is_belady_not_a_strict_bound_under_the_low_watermark() -> None:
    """``optimal`` admits every page used again; an admission that overflows the budget costs a
    pass down to the low watermark, so a policy that bypasses it can save more (the caveat in
    ``policies.py``'s docstring: the ratios to ``optimal`` flatter online policies slightly)."""
    trace = single_page_requests("ABCABC")
    # Budget two pages, passes down to one. Belady writes C (used again, last): three pages
    # overflow, the pass takes C then B (next used furthest); A hits, B and C miss.
    best = simulate(trace, 2, "optimal", low_watermark=0.5)
    assert (best.hit_lookups, best.pages_written, best.pages_evicted) == (1, 3, 2)
    # Never writing C keeps A and B: both hit.
    bypass = simulate(trace, 2, AdmitOnly({"A", "B"}), low_watermark=0.5)
    assert (bypass.hit_lookups, bypass.pages_evicted) == (2, 0)


def hot_then_one_off(policy_name: str) -> set[str]:
    """A hot document asked about 6 times, then one long prompt that alone exceeds the budget."""
    rng = np.random.default_rng(3)
    hot = rng.integers(0, 1000, 512, dtype=np.int32)
    prompts = [np.concatenate([hot, rng.integers(0, 1000, 20, dtype=np.int32)]) for _ in range(6)]
    prompts.append(rng.integers(0, 1000, 2048, dtype=np.int32))  # the one-off
    prompts.append(prompts[0])
    events = synthetic.events(prompts, page_tokens=128, bytes_per_token=1000)
    hot_keys = set(events[0].keys[:4])  # the document's four full pages
    sim = Simulator(1_400_000, simulate_policy(policy_name, events))
    for event in events[:-2]:
        sim.step(event)
    return hot_keys & set(sim.pages)


def simulate_policy(name: str, events: list[TraceEvent]):  # type: ignore[no-untyped-def]
    from skippy_llama.tiers.l3.simulate import policy_for

    return policy_for(name, 1_400_000, events)


def test_one_off_long_prompt_never_evicts_a_hot_prefix() -> None:
    assert len(hot_then_one_off("reuse")) == 4
    assert len(hot_then_one_off("optimal")) == 4
    assert len(hot_then_one_off("lru")) < 4  # what the new default fixes


def test_a_one_off_long_prompt_goes_before_documents_seen_once() -> None:
    """Two documents seen once (4 full pages each), then a 6-page one-off: the pass down to the
    low watermark must take 6 pages. Tied first sightings would go deepest first, cutting the
    documents' tails beside the one-off's head; ``reuse`` takes the one-off's pages first."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, 520, dtype=np.int32) for _ in range(2)]
    one_off = rng.integers(0, 1000, 780, dtype=np.int32)
    events = synthetic.events([*docs, one_off], page_tokens=128, bytes_per_token=1000)
    doc_keys = {key for event in events[:4] for key in event.keys[:4]}
    page = 128_000
    sim = Simulator(13 * page, ReusePolicy(13 * page), low_watermark=0.62)
    for event in events:
        sim.step(event)
    assert doc_keys <= set(sim.pages)
    assert not set(events[-1].keys) & set(sim.pages)


#: The seeds ``reuse`` was tuned on (``bench_policies.py``'s default; the tables in
#: ``skippy_llama/tiers/l3/policies.py``). Its targets are asserted on the others, which chose
#: nothing: a policy fitted to these three traces must still meet them on traces it never saw.
TUNING_SEEDS = (0, 1, 2)
#: the held-out seeds of ``benchmarks/results/policies_heldout.json`` (``--seeds 3-22``)
HELD_OUT_SEEDS = tuple(range(3, 23))
TARGET_BUDGETS = (32 * MiB, 64 * MiB, 128 * MiB)
POLICIES = ("lru", "reuse", "optimal")

Saved = dict[tuple[str, int, int, str], float]


@pytest.fixture(scope="module")
def held_out_saved() -> Saved:
    """Saved prefill seconds per (workload, seed, budget, policy) on the held-out seeds: every
    seed for the workloads with targets (skewed, uniform), five for loop and scan (~40 s)."""
    assert not set(HELD_OUT_SEEDS) & set(TUNING_SEEDS)
    saved: Saved = {}
    for workload in synthetic.WORKLOADS:
        seeds = HELD_OUT_SEEDS if workload in ("skewed", "uniform") else HELD_OUT_SEEDS[:5]
        for seed in seeds:
            events = synthetic.workload_events(workload, seed=seed)
            for budget in TARGET_BUDGETS:
                for policy in POLICIES:
                    saved[workload, seed, budget, policy] = simulate(events, budget, policy).saved_s
    return saved


def _summed(saved: Saved, workload: str, budget: int, policy: str) -> float:
    return sum(v for (w, _, b, p), v in saved.items() if (w, b, p) == (workload, budget, policy))


def test_policy_never_beats_the_optimum_nor_loses_to_lru_held_out(held_out_saved: Saved) -> None:
    for (workload, seed, budget, policy), new in held_out_saved.items():
        if policy != "reuse":
            continue
        lru = held_out_saved[workload, seed, budget, "lru"]
        best = held_out_saved[workload, seed, budget, "optimal"]
        assert best >= new, (workload, seed, budget)
        if workload == "uniform" and budget == 32 * MiB:
            # decided by 20-30 hits per trace: per seed 0.80-1.55x LRU held out (1.11x summed)
            assert new >= 0.75 * lru, (workload, seed, budget)
        else:
            assert new >= 0.98 * lru, (workload, seed, budget)


def test_skewed_reuse_targets_held_out(held_out_saved: Saved) -> None:
    """The issue's skewed-reuse targets on seeds the policy never saw (figures: benchmarks)."""
    for seed in HELD_OUT_SEEDS:
        for budget in TARGET_BUDGETS:
            new = held_out_saved["skewed", seed, budget, "reuse"]
            assert new >= 1.5 * held_out_saved["skewed", seed, budget, "lru"], (seed, budget)
    # summed over the held-out seeds: measured 0.849 / 0.870 / 0.908 of the optimum (the GDSF
    # default before the frequency classes reached 0.757 at 64 MiB on the tuning seeds)
    for budget, floor in zip(TARGET_BUDGETS, (0.83, 0.85, 0.89), strict=True):
        fraction = _summed(held_out_saved, "skewed", budget, "reuse") / _summed(
            held_out_saved, "skewed", budget, "optimal"
        )
        assert fraction >= floor, (budget, fraction)


def test_uniform_reuse_saves_at_least_lru_held_out(held_out_saved: Saved) -> None:
    # summed over the held-out seeds: measured 1.11 / 1.18 / 1.19x LRU
    for budget in TARGET_BUDGETS:
        new = _summed(held_out_saved, "uniform", budget, "reuse")
        assert new >= 1.05 * _summed(held_out_saved, "uniform", budget, "lru"), budget


def test_document_pages_name_each_document_request_and_its_probability() -> None:
    shape = synthetic.Shape(requests=50)
    pages = synthetic.document_pages(shape, seed=4)
    events = synthetic.workload_events("skewed", shape, seed=4)
    lookups = [e for e in events if isinstance(e, LookupEvent)]
    documents = [pages.get(e.keys[0], (None, 0.0))[0] for e in lookups]
    one_offs = [i for i, d in enumerate(documents) if d is None]
    assert one_offs == list(range(shape.long_every - 1, shape.requests, shape.long_every))
    # every full page of a document request is the document's, and nothing else is
    for event, document in zip(lookups, documents, strict=True):
        full = [k for k, n in zip(event.keys, event.tokens, strict=True) if n == 128]
        expected = (shape.system_tokens + shape.document_tokens) // 128
        owners = [pages[k][0] for k in full[:expected]] if document is not None else []
        assert owners == ([document] * expected if document is not None else [])
        assert not set(full[expected:]) & set(pages)
    per_document = {index: p for index, p in pages.values()}
    assert len(per_document) == shape.documents
    assert sum(per_document.values()) == pytest.approx(1 - 1 / shape.long_every)
    assert per_document[0] > per_document[1] > per_document[shape.documents - 1]


def test_sweep_table_and_plot(tmp_path: Path) -> None:
    events = synthetic.workload_events("skewed", synthetic.Shape(requests=60))
    results = sweep(events, [16 * MiB, 64 * MiB], ["lru", "reuse", "optimal"])
    assert [(r.budget, r.policy) for r in results][:3] == [
        (16 * MiB, "lru"),
        (16 * MiB, "reuse"),
        (16 * MiB, "optimal"),
    ]
    table = format_table(results)
    assert "16MiB" in table and "x lru" in table and "optimal" in table
    assert table.count("\n") == len(results) + 1
    png = plot(results, tmp_path / "saved.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results[0].to_json()["hit_ratio"] == results[0].hit_ratio


def test_trace_round_trip_and_bad_lines(tmp_path: Path) -> None:
    events = synthetic.workload_events("uniform", synthetic.Shape(requests=5))
    path = tmp_path / "t.jsonl"
    write_trace(path, events)
    assert list(read_trace(path)) == events
    good = path.read_text().splitlines()
    for bad, why in [
        ("{nope", "Expecting"),
        (json.dumps({"v": 99}), "unknown trace version"),
        (good[0].replace('"ev":"lookup"', '"ev":"evict"'), "unknown event"),
        (good[1].replace('"bytes":[', '"bytes":[-1,'), "non-negative"),
        (good[0].replace('"tokens":[', '"tokens":[1,'), "differ in length"),
    ]:
        path.write_text(good[0] + "\n" + bad + "\n")
        with pytest.raises(TraceFormatError, match=rf"t\.jsonl:2: .*{why}"):
            list(read_trace(path))


def test_trace_writer_holds_no_token_ids(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    writer = TraceWriter(path, page_tokens=128)
    tokens = np.arange(40_000, 40_300, dtype=np.int32)
    costs = CostModel()
    costs.observe_prefill(1000, 4.0)
    writer.lookup(b"\x01" * 16, tokens, 299, 256, "l3", costs)
    writer.record(b"\x01" * 16, tokens, 298)
    writer.learn_payloads(payload_bytes=128 * 1000, n_tokens=128)
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["ev"] for line in lines] == ["lookup", "record"]
    assert lines[0]["tokens"] == [128, 128, 43]
    assert lines[1]["bytes"] == [128_000, 128_000, 42_000]
    assert lines[0]["hit_tokens"] == 256 and lines[0]["prefill_s_per_token"] == 0.004
    assert lines[0]["restore_s_per_byte"] is None
    numbers = [n for line in lines for v in line.values() if isinstance(v, list) for n in v]
    assert not any(isinstance(n, int) and 40_000 <= n < 40_300 for n in numbers)
    assert all(len(k) == 16 for line in lines for k in line["keys"])


def test_cost_book_round_trip_and_garbage() -> None:
    book = CostBook()
    book.put("model-a", "CPU", CostRates(0.004, {"l3": 2e-9}, 1.0))
    book.put("model-a", "CUDA", CostRates(0.0001, {}, 2.0))
    again = CostBook.from_bytes(book.to_bytes())
    assert again.get("model-a", "CPU") == CostRates(0.004, {"l3": 2e-9}, 1.0)
    assert again.get("model-a", "CUDA") == CostRates(0.0001, {}, 2.0)
    assert again.get("model-b", "CPU") is None
    for raw in [b"\xff\xfe", b"[]", b'{"v":3,"entries":[]}']:
        book = CostBook.from_bytes(raw)
        assert len(book) == 0 and book.dropped == 1
    mixed = json.dumps(
        {
            "v": 1,
            "entries": [
                {"model_identity": "m", "backend": "CPU", "prefill_s_per_token": "fast"},
                {"model_identity": "m", "backend": "CPU", "prefill_s_per_token": float("nan")},
                {"model_identity": "m", "backend": "CPU", "prefill_s_per_token": 0.01},
                "junk",
            ],
        }
    ).encode()
    book = CostBook.from_bytes(mixed)
    assert book.dropped == 3
    assert book.get("m", "CPU") == CostRates(0.01, {}, 0.0)


def test_cost_book_seeds_a_restarted_cost_model() -> None:
    learned = CostModel()
    learned.observe_prefill(256, 1.0)
    learned.observe_restore(1_000_000, 0.002, tier="l3")
    book = CostBook()
    book.learn("m", "CPU", learned, now=5.0)
    fresh = CostModel()
    assert CostBook.from_bytes(book.to_bytes()).seed("m", "CPU", fresh)
    assert fresh.measured
    assert fresh.cold_cost(256) == pytest.approx(1.0)
    assert not CostBook().seed("m", "CPU", CostModel())


def test_reuse_policy_object_drives_the_simulator_directly() -> None:
    events = synthetic.workload_events("skewed", synthetic.Shape(requests=40))
    by_name = simulate(events, 32 * MiB, "reuse")
    by_object = simulate(events, 32 * MiB, ReusePolicy(32 * MiB))
    assert by_name == by_object


def test_a_restore_dearer_than_its_prefill_is_served_cold_as_live() -> None:
    """One page of 10 tokens and 1,000 bytes, looked up twice: at rates where the restore loses
    (a GPU build) the replay serves it cold and touches no page, as the live store does."""
    record = RecordEvent(0.0, ("a",), (10,), (1000,), 10)

    def lookup(prefill: float | None, restore: float | None) -> LookupEvent:
        return LookupEvent(0.0, ("a",), (10,), 11, 0, "cold", prefill, restore)

    sim = Simulator(1 << 20, LruPolicy())
    sim.step(record)
    assert sim.step(lookup(1e-3, 1e-4)) == 0  # restore 0.1 s > prefill 0.01 s
    assert sim.pages["a"].hits == 0
    assert sim.step(lookup(1e-3, 1e-6)) == 10  # restore 1 ms < prefill 10 ms
    assert sim.step(lookup(None, 1e-4)) == 10  # not measured yet: restores go ahead
    assert sim.pages["a"].hits == 2
