"""Fixtures of the integration tests: one real Redis-protocol server per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from redisserver import RedisServer


#: The integration files of the contributor's loop (the README's test command): the request path
#: end to end on SmolLM2 (drop-in behaviour, every tier's exactness against cold, the arena and
#: page copies, restore points, the records' export). Every other integration test is marked
#: slow below: CI runs those right after (``-m slow``) and the GPU-like and stock lanes run
#: everything (``-m ""``), so nothing leaves CI; the loop stays near 10 minutes on 2 cores,
#: where all 311 integration tests took about 30 (issue 44).
LOOP_FILES = frozenset(
    {
        "test_skippy_llama.py",
        "test_restore_exact.py",
        "test_dropin.py",
        "test_l3_runtime.py",
        "test_tier_interplay.py",
        "test_l2_arena.py",
        "test_l3_page_copies.py",
        "test_restore_points.py",
        "test_record_export.py",
        "test_commit_served.py",
        "test_tier_protocol.py",
        "test_lone_decode.py",
    }
)
HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the integration tests outside :data:`LOOP_FILES` slow."""
    for item in items:
        if item.path.parent == HERE and item.path.name not in LOOP_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real ``redis-server`` for the session (skips without one, fails under CI)."""
    from redisserver import RedisServer  # imports the redis client: only where it is used

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_clean(redis_server: RedisServer) -> RedisServer:
    """The session's server, running, emptied and unbounded for this test."""
    redis_server.reset()
    return redis_server
