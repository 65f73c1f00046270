"""One thread for everything the server computes with the model.

llama-cpp-python's CPU wheels run each llama.cpp graph as an OpenMP parallel region, and libgomp
gives every thread that starts one its own team of worker threads. llama_cpp.server runs model
calls on whichever anyio worker thread is free (and loads the model on the main thread), so a
process collects several teams. On 2 cores a 25-token prefill took 111 ms with every call on the
main thread, 132 ms on a thread other than the one that loaded the model and 141 ms alternating
between two such threads, and 106 ms with everything on one other thread (``bench_threads.py``,
medians of six rounds; ``benchmarks/experiments/NOTEBOOK.md``, "One model thread"). ``skippy-llama serve``
sends every model call through one :class:`ModelThread`: the load, each request, each streamed
chunk and the idle work. Calls still queue behind upstream's per-model lock as before; this
thread only decides where they run.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def step(chunks: Iterator[T]) -> tuple[bool, T | None]:
    # StopIteration cannot cross a Future (it would end the caller's generator as RuntimeError)
    try:
        return False, next(chunks)
    except StopIteration:
        return True, None


def close_on_thread(chunks: Iterator[Any]) -> None:
    close = getattr(chunks, "close", None)
    if close is not None:
        close()


class ModelThread:
    """Runs callables on one dedicated thread, one at a time, in the order given."""

    def __init__(self) -> None:
        self._thread_id: int | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="skippy-model", initializer=self._started
        )

    def _started(self) -> None:
        self._thread_id = threading.get_ident()

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the model thread; blocks the calling thread.

        Called on the model thread itself it runs ``fn`` at once: a streamed response's
        generator that the garbage collector finalizes there must not wait for itself.
        """
        if threading.get_ident() == self._thread_id:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the model thread, awaited from the event loop.

        Like ``run_in_threadpool``, a cancelled caller still waits for the call to end, so the
        model lock it holds is not released while the model is busy.
        """
        future = self._pool.submit(fn, *args, **kwargs)
        with anyio.CancelScope(shield=True):
            result = await asyncio.wrap_future(future)
        return result

    def iterate(self, chunks: Iterator[T]) -> Generator[T, None, None]:
        """``chunks``, each ``next`` (and the final ``close``) run on the model thread."""
        try:
            while True:
                done, chunk = self.call(step, chunks)
                if done:
                    return
                yield chunk  # type: ignore[misc]
        finally:
            self.call(close_on_thread, chunks)

    def shutdown(self) -> None:
        """Finish queued calls and stop the thread."""
        self._pool.shutdown(wait=True)
