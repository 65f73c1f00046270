"""L3 records that wait (``SkippyLlama.defer_record_tokens``).

On GPU builds no capture sits between a reply and the next request: a record is made when
another prompt takes the sequence, while idle or on close; the CPU build records every turn by
default, so these tests turn the deferral on to exercise it with the real model. Every
output is compared with plain ``llama_cpp.Llama`` prefilling each prompt cold, and what reached
L3 is read back by a fresh object with L1 off (a restart).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT

from skippy_llama.config import Settings
from skippy_llama.runtime import native
from skippy_llama.runtime.llama import DEFER_RECORD_TOKENS, SkippyLlama

pytestmark = [
    pytest.mark.model,
    # the counts below assume token-granular reuse; GPU builds (granule n_ubatch) defer by
    # default, so every GPU run of the other L3 suites exercises the waiting records
    pytest.mark.skipif(
        native.backend_name() != "CPU" or os.environ.get("SKIPPY_TEST_GPU_LIKE") == "1",
        reason="counts written for the CPU build's granule",
    ),
]

N_CTX = 1024
MAX_TOKENS = 8
OTHER = (
    "The baker rose long before dawn, when the street outside was still dark and silent. She lit "
    "the oven first, because it needed an hour to reach the heat that gives bread its crust. Then "
    "she weighed the flour, the water, the salt and a spoonful of the old dough kept from "
    "yesterday, which carried the wild yeast her grandmother had first caught decades ago. "
)
MORE = [
    " The next morning the keeper found",
    " By noon the fog had lifted and",
    " That evening, before the first flash,",
]


def settings(directory: Path, *, l1: bool = True) -> Settings:
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(directory), "minimum_free": "1GiB"}
    return Settings(l1={"enabled": l1}, l3=l3)


def complete(llm: llama_cpp.Llama, prompt: str) -> str:
    done = llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert isinstance(done, dict)
    return str(done["choices"][0]["text"])


def continuation(llm: llama_cpp.Llama, turns: int = len(MORE)) -> tuple[list[str], list[str]]:
    """A raw-text chat: each prompt is the previous prompt, its reply and a new line."""
    prompts, outputs = [TEXT], []
    for i in range(turns + 1):
        outputs.append(complete(llm, prompts[-1]))
        if i < turns:
            prompts.append(prompts[-1] + outputs[-1] + MORE[i])
    return prompts, outputs


def cold(smollm2_path: Path, prompts: list[str]) -> list[str]:
    plain = llama_cpp.Llama(str(smollm2_path), n_ctx=N_CTX, verbose=False)
    try:
        out = []
        for prompt in prompts:
            plain.reset()
            out.append(complete(plain, prompt))
        return out
    finally:
        plain.close()


@contextlib.contextmanager
def deferring(
    smollm2_path: Path, directory: Path, tokens: int = DEFER_RECORD_TOKENS
) -> Iterator[SkippyLlama]:
    """A SkippyLlama whose records wait up to ``tokens``; closed (making them) on exit."""
    llm = SkippyLlama(
        str(smollm2_path), n_ctx=N_CTX, verbose=False, cache_settings=settings(directory)
    )
    assert llm.defer_record_tokens == 0  # the CPU build records every turn by default
    llm.defer_record_tokens = tokens
    try:
        yield llm
    finally:
        llm.close()


def restored(smollm2_path: Path, directory: Path, prompt: str) -> tuple[str, Any]:
    """A restart's answer to ``prompt`` from L3 alone, and its cache event."""
    llm = SkippyLlama(
        str(smollm2_path), n_ctx=N_CTX, verbose=False, cache_settings=settings(directory, l1=False)
    )
    try:
        return complete(llm, prompt), llm.last_cache_event
    finally:
        llm.close()


