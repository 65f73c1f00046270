"""L3, the durable disk tier: a façade over :mod:`skippy_llama.tiers.l3` (see its modules).

Kept so that ``from skippy_llama.tiers.disk import DiskTier`` keeps working; new code may import
from ``skippy_llama.tiers.l3`` directly.
"""

from __future__ import annotations

from .l3.health import ENTRY_FLOOR, statvfs_free
from .l3.tier import DiskTier
from .l3.tree import payload_digest

__all__ = ["ENTRY_FLOOR", "DiskTier", "payload_digest", "statvfs_free"]
