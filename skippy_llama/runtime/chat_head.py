"""The tokens a chat template puts between an assistant reply and the next user message.

A chat's next prompt is the previous prompt, the reply, this *head* (for ChatML
``<|im_end|>\\n<|im_start|>user\\n``) and the new message. ``SkippyLlama.prepare_next_turn``
decodes the head together with the reply, while the user types, so the next turn prefills only
the message and what follows it. The head is found by rendering the model's own template (the
one ``create_chat_completion`` uses) on a two-turn conversation; it is used only where the
tokens of the whole rendering start with the tokens of its parts, so a prediction can never
make a prompt's tokens differ. A wrong prediction costs a few wasted cells: the next prompt
keeps only what matches.
"""

from __future__ import annotations

import logging
from typing import Any

import llama_cpp
from llama_cpp import llama_chat_format

log = logging.getLogger("skippy_llama")

#: A head longer than this is not a template's glue (a system prompt re-sent every turn).
MAX_HEAD_TOKENS = 32
_USER, _REPLY, _NEXT = "Hello there.", "Fine, thanks.", "What next?"


def chat_formatter(llm: llama_cpp.Llama) -> llama_chat_format.Jinja2ChatFormatter | None:
    """The formatter of the GGUF template ``create_chat_completion`` uses, or None (a custom
    handler or a registered format: their rendering is not reproduced here)."""
    name = llm.chat_format
    if llm.chat_handler is not None or name is None or not name.startswith("chat_template."):
        return None
    key = "tokenizer.chat_template" if name == "chat_template.default" else f"tokenizer.{name}"
    template = llm.metadata.get(key)
    if not template:
        return None
    model = llm._model
    eos, bos = llm.token_eos(), llm.token_bos()
    return llama_chat_format.Jinja2ChatFormatter(
        template=template,
        eos_token=model.token_get_text(eos) if eos != -1 else "",
        bos_token=model.token_get_text(bos) if bos != -1 else "",
        stop_token_ids=[eos],
    )


def template_head(llm: llama_cpp.Llama) -> list[int]:
    """The head's tokens for ``llm``'s chat template; empty where it cannot be found safely."""
    try:
        fmt = chat_formatter(llm)
        if fmt is None:
            return []
        first = fmt(messages=[{"role": "user", "content": _USER}])
        turn: list[Any] = [
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _REPLY},
            {"role": "user", "content": _NEXT},
        ]
        whole = fmt(messages=turn)
        before = first.prompt + _REPLY
        at = whole.prompt.find(_NEXT, len(before))
        if not whole.prompt.startswith(before) or at < 0:
            return []

        def tokens(text: str, bos: bool) -> list[int]:
            return llm.tokenize(text.encode(), add_bos=bos, special=True)

        bos = not whole.added_special
        full, head = tokens(whole.prompt, bos), tokens(whole.prompt[len(before) : at], False)
        prefix = tokens(before, bos)
        start = len(prefix)
        if not 0 < len(head) <= MAX_HEAD_TOKENS or full[: start + len(head)] != prefix + head:
            return []  # the pieces tokenize differently from the whole: no safe prediction
        return head
    except Exception as exc:  # a template that does not render this conversation
        log.debug("skippy-llama: no chat head for this template (%s)", exc)
        return []
