"""The prefix cache's in-process counters, and what counts as a hit.

:class:`~skippy_llama.cache.PrefixCache` is their only writer (``commit`` and its ``count_*``
methods); everything that shows them reads one ``dataclasses.asdict`` of them
(``PrefixCache.counters_json``): ``SkippyLlama.cache_status()["counters"]``, the server's
``/v1/kv-cache/status`` and status page, and ``/metrics`` (:func:`metric_fields`). A counter
added here therefore shows everywhere without another edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

#: A request is a *hit* when it reused at least this share of its prompt's tokens. A shorter
#: match is counted apart (``short_matches``): every chat prompt starts with the template's
#: opening tokens (a dozen for SmolLM2), so a match on them alone reuses ~1 % of a 700-token
#: prompt and saves nothing anyone can see, while a quarter of the prefill is a visible share
#: of the time to first token. A share, not a page count: an L1 copy reuses token-exact
#: prefixes shorter than a page, and the server's request history applies the same rule to
#: the two numbers it keeps (prompt and cached tokens) without knowing the page size.
HIT_SHARE = 0.25


def is_hit(reused_tokens: int, prompt_tokens: int) -> bool:
    """Whether reusing ``reused_tokens`` of a ``prompt_tokens`` prompt counts as a hit."""
    return reused_tokens > 0 and reused_tokens >= HIT_SHARE * prompt_tokens


def _count(doc: str, metric: str | None = None) -> Any:
    """A plain count's field."""
    return field(default=0, metadata={"doc": doc, "metric": metric})


def _by(label: str, doc: str, metric: str | None = None) -> dict[str, Any]:
    """The metadata of a field that counts by ``label`` (``field(default_factory=dict, ...)``:
    a field() call of its own, so that linters see the mutable default is made per instance)."""
    return {"doc": doc, "metric": metric, "label": label}


@dataclass
class CacheCounters:
    """What the prefix cache did since it was opened; each field's metadata says what it
    counts (``doc``), its Prometheus name when not ``skippy_cache_<name>`` (``metric``) and,
    for counts kept by a key, the key's label (``label``).

    Plain dicts, not ``collections.Counter``: ``dataclasses.asdict`` rebuilds a ``Counter``
    from its items and so miscounts it.
    """

    lookups: int = _count("Prefix-cache lookups (requests)")
    hits: dict[str, int] = field(
        default_factory=dict,
        metadata=_by(
            "tier", "Requests that reused at least a quarter of their prompt, by the serving tier"
        ),
    )
    short_matches: dict[str, int] = field(
        default_factory=dict,
        metadata=_by(
            "tier", "Requests that reused less than a quarter of their prompt, by the serving tier"
        ),
    )
    misses: int = _count("Requests that reused nothing")
    fallbacks: dict[str, int] = field(
        default_factory=dict,
        metadata=_by(
            "reason",
            "Tier faults turned into a shallower hit or a cold prefill, by reason",
            metric="skippy_fallbacks",
        ),
    )
    parked: int = _count("Prefixes checkpointed in L1")
    parked_ahead: int = _count(
        "Of parked, chats checkpointed between requests (SkippyLlama.prepare_next_turn)"
    )
    park_skipped: int = _count("L1 checkpoints not taken: they would not pay or fit")
    records: int = _count("Records (new pages) a tier took")
    records_skipped: int = _count("Records not made: their pages were all stored already")
    records_deferred: int = _count(
        "Records left for a later turn (SkippyLlama.defer_record_tokens)"
    )
    restores_skipped: int = _count(
        "Requests served shallower or cold: the measured costs said the restore would lose"
    )
    turns_prepared: int = _count(
        "Replies re-decoded between requests for their next turn", metric="skippy_turns_prepared"
    )
    tokens_prepared: int = _count("Tokens of the replies re-decoded between requests")
    prefetches: int = _count("Prefetches asked for (PrefixCache.prefetch)")
    prefetched_pages: int = _count(
        "L3 pages copied into L2 between requests for the conversations likely next",
        metric="skippy_prefetched_pages",
    )
    prefetched_bytes: int = _count("Bytes of the prefetched pages")
    prefetch_misses: int = _count("Prefetches that ended on an L3 miss or a fault")


@dataclass(frozen=True)
class MetricField:
    """How one counter is exported to Prometheus."""

    name: str
    metric: str
    doc: str
    label: str | None


def metric_fields() -> list[MetricField]:
    """Every counter's Prometheus name, help text and label (None: a plain count)."""
    return [
        MetricField(
            f.name,
            f.metadata["metric"] or f"skippy_cache_{f.name}",
            f.metadata["doc"],
            f.metadata.get("label"),
        )
        for f in fields(CacheCounters)
    ]
