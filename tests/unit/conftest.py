"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from skippy_llama.tiers.l3 import reader


@pytest.fixture(params=["serial", "parallel"])
def both_read_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with L3 pages read one by one and on the thread pool (large reads take the
    pool: every verification and repair must hold on both paths)."""
    if request.param == "parallel":
        monkeypatch.setattr(reader, "PARALLEL_BYTES", 0)
    return str(request.param)
