"""Fixtures of the integration tests: one real Redis-protocol server per test session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from redisserver import RedisServer


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
