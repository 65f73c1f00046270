"""``SkippyLlama.cache_status``: the in-process cache state that ``kv-cache status`` cannot see."""

from __future__ import annotations

from typing import Any

from ..cache import PrefixCache
from .working import WorkingSequence


def cache_status(seq: WorkingSequence, cache: PrefixCache, l1_budget_tokens: int) -> dict[str, Any]:
    """L1 memory, the tiers' statuses and the counters of ``cache``, the cache of the working
    sequence ``seq`` (L1 keeps up to ``l1_budget_tokens``)."""
    resident = cache.resident
    layout = seq.layout
    per_token = layout.kv_bytes_per_cell if layout is not None else 0
    used = resident.used_tokens if resident is not None else 0
    pinner = seq.seam.buffers.pinner
    n_ctx = seq.llm.n_ctx()
    bus = cache.costs.bus_seconds_per_byte
    exporter = seq.seam.exporter
    return {
        "caching": seq.caching,
        "disabled_reason": seq.disabled_reason,
        "n_ctx": n_ctx,
        "granule": seq.granule,
        "lone_decodes_exact": seq.lone_decodes_exact,
        "pinned_host_buffers": pinner.stats() if pinner is not None else None,
        # the load-time bus probe's rate (runtime/bus.py), where pages may be restored
        "bus_gb_per_s": round(1e-9 / bus, 2) if bus else None,
        # host memory the restores of L3 pages copy through on a device (KVSeam.staging),
        # outside l2.budget; pinned with the other host buffers where they are
        "staging_bytes": sum(a.nbytes for a in seq.seam.staging) if seq.seam.staging else 0,
        "native": seq.verdict.to_json(),
        "kv_bytes_per_token": per_token,
        "context_kv_bytes": per_token * n_ctx,
        "tiers": [tier.name for tier in cache.tiers],
        "l1": {
            "slots": len(resident.entries()) if resident is not None else 0,
            "max_prefixes": resident.max_prefixes if resident is not None else 0,
            "budget_tokens": l1_budget_tokens,
            "budget_bytes": per_token * l1_budget_tokens,
            "resident_tokens": used,
            "resident_bytes": per_token * used,
        },
        # records' new cells exported into arena slots off the request path (export.py)
        "export": None
        if exporter is None
        else {
            "exports": exporter.exports,
            "no_room": exporter.no_room,
            "arena_bytes": exporter.arena.nbytes,
            "arena_pinned": exporter.arena.on_close is not None,
        },
        # how often a prefix that left the live sequence came back (the park rule weighs it)
        "reuse_probability": round(cache.costs.reuse_probability, 3),
        "counters": cache.counters_json(),
    }
