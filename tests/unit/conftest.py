"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.l3 import reader

#: keyword arguments of DiskTier itself; every other one is an L3 setting
_TIER_ARGS = ("admission", "verify", "reconcile", "timeout")


@pytest.fixture(params=["serial", "parallel"])
def both_read_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with L3 pages read one by one and on the thread pool (large reads take the
    pool: every verification and repair must hold on both paths)."""
    if request.param == "parallel":
        monkeypatch.setattr(reader, "PARALLEL_BYTES", 0)
    return str(request.param)


@pytest.fixture
def tier_at() -> Iterator[Callable[..., DiskTier]]:
    """Open L3 tiers on real directories: ``tier_at(directory, secret_file=None, *, free=...,
    **settings_or_tier_args)``, with the disk's free space reported as ``free`` (plenty by
    default). Every tier is closed after the test, which fails if any counted an internal
    error: a bug in L3's own code is logged and counted, never passed off as a fault."""
    from test_tier_disk import PLENTY, settings

    opened: list[DiskTier] = []

    def make(
        directory: Path, secret_file: Path | None = None, *, free: int = PLENTY, **kw: Any
    ) -> DiskTier:
        opts = {k: kw.pop(k) for k in list(kw) if k in _TIER_ARGS}
        tier = DiskTier(
            settings(directory, secret_file=secret_file, **kw),
            disk_free=lambda _path: free,
            close_at_exit=False,
            **opts,
        )
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()
    assert [t._parts.counters.get("internal_errors") for t in opened] == [0] * len(opened)
