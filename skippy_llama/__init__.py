"""skippy-llama: repeated prompt prefixes nearly free, on llama-cpp-python.

``SkippyLlama`` is imported lazily so that the layers below the runtime (state, identity,
tiers, config) import and test without llama_cpp being loadable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .runtime.llama import SkippyLlama

__all__ = ["SkippyLlama", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SkippyLlama":
        from .runtime.llama import SkippyLlama

        return SkippyLlama
    raise AttributeError(name)
