"""Recent requests, kept in memory for the status page's charts over time."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from ..counters import HIT_SHARE, is_hit


@dataclass(frozen=True)
class RequestRecord:
    """What one served request got from the cache (``at`` is a Unix time)."""

    at: float
    endpoint: str
    outcome: str  # ok, error, or cancelled (the client went away mid-stream)
    tier: str = "cold"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    restored_bytes: int = 0
    restore_ms: float = 0.0
    #: checkpointing the conversation the request left (0 when it was resident already)
    park_ms: float = 0.0
    ttft_ms: float = 0.0
    fallbacks: list[str] = field(default_factory=list)

    @property
    def hit(self) -> bool:
        """Whether the request reused a meaningful share of its prompt (``counters.is_hit``)."""
        return is_hit(self.cached_tokens, self.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit": self.hit}


class RequestHistory:
    """The latest ``capacity`` requests plus running totals since start."""

    def __init__(self, capacity: int = 600) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.requests = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.by_tier: dict[str, int] = {}
        self.hits = 0
        #: requests that reused some of their prompt, too little to count as a hit
        self.short_matches = 0

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)
            self.requests += 1
            self.errors += record.outcome != "ok"
            self.prompt_tokens += record.prompt_tokens
            self.cached_tokens += record.cached_tokens
            self.by_tier[record.tier] = self.by_tier.get(record.tier, 0) + 1
            self.hits += record.hit
            self.short_matches += record.cached_tokens > 0 and not record.hit

    def recent(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def totals(self) -> dict[str, Any]:
        with self._lock:
            served = sum(self.by_tier.values())
            return {
                "requests": self.requests,
                "errors": self.errors,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "cached_share": self.cached_tokens / self.prompt_tokens
                if self.prompt_tokens
                else 0.0,
                "hit_rate": self.hits / served if served else 0.0,
                "hits": self.hits,
                "short_matches": self.short_matches,
                # a hit reused at least this share of its prompt's tokens
                "hit_share": HIT_SHARE,
                "by_tier": dict(self.by_tier),
            }
