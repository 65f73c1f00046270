"""The patched llama.cpp calls on the real SmolLM2 model: range export and append import.

The patched tests run against a library built by ``scripts/build_patched_llama.sh`` (what
``scripts/setup.sh`` installs by default); on a stock wheel (CI's stock lane) they are skipped and
the absence test runs instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from modelhelpers import TEXT, last_logits

from skippy_llama.roster import SKIPPY_ABI_VERSION, Recipe
from skippy_llama.runtime import native, native_ext
from skippy_llama.runtime.recipe import library_recipe, native_verdict, row_key
from skippy_llama.state import parse_state, slice_state
from skippy_llama.state.format import SequenceState
from skippy_llama.state.pages import Page

pytestmark = pytest.mark.model

PATCHED = native_ext.abi_version() is not None
patched_only = pytest.mark.skipif(not PATCHED, reason="needs the patched llama.cpp build")


def _llama(path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        str(path), n_ctx=1024, n_batch=512, flash_attn=False, verbose=False
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokens(smollm2_path: Path) -> list[int]:
    llm = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize((TEXT * 2).encode())[:300]
    finally:
        llm.close()


@pytest.fixture
def cold(smollm2_path: Path, tokens: list[int]) -> Iterator[llama_cpp.Llama]:
    """A context that prefilled the 300 tokens as 128 + 72 + 100 (the warm runs' batch shapes)."""
    llm = _llama(smollm2_path)
    for a, b in ((0, 128), (128, 200), (200, 300)):
        llm.eval(tokens[a:b])
    yield llm
    llm.close()


def _page(state: SequenceState, p0: int) -> Page:
    """A range export as a page: its cells must be exactly positions p0, p0+1, …"""
    assert np.array_equal(state.positions, np.arange(p0, p0 + state.n_tokens, dtype=np.int32))
    return Page(p0, state.n_tokens, state.layout, state.ext, state.k, state.v)


def test_stock_build_reports_absence() -> None:
    if PATCHED:
        pytest.skip("the loaded llama.cpp library is the patched build")
    assert native_ext.abi_version() is None
    assert native_ext.queue_sha256() is None
    assert library_recipe() is None
    with pytest.raises(Exception, match="stock build"):
        native_ext.append_import(None, b"x", 0)


@patched_only
def test_patched_build_reports_its_recipe() -> None:
    assert native_ext.abi_version() == SKIPPY_ABI_VERSION
    recipe = library_recipe()
    assert isinstance(recipe, Recipe)
    assert recipe.skippy_abi == SKIPPY_ABI_VERSION
    assert recipe.llama_cpp_python == llama_cpp.__version__


@patched_only
@pytest.mark.parametrize(("p0", "p1"), [(0, 128), (128, 256), (256, 300), (100, -1), (0, -1)])
def test_range_export_equals_the_slice_of_a_full_export(
    cold: llama_cpp.Llama, p0: int, p1: int
) -> None:
    full = parse_state(native.get_seq_state(cold.ctx, 0))
    end = full.n_tokens if p1 < 0 else p1
    blob = native_ext.range_export(cold.ctx, 0, p0, p1)
    assert native_ext.range_export_size(cold.ctx, 0, p0, p1) == len(blob)
    part = parse_state(blob)
    assert part.layout == full.layout
    assert part.n_tokens == end - p0
    assert _page(part, p0).to_bytes() == slice_state(full, p0, end).to_bytes()
    # the whole range is the stock export, byte for byte
    if p0 == 0 and p1 < 0:
        assert bytes(blob) == bytes(native.get_seq_state(cold.ctx, 0))


@patched_only
def test_range_export_of_an_empty_range_has_no_cells(cold: llama_cpp.Llama) -> None:
    assert parse_state(native_ext.range_export(cold.ctx, 0, 500, 600)).n_tokens == 0


@patched_only
def test_append_import_continues_a_resident_prefix_bit_identically(
    smollm2_path: Path, tokens: list[int], cold: llama_cpp.Llama
) -> None:
    reference = last_logits(cold)
    middle = native_ext.range_export(cold.ctx, 0, 128, 200)
    warm = _llama(smollm2_path)
    try:
        warm.eval(tokens[:128])  # the resident prefix
        assert native_ext.append_import(warm.ctx, middle, 0)
        assert native.seq_pos_max(warm.ctx, 0) == 199
        warm.input_ids[:200] = tokens[:200]
        warm.n_tokens = 200
        warm.eval(tokens[200:300])
        got = last_logits(warm)
    finally:
        warm.close()
    assert np.array_equal(reference, got), f"max |Δ| = {np.abs(reference - got).max()}"


@patched_only
def test_append_import_into_an_empty_sequence_streams_a_restore(
    smollm2_path: Path, tokens: list[int], cold: llama_cpp.Llama
) -> None:
    reference = last_logits(cold)
    parts = [native_ext.range_export(cold.ctx, 0, a, b) for a, b in ((0, 128), (128, 200))]
    warm = _llama(smollm2_path)
    try:
        for part in parts:
            assert native_ext.append_import(warm.ctx, bytes(part), 0)  # read-only input works too
        warm.input_ids[:200] = tokens[:200]
        warm.n_tokens = 200
        warm.eval(tokens[200:300])
        got = last_logits(warm)
    finally:
        warm.close()
    assert np.array_equal(reference, got), f"max |Δ| = {np.abs(reference - got).max()}"


@patched_only
def test_append_import_refuses_what_does_not_continue_and_changes_nothing(
    smollm2_path: Path, tokens: list[int], cold: llama_cpp.Llama
) -> None:
    reference = last_logits(cold)
    good = native_ext.range_export(cold.ctx, 0, 128, 200)
    refused: dict[str, bytes | bytearray | memoryview] = {
        "gap": native_ext.range_export(cold.ctx, 0, 150, 200),
        "overlap": native_ext.range_export(cold.ctx, 0, 100, 200),
        "from 0": native_ext.range_export(cold.ctx, 0, 0, 72),
        # positions continue, but the K/V data ends early: fails after cells were placed
        "truncated": good[:-4096],
        "bad magic": b"\0\0\0\0" + bytes(good[4:]),
    }
    warm = _llama(smollm2_path)
    try:
        warm.eval(tokens[:128])
        before = bytes(native.get_seq_state(warm.ctx, 0))
        for name, blob in refused.items():
            assert not native_ext.append_import(warm.ctx, blob, 0), name
            assert native.seq_pos_max(warm.ctx, 0) == 127, name
            assert bytes(native.get_seq_state(warm.ctx, 0)) == before, name
        # and the untouched sequence still continues exactly
        assert native_ext.append_import(warm.ctx, good, 0)
        warm.input_ids[:200] = tokens[:200]
        warm.n_tokens = 200
        warm.eval(tokens[200:300])
        got = last_logits(warm)
    finally:
        warm.close()
    assert np.array_equal(reference, got), f"max |Δ| = {np.abs(reference - got).max()}"


@pytest.mark.certified_backend
def test_verdict_for_the_loaded_library(cold: llama_cpp.Llama) -> None:
    layout = parse_state(native.get_seq_state(cold.ctx, 0)).layout
    verdict = native_verdict("llama", native.backend_name(), layout)
    if not PATCHED:
        assert verdict.kind == "stock"
        assert not verdict.range_export and not verdict.append_import
        return
    # the roster certifies SmolLM2's row for the recipe of a library built from this checkout
    assert verdict.kind == "certified", verdict.describe()
    assert verdict.range_export and verdict.append_import
    # an architecture nobody certified keeps the stock paths unless overridden
    other = native_verdict("nonesuch", native.backend_name(), layout)
    assert other.kind == "uncertified" and not other.append_import
    forced = native_verdict("nonesuch", native.backend_name(), layout, allow_uncertified=True)
    assert forced.kind == "uncertified_override" and forced.append_import
    assert row_key("llama", native.backend_name(), layout).flash_attn is False
