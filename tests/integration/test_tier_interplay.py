"""L1 stream copies and L2/L3 restores in one context never mix their bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelhelpers import TEXT

from skippy_llama.config import Settings
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model


def test_a_parked_prefix_survives_a_following_l3_restore(
    tmp_path: Path, smollm2_path: Path
) -> None:
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    other = "Ships and harbours: " + TEXT[::-1][:900]
    first = TEXT + " So the keeper wrote:"
    # fill L3 with `other` from a separate instance, and take a cold reference for `first`
    filler = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3)
    )
    try:
        filler.create_completion(other, max_tokens=2, temperature=0.0)
        filler.reset()
        cold = filler.create_completion(first + " again", max_tokens=8, temperature=0.0)
    finally:
        filler.close()

    llm = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3))
    try:
        llm.create_completion(first, max_tokens=4, temperature=0.0)  # parked in a resident stream
        llm.create_completion(other, max_tokens=2, temperature=0.0)  # restored from L3
        assert llm.last_cache_event is not None and llm.last_cache_event.tier == "l3"
        warm = llm.create_completion(first + " again", max_tokens=8, temperature=0.0)
        assert llm.last_cache_event.tier == "l1"
    finally:
        llm.close()
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
