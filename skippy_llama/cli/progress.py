"""A dependency-free progress line on stderr for long CLI work."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``[######----] 6/10 label 12.3s`` redrawn in place on a TTY, one line per step otherwise."""

    def __init__(self, total: int, title: str, stream: TextIO | None = None, enabled: bool = True):
        self.total = max(total, 1)
        self.title = title
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.started
        line = (
            f"{self.title} [{'#' * filled}{'-' * (width - filled)}] "
            f"{self.done}/{self.total} {label} {elapsed:.1f}s"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
