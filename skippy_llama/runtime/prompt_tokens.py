"""The tokens a completion or chat request will prefill, found before the request runs.

A prefetch (:meth:`SkippyLlama.prefetch`) walks the page path of the tokens the request will
use: a prompt tokenized differently (a BOS more or less, special tokens read as text) would
prefetch another path. These reproduce llama-cpp-python 0.3's tokenization of a text prompt in
``Llama.create_completion`` and of messages in the Jinja chat handler; a wrong guess costs a
wasted read, never a different output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import llama_cpp

from .chat_head import chat_formatter

log = logging.getLogger("skippy_llama")


def completion_tokens(llm: llama_cpp.Llama, prompt: str) -> list[int]:
    """The tokens ``llm.create_completion(prompt)`` prefills (no suffix)."""
    model = llm._model
    bos = model.token_cls() if model.token_cls() != -1 else llm.token_bos()
    sep = model.token_sep()
    head = [bos] if model.add_bos_token() and bos != -1 else []
    tail = [sep if sep != -1 else llm.token_eos()] if model.add_eos_token() or sep != -1 else []
    body = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) if prompt else []
    return head + body + tail


def chat_tokens(llm: llama_cpp.Llama, messages: Sequence[dict[str, Any]]) -> list[int] | None:
    """The tokens ``llm.create_chat_completion(messages=...)`` prefills with the model's own
    chat template; None where that rendering is not reproduced here (a custom chat handler or
    a registered format, or a template that fails on these messages)."""
    formatter = chat_formatter(llm)
    if formatter is None:
        return None
    try:
        result = formatter(messages=cast(Any, list(messages)))
    except Exception as exc:  # a template that does not render these messages
        log.debug("skippy-llama: cannot render these messages for a prefetch (%s)", exc)
        return None
    return llm.tokenize(
        result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
    )
