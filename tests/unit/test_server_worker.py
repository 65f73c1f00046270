"""``ModelThread``: every call, awaited call, chunk and close runs on one thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import pytest

from skippy_llama.server.worker import ModelThread


@pytest.fixture
def worker() -> Iterator[ModelThread]:
    thread = ModelThread()
    yield thread
    thread.shutdown()


def _ident() -> int:
    return threading.get_ident()


def test_calls_from_many_threads_run_on_one(worker: ModelThread) -> None:
    seen: list[int] = []

    def caller() -> None:
        seen.append(worker.call(_ident))

    callers = [threading.Thread(target=caller) for _ in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    seen.append(anyio.run(worker.run, _ident))
    assert len(seen) == 7 and len(set(seen)) == 1
    assert seen[0] != threading.get_ident()


def test_iterate_steps_and_closes_the_chunks_on_the_model_thread(worker: ModelThread) -> None:
    where: list[int] = []
    closed: list[int] = []

    def chunks() -> Iterator[int]:
        try:
            for i in range(3):
                where.append(threading.get_ident())
                yield i
        finally:
            closed.append(threading.get_ident())

    assert list(worker.iterate(chunks())) == [0, 1, 2]
    model = worker.call(_ident)
    assert set(where) == {model} and closed == [model]

    # a consumer that leaves early (a client gone mid-stream) still closes them there
    where.clear()
    closed.clear()
    relay = worker.iterate(chunks())
    assert next(relay) == 0
    relay.close()
    assert closed == [model]


def test_errors_reach_the_caller(worker: ModelThread) -> None:
    def fail() -> None:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        worker.call(fail)
    with pytest.raises(ValueError, match="bad prompt"):
        anyio.run(worker.run, fail)

    def broken() -> Iterator[int]:
        yield 1
        raise KeyError("mid-stream")

    relay = worker.iterate(broken())
    assert next(relay) == 1
    with pytest.raises(KeyError):
        next(relay)
    assert worker.call(_ident) != threading.get_ident()  # the thread survives


def test_a_cancelled_waiter_still_waits_for_the_call(worker: ModelThread) -> None:
    """The route holds the model lock while it awaits: the call must end before it lets go."""
    release = threading.Event()
    finished: list[bool] = []

    def slow() -> None:
        release.wait(5)
        finished.append(True)

    async def main() -> None:
        with anyio.move_on_after(0.05):
            await worker.run(slow)
        assert finished == [True]  # returned only after the call ended

    threading.Timer(0.2, release.set).start()
    anyio.run(main)


def test_a_call_from_the_model_thread_runs_inline(worker: ModelThread) -> None:
    """A generator finalized on the model thread (by the garbage collector) closes its chunks
    there instead of queueing behind itself forever."""

    def chunks() -> Iterator[int]:
        yield 1

    relay = worker.iterate(chunks())
    assert next(relay) == 1
    model = worker.call(_ident)
    assert worker.call(lambda: worker.call(_ident)) == model
    assert worker.call(relay.close) is None  # closes the inner chunks on the same thread
