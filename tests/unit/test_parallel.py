"""The shared byte-work pool: order, errors and early stops."""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import pytest

from skippy_llama.parallel import ordered, run_all


@pytest.mark.parametrize("parallel", [False, True])
def test_results_come_in_item_order(parallel: bool) -> None:
    def slow_first(i: int) -> int:
        time.sleep(0.02 if i == 0 else 0)
        return i * i

    assert list(ordered(slow_first, range(6), parallel=parallel)) == [0, 1, 4, 9, 16, 25]


def test_parallel_items_run_off_the_callers_thread() -> None:
    names = list(ordered(lambda _: threading.current_thread().name, range(4), parallel=True))
    assert all(name.startswith("skippy-bytes") for name in names)
    inline = list(ordered(lambda _: threading.current_thread().name, range(4), parallel=False))
    assert set(inline) == {threading.current_thread().name}


@pytest.mark.parametrize("parallel", [False, True])
def test_an_error_raises_at_its_item(parallel: bool) -> None:
    def fail_at_two(i: int) -> int:
        if i == 2:
            raise OSError("item 2")
        return i

    got: list[int] = []
    with pytest.raises(OSError, match="item 2"):
        for value in ordered(fail_at_two, range(5), parallel=parallel):
            got.append(value)
    assert got == [0, 1]


def test_an_early_stop_cancels_what_has_not_started() -> None:
    gate = threading.Event()
    started: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        if i:
            gate.wait(5)  # every item after the first blocks a worker until the stop
        return i

    with contextlib.closing(ordered(work, range(200), parallel=True)) as results:
        assert next(results) == 0
    gate.set()
    time.sleep(0.05)
    # only the items the pool's workers (at most 8) had taken before the stop ever ran
    assert len(started) <= 1 + 8


def test_an_early_stop_waits_for_the_items_already_running() -> None:
    started: list[int] = []
    finished: list[int] = []
    one_started = threading.Event()

    def work(i: int) -> int:
        if i:
            started.append(i)
            one_started.set()
            time.sleep(0.2)  # still running when the consumer stops
            finished.append(i)
        else:
            # on a loaded machine item 1 may not have started by the time item 0 returns and
            # the consumer stops: wait for it (the pool has two workers or more on 2 cores)
            one_started.wait(timeout=30)
        return i

    with contextlib.closing(ordered(work, range(3), parallel=True)) as results:
        assert next(results) == 0
    # nothing writes into the caller's buffers once it is closed
    assert started and sorted(finished) == sorted(started)


def test_run_all_runs_every_task() -> None:
    done: list[int] = []
    run_all([functools.partial(done.append, i) for i in range(10)], parallel=True)
    assert sorted(done) == list(range(10))
