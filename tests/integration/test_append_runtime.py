"""An L1 prefix continued by L3 pages (append import), with the real SmolLM2 model.

On a patched library whose roster row certifies ``append_import_exact``, a prompt whose L1 prefix
(the live sequence or a resident checkpoint) is shorter than what L3 holds keeps the L1 part and
append-imports only the pages past it; on a stock library the same prompt restores every page from
L3 (today's path). Either way the logits are bit-identical to a cold prefill (CPU, flash
attention off), and the event says which split was taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from modelhelpers import TEXT, aligned, cold_logits, last_logits

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.events import CacheEvent
from skippy_llama.runtime import native_ext
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

PATCHED = native_ext.abi_version() is not None
N_CTX = 1024
#: the long document L3 holds, the shorter prefix L1 gets, and the page size
LONG, SHORT, PAGE = 400, 150, 64


def _kwargs() -> dict[str, object]:
    # restores forced: a GPU build's measured costs may prefill these short prompts instead
    return {
        "n_ctx": N_CTX,
        "n_batch": 512,
        "flash_attn": False,
        "verbose": False,
        "cost_model": AlwaysRestore(),
    }


def _settings(directory: Path) -> Settings:
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(directory), "minimum_free": "1GiB"}
    return Settings(l3=l3, page_tokens=PAGE)


@pytest.fixture(scope="module")
def tokens(smollm2_path: Path) -> list[int]:
    llm = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize((TEXT * 4).encode())
    finally:
        llm.close()


@pytest.fixture(scope="module")
def cold(smollm2_path: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(smollm2_path), **_kwargs())  # type: ignore[arg-type]
    yield llm
    llm.close()


@pytest.fixture
def filled(smollm2_path: Path, tokens: list[int], tmp_path: Path) -> Path:
    """An L3 directory holding the pages of ``tokens[:LONG]`` (written by another instance)."""
    llm = SkippyLlama(str(smollm2_path), cache_settings=_settings(tmp_path), **_kwargs())
    try:
        llm.eval(tokens[:LONG])
        assert llm.prefix_cache.disk is not None and llm.flush_cache()
    finally:
        llm.close()
    return tmp_path


def _expect_split(llm: SkippyLlama, event: CacheEvent | None, n_cached: int) -> None:
    """Patched and certified: L1 prefix + appended pages; otherwise every page from L3.

    Reuse ends on whole granules (GPU builds: see ``SkippyLlama.granule``).
    """
    assert event is not None
    assert event.tier == "l3"
    assert event.cached_tokens == aligned(llm, n_cached)
    if llm.native_verdict.append_import:
        assert event.l1_tokens == aligned(llm, SHORT)
        assert event.appended_tokens == event.cached_tokens - event.l1_tokens
    else:
        assert event.l1_tokens == event.appended_tokens == 0


def test_live_prefix_continued_by_l3_pages(
    smollm2_path: Path, tokens: list[int], filled: Path, cold: llama_cpp.Llama
) -> None:
    llm = SkippyLlama(str(smollm2_path), cache_settings=_settings(filled), **_kwargs())
    try:
        # the live sequence shares SHORT tokens with the pages L3 holds, then differs
        other = tokens[LONG + 50 : LONG + 90]
        assert other[0] != tokens[SHORT]
        llm.create_completion(tokens[:SHORT] + other, max_tokens=1)
        prompt = tokens[: LONG + 20]
        llm.create_completion(prompt, max_tokens=1)
        event = llm.last_cache_event
        got = last_logits(llm)
    finally:
        llm.close()
    _expect_split(llm, event, LONG - 2)
    assert np.array_equal(got, cold_logits(cold, prompt))


def test_resident_prefix_continued_by_l3_pages(
    smollm2_path: Path, tokens: list[int], filled: Path, cold: llama_cpp.Llama
) -> None:
    llm = SkippyLlama(str(smollm2_path), cache_settings=_settings(filled), **_kwargs())
    try:
        # the resident checkpoint shares SHORT tokens with the pages L3 holds
        llm.create_completion(tokens[:SHORT] + tokens[LONG + 50 : LONG + 90], max_tokens=1)
        llm.create_completion(tokens[LONG + 100 : LONG + 140], max_tokens=1)  # parks it
        prompt = tokens[: LONG + 20]
        llm.create_completion(prompt, max_tokens=1)
        event = llm.last_cache_event
        got = last_logits(llm)
    finally:
        llm.close()
    assert event is not None
    _expect_split(llm, event, LONG - 2)
    assert np.array_equal(got, cold_logits(cold, prompt))


@pytest.mark.certified_backend
@pytest.mark.skipif(not PATCHED, reason="needs the patched llama.cpp build")
def test_a_refused_append_falls_back_and_stays_exact(
    smollm2_path: Path,
    tokens: list[int],
    filled: Path,
    cold: llama_cpp.Llama,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: the library refuses the append; the request falls back to what L1 alone
    holds (the live prefix the append was to continue, left in place) and stays exact."""
    llm = SkippyLlama(str(smollm2_path), cache_settings=_settings(filled), **_kwargs())
    try:
        llm.create_completion(tokens[:SHORT] + tokens[LONG + 50 : LONG + 90], max_tokens=1)
        monkeypatch.setattr(native_ext, "append_import", lambda *_: False)
        prompt = tokens[: LONG + 20]
        llm.create_completion(prompt, max_tokens=1)
        event = llm.last_cache_event
        got = last_logits(llm)
        fallbacks = dict(llm.prefix_cache.counters.fallbacks)
    finally:
        llm.close()
    assert event is not None and event.fallbacks and event.l1_tokens == 0
    assert event.tier == "l1" and event.cached_tokens == aligned(llm, SHORT)
    assert sum(n for reason, n in fallbacks.items() if reason.startswith("l3")) == 1
    assert np.array_equal(got, cold_logits(cold, prompt))
