"""One shared thread pool for bulk byte work on the request path.

Assembling a restore blob and reading and verifying L3 pages each move the whole prefix's bytes
(720 MB for 32k tokens of a 1B model; on a GPU build they sit on the request path next to a
prefill of a few hundred ms). numpy copies, file reads, xxhash and
zstd release the GIL, and one thread reaches only a fraction of memory bandwidth, so the work is
spread over a small pool. (A record's pages are cut by the L3 writer, off the request path and
off this pool, so background work never queues ahead of a restore.) Tasks never submit tasks, so
the pool cannot deadlock on itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

#: Work on at least this many bytes is spread over the pool; below it a thread hand-off costs
#: more than it saves.
PARALLEL_BYTES = 32 << 20

_T = TypeVar("_T")
_R = TypeVar("_R")
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = max(1, min(8, os.cpu_count() or 1))
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="skippy-bytes")
        return _POOL


def ordered(
    fn: Callable[[_T], _R], items: Sequence[_T], *, parallel: bool
) -> Generator[_R, None, None]:
    """``fn`` over ``items``, results in order; an exception is raised at its item.

    With ``parallel`` (and two items or more) the items run on the shared pool ahead of the
    consumer; when the consumer stops early (close the generator, e.g. with
    ``contextlib.closing``) the items not started yet are cancelled and the running ones waited
    for, so none still runs (writing into a buffer the caller reuses) once it is closed. Without
    it, each item runs on the caller's thread when its result is asked for.
    """
    if not parallel or len(items) < 2:
        for item in items:
            yield fn(item)
        return
    futures = [_pool().submit(fn, item) for item in items]
    try:
        for future in futures:
            yield future.result()
    finally:
        for future in futures:
            future.cancel()
        wait(futures)


def submit(fn: Callable[..., _R], *args: object) -> Future[_R]:
    """``fn(*args)`` on the shared pool (work that overlaps the caller's own, such as network
    reads; it must not submit work itself)."""
    return _pool().submit(fn, *args)


def run_all(tasks: Sequence[Callable[[], object]], *, parallel: bool) -> None:
    """Run every task (see :func:`ordered`); the first failure raises, and tasks not started
    by then are cancelled."""
    for _ in ordered(_call, tasks, parallel=parallel):
        pass


def _call(task: Callable[[], object]) -> object:
    return task()
