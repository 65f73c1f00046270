"""Opening a ``SkippyLlama``'s cache: the L1 budget, pageability and the tiers from settings."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..cache import PrefixCache
from ..costs import CostModel
from ..state import KVLayout
from ..tiers.factory import TierContext, build_tiers
from .seam import backend_name

if TYPE_CHECKING:
    from .llama import SkippyLlama

log = logging.getLogger("skippy_llama")


def l1_budget(llm: SkippyLlama, slots: int) -> int:
    """Tokens L1 may keep resident (0: no L1), logged once."""
    if not llm.caching or slots <= 0:
        if not llm.caching:
            log.warning("skippy-llama cache disabled: %s", llm.cache_disabled_reason)
        return 0
    # checkpoints hold their own cells: the default budget of n_ctx tokens keeps the KV
    # memory at most twice what plain Llama takes
    budget = llm.cache_settings.l1.budget_tokens or llm.n_ctx()
    log.info(
        "skippy-llama: L1 keeps up to %d resident prefixes, %d tokens in all, in %s "
        "(KV memory at most %.1fx plain Llama's)",
        slots,
        budget,
        "device checkpoints" if llm.seam.on_device else "host memory (quantized K/V)",
        1 + budget / llm.n_ctx(),
    )
    return budget


def open_cache(
    llm: SkippyLlama, layout: KVLayout | None, costs: CostModel, slots: int, window: int
) -> PrefixCache:
    """The cache of ``llm``, with the tiers its settings ask for (fail-open: a tier that cannot
    open is left out); ``layout`` is None where it was not read (no page tier wants it)."""
    settings = llm.cache_settings
    pageable = llm.caching and layout is not None and layout.pageable and window == 0
    # measured by scripts/certify.py (roster/split-certified.json, gemma3 rows): the state of a
    # sliding-window model has a second section holding only the window's cells, so pages cut
    # from a capture cannot rebuild a shorter prefix
    why = f"SWA model (n_swa={window})" if window else "the KV layout cannot be paged"
    tiers = build_tiers(
        TierContext(
            settings=settings,
            identity=llm.cache_identity,
            backend=backend_name(),
            costs=costs,
            pageable=pageable,
            unpageable_reason=why,
            resident_slots=range(1, slots + 1) if llm.l1_budget_tokens else (),
            l1_budget_tokens=llm.l1_budget_tokens,
            window=window,
        )
    )
    return PrefixCache(
        identity=llm.cache_identity,
        page_tokens=settings.page_tokens,
        tiers=tiers,
        costs=costs,
        bytes_per_token=layout.bytes_per_token if layout else 0,
        trace_file=settings.l3.trace_file,
    )
