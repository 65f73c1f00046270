"""A new tier is a new file: an in-memory page tier, defined in one file (the tests'
``fake_tiers.DictPages``) and registered with the tier factory here, serves real prompts end to
end with outputs equal to a cold model's.

Nothing in ``cache.py``, ``runtime/`` or the server knows this tier: it implements the page-tier
protocol (``tiers/base.py``) and is built by a factory added to ``tiers.factory``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fake_tiers import DictPages

from skippy_llama.config import Settings
from skippy_llama.costs import CostModel
from skippy_llama.runtime.baseline import ColdLlama
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.tiers import factory
from skippy_llama.tiers.base import PageTier, Tier

pytestmark = pytest.mark.model

DOC = "The harbour town kept its lighthouse lit through every winter storm. " * 12
QUESTIONS = ["Who kept the light?", "What season was hardest?", "Name the town."]


@pytest.fixture
def memory_tier(monkeypatch: pytest.MonkeyPatch) -> DictPages:
    tier = DictPages()

    def build(context: factory.TierContext, built: Sequence[Tier]) -> Tier | None:
        return tier if context.pageable else None

    monkeypatch.setattr(factory, "EXTRA_FACTORIES", [build])
    return tier


def test_a_tier_registered_in_a_test_serves_hits_equal_to_cold(
    smollm2_path: Path, memory_tier: DictPages, always_restore: CostModel
) -> None:
    assert isinstance(memory_tier, PageTier)
    args: dict[str, Any] = {"n_ctx": 1024, "verbose": False}
    prompts = [f"{DOC}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    cold = ColdLlama(str(smollm2_path), **args)
    try:
        want = []
        for p in prompts:
            done = cold.create_completion(p, max_tokens=12, temperature=0)
            assert isinstance(done, dict)
            want.append(done["choices"][0]["text"])
    finally:
        cold.close()
    # L1 off and L3 off: only the memory tier can serve; the tier needs a pageable layout,
    # which the runtime reads when a page tier asks for it
    settings = Settings(page_tokens=64, l1={"enabled": False})
    llm = SkippyLlama(str(smollm2_path), cache_settings=settings, cost_model=always_restore, **args)
    try:
        assert [t.name for t in llm.prefix_cache.tiers] == ["memory"]
        got, events = [], []
        for p in prompts:
            llm.reset()  # the live sequence would serve the shared document: leave it
            got.append(llm.create_completion(p, max_tokens=12, temperature=0)["choices"][0]["text"])
            events.append(llm.last_cache_event)
        status = llm.cache_status()
    finally:
        llm.close()
    assert got == want
    assert events[0] is not None and events[0].tier == "cold"
    for event in events[1:]:
        assert event is not None and event.tier == "memory" and event.cached_tokens > 100
    assert status["tiers"] == ["memory"]
    assert status["counters"]["hits"] == {"memory": 2} and memory_tier.fetches == 2
