"""L2's host arena on the real SmolLM2 model: a restore from it equals a cold prefill.

Where the roster certifies ``layer_copy_exact`` (the patched build, patch 0006), L2 keeps pages
in a host arena laid out as the KV tensors and a restore copies them per layer straight into the
context; anywhere else L2 keeps page bytes and restores through the state format. Either way the
continuation's logits must be bit-identical to a one-shot cold prefill (CPU), with flash
attention on (V rows) and off (V transposed, the library's default).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from modelhelpers import last_logits, prefill_logits, serve_until, text_tokens, tiered_llama

from skippy_llama.runtime import native_ext
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

N_CTX = 1024
DOC = 700  # five pages and a tail: one run of arena slots, cut inside the last page


def _arena_llama(path: Path, store: Path, flash_attn: bool = False) -> SkippyLlama:
    """SkippyLlama with L1 off, a 64 MiB L2 and an L3 in ``store``; every restore taken."""
    return tiered_llama(path, store, n_ctx=N_CTX, flash_attn=flash_attn, l2_budget="64MiB")


@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa_off", "fa_on"])
def test_l2_restores_from_the_arena_exactly(
    smollm2_path: Path, tmp_path: Path, flash_attn: bool
) -> None:
    tokens = text_tokens(smollm2_path, DOC + 200)
    doc, first, query = tokens[:DOC], tokens[DOC : DOC + 40], tokens[DOC + 40 : DOC + 100]
    cold = prefill_logits(smollm2_path, doc + query, n_ctx=N_CTX, flash_attn=flash_attn)
    llm = _arena_llama(smollm2_path, tmp_path, flash_attn)
    try:
        arena = llm.native_verdict.layer_copy
        assert (llm.arena_refusal is None) == arena, llm.arena_refusal
        llm.eval(doc + first)  # recorded into L3
        llm.recorder.flush()
        # L3 serves until its second fill promotes the pages (the first request may read the
        # record still in flight to L3, which is no fill); then L2, twice
        events, exact = serve_until(llm, doc + query, cold, "l2", times=2, tries=6)
        ram = llm.prefix_cache.ram
        assert ram is not None
        status = ram.status()
    finally:
        llm.close()
    tiers = [event.tier for event in events]
    cached = [event.cached_tokens for event in events]
    assert tiers[-2:] == ["l2", "l2"] and set(tiers[:-2]) == {"l3"}, tiers
    # (with flash attention on, cached prefixes end on the canonical batch boundary, 512 here)
    assert len(set(cached)) == 1 and cached[0] >= 512
    assert all(exact), exact
    if arena:
        assert status.arena_hits > 0 and status.arena_bytes > 0
    else:
        assert status.arena_hits == 0 and status.arena_bytes == 0


def test_a_refused_arena_copy_falls_back_to_l3_exactly(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = text_tokens(smollm2_path, DOC + 200)
    doc, first, query = tokens[:DOC], tokens[DOC : DOC + 40], tokens[DOC + 40 : DOC + 100]
    cold = prefill_logits(smollm2_path, doc + query, n_ctx=N_CTX)
    llm = _arena_llama(smollm2_path, tmp_path)
    try:
        if llm.arena_refusal is not None:
            pytest.skip(f"no arena on this build: {llm.arena_refusal}")
        llm.eval(doc + first)
        llm.recorder.flush()
        for _ in range(6):  # until L3's second fill promotes the pages into the arena
            llm.reset()
            llm.eval(doc + query)
            served = llm.last_cache_event
            # wholly from L2 (pages promoted while a record was in flight can leave a mixed
            # plan, L2 and L3, whose refused copy would be L3's step)
            if served is not None and served.tier == "l2":
                break
        # the library refuses the copy (as it would a cache with no room): nothing is
        # changed, the seam fails the L2 step and the next plan reads L3
        monkeypatch.setattr(native_ext, "cells_set", lambda *args: False)
        llm.reset()
        llm.eval(doc + query)
        event = llm.last_cache_event
        assert event is not None
        assert event.tier == "l3" and event.cached_tokens > 0
        assert any("l2" in note for note in event.fallbacks), event.fallbacks
        assert (last_logits(llm) == cold).all()
    finally:
        llm.close()


def test_a_prefix_past_l2_copies_the_arena_part_and_appends_the_rest(
    smollm2_path: Path, tmp_path: Path
) -> None:
    tokens = text_tokens(smollm2_path, 1100, repeats=8)
    doc, longer = tokens[:DOC], tokens[:900]
    tail_a, tail_b = tokens[1000:1040], tokens[1040:1100]
    cold = prefill_logits(smollm2_path, longer + tail_b, n_ctx=N_CTX)
    llm = _arena_llama(smollm2_path, tmp_path)
    try:
        if llm.arena_refusal is not None:
            pytest.skip(f"no arena on this build: {llm.arena_refusal}")
        ram = llm.prefix_cache.ram
        assert ram is not None
        llm.eval(doc + tail_a)
        llm.recorder.flush()
        for _ in range(6):  # until L3's second fill promotes the document's pages into L2
            llm.reset()
            llm.eval(doc + tail_b)
            if ram.status().pages:
                break
        # the longer prefix's later pages go to L3 only (one fill: not promoted)
        llm.reset()
        llm.eval(longer + tail_a)
        llm.recorder.flush()
        before = ram.status().arena_hits
        llm.reset()
        llm.eval(longer + tail_b)
        event = llm.last_cache_event
        assert event is not None
        # the document's pages came from the arena, the rest from L3, appended after them
        assert ram.status().arena_hits > before
        assert event.cached_tokens > 768 and event.fallbacks == []
        assert (last_logits(llm) == cold).all()
    finally:
        llm.close()
