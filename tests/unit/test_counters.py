"""The cache counters: written through the cache, read as one ``asdict`` everywhere, and what
counts as a hit (a meaningful share of the prompt, not the chat template's first tokens)."""

from __future__ import annotations

from dataclasses import asdict, fields

import numpy as np
from prometheus_client import generate_latest
from test_cache_tree import IDENTITY

from skippy_llama.cache import PrefixCache
from skippy_llama.counters import HIT_SHARE, CacheCounters, is_hit, metric_fields
from skippy_llama.plan import Prompt, RestoreOutcome, RestorePlan
from skippy_llama.prefetch import PrefetchResult
from skippy_llama.server.history import RequestHistory, RequestRecord
from skippy_llama.server.metrics import ServerMetrics
from skippy_llama.server.snapshot import SnapshotCache, TierSnapshot


def test_a_hit_reuses_a_quarter_of_the_prompt() -> None:
    assert HIT_SHARE == 0.25
    assert is_hit(185, 740) and is_hit(739, 740)
    assert not is_hit(184, 740)
    assert not is_hit(12, 740)  # the chat template's first tokens: a short match
    assert not is_hit(0, 0) and not is_hit(0, 10)


def _serve(cache: PrefixCache, n_prompt: int, reused: int, tier: str = "l1") -> None:
    plan = RestorePlan(tier if reused else "cold", reused, reused)
    tokens = np.arange(n_prompt, dtype=np.int32)
    cache.commit(plan, RestoreOutcome(plan), Prompt(tokens=tokens, limit=n_prompt - 1))


def test_the_cache_counts_short_matches_apart_from_hits() -> None:
    cache = PrefixCache(identity=IDENTITY, page_tokens=16)
    _serve(cache, 740, 12)
    _serve(cache, 748, 12)
    _serve(cache, 740, 700)
    _serve(cache, 740, 0)
    counts = cache.counters_json()
    assert counts["lookups"] == 4 and counts["misses"] == 1
    assert counts["hits"] == {"l1": 1} and counts["short_matches"] == {"l1": 2}


def test_every_counter_is_in_the_json_and_written_through_the_cache() -> None:
    cache = PrefixCache(identity=IDENTITY, page_tokens=16)
    cache.count_deferred()
    cache.count_prepared(40)
    cache.count_parked_ahead()
    cache.count_prepared(8)
    cache.count_prefetch(PrefetchResult(pages=3, bytes=300, stopped="complete"))
    cache.count_prefetch(PrefetchResult(stopped="miss"))
    cache.fallback("record: OSError")
    counts = cache.counters_json()
    assert set(counts) == {f.name for f in fields(CacheCounters)}
    assert counts["records_deferred"] == 1
    assert (counts["turns_prepared"], counts["tokens_prepared"], counts["parked_ahead"]) == (
        2,
        48,
        1,
    )
    assert (counts["prefetches"], counts["prefetched_pages"], counts["prefetched_bytes"]) == (
        2,
        3,
        300,
    )
    assert counts["prefetch_misses"] == 1 and counts["fallbacks"] == {"record: OSError": 1}
    counts["hits"]["l9"] = 5  # a copy: the live counters are untouched
    assert "l9" not in cache.counters.hits


def test_every_counter_is_a_metric() -> None:
    cache = PrefixCache(identity=IDENTITY, page_tokens=16)
    _serve(cache, 100, 90)
    _serve(cache, 100, 5)
    cache.count_deferred()

    class _Llm:
        prefix_cache = cache

    metrics = ServerMetrics(SnapshotCache(lambda: _Llm()))  # type: ignore[arg-type,return-value]
    text = generate_latest(metrics.registry).decode()
    names = [spec.metric for spec in metric_fields()]
    assert len(names) == len(fields(CacheCounters))
    for name in names:
        assert f"# TYPE {name}_total counter" in text, name
    assert 'skippy_cache_hits_total{tier="l1"} 1.0' in text
    assert 'skippy_cache_short_matches_total{tier="l1"} 1.0' in text
    assert "skippy_cache_records_deferred_total 1.0" in text
    assert "skippy_turns_prepared_total 0.0" in text  # documented names are kept


def test_a_server_without_a_model_shows_every_counter_at_zero() -> None:
    snap: TierSnapshot = SnapshotCache(lambda: None).get()
    assert snap.counters_json() == asdict(CacheCounters())
    assert snap.counters_json()["records_deferred"] == 0


def test_the_request_history_applies_the_same_rule() -> None:
    history = RequestHistory()
    for cached, prompt in ((12, 740), (12, 748), (700, 740), (0, 740)):
        history.add(
            RequestRecord(
                at=0.0,
                endpoint="chat",
                outcome="ok",
                tier="l1" if cached else "cold",
                prompt_tokens=prompt,
                cached_tokens=cached,
            )
        )
    totals = history.totals()
    assert totals["hit_rate"] == 0.25 and totals["hits"] == 1
    assert totals["short_matches"] == 2 and totals["hit_share"] == HIT_SHARE
    assert [r.to_json()["hit"] for r in history.recent()] == [False, False, True, False]
