"""Prometheus metrics of the server: per-request counters and histograms, tier gauges at scrape.

Request metrics are observed when a request finishes; tier sizes and the cache's own counters
(every field of :class:`~skippy_llama.counters.CacheCounters`, as ``skippy_cache_<name>`` unless
the field names another) are read from a :class:`~.snapshot.TierSnapshot` when scraped, so
they cannot drift from what ``/v1/kv-cache/status`` reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..counters import metric_fields
from ..events import CacheEvent
from .history import RequestRecord
from .snapshot import L3_STATES, SnapshotCache

#: TTFT spans a cached 1 ms turn to a cold multi-second prefill on two CPU cores.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _TierCollector(Collector):
    def __init__(self, snapshots: SnapshotCache) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshots.get()
        yield from _counter_metrics(snap.counters)

        l1 = snap.l1
        yield _gauge("skippy_l1_resident_prefixes", "Prefixes resident in the context", l1.prefixes)
        yield _gauge("skippy_l1_resident_tokens", "Tokens of the resident prefixes", l1.tokens)
        yield _gauge("skippy_l1_budget_tokens", "Resident-token budget", l1.budget_tokens)

        l2 = snap.l2
        yield _gauge("skippy_l2_enabled", "1 when the L2 RAM mirror is on", int(l2 is not None))
        yield _gauge(
            "skippy_l2_used_bytes", "Bytes in the L2 RAM mirror", l2.used_bytes if l2 else 0
        )
        yield _gauge("skippy_l2_budget_bytes", "L2 budget", l2.budget_bytes if l2 else 0)
        yield _gauge("skippy_l2_pages", "Pages in the L2 RAM mirror", l2.pages if l2 else 0)

        l3 = snap.l3
        state = GaugeMetricFamily(
            "skippy_l3_state", "1 for the L3 disk tier's current state", labels=["state"]
        )
        current = l3.state if l3 is not None else "off"
        for name in L3_STATES:
            state.add_metric([name], int(name == current))
        yield state
        usage = l3.usage if l3 is not None else None
        yield _gauge(
            "skippy_l3_used_bytes", "Bytes in the L3 store", usage.used_bytes if usage else 0
        )
        yield _gauge("skippy_l3_budget_bytes", "L3 budget", usage.budget_bytes if usage else 0)
        yield _gauge("skippy_l3_pages", "Pages in the L3 store", usage.pages if usage else 0)
        yield _gauge(
            "skippy_l3_prefixes", "Prefixes (manifests) in L3", usage.manifests if usage else 0
        )
        yield _gauge(
            "skippy_l3_quarantined", "Quarantined L3 entries", usage.quarantined if usage else 0
        )
        remote = snap.others.get("remote")
        if remote is not None:
            yield from _remote_metrics(remote)


def _counter_metrics(counters: dict[str, Any]) -> Iterator[Metric]:
    """Every cache counter (:func:`~skippy_llama.counters.metric_fields`): a count, or one
    sample per key for the counts kept by a key (tier, reason)."""
    for spec in metric_fields():
        value = counters.get(spec.name)
        if spec.label is None:
            family = CounterMetricFamily(spec.metric, spec.doc)
            family.add_metric([], value or 0)
        else:
            family = CounterMetricFamily(spec.metric, spec.doc, labels=[spec.label])
            for key, n in sorted((value or {}).items()):
                family.add_metric([key], n)
        yield family


def _remote_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """The remote tier: its breaker, this process's activity and failures by reason."""
    breaker = GaugeMetricFamily(
        "skippy_remote_breaker", "1 for the remote tier breaker's state", labels=["state"]
    )
    current = status.get("breaker", {}).get("state", "closed")
    for name in ("closed", "open", "half_open"):
        breaker.add_metric([name], int(name == current))
    yield breaker
    activity = CounterMetricFamily(
        "skippy_remote_activity",
        "Remote tier activity (requests, hits, misses, bytes in and out, pages sent ...)",
        labels=["event"],
    )
    for name, n in sorted(status.get("activity", {}).items()):
        activity.add_metric([name], n)
    yield activity
    failures = CounterMetricFamily(
        "skippy_remote_failures", "Remote server failures, by reason", labels=["reason"]
    )
    for reason, n in sorted(status.get("failures", {}).items()):
        failures.add_metric([reason], n)
    yield failures


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc)
    gauge.add_metric([], value)
    return gauge


class ServerMetrics:
    """The server's own registry (not prometheus_client's global one, which a host app owns)."""

    def __init__(self, snapshots: SnapshotCache) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "skippy_requests", "Completed requests", ["endpoint", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("skippy_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("skippy_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "skippy_cached_tokens", "Prompt tokens reused, by the tier that served them", ["tier"],
            registry=r,
        )  # fmt: skip
        self.restored_bytes = Counter(
            "skippy_restored_bytes", "KV state bytes restored, by tier", ["tier"], registry=r
        )
        self.restore_seconds = Histogram(
            "skippy_restore_seconds", "Time to restore a cached prefix, by tier", ["tier"],
            buckets=RESTORE_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "skippy_ttft_seconds", "Time to first token, by the tier that served the prompt",
            ["tier"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_TierCollector(snapshots))

    def observe(self, record: RequestRecord) -> None:
        self.requests.labels(record.endpoint, record.outcome).inc()
        if record.outcome != "ok" or not record.prompt_tokens:
            return
        self.prompt_tokens.inc(record.prompt_tokens)
        self.completion_tokens.inc(record.completion_tokens)
        self.ttft_seconds.labels(record.tier).observe(record.ttft_ms / 1e3)
        if record.tier != "cold":
            self.cached_tokens.labels(record.tier).inc(record.cached_tokens)
            self.restored_bytes.labels(record.tier).inc(record.restored_bytes)
            self.restore_seconds.labels(record.tier).observe(record.restore_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def record_from_event(
    endpoint: str, at: float, event: CacheEvent | None, completion_tokens: int, outcome: str
) -> RequestRecord:
    """A :class:`RequestRecord` from the model's ``last_cache_event`` (None: nothing was run)."""
    if event is None:
        return RequestRecord(at=at, endpoint=endpoint, outcome=outcome)
    return RequestRecord(
        at=at,
        endpoint=endpoint,
        outcome=outcome,
        tier=event.tier,
        prompt_tokens=event.prompt_tokens,
        cached_tokens=event.cached_tokens,
        completion_tokens=completion_tokens,
        restored_bytes=event.restored_bytes,
        restore_ms=event.restore_ms,
        park_ms=event.park_ms,
        ttft_ms=event.ttft_ms,
        fallbacks=list(event.fallbacks),
    )
