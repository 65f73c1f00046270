"""``SkippyLlama.cache_status``: the in-process cache state that ``kv-cache status`` cannot see."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .llama import SkippyLlama


def cache_status(llm: SkippyLlama) -> dict[str, Any]:
    """L1 memory, the tiers' statuses and the counters of ``llm``'s cache."""
    cache = llm.prefix_cache
    resident = cache.resident
    layout = llm.kv_layout
    per_token = layout.kv_bytes_per_cell if layout is not None else 0
    used = resident.used_tokens if resident is not None else 0
    pinner = llm.seam.buffers.pinner
    return {
        "caching": llm.caching,
        "disabled_reason": llm.cache_disabled_reason,
        "n_ctx": llm.n_ctx(),
        "granule": llm.granule,
        "lone_decodes_exact": llm.lone_decodes_exact,
        "pinned_host_buffers": pinner.stats() if pinner is not None else None,
        "native": llm.native_verdict.to_json(),
        "kv_bytes_per_token": per_token,
        "context_kv_bytes": per_token * llm.n_ctx(),
        "tiers": [tier.name for tier in cache.tiers],
        "l1": {
            "slots": len(resident.entries()) if resident is not None else 0,
            "max_prefixes": resident.max_prefixes if resident is not None else 0,
            "budget_tokens": llm.l1_budget_tokens,
            "budget_bytes": per_token * llm.l1_budget_tokens,
            "resident_tokens": used,
            "resident_bytes": per_token * used,
        },
        "counters": cache.counters_json(),
    }
