"""The circuit breaker: after ``failures`` consecutive failed calls the tier stops trying for a
back-off period (doubled each time it opens again without a success in between, up to
:data:`MAX_BACKOFF_FACTOR` times the configured one), so a server that is down costs a request
one clock read, not a connect timeout.

Thread-safe; the clock is injectable so tests need not sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: The back-off grows to at most this multiple of ``remote.breaker_backoff_s``.
MAX_BACKOFF_FACTOR = 8

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class BreakerStatus:
    state: BreakerState
    consecutive_failures: int
    opened: int  # times it opened
    open_until: float | None  # wall-clock time (unix) the back-off ends, while open
    last_reason: str | None


class Breaker:
    """Closed (calls go through), open (calls refused until the back-off ends), half-open (one
    call goes through: its success closes the breaker, its failure opens it again, longer)."""

    def __init__(
        self,
        failures: int,
        backoff_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._threshold = failures
        self._backoff = backoff_s
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._failures = 0
        self._opened = 0
        self._streak = 0  # openings since the last success: the back-off's exponent
        self._until: float | None = None  # monotonic end of the back-off, while open
        self._probing = False
        self._reason: str | None = None

    def allow(self) -> bool:
        """True when a call may go to the server now (False costs no socket work)."""
        with self._lock:
            if self._until is None:
                return True
            if self._clock() < self._until or self._probing:
                return False
            self._probing = True  # half-open: this caller probes, the others wait
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._streak = 0
            self._until = None
            self._probing = False

    def failure(self, reason: str) -> bool:
        """Count a failed call; True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            self._reason = reason
            if not self._probing and self._failures < self._threshold:
                return False
            factor = min(2**self._streak, MAX_BACKOFF_FACTOR)
            self._until = self._clock() + self._backoff * factor
            self._streak += 1
            self._opened += 1
            self._probing = False
            return True

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._until is not None and (self._clock() < self._until or self._probing)

    def status(self) -> BreakerStatus:
        with self._lock:
            now = self._clock()
            if self._until is None:
                state: BreakerState = "closed"
                until = None
            else:
                state = "open" if now < self._until or self._probing else "half_open"
                until = self._wall() + max(self._until - now, 0.0)
            return BreakerStatus(state, self._failures, self._opened, until, self._reason)
