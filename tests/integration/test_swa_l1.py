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
from typing import Any

import llama_cpp
import numpy as np
import pytest
from modelhelpers import TEXT, cold_logits, last_logits

from skippy_llama.config import Settings
from skippy_llama.errors import StateFormatError
from skippy_llama.roster import RowKey
from skippy_llama.runtime import native, native_ext
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.runtime.recipe import row_key
from skippy_llama.state import parse_sections, parse_state

pytestmark = pytest.mark.model

# Gemma 3 Q4_K_M's CPU kernels make results depend on the batch split (see
# SkippyLlama._split_invariant), so reuse ends on n_ubatch boundaries: 100 keeps LONG on one
KWARGS: dict[str, Any] = {
    "n_ctx": 2048,
    "n_batch": 100,
    "n_ubatch": 100,
    "flash_attn": False,
    "verbose": False,
}
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
    llm = llama_cpp.Llama(str(gemma3_path), **KWARGS)
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


def test_the_two_section_layout_finds_the_gemma3_row_and_swa_stays_l1_only(
    gemma3_path: Path, tokens: list[int], tmp_path: Path
) -> None:
    # L2 and L3 configured: an SWA model must still get neither, with its layout now known
    settings = Settings(
        l2={"budget": "64MiB"}, l3={"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path)}
    )
    llm = SkippyLlama(str(gemma3_path), cache_settings=settings, **KWARGS)  # type: ignore[arg-type]
    try:
        layout = llm.kv_layout  # read at load (L3 is configured): by the one-token probe
        assert layout is not None
        # Gemma 3 270M: 18 layers, every sixth full attention; both sections' K/V are F16
        assert (layout.n_layer, len(layout.swa_layers), layout.n_sections) == (3, 15, 2)
        assert not layout.pageable and layout.v_trans
        assert llm.cache_identity.layout_digest == layout.digest()
        assert llm.prefix_cache.disk is None and llm.prefix_cache.ram is None
        verdict = llm.native_verdict
        key = row_key("gemma3", native.backend_name(), layout)
        assert key == RowKey("gemma3", native.backend_name(), "F16", "F16", False)
        if native_ext.abi_version() is None:
            assert verdict.kind == "stock", verdict.describe()
        else:
            # the roster's gemma3 row: L1 only; the failed lanes keep the stock paths
            assert verdict.kind == "certified", verdict.describe()
            assert verdict.lanes == ("l1_stream_copy_exact",)
        assert not verdict.range_export and not verdict.append_import
        llm.create_completion(tokens[:LONG], max_tokens=1)
        state = native.get_seq_state(llm.ctx, 0)
        # the live state past the window: the second section holds only the window's cells,
        # so it is never parsed as a pageable state
        first, second = parse_sections(state)
        n = first.n_tokens
        assert n >= LONG and sorted(first.positions.tolist()) == list(range(n))
        assert sorted(second.positions.tolist()) == list(range(n - 512, n))
        with pytest.raises(StateFormatError, match="second one"):
            parse_state(state)
        assert llm.last_cache_event is not None and llm.prefix_cache.counters.records == 0
    finally:
        llm.close()
    # L1 alone reads the layout later, from a cell of the live sequence: the same layout
    l1 = SkippyLlama(str(gemma3_path), cache_settings=Settings(), **KWARGS)  # type: ignore[arg-type]
    try:
        l1.create_completion(tokens[:40], max_tokens=1)
        assert l1.kv_layout == layout
        assert l1.cache_status()["native"] == verdict.to_json()
    finally:
        l1.close()
