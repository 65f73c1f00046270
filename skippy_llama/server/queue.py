"""The bounded queue in front of the model (``--max-queue``): admit a request, or say when to retry.

Requests run on the model one at a time (llama_cpp.server's lock); without a bound, every client
that connects waits however long the line is, holding its connection and its prompt. A request
is admitted while fewer than ``1 + max_queue`` are running or waiting, and refused otherwise with
``503`` and a ``Retry-After`` of about the time the line ahead needs (recent requests' mean
duration times the line's length, 1 to 60 s). A ticket is given back once, when the request ends
however it ends (answered, failed, or its client gone), so a client that disconnects frees its
place at once.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

#: Retry-After bounds, seconds.
RETRY_MIN_S = 1
RETRY_MAX_S = 60
#: weight of the latest request in the mean duration (an exponential moving average)
DURATION_WEIGHT = 0.2


class Ticket:
    """A place in the line; :meth:`release` gives it back (once, from any thread)."""

    def __init__(self, queue: RequestQueue) -> None:
        self._queue = queue
        self._released = False

    def release(self) -> None:
        queue = self._queue
        with queue._lock:
            if self._released:
                return
            self._released = True
            queue._inflight -= 1


@dataclass(frozen=True)
class QueueStatus:
    max_queue: int
    inflight: int
    admitted: int
    rejected: int
    mean_request_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "max_queue": self.max_queue,
            "running_or_waiting": self.inflight,
            "admitted": self.admitted,
            "rejected": self.rejected,
            "mean_request_s": self.mean_request_s,
        }


class RequestQueue:
    """Counts the requests running or waiting for the model, up to ``1 + max_queue``."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue {max_queue} is negative")
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._inflight = 0
        self._admitted = 0
        self._rejected = 0
        self._mean_s: float | None = None

    def enter(self) -> Ticket | None:
        """A ticket, or None when the line is full (the caller answers 503)."""
        with self._lock:
            if self._inflight >= 1 + self.max_queue:
                self._rejected += 1
                return None
            self._inflight += 1
            self._admitted += 1
            return Ticket(self)

    def observe(self, seconds: float) -> None:
        """A request held the model this long (for :meth:`retry_after`)."""
        with self._lock:
            mean = self._mean_s
            self._mean_s = seconds if mean is None else mean + DURATION_WEIGHT * (seconds - mean)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about what the requests ahead need."""
        with self._lock:
            mean = self._mean_s if self._mean_s is not None else 1.0
            ahead = self._inflight
        return max(RETRY_MIN_S, min(RETRY_MAX_S, math.ceil(mean * ahead)))

    def status(self) -> QueueStatus:
        with self._lock:
            return QueueStatus(
                self.max_queue, self._inflight, self._admitted, self._rejected, self._mean_s
            )
