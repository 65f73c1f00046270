"""CacheGen through SkippyLlama and L3 on the real model: an unqualified layout stores native
pages (the identity is the exact one), a qualified one (a roster row, planted here) stores
CacheGen pages under its own identity, an exact instance on the same store never restores them,
and a CacheGen instance restores them from L3."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# the codec comes with the cachegen extra; CI installs it, so there a missing one fails
if importlib.util.find_spec("zstandard") is None and not os.environ.get("CI"):
    pytest.skip("the cachegen extra (zstandard) is not installed", allow_module_level=True)

from modelhelpers import TEXT

from skippy_llama.codecs import select
from skippy_llama.codecs.cachegen import CacheGenParams
from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.roster import CacheGenRow
from skippy_llama.runtime import identity_params
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.tiers.l3.schema import DATA

pytestmark = pytest.mark.model

PARAMS = CacheGenParams((8, 8, 8), (8, 8, 8))
PROMPT = TEXT * 2 + "Counting the steps again that night, the keeper reached the number"


def _settings(directory: Path, codec: str) -> Settings:
    return Settings(
        l1={"enabled": False},
        l3={"mode": "fixed", "budget": "1GiB", "directory": str(directory),
            "minimum_free": "1GiB", "codec": codec},
    )  # fmt: skip


def _llm(path: Path, directory: Path, codec: str) -> SkippyLlama:
    # restores forced: a GPU build's measured costs may prefill this short prompt instead
    return SkippyLlama(
        str(path),
        n_ctx=1024,
        verbose=False,
        cache_settings=_settings(directory, codec),
        cost_model=AlwaysRestore(),
    )


def _plant_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A passing cachegen row for whatever model and layout asks (a test's roster)."""

    class Qualified:
        def cachegen_row(self, digest: str, backend: str, layout: str) -> CacheGenRow:
            return CacheGenRow(
                "test", digest, backend, layout, "F16", "F16", False, PARAMS.identity(),
                {"argmax_agree": 1.0, "mean_kl": 0.0, "ppl_rise": 0.0, "size_ratio": 0.5},
            )  # fmt: skip

    monkeypatch.setattr(identity_params, "load_roster", lambda: Qualified())


def _stored_codecs(llm: SkippyLlama) -> set[bytes]:
    disk = llm.prefix_cache.disk
    assert disk is not None and llm.flush_cache(60)
    store = disk._parts.rw
    return {bytes((store.get(key) or b"")[:4]) for key in store.keys(DATA)}


def test_unqualified_layout_stores_native_pages(smollm2_path: Path, tmp_path: Path) -> None:
    exact = _llm(smollm2_path, tmp_path / "a", "native")
    lossy = _llm(smollm2_path, tmp_path / "b", "cachegen")
    try:
        # SmolLM2 has no passing cachegen row (roster/split-certified.json): same identity
        assert lossy.cache_identity.codec_name == "native"
        assert lossy.cache_identity.root == exact.cache_identity.root
        lossy.create_completion(PROMPT, max_tokens=1)
        assert _stored_codecs(lossy) <= {b"SKZ1", b"SKPG"}  # native pages only
        assert lossy.prefix_cache.disk is not None
        assert lossy.prefix_cache.disk._parts.counters.get("codec_unqualified") > 0
    finally:
        exact.close()
        lossy.close()


def test_qualified_layout_stores_cachegen_and_exact_never_reads_it(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "l3"
    exact = _llm(smollm2_path, directory, "native")
    _plant_row(monkeypatch)
    lossy = _llm(smollm2_path, directory, "cachegen")
    try:
        assert lossy.cache_identity.codec_name == "cachegen/1"
        assert lossy.cache_identity.root != exact.cache_identity.root
        lossy.create_completion(PROMPT, max_tokens=1)
        assert _stored_codecs(lossy) == {b"SKCG"}
        # the exact instance on the same store: nothing to restore (a cold prefill)
        exact.create_completion(PROMPT + " seven", max_tokens=1)
        event = exact.last_cache_event
        assert event is not None and event.tier == "cold" and event.cached_tokens == 0
        # the CacheGen instance restores its pages from L3 (its live sequence displaced first)
        lossy.create_completion("Bread and butter.", max_tokens=1)
        lossy.create_completion(PROMPT + " seven", max_tokens=1)
        event = lossy.last_cache_event
        assert event is not None and event.tier == "l3" and event.cached_tokens >= 128
    finally:
        exact.close()
        lossy.close()
        select.register(lossy.cache_identity.hex, None)
