"""What the tier factory builds from settings (no model)."""

from __future__ import annotations

from pathlib import Path

from test_cache_tree import IDENTITY

from skippy_llama.config import Settings
from skippy_llama.costs import CostModel
from skippy_llama.tiers.factory import TierContext, build_point_tiers, build_tiers
from skippy_llama.tiers.l3.tier import DiskTier


def test_auto_compression_stores_pages_as_they_are_on_every_backend(tmp_path: Path) -> None:
    """Issue 45: on 2 CPU cores zstd took the L3 writer 128 ms of CPU per 500 SmolLM2 tokens,
    which the decode's threads waited for, to store 0.86 of the bytes; on GPU builds
    decompressing cost about a cold prefill. ``auto`` is none everywhere; zstd stays a choice."""
    for backend, asked, stored in (
        ("CPU", "auto", "none"),
        ("CUDA", "auto", "none"),
        ("CPU", "zstd", "zstd"),
    ):
        l3 = {
            "mode": "fixed",
            "budget": "1GiB",
            "directory": str(tmp_path / f"{backend}-{asked}"),
            "minimum_free": "1GiB",
            "compression": asked,
        }
        context = TierContext(Settings(l3=l3), IDENTITY, backend, CostModel(), pageable=True)
        disk = next(t for t in build_tiers(context) if isinstance(t, DiskTier))
        try:
            assert disk.settings.compression == stored
        finally:
            disk.close()


def test_point_tiers_declare_the_roles_the_runtime_stores_by(tmp_path: Path) -> None:
    """Issue 44: where a restore point goes is decided by each tier's role, not its name: L2
    mirrors what L3, the durable tier, holds; without L3 there is no point tier at all."""
    assert build_point_tiers(Settings(l2={"budget": "64MiB"})) == []
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    tiers = build_point_tiers(Settings(l2={"budget": "64MiB"}, l3=l3))
    try:
        assert [(t.name, t.role) for t in tiers] == [("l2", "mirror"), ("l3", "durable")]
    finally:
        for tier in tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
