"""Batch output: one JSON line per finished item, appended and flushed as each one finishes.

A crash can leave at most one partial last line; reopening drops it, so the item in flight is
the only one lost and a resumed run repeats it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

from ..errors import ConfigError
from .items import ItemId


class OutputFile:
    """The output JSONL of a batch, opened for appending after reading what it holds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dropped_partial_line = False
        self._stream: IO[str] | None = None

    def finished_ids(self, known: Collection[ItemId]) -> set[ItemId]:
        """Ids already in the file (written by an earlier run of the same batch).

        A partial last line (a crash while writing it) is cut off the file.

        Raises:
            ConfigError: a complete line is not an output record of this batch.
        """
        if not self.path.exists():
            return set()
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            with self.path.open("r+b") as f:
                f.truncate(len(complete))
            self.dropped_partial_line = True
        done: set[ItemId] = set()
        for lineno, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            item_id = obj.get("id") if isinstance(obj, dict) else None
            if item_id is None:
                raise ConfigError(
                    f"{self.path} line {lineno}: not a batch output record; give a new OUT "
                    "file or remove this one"
                )
            if item_id not in known:
                raise ConfigError(
                    f"{self.path} line {lineno}: id {item_id!r} is not in the input; is OUT "
                    "the output of another batch?"
                )
            done.add(item_id)
        return done

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and push it to the disk before the next item starts."""
        if self._stream is None:
            self._stream = self.path.open("a", encoding="utf-8")
        self._stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._stream.flush()
        os.fsync(self._stream.fileno())

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
