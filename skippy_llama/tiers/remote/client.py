"""The connection to the server (the only module that imports ``redis``) and what its failures
mean.

The ``redis`` client speaks to Redis and Valkey servers alike. It is built to fail fast: one
connect and per-command timeout (``remote.timeout_ms``), no retries (the breaker decides when to
try again), no health-check pings on the request path. :func:`failure_reason` names every
failure the tier counts: ``connection`` (refused, reset, closed), ``timeout``, ``oom``
(``maxmemory`` reached under ``noeviction``: writes refused), ``readonly`` (a replica),
``auth``, ``loading`` (a server reading its dump after a restart), ``server_error``.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...config import RemoteSettings

#: Bytes asked of the socket per read.
READ_CHUNK = 1 << 20


def connect(settings: RemoteSettings) -> redis.Redis:
    """A client for ``settings.url`` (connects on first use, not here)."""
    assert settings.url is not None
    timeout = settings.timeout_ms / 1000.0
    client: redis.Redis = redis.Redis.from_url(
        settings.url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        decode_responses=False,
        client_name="skippy-llama",
        # pages are megabytes: read them in 1 MiB chunks, not the default 64 KiB
        socket_read_size=READ_CHUNK,
    )
    return client


def failure_reason(exc: BaseException) -> str:
    """The counter name of a failed call (see the module docstring)."""
    if isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError):
        return "auth"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "oom"
    if isinstance(exc, redis.exceptions.BusyLoadingError):
        return "loading"
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "readonly"
    if isinstance(exc, redis.exceptions.ConnectionError | OSError):
        return "connection"
    if isinstance(exc, redis.exceptions.ResponseError):
        text = str(exc)
        if text.startswith("OOM") or "maxmemory" in text:
            return "oom"
        if "NOAUTH" in text or "WRONGPASS" in text or "NOPERM" in text:
            return "auth"
        if "READONLY" in text:
            return "readonly"
        return "server_error"
    return "server_error"


def is_server_failure(exc: BaseException) -> bool:
    """A failure of the server or the network (counted, fail-open), as opposed to a bug."""
    return isinstance(exc, redis.exceptions.RedisError | OSError)


def first_error(results: list[Any]) -> BaseException | None:
    """The first error among a pipeline's results (run with ``raise_on_error=False``)."""
    for result in results:
        if isinstance(result, BaseException):
            return result
    return None
