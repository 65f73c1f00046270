"""Measured costs kept with the store: loaded when a tier opens, saved by the writer thread.

A process starts with no measurements, and until it has both a prefill and a restore timing the
admission policy falls back to write-through and the page policy ranks without benefit. The
store therefore keeps a :class:`~.costs.CostBook` under one info key (``schema.COSTS``): the
rates each (model identity, backend) pair last learned (the prefill rate and L3's own restore
rate: restores other tiers served are not L3's to keep). A tier opened for a model seeds its
:class:`~skippy_llama.admission.CostModel` from its entry, so a restarted process decides with
what earlier ones measured, and its own measurements go back into the book in the writer's
housekeeping transaction (only when they changed), merged with the entries of other models.

The stored value is ``tag + JSON``; the tag is the store's HMAC over the JSON when
``l3.secret_file`` is set (zeros otherwise). A book that fails the tag or validation is ignored,
counted as ``damaged_costs``, and replaced by this process's entry on its next save; it never
raises into the tier.
"""

from __future__ import annotations

import time

from ...costs import CostModel
from .context import Parts
from .costs import TIER, CostBook
from .schema import COSTS, TAG_BYTES
from .store import DiskStore, StoreReader


class LearnedCosts:
    """The cost book entry of one (model identity, backend) in one open store."""

    def __init__(self, parts: Parts, costs: CostModel, model_identity: str, backend: str) -> None:
        self.parts = parts
        self.costs = costs
        self.model_identity = model_identity
        self.backend = backend
        self._saved: tuple[float | None, float | None] | None = None
        self.loaded = False  # True when the book had rates for this model and backend

    def _rates(self) -> tuple[float | None, float | None]:
        return (self.costs.prefill_seconds_per_token, self.costs.restore_rate(TIER))

    def _read(self, store: StoreReader, *, count: bool = True) -> CostBook:
        """The stored book; damage is counted once, at load (a save merges and overwrites)."""
        raw = store.get(COSTS)
        if raw is None:
            return CostBook()
        tag, body = raw[:TAG_BYTES], raw[TAG_BYTES:]
        signer = self.parts.signer
        if len(raw) < TAG_BYTES or not signer.verify(tag, signer.costs(body)):
            if count:
                self.parts.counters.add("damaged_costs")
            return CostBook()
        book = CostBook.from_bytes(body)
        if count:
            self.parts.counters.add("damaged_costs", book.dropped)
        return book

    def load(self) -> bool:
        """Seed the cost model from the store's book; True when it had this model's rates.

        Rates this process already measured are kept (a seed fills only what is unmeasured).
        """
        store = self.parts.store
        if store is None:
            return False
        try:
            book = self._read(store)
        except Exception as exc:
            self.parts.health.fault(exc, "load costs")
            return False
        self.loaded = book.seed(self.model_identity, self.backend, self.costs)
        self._saved = self._rates() if self.loaded else None
        return self.loaded

    def save(self, store: DiskStore) -> bool:
        """Put this process's rates into the stored book when they changed since the last save;
        call inside a store transaction (another process may have added its own entry)."""
        rates = self._rates()
        if rates == self._saved or rates == (None, None):
            return False
        book = self._read(store, count=False)
        book.learn(self.model_identity, self.backend, self.costs, time.time())
        body = book.to_bytes()
        store.set(COSTS, self.parts.signer.costs(body) + body)
        self._saved = rates
        return True

    def unsaved(self) -> None:
        """The transaction of the last :meth:`save` did not commit: save again next time."""
        self._saved = None
