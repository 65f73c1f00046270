"""Every llama.cpp model, context and state call: SkippyLlama and the native calls it makes."""

from .llama import SkippyLlama

__all__ = ["SkippyLlama"]
