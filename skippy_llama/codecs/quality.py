"""The quality gate of a lossy page codec: teacher-forced scores against the native cache.

A lossy codec is judged the way the CacheGen and KIVI papers judge theirs: the same text is
scored teacher-forced twice, once after restoring its prefix from native pages and once from the
codec's pages, and the two next-token distributions are compared position by position. A
parameter set qualifies when, over the calibration positions, the next-token argmax agrees at
>= 98 % of them and the mean KL divergence (native || lossy) is <= 0.02 nats, and the held-out
texts' perplexity rises <= 1 %. Greedy agreement (a cascade measure: one near-tie flipped early
loses the whole continuation) is measured and reported by the qualifier, never gated on.

Pure numpy: the qualifier (``scripts/qualify_cachegen.py``) feeds it logits; tests feed it
arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Logits = npt.NDArray[Any]


@dataclass(frozen=True)
class Gate:
    """The thresholds (issue 43)."""

    min_argmax_agree: float = 0.98
    max_mean_kl: float = 0.02
    max_ppl_rise: float = 0.01


GATE = Gate()


def log_softmax(logits: Logits) -> npt.NDArray[np.float64]:
    """Row-wise log-probabilities, in float64 (positions x vocabulary)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


@dataclass
class Scores:
    """Teacher-forced comparison of lossy against native logits, summed over positions.

    ``add`` takes one text's logits (positions x vocabulary) from both restores and the tokens
    they predict; ``kl`` is KL(native || lossy) per position (nats), the NLLs are of the targets.
    """

    positions: int = 0
    argmax_agree: int = 0
    kl_sum: float = 0.0
    native_nll: float = 0.0
    lossy_nll: float = 0.0
    max_kl: float = 0.0
    per_text_kl: list[float] = field(default_factory=list)

    def add(self, native: Logits, lossy: Logits, targets: npt.ArrayLike) -> None:
        """Score one text. Raises ValueError when the shapes disagree."""
        native = np.asarray(native)
        lossy = np.asarray(lossy)
        tgt = np.asarray(targets, dtype=np.int64)
        if native.shape != lossy.shape or native.ndim != 2 or tgt.shape != (native.shape[0],):
            raise ValueError(
                f"logits {native.shape} and {lossy.shape} with targets {tgt.shape} do not match"
            )
        lp, lq = log_softmax(native), log_softmax(lossy)
        kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
        rows = np.arange(len(tgt))
        self.positions += len(tgt)
        self.argmax_agree += int((native.argmax(axis=1) == lossy.argmax(axis=1)).sum())
        self.kl_sum += float(kl.sum())
        self.max_kl = max(self.max_kl, float(kl.max(initial=0.0)))
        self.per_text_kl.append(float(kl.mean()) if len(kl) else 0.0)
        self.native_nll += float(-lp[rows, tgt].sum())
        self.lossy_nll += float(-lq[rows, tgt].sum())

    @property
    def agree_share(self) -> float:
        return self.argmax_agree / self.positions if self.positions else 0.0

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else math.inf

    @property
    def ppl_rise(self) -> float:
        """Relative perplexity rise of the lossy restore over the native one."""
        if not self.positions:
            return math.inf
        return math.exp((self.lossy_nll - self.native_nll) / self.positions) - 1.0


@dataclass(frozen=True)
class Quality:
    """One parameter set's gated figures: calibration agreement and KL, held-out perplexity."""

    agree_share: float
    mean_kl: float
    ppl_rise: float
    positions: int
    held_out_positions: int

    @classmethod
    def of(cls, calibration: Scores, held_out: Scores) -> Quality:
        return cls(
            calibration.agree_share,
            calibration.mean_kl,
            held_out.ppl_rise,
            calibration.positions,
            held_out.positions,
        )

    def failures(self, gate: Gate = GATE) -> list[str]:
        """Why the set fails the gate (empty: it qualifies). No positions never qualify."""
        out: list[str] = []
        if not self.positions or not self.held_out_positions:
            out.append("no scored positions")
        if not self.agree_share >= gate.min_argmax_agree:
            out.append(
                f"next-token argmax agrees at {self.agree_share:.2%} of positions "
                f"(gate >= {gate.min_argmax_agree:.0%})"
            )
        if not self.mean_kl <= gate.max_mean_kl:
            out.append(f"mean KL {self.mean_kl:.4f} nats (gate <= {gate.max_mean_kl})")
        if not self.ppl_rise <= gate.max_ppl_rise:
            out.append(
                f"held-out perplexity {self.ppl_rise:+.2%} (gate <= +{gate.max_ppl_rise:.0%})"
            )
        return out

    def passed(self, gate: Gate = GATE) -> bool:
        return not self.failures(gate)


def greedy_agreement(cold: list[int], restored: list[int]) -> int:
    """Tokens before the first difference of two greedy continuations (the strict reading)."""
    n = min(len(cold), len(restored))
    return next((i for i in range(n) if cold[i] != restored[i]), n)


def cheapest(candidates: list[tuple[float, bool]]) -> int | None:
    """Index of the smallest size among the passing ``(size_ratio, passed)``; None if none."""
    passing = [(size, i) for i, (size, ok) in enumerate(candidates) if ok]
    return min(passing)[1] if passing else None
