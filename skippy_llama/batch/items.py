"""Batch input: one JSON object per line, ``{"id": ..., "prompt": ...}`` or ``"messages"``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

ItemId = str | int
_KEYS = {"id", "prompt", "messages", "max_tokens", "temperature", "seed"}


@dataclass(frozen=True)
class BatchItem:
    """One request of a batch. Exactly one of ``prompt`` and ``messages`` is set."""

    id: ItemId
    line: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None

    def order_text(self) -> str:
        """Text whose tokens stand for the prompt when ordering (a chat's messages in turn)."""
        if self.prompt is not None:
            return self.prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in self.messages or ())


def _bad(path: Path, lineno: int, what: str) -> ConfigError:
    return ConfigError(f"{path} line {lineno}: {what}")


def _messages(path: Path, lineno: int, value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _bad(path, lineno, "'messages' must be a non-empty list of {role, content}")
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise _bad(
                path,
                lineno,
                f"messages[{i}] must be {{'role': str, 'content': str}}, got {message!r}",
            )
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def parse_item(path: Path, lineno: int, line: str) -> BatchItem:
    """Check one input line.

    Raises:
        ConfigError: the line is not a valid item; the message names the file, line and field.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _bad(path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _bad(path, lineno, "expected a JSON object with 'id' and 'prompt' or 'messages'")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise _bad(
            path,
            lineno,
            f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {sorted(_KEYS)}",
        )
    item_id = obj.get("id")
    if isinstance(item_id, bool) or not isinstance(item_id, str | int) or item_id == "":
        raise _bad(path, lineno, f"'id' must be a non-empty string or an integer, got {item_id!r}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise _bad(path, lineno, "give exactly one of 'prompt' (a string) and 'messages'")
    prompt = obj.get("prompt")
    if has_prompt and (not isinstance(prompt, str) or not prompt):
        raise _bad(path, lineno, "'prompt' must be a non-empty string")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise _bad(path, lineno, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    temperature = obj.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise _bad(path, lineno, f"'temperature' must be a number >= 0, got {temperature!r}")
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise _bad(path, lineno, f"'seed' must be a non-negative integer, got {seed!r}")
    return BatchItem(
        id=item_id,
        line=lineno,
        prompt=prompt if has_prompt else None,
        messages=_messages(path, lineno, obj["messages"]) if has_messages else None,
        max_tokens=max_tokens,
        temperature=None if temperature is None else float(temperature),
        seed=seed,
    )


def load_items(path: Path) -> list[BatchItem]:
    """Read and check every line of ``path`` before anything runs (blank lines are skipped).

    Raises:
        ConfigError: the file is missing or empty, a line is invalid, or an id repeats.
    """
    if not path.is_file():
        raise ConfigError(f"input {str(path)!r} does not exist or is not a file")
    items: list[BatchItem] = []
    seen: dict[ItemId, int] = {}
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            item = parse_item(path, lineno, line)
            if item.id in seen:
                raise _bad(path, lineno, f"id {item.id!r} repeats line {seen[item.id]}")
            seen[item.id] = lineno
            items.append(item)
    if not items:
        raise ConfigError(f"input {str(path)!r} holds no items")
    return items
