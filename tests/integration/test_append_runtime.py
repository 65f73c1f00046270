"""Page restores built on the append import, with the real SmolLM2 model.

An L1 prefix continued by L3 pages: on a patched library whose roster row certifies
``append_import_exact``, a prompt whose L1 prefix (the live sequence or a resident checkpoint) is
shorter than what L3 holds keeps the L1 part and append-imports only the pages past it; on a stock
library the same prompt restores every page from L3. Either way the logits are bit-identical to a
cold prefill (CPU, flash attention off), and the event says which split was taken.

Pipelined restores (``KVSeam._pipelined``): on GPU builds (``SkippyLlama.pipeline_restores``,
turned on here) where the append import is certified, a page restore of more than
``PIPELINE_BYTES`` of state is cut into chunks, each read and assembled on the seam's read-ahead
thread while the previous one is imported. These tests shrink the chunk to one 64-token page so
that a short prompt runs the whole pipeline: a restore from L3, one that continues an L1 prefix,
one whose L3 pages are promoted to L2 chunk by chunk, one cut short by a damaged page, and one
wholly from L2.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import diskcache
import llama_cpp
import numpy as np
import numpy.typing as npt
import pytest
from modelhelpers import TEXT, aligned, cold_logits, last_logits

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.events import CacheEvent
from skippy_llama.runtime import native_ext, seam
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

PATCHED = native_ext.abi_version() is not None
N_CTX = 1024
#: the long document L3 holds, the shorter prefix L1 gets, and the page size
LONG, SHORT, PAGE = 400, 150, 64


def _kwargs() -> dict[str, Any]:
    # restores forced: a GPU build's measured costs may prefill these short prompts instead
    return {
        "n_ctx": N_CTX,
        "n_batch": 512,
        "flash_attn": False,
        "verbose": False,
        "cost_model": AlwaysRestore(),
    }


def _settings(
    directory: Path, *, l1: bool = True, l2: str | None = None, compression: str | None = None
) -> Settings:
    l3: dict[str, str] = {
        "mode": "fixed",
        "budget": "1GiB",
        "directory": str(directory),
        "minimum_free": "1GiB",
    }
    if compression is not None:
        l3["compression"] = compression
    return Settings(l1={"enabled": l1}, l2={"budget": l2}, l3=l3, page_tokens=PAGE)


def _fill(model: Path, tokens: list[int], settings: Settings) -> None:
    """Store the pages of ``tokens[:LONG]`` in L3 (written by another instance)."""
    llm = SkippyLlama(str(model), cache_settings=settings, **_kwargs())
    try:
        llm.eval(tokens[:LONG])
        assert llm.prefix_cache.disk is not None and llm.flush_cache()
    finally:
        llm.close()


@pytest.fixture
def open_llm(smollm2_path: Path) -> Iterator[Callable[..., SkippyLlama]]:
    """Opens SkippyLlamas on the test model (closed at teardown); ``chunked`` makes one chunk
    long page restores as GPU builds do (off on the CPU; otherwise the build's default)."""
    made: list[SkippyLlama] = []

    def open_one(settings: Settings, *, chunked: bool = False) -> SkippyLlama:
        llm = SkippyLlama(str(smollm2_path), cache_settings=settings, **_kwargs())
        if chunked:
            llm.pipeline_restores = True
            # as on GPU builds, where pages are not copied per layer from their bytes
            llm.seam.page_copies = False
        made.append(llm)
        return llm

    yield open_one
    for llm in made:
        llm.close()


def _answer(llm: SkippyLlama, prompt: list[int]) -> tuple[CacheEvent, npt.NDArray[np.float32]]:
    """The event ``prompt``'s completion left and its last logits."""
    llm.create_completion(prompt, max_tokens=1)
    event = llm.last_cache_event
    assert event is not None
    return event, last_logits(llm)


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
    """An L3 directory holding the pages of ``tokens[:LONG]``."""
    _fill(smollm2_path, tokens, _settings(tmp_path))
    return tmp_path


def _expect_split(llm: SkippyLlama, event: CacheEvent, n_cached: int) -> None:
    """Patched and certified: L1 prefix + appended pages; otherwise every page from L3.

    Reuse ends on whole granules (GPU builds: see ``SkippyLlama.granule``).
    """
    assert event.tier == "l3"
    assert event.cached_tokens == aligned(llm, n_cached)
    if llm.native_verdict.append_import:
        assert event.l1_tokens == aligned(llm, SHORT)
        assert event.appended_tokens == event.cached_tokens - event.l1_tokens
    else:
        assert event.l1_tokens == event.appended_tokens == 0


def test_live_prefix_continued_by_l3_pages(
    open_llm: Callable[..., SkippyLlama], tokens: list[int], filled: Path, cold: llama_cpp.Llama
) -> None:
    llm = open_llm(_settings(filled))
    # the live sequence shares SHORT tokens with the pages L3 holds, then differs
    other = tokens[LONG + 50 : LONG + 90]
    assert other[0] != tokens[SHORT]
    llm.create_completion(tokens[:SHORT] + other, max_tokens=1)
    prompt = tokens[: LONG + 20]
    event, got = _answer(llm, prompt)
    _expect_split(llm, event, LONG - 2)
    assert np.array_equal(got, cold_logits(cold, prompt))


@pytest.mark.slow
def test_resident_prefix_continued_by_l3_pages(
    open_llm: Callable[..., SkippyLlama], tokens: list[int], filled: Path, cold: llama_cpp.Llama
) -> None:
    llm = open_llm(_settings(filled))
    # the resident checkpoint shares SHORT tokens with the pages L3 holds
    llm.create_completion(tokens[:SHORT] + tokens[LONG + 50 : LONG + 90], max_tokens=1)
    llm.create_completion(tokens[LONG + 100 : LONG + 140], max_tokens=1)  # parks it
    prompt = tokens[: LONG + 20]
    event, got = _answer(llm, prompt)
    _expect_split(llm, event, LONG - 2)
    assert np.array_equal(got, cold_logits(cold, prompt))


@pytest.mark.certified_backend
@pytest.mark.skipif(not PATCHED, reason="needs the patched llama.cpp build")
def test_a_refused_append_falls_back_and_stays_exact(
    open_llm: Callable[..., SkippyLlama],
    tokens: list[int],
    filled: Path,
    cold: llama_cpp.Llama,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection: the library refuses the append; the request falls back to what L1 alone
    holds (the live prefix the append was to continue, left in place) and stays exact."""
    llm = open_llm(_settings(filled))
    # the append import, not the per-layer copies from the pages' bytes that precede it where
    # certified (their refusal falls back to this path: test_l3_page_copies.py)
    llm.seam.page_copies = False
    llm.create_completion(tokens[:SHORT] + tokens[LONG + 50 : LONG + 90], max_tokens=1)
    monkeypatch.setattr(native_ext, "append_import", lambda *_: False)
    prompt = tokens[: LONG + 20]
    event, got = _answer(llm, prompt)
    fallbacks = llm.prefix_cache.counters.fallbacks
    assert event.fallbacks and event.l1_tokens == 0
    assert event.tier == "l1" and event.cached_tokens == aligned(llm, SHORT)
    assert sum(n for reason, n in fallbacks.items() if reason.startswith("l3")) == 1
    assert np.array_equal(got, cold_logits(cold, prompt))


# -- pipelined restores ------------------------------------------------------------------

#: the pipelined restores need the patched append import and its certification
pipelined = pytest.mark.skipif(not PATCHED, reason="the append import needs the patched build")


_MAN, _DATA = b"\x04", b"\x07"


@pytest.fixture
def raw(smollm2_path: Path, tokens: list[int], tmp_path: Path) -> Path:
    """:func:`filled`, with pages stored uncompressed as GPU builds store them (L3 then serves
    views into its reused read buffer, which each chunk must be done with in time)."""
    _fill(smollm2_path, tokens, _settings(tmp_path, compression="none"))
    return tmp_path


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One page per chunk; the sizes of the append imports the seam makes, in order."""
    monkeypatch.setattr(seam, "PIPELINE_BYTES", 1)
    sizes: list[int] = []
    real: Callable[..., bool] = native_ext.append_import

    def counting(ctx: Any, blob: memoryview, seq_id: int) -> bool:
        sizes.append(len(blob))
        return real(ctx, blob, seq_id)

    monkeypatch.setattr(native_ext, "append_import", counting)
    return sizes


def _pages_stored(directory: Path) -> list[str]:
    """The page keys (hex) of the longest manifest L3 holds, in order."""
    with diskcache.Cache(str(directory)) as store:
        found = [
            json.loads(store.get(key))
            for key in store.iterkeys()
            if isinstance(key, bytes) and key[:1] == _MAN
        ]
    return [page[0] for page in max(found, key=lambda man: man["n_tokens"])["pages"]]


@pytest.mark.certified_backend
@pipelined
def test_a_restore_in_one_page_chunks_equals_cold(
    open_llm: Callable[..., SkippyLlama],
    tokens: list[int],
    raw: Path,
    cold: llama_cpp.Llama,
    imports: list[int],
) -> None:
    llm = open_llm(_settings(raw), chunked=True)
    if not llm.native_verdict.append_import:
        pytest.skip("the roster does not certify the append import on this backend")
    prompt = tokens[: LONG + 20]
    event, got = _answer(llm, prompt)
    assert event.tier == "l3" and not event.fallbacks
    assert event.cached_tokens == aligned(llm, LONG - 2)
    # the first chunk rebuilds the prefix (set_data); every later page is appended
    n_pages = -(-event.cached_tokens // PAGE)
    assert len(imports) == n_pages - 1
    assert np.array_equal(got, cold_logits(cold, prompt))


@pytest.mark.slow
@pytest.mark.certified_backend
@pipelined
def test_an_l1_prefix_continued_in_chunks_equals_cold(
    open_llm: Callable[..., SkippyLlama],
    tokens: list[int],
    raw: Path,
    cold: llama_cpp.Llama,
    imports: list[int],
) -> None:
    llm = open_llm(_settings(raw), chunked=True)
    # the live sequence shares SHORT tokens with the pages L3 holds, then differs
    llm.create_completion(tokens[:SHORT] + tokens[LONG + 50 : LONG + 90], max_tokens=1)
    imports.clear()
    prompt = tokens[: LONG + 20]
    event, got = _answer(llm, prompt)
    assert event.tier == "l3"
    assert event.l1_tokens == aligned(llm, SHORT)
    assert event.cached_tokens == aligned(llm, LONG - 2)
    # every page from the one holding position SHORT on, one import each
    assert len(imports) == -(-event.cached_tokens // PAGE) - SHORT // PAGE
    assert np.array_equal(got, cold_logits(cold, prompt))


@pytest.mark.slow
@pytest.mark.certified_backend
@pipelined
def test_chunks_promoted_to_l2_serve_the_next_restore(
    open_llm: Callable[..., SkippyLlama],
    tokens: list[int],
    raw: Path,
    cold: llama_cpp.Llama,
    imports: list[int],
) -> None:
    """Each chunk is copied into L2 before the read-ahead thread's next read reuses its bytes:
    a later restore reads them from L2, whose digests would refuse bytes overwritten since."""
    llm = open_llm(_settings(raw, l1=False, l2="64MiB"), chunked=True)
    prompt = tokens[: LONG + 20]
    answers = []
    for _ in range(3):
        answers.append(_answer(llm, prompt))
        # L1 off: another prompt displaces the live sequence, so the next one restores
        llm.create_completion(tokens[LONG + 100 : LONG + 140], max_tokens=1)
    ram = llm.prefix_cache.ram
    assert ram is not None
    l2 = ram.status()
    # L2 copies a page on its second fill: the third restore takes every page from L2 (which
    # checks each copy's digest) but, where reuse is token-granular, the tail this process
    # recorded anew (then the restore is named for L3)
    tiers = [event.tier for event, _ in answers]
    assert tiers[:2] == ["l3", "l3"] and tiers[2] in ("l2", "l3") and len(imports) > 0
    full = (LONG + 20 - 2) // PAGE
    assert l2.promotions >= full and l2.hits >= full, l2
    assert l2.digest_mismatches == 0, l2
    expected = cold_logits(cold, prompt)
    assert all(np.array_equal(got, expected) for _, got in answers)


@pytest.mark.slow
@pytest.mark.certified_backend
@pipelined
def test_a_damaged_page_ends_the_pipelined_restore_before_it(
    open_llm: Callable[..., SkippyLlama],
    tokens: list[int],
    raw: Path,
    cold: llama_cpp.Llama,
    imports: list[int],
) -> None:
    keys = _pages_stored(raw)
    assert len(keys) >= 5
    with diskcache.Cache(str(raw)) as store:
        key = _DATA + bytes.fromhex(keys[3])
        value = store.get(key)
        assert isinstance(value, bytes)
        store.set(key, value[: len(value) // 2])
    llm = open_llm(_settings(raw), chunked=True)
    prompt = tokens[: LONG + 20]
    event, got = _answer(llm, prompt)
    assert event.tier == "l3"
    assert event.cached_tokens == aligned(llm, 3 * PAGE)  # pages 0-2, imported before page 3
    assert len(imports) == 2
    assert llm.prefix_cache.counters.fallbacks["l3_short_read"] == 1
    assert any("failed verification" in note for note in event.fallbacks)
    assert np.array_equal(got, cold_logits(cold, prompt))


@pytest.mark.slow
@pytest.mark.certified_backend
@pipelined
@pytest.mark.parametrize("chunked", [True, False])
def test_a_restore_from_l2_alone_is_imported_whole_unless_chunked(
    open_llm: Callable[..., SkippyLlama],
    tokens: list[int],
    raw: Path,
    cold: llama_cpp.Llama,
    imports: list[int],
    chunked: bool,
) -> None:
    """L2's pages are in RAM, with no read to hide: imported whole by default, in chunks (each
    assembled while the last is imported) with ``chunk_ram_restores``; where L2 keeps them in
    its host arena (``layer_copy_exact`` certified) they are copied per layer and nothing is
    imported either way; cold's logits in every case."""
    llm = open_llm(_settings(raw, l1=False, l2="64MiB"), chunked=True)
    arena = llm.arena_refusal is None
    llm.seam.chunk_ram_restores = chunked
    prompt = tokens[:LONG]  # what L3 holds, so this process records no new tail
    for _ in range(2):  # L2 copies each page on its second fill
        llm.create_completion(prompt, max_tokens=1)
        llm.create_completion(tokens[LONG + 100 : LONG + 140], max_tokens=1)
    imports.clear()
    event, got = _answer(llm, prompt)
    assert event.tier == "l2" and not event.fallbacks
    assert event.cached_tokens == aligned(llm, LONG - 2)
    if arena:
        ram = llm.prefix_cache.ram
        assert ram is not None and ram.status().arena_hits > 0
        assert imports == []
    else:
        assert len(imports) == (-(-event.cached_tokens // PAGE) - 1 if chunked else 0)
    assert np.array_equal(got, cold_logits(cold, prompt))
