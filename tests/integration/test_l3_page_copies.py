"""L3 pages restored by per-layer copies from their own bytes (issue 45 item 3), real SmolLM2.

Where the roster certifies ``layer_copy_exact`` (patch 0006), a restore of pages read from L3
copies each page's K and V straight into the KV tensors (``KVSeam._direct``): no state blob is
assembled and none is parsed. Where the KV cache is on a device the pages go through the seam's
staging arenas first (pinned on CUDA builds), or come from L2's arena when the read promoted them
there, and each chunk is one copy per layer and K/V; ``staged`` runs that path on the CPU (as
``SKIPPY_TEST_GPU_LIKE=1`` does for every test). A new process on the same directory (a restart)
must get logits bit-identical to a one-shot cold prefill, with flash attention off (V
transposed, the library's default) and on; a refused copy falls back to the stock state path,
exactly.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import runtime_patches
from modelhelpers import Logits, prefill_logits, serve, serve_until, text_tokens, tiered_llama

from skippy_llama.runtime import native_ext
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.tiers.disk import DiskTier

pytestmark = pytest.mark.model

N_CTX = 1024
DOC = 700  # five pages and a tail, cut inside the last page


def _restarted(
    path: Path, store: Path, flash_attn: bool, l2_budget: str | None = None
) -> tuple[list[int], Logits, SkippyLlama]:
    """A document recorded into L3 in ``store`` by one SkippyLlama, then a new one on the same
    directory (a new process's view: nothing in memory): the prompt that continues the document
    with another question, its cold logits, and the new SkippyLlama."""
    tokens = text_tokens(path, DOC + 100)
    doc, first, query = tokens[:DOC], tokens[DOC : DOC + 40], tokens[DOC + 40 : DOC + 100]
    cold = prefill_logits(path, doc + query, n_ctx=N_CTX, flash_attn=flash_attn)
    writer = tiered_llama(path, store, n_ctx=N_CTX, flash_attn=flash_attn)
    try:
        writer.eval(doc + first)
        assert writer.flush_cache(60.0)
    finally:
        writer.close()
    llm = tiered_llama(path, store, n_ctx=N_CTX, flash_attn=flash_attn, l2_budget=l2_budget)
    return doc + query, cold, llm


def _count(monkeypatch: pytest.MonkeyPatch, llm: SkippyLlama, name: str) -> list[int]:
    calls = [0]
    real = getattr(llm.seam, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.seam, name, counted)
    return calls


@pytest.mark.parametrize("staged", [False, True], ids=["bytes", "staged"])
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa_off", "fa_on"])
def test_a_restart_restores_l3_pages_by_copies_exactly(
    smollm2_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flash_attn: bool,
    staged: bool,
) -> None:
    if staged:
        runtime_patches.staged_page_copies(monkeypatch.setattr)
    prepared: list[tuple[DiskTier, str]] = []
    prepare = DiskTier.prepare_reads

    def spy(tier: DiskTier, nbytes: int) -> None:
        prepared.append((tier, threading.current_thread().name))
        prepare(tier, nbytes)

    monkeypatch.setattr(DiskTier, "prepare_reads", spy)
    prompt, cold, llm = _restarted(smollm2_path, tmp_path, flash_attn)
    try:
        copies = llm.native_verdict.layer_copy
        assert (llm.page_copy_refusal is None) == copies, llm.page_copy_refusal
        stage = llm.seam.staging
        if staged and copies:
            assert stage is not None
        staging_bytes = llm.cache_status()["staging_bytes"]
        assert (staging_bytes > 0) == (stage is not None)
        copied = _count(monkeypatch, llm, "_copy_fetched")
        from_slots = _count(monkeypatch, llm, "_copy_slots")
        from_bytes = _count(monkeypatch, llm, "_copy_pages")
        l3 = llm.prefix_cache.tier("l3")
        assembled = _count(monkeypatch, llm, "_assemble")
        event, exact = serve(llm, prompt, cold)
    finally:
        llm.close()
    assert event.tier == "l3" and event.cached_tokens >= 512 and event.fallbacks == []
    assert event.restored_bytes > 0
    assert exact
    if copies:
        assert copied[0] > 0 and assembled[0] == 0
        if stage is not None:
            # every page went through the staging arenas: none from its pageable bytes
            assert from_slots[0] > 0 and from_bytes[0] == 0
        else:
            assert from_bytes[0] > 0
        # both read-ahead threads readied their reads (buffer, connection) at load
        names = sorted(name for tier, name in prepared if tier is l3)
        assert names == ["skippy-direct-a_0", "skippy-direct-b_0"]
    else:
        assert copied[0] == 0 and assembled[0] > 0
        assert not [name for tier, name in prepared if tier is l3]


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["bytes", "staged"])
def test_l3_pages_restored_by_copies_are_promoted_into_the_arena(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    if staged:
        runtime_patches.staged_page_copies(monkeypatch.setattr)
    prompt, cold, llm = _restarted(smollm2_path, tmp_path, False, l2_budget="64MiB")
    try:
        if llm.arena_refusal is not None:
            pytest.skip(f"no arena on this build: {llm.arena_refusal}")
        ram = llm.prefix_cache.ram
        assert ram is not None and ram.arena is not None
        # staged: the second L3 restore (the pages' second fill) promotes them into L2's
        # arena as it reads them, and copies them from there, not from the staging arena
        promoted = _count(monkeypatch, llm, "_copy_promoted")
        page_copies = llm.page_copy_refusal is None
        # L3 serves (by copies) until its second fill promotes the pages into the arena
        events, exact = serve_until(llm, prompt, cold, "l2", times=1, tries=4)
        status = ram.status()
    finally:
        llm.close()
    tiers = [event.tier for event in events]
    assert tiers[0] == "l3" and tiers[-1] == "l2", tiers
    assert all(event.fallbacks == [] for event in events), [e.fallbacks for e in events]
    assert all(exact), exact
    assert status.arena_hits > 0 and status.arena_bytes > 0
    if staged and page_copies:
        assert promoted[0] > 0


@pytest.mark.slow
def test_a_refused_page_copy_falls_back_to_the_state_path_exactly(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, cold, llm = _restarted(smollm2_path, tmp_path, False)
    try:
        if llm.page_copy_refusal is not None:
            pytest.skip(f"no page copies on this build: {llm.page_copy_refusal}")
        # the library refuses the copy (as it would a cache with no room): the restore is
        # cleared and the same plan goes by the stock state path
        monkeypatch.setattr(native_ext, "cells_set", lambda *args: False)
        assembled = _count(monkeypatch, llm, "_assemble")
        event, exact = serve(llm, prompt, cold)
    finally:
        llm.close()
    assert event.tier == "l3" and event.cached_tokens >= 512
    assert assembled[0] > 0
    assert any("cells_set" in note for note in event.fallbacks), event.fallbacks
    assert exact
