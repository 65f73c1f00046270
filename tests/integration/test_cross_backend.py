"""``cross_backend``: off by default; pages of another backend are a miss unless it is on (SmolLM2).

This machine has one backend. The cache identity takes the backend from
``native.backend_name()``, so the first instance is loaded while that reports ``Vulkan``: its
pages are written under a Vulkan identity (offload fields and device names included, as on a GPU
build), and a second, honest instance (this machine's backend: CPU in CI) then looks them up
in the same L3 store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT

from skippy_llama import SkippyLlama
from skippy_llama.config import Settings
from skippy_llama.runtime import native

pytestmark = pytest.mark.model

KWARGS: dict[str, Any] = {"n_ctx": 1024, "n_batch": 64, "n_ubatch": 64, "verbose": False, "seed": 1}
PROMPT = TEXT * 2


def _settings(directory: Path, cross: bool) -> Settings:
    return Settings(
        cross_backend=cross,
        l1={"enabled": False},
        l3={
            "mode": "fixed",
            "budget": "256MiB",
            "directory": str(directory),
            "minimum_free": "1GiB",
        },
    )  # type: ignore[call-arg]


def test_cross_backend_is_off_by_default() -> None:
    assert Settings.model_fields["cross_backend"].default is False
    assert Settings().cross_backend is False  # type: ignore[call-arg]


@pytest.mark.parametrize("cross", [False, True], ids=["default", "cross_backend"])
def test_page_captured_under_another_backend_is_a_miss_unless_cross_backend(
    smollm2_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cross: bool,
) -> None:
    store = tmp_path / "l3"
    honest = native.backend_name()
    assert honest != "Vulkan"
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, "skippy_llama"):
        m.setattr(native, "backend_name", lambda: "Vulkan")
        writer = SkippyLlama(str(smollm2_path), cache_settings=_settings(store, cross), **KWARGS)
    try:
        assert writer.cache_identity.backend == ("any" if cross else "Vulkan")
        assert ("cross_backend is ON" in caplog.text) is cross
        writer.create_completion(PROMPT, max_tokens=4, temperature=0.0)
    finally:
        writer.close()  # flushes the pages to L3

    reader = SkippyLlama(str(smollm2_path), cache_settings=_settings(store, cross), **KWARGS)
    try:
        assert reader.cache_identity.backend == ("any" if cross else honest)
        got = reader.create_completion(PROMPT, max_tokens=8, temperature=0.0)
        event = reader.last_cache_event
        assert event is not None
        if cross:
            assert event.tier == "l3" and event.cached_tokens > 100
        else:
            assert event.tier == "cold" and event.cached_tokens == 0
    finally:
        reader.close()

    cold = llama_cpp.Llama(str(smollm2_path), **KWARGS)
    try:
        want = cold.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    finally:
        cold.close()
    assert isinstance(want, dict)
    # the "Vulkan" pages were computed on this machine's backend: here, and only here, they
    # are exact
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
