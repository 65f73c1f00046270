"""The cost book: measured prefill and restore rates per model identity and backend (pure).

Admission and eviction weigh what a page saves (its cold prefill) against what it costs to bring
back (its restore). Both are measured on this machine as moving averages
(:class:`skippy_llama.admission.CostModel`); the book keeps them with the store, so a restarted
process decides with what earlier ones learned instead of falling back to write-through.

This module only turns a book into bytes and back; the store persists the bytes (one value under
one key, written when the writer flushes its counters). A book read from disk is input like any
other: :meth:`CostBook.from_bytes` checks every field and drops what it does not understand,
never raising on bad data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ...admission import CostModel

BOOK_VERSION = 1
#: Entries kept: one per (model identity, backend) this store has served; old ones drop first.
MAX_ENTRIES = 256
#: A stored book larger than this is not one this build wrote (256 entries take ~60 kB).
MAX_BOOK_BYTES = 1 << 20
#: Longest model identity or backend name accepted from a stored book.
MAX_NAME_CHARS = 512
#: Rates above these are not measurements (an hour per token, a second per byte): a planted
#: value would otherwise make every restore look slower than its prefill and turn L3 off.
MAX_PREFILL_S_PER_TOKEN = 3600.0
MAX_RESTORE_S_PER_BYTE = 1.0


@dataclass(frozen=True)
class CostRates:
    """Learned rates of one model on one backend (None while unmeasured)."""

    prefill_s_per_token: float | None
    restore_s_per_byte: float | None
    updated: float = 0.0


def _rate(value: Any, limit: float) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and 0 < value <= limit else None


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS else None


class CostBook:
    """Rates keyed by ``(model identity, backend)``; see the module docstring."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, str], CostRates] = {}
        self.dropped = 0  # entries of a loaded book that failed validation

    def get(self, model_identity: str, backend: str) -> CostRates | None:
        """The rates learned for this model on this backend, or None."""
        return self._rates.get((model_identity, backend))

    def put(self, model_identity: str, backend: str, rates: CostRates) -> None:
        """Store ``rates`` (the newest ``MAX_ENTRIES`` entries are kept)."""
        self._rates.pop((model_identity, backend), None)
        self._rates[(model_identity, backend)] = rates
        while len(self._rates) > MAX_ENTRIES:
            oldest = min(self._rates, key=lambda k: self._rates[k].updated)
            del self._rates[oldest]

    def __len__(self) -> int:
        return len(self._rates)

    def learn(self, model_identity: str, backend: str, costs: CostModel, now: float) -> None:
        """Copy ``costs``' current averages into the book (unmeasured ones keep the old value)."""
        old = self.get(model_identity, backend)
        prefill = costs.prefill_seconds_per_token
        restore = costs.restore_seconds_per_byte
        if old is not None:
            prefill = prefill if prefill is not None else old.prefill_s_per_token
            restore = restore if restore is not None else old.restore_s_per_byte
        if prefill is None and restore is None:
            return
        self.put(model_identity, backend, CostRates(prefill, restore, now))

    def seed(self, model_identity: str, backend: str, costs: CostModel) -> bool:
        """Start ``costs`` from the book's rates for this model and backend; True if any."""
        rates = self.get(model_identity, backend)
        if rates is None:
            return False
        if costs.prefill_seconds_per_token is None:
            costs.prefill_seconds_per_token = rates.prefill_s_per_token
        if costs.restore_seconds_per_byte is None:
            costs.restore_seconds_per_byte = rates.restore_s_per_byte
        return rates.prefill_s_per_token is not None or rates.restore_s_per_byte is not None

    def to_bytes(self) -> bytes:
        """The book as compact JSON bytes."""
        entries = [
            {
                "model_identity": model,
                "backend": backend,
                "prefill_s_per_token": r.prefill_s_per_token,
                "restore_s_per_byte": r.restore_s_per_byte,
                "updated": r.updated,
            }
            for (model, backend), r in self._rates.items()
        ]
        return json.dumps({"v": BOOK_VERSION, "entries": entries}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> CostBook:
        """A book from :meth:`to_bytes` output; empty for None, another version or garbage.

        Entries that fail validation are skipped and counted in ``dropped``.
        """
        book = cls()
        if not raw:
            return book
        if len(raw) > MAX_BOOK_BYTES:
            book.dropped += 1
            return book
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # deep nesting: RecursionError
            book.dropped += 1
            return book
        version = obj.get("v") if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or type(version) is not int or version != BOOK_VERSION:
            book.dropped += 1
            return book
        entries = obj.get("entries")
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, dict):
                book.dropped += 1
                continue
            model, backend = _name(entry.get("model_identity")), _name(entry.get("backend"))
            prefill = _rate(entry.get("prefill_s_per_token"), MAX_PREFILL_S_PER_TOKEN)
            restore = _rate(entry.get("restore_s_per_byte"), MAX_RESTORE_S_PER_BYTE)
            updated = _rate(entry.get("updated"), math.inf) or 0.0
            if model is None or backend is None:
                book.dropped += 1
                continue
            if prefill is None and restore is None:
                book.dropped += 1
                continue
            book.put(model, backend, CostRates(prefill, restore, updated))
        return book
