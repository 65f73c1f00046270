"""Whether an L1 checkpoint pays on this machine: measured costs, no llama.cpp.

A resident prefix is a llama.cpp sequence checkpoint. On the CPU a checkpoint or its restore
takes a few milliseconds and always beats re-prefilling the prefix. On a GPU build the state
calls have a fixed cost that does not shrink with the prefix (measured on an H200: ~60 ms for
64 or 4,096 tokens, one synchronized copy per layer's K and V), while the prefill they save may
be a few milliseconds (a small model, a short prompt). So both decisions are taken from what this
process measured:

- a hit restores a checkpoint only if its restore costs less than prefilling the tokens it adds
  beyond what the live sequence already holds;
- a prefix is parked only if parking it and restoring it once cost less than its prefill.

Until every cost has been measured the answer is yes: that is how they get measured.
"""

from __future__ import annotations

import math

#: Prefills shorter than this are not timed: fixed per-call costs would dominate the rate.
MIN_PREFILL_TOKENS = 16


class ResidentCosts:
    """Exponentially weighted averages of prefill rate and checkpoint (park/restore) times."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.prefill_seconds_per_token: float | None = None
        self.restore_seconds: float | None = None
        self.park_seconds: float | None = None

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.alpha * (sample - old)

    @staticmethod
    def _valid(seconds: float) -> bool:
        return seconds >= 0 and math.isfinite(seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` prompt tokens took ``seconds`` (short ones are ignored)."""
        if tokens >= MIN_PREFILL_TOKENS and self._valid(seconds):
            self.prefill_seconds_per_token = self._ewma(
                self.prefill_seconds_per_token, seconds / tokens
            )

    def observe_restore(self, seconds: float) -> None:
        """Restoring one checkpoint into the working sequence took ``seconds``."""
        if self._valid(seconds):
            self.restore_seconds = self._ewma(self.restore_seconds, seconds)

    def observe_park(self, seconds: float) -> None:
        """Checkpointing one prefix took ``seconds``."""
        if self._valid(seconds):
            self.park_seconds = self._ewma(self.park_seconds, seconds)

    def restore_pays(self, saved_tokens: int) -> bool:
        """Whether a restore that spares prefilling ``saved_tokens`` beats that prefill."""
        rate, restore = self.prefill_seconds_per_token, self.restore_seconds
        if rate is None or restore is None:
            return True
        return restore < rate * saved_tokens

    def park_pays(self, n_tokens: int) -> bool:
        """Whether keeping an ``n_tokens`` prefix resident can ever repay its park and restore."""
        rate, restore, park = (
            self.prefill_seconds_per_token,
            self.restore_seconds,
            self.park_seconds,
        )
        if rate is None or restore is None or park is None:
            return True
        return park + restore < rate * n_tokens
