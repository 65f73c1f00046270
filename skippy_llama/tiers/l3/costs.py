"""The cost book: measured prefill and restore rates per model identity and backend (pure).

Admission and eviction weigh what a page saves (its cold prefill) against what it costs to bring
back (its restore). Both are measured on this machine as moving averages
(:class:`skippy_llama.costs.CostModel`); the book keeps them with the store, so a restarted
process decides with what earlier ones learned instead of falling back to write-through.
Restore rates are kept by tier name, as the cost model keeps them; L3 stores its own (``l3``):
a remote restore or an L2 one never reaches its book.

This module only turns a book into bytes and back; the store persists the bytes (one value under
one key, written when the writer flushes its counters). A book read from disk is input like any
other: :meth:`CostBook.from_bytes` checks every field and drops what it does not understand,
never raising on bad data. Version 1 books (one restore rate per entry, L3's) are read as L3
rates; books are written as version 2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...costs import CostModel

#: The tier name L3's rates are kept under in the cost model and the book (``DiskTier.name``).
TIER = "l3"
BOOK_VERSION = 2
#: Versions :meth:`CostBook.from_bytes` reads (1: ``restore_s_per_byte`` was one number, L3's).
READ_VERSIONS = (1, 2)
#: Entries kept: one per (model identity, backend) this store has served; old ones drop first.
MAX_ENTRIES = 256
#: A stored book larger than this is not one this build wrote (256 entries take ~60 kB).
MAX_BOOK_BYTES = 1 << 20
#: Longest model identity or backend name accepted from a stored book.
MAX_NAME_CHARS = 512
#: Tier rates one entry may hold, and the longest tier name, in a stored book.
MAX_TIERS = 16
MAX_TIER_CHARS = 64
#: Rates above these are not measurements (an hour per token, a second per byte): a planted
#: value would otherwise make every restore look slower than its prefill and turn L3 off.
MAX_PREFILL_S_PER_TOKEN = 3600.0
MAX_RESTORE_S_PER_BYTE = 1.0


@dataclass(frozen=True)
class CostRates:
    """Learned rates of one model on one backend: its prefill rate (None while unmeasured)
    and the restore rate of each tier that measured one, by tier name."""

    prefill_s_per_token: float | None
    restore_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    updated: float = 0.0


def _rate(value: Any, limit: float) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and 0 < value <= limit else None


def _name(value: Any, limit: int = MAX_NAME_CHARS) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= limit else None


def _restore_rates(value: Any, version: int) -> dict[str, float]:
    """The valid tier rates of a stored entry's ``restore_s_per_byte`` (invalid pairs left
    out; a version 1 number is L3's)."""
    if version == 1:
        rate = _rate(value, MAX_RESTORE_S_PER_BYTE)
        return {} if rate is None else {TIER: rate}
    if not isinstance(value, dict) or len(value) > MAX_TIERS:
        return {}
    out: dict[str, float] = {}
    for name, raw in value.items():
        tier, rate = _name(name, MAX_TIER_CHARS), _rate(raw, MAX_RESTORE_S_PER_BYTE)
        if tier is not None and rate is not None:
            out[tier] = rate
    return out


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

    def learn(
        self, model_identity: str, backend: str, costs: CostModel, now: float, *, tier: str = TIER
    ) -> None:
        """Copy ``costs``' current prefill rate and ``tier``'s restore rate into the book
        (unmeasured ones keep the old value; other tiers' stored rates are kept)."""
        old = self.get(model_identity, backend)
        prefill = costs.prefill_seconds_per_token
        restore = dict(old.restore_s_per_byte) if old is not None else {}
        rate = costs.restore_rate(tier)
        if rate is not None:
            restore[tier] = rate
        if old is not None and prefill is None:
            prefill = old.prefill_s_per_token
        if prefill is None and not restore:
            return
        self.put(model_identity, backend, CostRates(prefill, restore, now))

    def seed(
        self, model_identity: str, backend: str, costs: CostModel, *, tier: str = TIER
    ) -> bool:
        """Start ``costs`` from the book's prefill rate and ``tier``'s restore rate for this
        model and backend, where ``costs`` has not measured them; True if the book had any."""
        rates = self.get(model_identity, backend)
        if rates is None:
            return False
        if costs.prefill_seconds_per_token is None:
            costs.prefill_seconds_per_token = rates.prefill_s_per_token
        restore = rates.restore_s_per_byte.get(tier)
        if restore is not None:
            costs.restore_rates.setdefault(tier, restore)
        return rates.prefill_s_per_token is not None or restore is not None

    def to_bytes(self) -> bytes:
        """The book as compact JSON bytes."""
        entries = [
            {
                "model_identity": model,
                "backend": backend,
                "prefill_s_per_token": r.prefill_s_per_token,
                "restore_s_per_byte": dict(r.restore_s_per_byte),
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
        if not isinstance(obj, dict) or type(version) is not int or version not in READ_VERSIONS:
            book.dropped += 1
            return book
        entries = obj.get("entries")
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, dict):
                book.dropped += 1
                continue
            model, backend = _name(entry.get("model_identity")), _name(entry.get("backend"))
            prefill = _rate(entry.get("prefill_s_per_token"), MAX_PREFILL_S_PER_TOKEN)
            restore = _restore_rates(entry.get("restore_s_per_byte"), version)
            updated = _rate(entry.get("updated"), math.inf) or 0.0
            if model is None or backend is None:
                book.dropped += 1
                continue
            if prefill is None and not restore:
                book.dropped += 1
                continue
            book.put(model, backend, CostRates(prefill, restore, updated))
        return book
