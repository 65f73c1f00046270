"""Records exported into arena slots off the request path (issue 45 item 4), real SmolLM2.

Where the roster certifies ``layer_copy_exact`` (patch 0006), a record's new cells leave the KV
tensors by per-layer copies into a host arena on the exporter's thread, right after the
request's decode (``runtime/export.py``); the L3 writer makes the pages from the slots. The pages
must be the stock capture's bytes, a one-shot prompt after an exported record must equal a cold
prefill, and a restart's restore of that record must too, bit for bit, with flash attention off
(V transposed) and on. Under ``SKIPPY_TEST_GPU_LIKE=1`` the same path runs with a GPU build's
granule (records no longer wait where they are exported).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT, last_logits, prefill_logits, tiered_llama

from skippy_llama.runtime import native_ext
from skippy_llama.runtime.export import CellExport
from skippy_llama.state import parse_state, slice_state, sort_by_position

pytestmark = pytest.mark.model

N_CTX = 1024
DOC = 600
OTHER = (
    "The baker rose long before dawn, when the street outside was still dark and silent. She lit "
    "the oven first, because it needed an hour to reach the heat that gives bread its crust. "
)


def _tokens(path: Path) -> tuple[list[int], list[int]]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        # the one-shot prompt spans a granule (512 with flash attention on this CPU build)
        return llm.tokenize((TEXT * 4).encode())[: DOC + 60], llm.tokenize((OTHER * 15).encode())[
            :560
        ]
    finally:
        llm.close()


@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa_off", "fa_on"])
def test_an_exported_record_then_a_one_shot_then_its_restore_equal_cold(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flash_attn: bool
) -> None:
    tokens, other = _tokens(smollm2_path)
    doc, query = tokens[:DOC], tokens[DOC:]
    llm = tiered_llama(smollm2_path, tmp_path, n_ctx=N_CTX, flash_attn=flash_attn, l1=True)
    try:
        copies = llm.native_verdict.layer_copy
        assert (llm.export_refusal is None) == copies, llm.export_refusal
        if not copies:
            pytest.skip(f"no per-layer copies on this build: {llm.export_refusal}")
        exports: list[CellExport] = []
        threads: list[str] = []
        start, get = llm.seam.export, native_ext.cells_get

        def export(parts: list[tuple[int, int]]) -> CellExport | None:
            out = start(parts)
            if out is not None:
                exports.append(out)
            return out

        def cells_get(*args: Any) -> bool:
            threads.append(threading.current_thread().name)
            return get(*args)

        monkeypatch.setattr(llm.seam, "export", export)
        monkeypatch.setattr(native_ext, "cells_get", cells_get)
        assert llm.seam.exporter is not None
        background = llm.seam.exporter.background
        llm.eval(doc)  # a record of the document's pages, exported after the decode
        assert len(exports) == 1
        # the pages the writer makes from the slots are the stock capture's bytes
        llm.seam.settle()
        n = exports[0].slots[-1].end
        blob = llm.seam.capture(0, n, range_export=False)
        state = sort_by_position(parse_state(blob))
        for i, slot in enumerate(exports[0].slots):
            assert exports[0].page_bytes(i) == slice_state(state, slot.start, slot.end).to_bytes()
        llm.seam.buffers.give(blob.obj)  # type: ignore[arg-type]
        # a one-shot prompt after it (its export waits for nothing of the first record)
        llm.reset()
        llm.eval(other)
        one_shot = last_logits(llm)
        event = llm.last_cache_event
        assert event is not None and event.cached_tokens <= 1  # the BOS token at most
        assert len(exports) == 2
        assert llm.flush_cache(60.0)
        status = llm.cache_status()
    finally:
        llm.close()
    # on the exporter's thread where the cache is on a device (and in the GPU-like lane),
    # on the request thread on the CPU
    assert threads and all(name.startswith("skippy-export") == background for name in threads)
    assert status["export"]["exports"] == 2 and status["export"]["no_room"] == 0
    assert status["counters"]["records"] == 2
    assert (
        one_shot == prefill_logits(smollm2_path, other, n_ctx=N_CTX, flash_attn=flash_attn)
    ).all()
    # a restart restores the first record from L3 alone
    again = tiered_llama(smollm2_path, tmp_path, n_ctx=N_CTX, flash_attn=flash_attn)
    try:
        again.eval(doc + query)
        event = again.last_cache_event
        restored = last_logits(again)
    finally:
        again.close()
    assert event is not None and event.tier == "l3" and event.cached_tokens >= 512
    assert event.fallbacks == []
    assert (
        restored == prefill_logits(smollm2_path, doc + query, n_ctx=N_CTX, flash_attn=flash_attn)
    ).all()


@pytest.mark.slow
def test_a_full_arena_or_a_failed_export_costs_a_record_never_an_answer(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, other = _tokens(smollm2_path)
    doc, query = tokens[:DOC], tokens[DOC:]
    llm = tiered_llama(smollm2_path, tmp_path, n_ctx=N_CTX, flash_attn=False, l1=True)
    try:
        exporter = llm.seam.exporter
        if exporter is None:
            pytest.skip(f"no export on this build: {llm.export_refusal}")
        background = exporter.background
        # no room in the arena: the stock capture records the document instead
        with monkeypatch.context() as full:
            full.setattr(exporter.arena, "reserve", lambda *args, **kwargs: None)
            llm.eval(doc)
        assert exporter.no_room == 1 and exporter.exports == 0
        # the library refuses the export: that record is dropped, the answer is not touched
        monkeypatch.setattr(native_ext, "cells_get", lambda *args: False)
        llm.reset()
        llm.eval(other)
        one_shot = last_logits(llm)
        assert llm.flush_cache(60.0)
        counters = llm.prefix_cache.counters_json()
    finally:
        llm.close()
    # on the request thread the failed export is a counted record fallback (and no record);
    # on the exporter's thread the record was queued, and the writer drops it
    assert counters["records"] == (2 if background else 1)
    assert any(reason.startswith("record") for reason in counters["fallbacks"])
    assert (one_shot == prefill_logits(smollm2_path, other, n_ctx=N_CTX, flash_attn=False)).all()
    again = tiered_llama(smollm2_path, tmp_path, n_ctx=N_CTX, flash_attn=False)
    try:
        again.eval(doc + query)
        event = again.last_cache_event
        restored = last_logits(again)
        again.reset()
        again.eval(other + query)  # the failed export's record never reached L3
        missed = again.last_cache_event
    finally:
        again.close()
    assert event is not None and event.tier == "l3" and event.cached_tokens >= 512
    assert (
        restored == prefill_logits(smollm2_path, doc + query, n_ctx=N_CTX, flash_attn=False)
    ).all()
    assert missed is not None and missed.cached_tokens <= 1
