"""Counters and the L3 trace count what served a request, never a plan that did not.

Two planned L3 hits that L3 does not serve: one the cost model rejects, one whose pages fail
verification. Each must count and trace as the tier that actually served (a cold prefill here),
with the outputs of a cold model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore, CostModel
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.tiers.l3.schema import DATA
from skippy_llama.tiers.l3.trace import LookupEvent, read_trace

pytestmark = pytest.mark.model

DOC = "Every morning the ferry left the island at six and came back at noon with the post. " * 8
PROMPT = DOC + "\nQuestion: when did the ferry leave?\nAnswer:"


class PagesNeverPay(CostModel):
    """A machine where every L2/L3 restore loses to a prefill (a fast GPU, a tiny model)."""

    def pages_pay(
        self, moved_bytes: int, saved_tokens: int, *, tier: str, storage: bool = False
    ) -> bool:
        return False


def _settings(tmp_path: Path, trace: Path | None = None) -> Settings:
    l3: dict[str, Any] = {
        "mode": "fixed",
        "budget": "1GiB",
        "directory": str(tmp_path / "l3"),
        "minimum_free": "1GiB",
    }
    if trace is not None:
        l3["trace_file"] = str(trace)
    # L1 off: only L3 could serve the prompt in a new process
    return Settings(page_tokens=64, l1={"enabled": False}, l3=l3)


def _complete(llm: SkippyLlama) -> str:
    return str(llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"])


@pytest.fixture
def filled(smollm2_path: Path, tmp_path: Path) -> str:
    """An L3 directory holding PROMPT's pages; returns the cold answer."""
    llm = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=_settings(tmp_path)
    )
    try:
        answer = _complete(llm)
        assert llm.last_cache_event is not None and llm.last_cache_event.tier == "cold"
        assert llm.prefix_cache.disk is not None and llm.flush_cache(60)
    finally:
        llm.close()
    return answer


def _served(
    model: Path, tmp_path: Path, costs: CostModel
) -> tuple[str, Any, dict[str, Any], LookupEvent]:
    """PROMPT answered by a new instance with ``costs`` and a trace: its text, event, counters
    and the trace's one lookup."""
    trace = tmp_path / "trace.jsonl"
    llm = SkippyLlama(
        str(model),
        n_ctx=1024,
        verbose=False,
        cache_settings=_settings(tmp_path, trace),
        cost_model=costs,
    )
    try:
        text = _complete(llm)
        event = llm.last_cache_event
        counters = llm.cache_status()["counters"]
        assert llm.prefix_cache.trace is not None
        llm.prefix_cache.trace.close()
    finally:
        llm.close()
    lookups = [e for e in read_trace(trace) if isinstance(e, LookupEvent)]
    assert len(lookups) == 1
    return text, event, counters, lookups[0]


def test_a_hit_the_cost_model_rejects_counts_as_the_cold_prefill_that_served(
    smollm2_path: Path, tmp_path: Path, filled: str
) -> None:
    text, event, counters, lookup = _served(smollm2_path, tmp_path, PagesNeverPay())
    assert text == filled
    assert event.tier == "cold" and event.cached_tokens == 0
    assert counters["hits"] == {} and counters["misses"] == 1
    assert counters["restores_skipped"] == 1
    assert (lookup.tier, lookup.hit_tokens) == ("cold", 0)


def test_a_hit_whose_pages_fail_verification_counts_as_what_served(
    smollm2_path: Path, tmp_path: Path, filled: str
) -> None:
    import diskcache

    # damage every stored page: the plan still finds them (metadata), the fetch does not verify
    with diskcache.Cache(str(tmp_path / "l3")) as store:
        keys = [k for k in store.iterkeys() if isinstance(k, bytes) and k[:1] == DATA]
        assert keys
        for key in keys:
            value = store.get(key)
            assert isinstance(value, bytes)
            store.set(key, value[: len(value) // 2])
    text, event, counters, lookup = _served(smollm2_path, tmp_path, AlwaysRestore())
    assert text == filled
    assert event.tier == "cold" and event.cached_tokens == 0
    assert any("failed verification" in note for note in event.fallbacks)
    assert counters["hits"] == {} and counters["misses"] == 1
    assert counters["fallbacks"] == {"l3_short_read": 1}
    assert (lookup.tier, lookup.hit_tokens) == ("cold", 0)
