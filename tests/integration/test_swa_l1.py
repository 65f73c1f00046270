"""L1 on a sliding-window model (Gemma 3 270M, n_swa 512): resident prefixes stay exact.

A device checkpoint of a sliding-window model holds only the last ``n_swa`` cells of its
sliding-window layers (llama.cpp writes no masked cell), so a checkpoint longer than the window
is exact only at its full length: cut shorter, the logits were off by up to 9.0 (measured). The
runtime serves such a checkpoint only at full length and prefills cold otherwise; L2/L3 stay off
for SWA models (roster/split-certified.json says why). Every output is compared with a cold
prefill of plain ``llama_cpp.Llama`` (CPU, flash attention off).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from modelhelpers import TEXT, cold_logits, last_logits

from skippy_llama.config import Settings
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

KWARGS: dict[str, object] = {"n_ctx": 2048, "n_batch": 512, "flash_attn": False, "verbose": False}
LONG = 700  # past the 512-token window


@pytest.fixture(scope="module")
def tokens(gemma3_path: Path) -> list[int]:
    llm = llama_cpp.Llama(str(gemma3_path), vocab_only=True, verbose=False)
    try:
        tokens = llm.tokenize((TEXT * 8).encode())
    finally:
        llm.close()
    assert len(tokens) > LONG + 200
    return tokens


@pytest.fixture(scope="module")
def cold(gemma3_path: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(gemma3_path), **KWARGS)  # type: ignore[arg-type]
    yield llm
    llm.close()


def test_swa_checkpoints_serve_only_their_full_length(
    gemma3_path: Path, tokens: list[int], cold: llama_cpp.Llama
) -> None:
    llm = SkippyLlama(str(gemma3_path), cache_settings=Settings(), **KWARGS)
    assert llm.cache_identity.n_swa == 512
    assert llm.prefix_cache.resident is not None and llm.prefix_cache.resident.window == 512
    unrelated = [tokens[LONG + 150 + i] for i in range(40)]
    try:
        llm.create_completion(tokens[:LONG], max_tokens=1)
        llm.create_completion(unrelated, max_tokens=1)  # parks the 700-token prefix
        longer = tokens[: LONG + 20]
        llm.create_completion(longer, max_tokens=1)
        full = llm.last_cache_event
        got_full = last_logits(llm)
        llm.create_completion(unrelated[::-1], max_tokens=1)  # parks the 720-token prefix too
        shorter = tokens[:600] + unrelated[:30]  # shares 600 tokens with both checkpoints
        llm.create_completion(shorter, max_tokens=1)
        cut = llm.last_cache_event
        got_cut = last_logits(llm)
    finally:
        llm.close()
    # a checkpoint at its full length: reused and exact
    assert full is not None and full.tier == "l1" and full.cached_tokens == LONG
    assert np.array_equal(got_full, cold_logits(cold, longer))
    # cut shorter it would be wrong: a miss, prefilled cold, and exact
    assert cut is not None and cut.tier == "cold" and cut.cached_tokens == 0
    assert np.array_equal(got_cut, cold_logits(cold, shorter))


def test_the_live_sequence_is_never_cut_back_inside_a_sliding_window(
    gemma3_path: Path, tokens: list[int], cold: llama_cpp.Llama
) -> None:
    # cutting a Gemma 3 working sequence of 800 cells back to 511 and continuing gave logits off
    # by 0.93 (plain Llama's own prefix reuse too); SkippyLlama prefills such a prompt cold
    first = tokens[:800]
    second = tokens[:511] + tokens[800:860]
    want = cold_logits(cold, second)
    llm = SkippyLlama(str(gemma3_path), cache_settings=Settings(), **KWARGS)  # type: ignore[arg-type]
    try:
        llm.create_completion(first, max_tokens=1)
        llm.create_completion(second, max_tokens=1)
        event = llm.last_cache_event
        got = last_logits(llm)
    finally:
        llm.close()
    assert event is not None and event.cached_tokens == 0
    assert np.array_equal(got, want)