def test_a_growing_sequence_is_recorded_once_on_close_with_cold_outputs(
    smollm2_path: Path, tmp_path: Path
) -> None:
    with deferring(smollm2_path, tmp_path / "l3") as llm:
        prompts, outputs = continuation(llm)
        counters = llm.prefix_cache.counters
        # no turn captured anything: each one's record waited, the later ones replacing it
        assert (counters.records, counters.records_deferred) == (0, len(MORE) + 1)
    assert counters.records == 1
    assert outputs == cold(smollm2_path, prompts)

    answer, event = restored(smollm2_path, tmp_path / "l3", prompts[-1])
    assert answer == outputs[-1]
    assert event.tier == "l3" and event.cached_tokens >= event.prompt_tokens - 8


def test_a_waiting_record_is_made_before_another_prompt_takes_the_sequence(
    smollm2_path: Path, tmp_path: Path
) -> None:
    with deferring(smollm2_path, tmp_path / "l3") as llm:
        prompts, outputs = continuation(llm, turns=2)
        counters = llm.prefix_cache.counters
        assert counters.records_deferred == 3 and counters.records == 0
        other = complete(llm, OTHER)
        # the waiting one, made before OTHER took the cells; OTHER's own record waits
        assert (counters.records, counters.records_deferred) == (1, 4)
        disk = llm.prefix_cache.disk
        assert disk is not None and disk.flush(60)
        # read back while this process still runs: nothing waited for close()
        answer, event = restored(smollm2_path, tmp_path / "l3", prompts[-1])
    assert answer == outputs[-1] and event.tier == "l3"
    assert [*outputs, other] == cold(smollm2_path, [*prompts, OTHER])


def test_prepare_next_turn_makes_the_waiting_record(smollm2_path: Path, tmp_path: Path) -> None:
    with deferring(smollm2_path, tmp_path / "l3") as llm:
        continuation(llm, turns=1)
        counters = llm.prefix_cache.counters
        assert (counters.records, counters.records_deferred) == (0, 2)
        llm.prepare_next_turn()
        assert counters.records == 1
        llm.prepare_next_turn()
        assert counters.records == 1  # nothing waits any more


def test_flush_cache_makes_the_waiting_record_durable_while_the_process_runs(
    smollm2_path: Path, tmp_path: Path
) -> None:
    with deferring(smollm2_path, tmp_path / "l3") as llm:
        prompts, outputs = continuation(llm, turns=1)
        counters = llm.prefix_cache.counters
        assert (counters.records, counters.records_deferred) == (0, 2)
        assert llm.flush_cache(60)
        assert counters.records == 1
        answer, event = restored(smollm2_path, tmp_path / "l3", prompts[-1])
        assert llm.flush_cache(60) and counters.records == 1  # nothing waits any more
    assert answer == outputs[-1] == cold(smollm2_path, prompts[-1:])[0]
    assert event.tier == "l3"


def test_a_record_waits_only_below_its_token_bound(smollm2_path: Path, tmp_path: Path) -> None:
    with deferring(smollm2_path, tmp_path / "l3", tokens=4) as llm:
        continuation(llm, turns=2)
        counters = llm.prefix_cache.counters
        # every turn adds more than 4 tokens: each is recorded at once
        assert (counters.records, counters.records_deferred) == (3, 0)


def test_cells_cleared_behind_the_cache_are_never_recorded(
    smollm2_path: Path, tmp_path: Path
) -> None:
    with deferring(smollm2_path, tmp_path / "l3") as llm:
        prompts, outputs = continuation(llm, turns=1)
        assert llm.prefix_cache.counters.records_deferred == 2
        llm._ctx.kv_cache_clear()  # what llama-cpp-python's multimodal handlers do
        llm.reset()  # leaves the sequence: the waiting record finds no cells to capture
        assert llm.prefix_cache.counters.records == 0
    answer, _ = restored(smollm2_path, tmp_path / "l3", prompts[-1])
    assert answer == outputs[-1] == cold(smollm2_path, prompts[-1:])[0]
