"""The only layer that imports llama_cpp: SkippyLlama and the native calls it makes."""

from .llama import SkippyLlama

__all__ = ["SkippyLlama"]
