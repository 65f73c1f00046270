"""Model loading for the server: llama_cpp.server's ``LlamaProxy`` building ``SkippyLlama``.

llama_cpp.server keeps one model loaded and hands it to each request under its lock; only the
constructor differs here, so the proxy keeps its switching and alias logic and replaces
``load_llama_from_model_settings``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings

from ..config import LoadedSettings
from ..packages.kvdtype import KVDtypeResolution
from ..packages.loader import LoadedPackage
from ..runtime.llama import SkippyLlama


class ServedLlama(SkippyLlama):
    """``SkippyLlama`` that remembers the tokens it sampled for the latest request.

    A streamed response carries no token count; the usage chunk that ``stream_options``
    asks for needs one that matches what a non-streamed response reports.
    """

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        self.sampled_tokens: list[int] = []
        self.prompt_token_count = 0
        super().__init__(model_path, **kwargs)
        # decide the native verdict now, before requests run: it may probe the KV layout by
        # decoding a token, which must not happen beside a request (status reads it later)
        _ = self.native_verdict

    def generate(  # type: ignore[override]
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``SkippyLlama.generate`` that records every sampled token."""
        self.sampled_tokens = []
        self.prompt_token_count = len(tokens)
        inner = super().generate(tokens, *args, **kwargs)
        try:
            token = next(inner)
            while True:
                self.sampled_tokens.append(token)
                sent = yield token
                token = inner.send(sent)
        except StopIteration:
            return
        finally:
            inner.close()

    def completion_tokens(self) -> int:
        """Tokens the latest completion generated, counted as ``Llama`` counts them in usage:
        an end-of-generation token ends the reply and is not part of it."""
        n = len(self.sampled_tokens)
        if n and llama_cpp.llama_vocab_is_eog(self._model.vocab, self.sampled_tokens[-1]):
            n -= 1
        return n


@dataclass(frozen=True)
class ModelSource:
    """The served GGUF, the live K/V dtype resolved for it, and its package if it has one."""

    path: str
    kv_dtype: KVDtypeResolution
    package: LoadedPackage | None = None


class SkippyLlamaProxy(LlamaProxy):  # type: ignore[misc]
    """``LlamaProxy`` whose models are :class:`ServedLlama` with the given cache settings."""

    def __init__(
        self, models: list[ModelSettings], source: ModelSource, cache: LoadedSettings
    ) -> None:
        self.source = source
        self.cache = cache
        super().__init__(models=models)

    def load_llama_from_model_settings(self, settings: ModelSettings) -> ServedLlama:  # type: ignore[override]
        """Build the model from the llama_cpp.server fields that apply to a text model."""
        kwargs: dict[str, Any] = {
            "n_gpu_layers": settings.n_gpu_layers,
            "main_gpu": settings.main_gpu,
            "use_mmap": settings.use_mmap,
            "use_mlock": settings.use_mlock,
            "seed": settings.seed,
            "n_ctx": settings.n_ctx,
            "n_batch": settings.n_batch,
            "n_ubatch": settings.n_ubatch,
            "n_threads": settings.n_threads,
            "n_threads_batch": settings.n_threads_batch,
            "offload_kqv": settings.offload_kqv,
            "flash_attn": settings.flash_attn,
            "last_n_tokens_size": settings.last_n_tokens_size,
            "chat_format": settings.chat_format,
            "verbose": settings.verbose,
        }
        resolution = self.source.kv_dtype
        kwargs.update(resolution.llama_kwargs())
        if resolution.needs_flash_attn:
            kwargs["flash_attn"] = True
        llm = ServedLlama(self.source.path, cache_settings=self.cache.settings, **kwargs)
        llm.kv_dtype, llm.model_package = resolution, self.source.package
        return llm

    def current(self) -> ServedLlama | None:
        """The loaded model, if any (for status reads that must not load one)."""
        model = self._current_model
        return model if isinstance(model, ServedLlama) else None
