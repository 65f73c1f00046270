"""A trace recorded from a real-model run replays to the live run's hits; it holds no tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from modelhelpers import TEXT

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.tiers.l3.policy_api import LruPolicy
from skippy_llama.tiers.l3.simulate import Simulator
from skippy_llama.tiers.l3.trace import LookupEvent, read_trace

pytestmark = pytest.mark.model

PAGE = 128
OTHER = (
    "The baker rose long before dawn, when the street outside was still dark and silent. She lit "
    "the oven first, because it needed an hour to reach the heat that gives bread its crust. "
)
DOCS = [TEXT * 2, OTHER * 4, "Minutes of the harbour board. " + TEXT]
QUESTIONS = ["The keeper wrote that", "Her first customer said", "The board decided to"]


def test_replayed_trace_matches_live_l3_hits(smollm2_path: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "trace.jsonl"
    settings = Settings(
        page_tokens=PAGE,
        l1={"enabled": False},
        l3={
            "mode": "fixed",
            "budget": "1GiB",  # nothing is evicted: hits depend only on what was recorded
            "directory": str(tmp_path / "l3"),
            "minimum_free": "1GiB",
            "trace_file": str(trace_path),
        },
    )
    # restores forced: a GPU build's measured costs may serve these short prompts cold
    llm = SkippyLlama(
        str(smollm2_path),
        n_ctx=1024,
        verbose=False,
        cache_settings=settings,
        cost_model=AlwaysRestore(),
    )
    live: list[tuple[str, int]] = []
    prompt_ids = set(llm.tokenize(DOCS[0].encode())) - set(range(PAGE + 1))
    try:
        # consecutive prompts start with different documents: the live sequence never helps,
        # so every hit after the first round is an L3 restore
        for round_ in range(3):
            for doc, question in zip(DOCS, QUESTIONS, strict=True):
                llm.create_completion(f"{doc}{question} {round_}", max_tokens=4, temperature=0.0)
                event = llm.last_cache_event
                assert event is not None
                live.append((event.tier, event.cached_tokens))
                disk = llm.prefix_cache.disk
                assert disk is not None
                # the writer's asynchrony, bounded to zero: each record is stored before the
                # next lookup, as the replay assumes
                assert llm.flush_cache(30)
        trace = llm.prefix_cache.trace
        assert trace is not None
        assert llm.prefix_cache.counters.restores_skipped == 0
        trace.close()
    finally:
        llm.close()

    raw = trace_path.read_text()
    events = list(read_trace(trace_path))
    lookups = [e for e in events if isinstance(e, LookupEvent)]
    assert len(lookups) == len(live) == 9
    assert len(events) == 18  # a record line per request, also when L3 held it all
    assert [(e.tier, e.hit_tokens) for e in lookups] == live
    assert sum(n for tier, n in live if tier == "l3") > 0

    sim = Simulator(1 << 30, LruPolicy(), low_watermark=1.0)
    replayed = [sim.step(e) for e in events]
    served = [n for e, n in zip(events, replayed, strict=True) if isinstance(e, LookupEvent)]
    for (tier, hit), sim_hit in zip(live, served, strict=True):
        # the replay counts whole aligned pages; the live store also uses the head of a page
        # where a prompt branches off inside it: at most one page less, never more
        assert 0 <= hit - sim_hit < PAGE, (tier, hit, sim_hit)
    assert sum(served) >= 3 * PAGE

    # safe to share: no token ids, no text
    allowed = {
        "lookup": {"v", "ev", "t", "keys", "tokens", "prompt_tokens", "hit_tokens", "tier"}
        | {"prefill_s_per_token", "restore_s_per_byte"},
        "record": {"v", "ev", "t", "keys", "tokens", "bytes", "n_tokens"},
    }
    for line in raw.splitlines():
        obj = json.loads(line)
        assert set(obj) == allowed[obj["ev"]]
        assert all(0 < n <= PAGE for n in obj["tokens"])  # counts, not ids
        assert all(len(k) == 16 and int(k, 16) >= 0 for k in obj["keys"])
    for word in ("lighthouse", "baker", "harbour", "keeper"):
        assert word not in raw
    counts = {n for e in events for n in e.tokens}
    assert not (counts & prompt_ids)
    record_bytes = [b for e in events if not isinstance(e, LookupEvent) for b in e.bytes]
    assert min(record_bytes) > 0  # the payload bytes per token were learned
