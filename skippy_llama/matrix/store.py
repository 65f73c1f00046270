"""What a cell left in its tiers, and the store-side gates (prune/clear, low space).

Write amplification is ``bytes_written / unique page bytes``: the page payload bytes the store
wrote (counted by the store over every instance that used it, restarts included) over the
distinct page bytes it holds at the end (nothing is evicted at the matrix's budgets). A page
written twice, or rewritten after a restart, pushes it above 1. Only page payloads count: the
manifests and page metadata the store writes beside them do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import GiB, Settings
from ..tiers.disk import DiskTier, statvfs_free


@dataclass
class StoreStats:
    """Bytes and counters of one SkippyLlama's tiers at the end of a cell."""

    l1_resident_bytes: int = 0
    l2_bytes: int = 0
    l3_page_bytes: int = 0  # distinct page payload bytes held (unique page bytes)
    l3_used_bytes: int = 0  # what the store occupies on disk (database and value files)
    pages: int = 0
    manifests: int = 0
    writes: int = 0
    bytes_written: int = 0
    pages_deduplicated: int = 0
    dropped_writes: int = 0
    dropped_low_space: int = 0
    state: str = "off"

    @property
    def bytes_stored(self) -> int:
        """What the cell keeps beyond the live context: L1 checkpoints, L2 and L3 pages."""
        return self.l1_resident_bytes + self.l2_bytes + self.l3_page_bytes

    @property
    def write_amplification(self) -> float | None:
        if self.l3_page_bytes <= 0:
            return None
        return self.bytes_written / self.l3_page_bytes


def store_stats(llm: Any) -> StoreStats:
    """Flush ``llm``'s L3 writes and read its tiers' sizes and counters."""
    cache = llm.prefix_cache
    stats = StoreStats(
        l1_resident_bytes=int(llm.cache_status()["l1"]["resident_bytes"]),
        l2_bytes=cache.ram.used_bytes if cache.ram is not None else 0,
    )
    disk: DiskTier | None = cache.disk
    if disk is None or disk.state == "off":
        return stats
    disk.flush(120.0)
    status = disk.status()
    stats.state = status.state
    stats.l3_page_bytes = sum(entry.bytes for entry in status.inventory)
    stats.l3_used_bytes = status.usage.used_bytes
    stats.pages = status.usage.pages
    stats.manifests = status.usage.manifests
    act = status.activity
    stats.writes = act.writes
    stats.bytes_written = act.bytes_written
    stats.pages_deduplicated = act.pages_deduplicated
    stats.dropped_writes = act.dropped_writes
    stats.dropped_low_space = act.dropped_low_space
    return stats


def empty_store(settings: Settings, how: str) -> dict[str, Any]:
    """Do what ``kv-cache prune --model-identity ID --yes`` (for every model in the store) or
    ``kv-cache clear --yes`` does, then count what is left (the gate: 0 pages, 0 prefixes)."""
    tier = DiskTier(settings.l3, close_at_exit=False)
    try:
        before = tier.status().usage
        if how == "prune":
            for model in tier.model_identities():
                tier.prune(model_identity=model)
        else:
            tier.clear()
        after = tier.status().usage
    finally:
        tier.close()
    return {
        "action": how,
        "pages_before": before.pages,
        "manifests_before": before.manifests,
        "pages_after": after.pages,
        "manifests_after": after.manifests,
        "pass": before.pages > 0 and after.pages == 0 and after.manifests == 0,
    }


def floor_above_free(directory: Path) -> str:
    """An ``l3.minimum_free`` 1 TiB above the free space at ``directory``: the store is at its
    reserve from the start, so it must serve reads and refuse every write."""
    return f"{statvfs_free(str(directory)) // GiB + 1024}GiB"
