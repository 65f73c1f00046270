"""``skippy-llama batch --ray``: one ``SkippyLlama`` per Ray actor, prefix-affine shards.

The driver (this module, in the CLI's process) has checked every line before it gets here. It
starts the actors (:class:`.worker.BatchWorker`, ``num_cpus`` each), has them tokenize the
pending items, cuts the trie order into shards and hands items out with
:class:`.shards.AffineScheduler`, two in flight per actor so an actor never waits for the
driver between items. Only the driver writes OUT, one record per finished item, flushed, so
resuming by id works as for one process. An actor that dies (``RayActorError``) is replaced
(at most ``2 × workers`` times in a batch) and its unfinished items go back to the queue.

Ray is imported only here and only when a Ray batch runs (``pip install 'skippy-llama[ray]'``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import BatchError, ConfigError
from .items import BatchItem
from .order import prefix_order
from .output import OutputFile
from .runner import BatchProgress, BatchSummary
from .shards import (
    DECODE_WEIGHT,
    AffineScheduler,
    chain_prefill,
    plan_shards,
    round_robin_prefill,
)
from .worker import BatchWorker, ItemResult, WorkerSpec

#: the namespace of the actors' names (``batch-<driver pid>-<n>``); tests find actors by it
NAMESPACE = "skippy-llama-batch"
#: calls queued on each actor: one running, one waiting, so it never waits for the driver
IN_FLIGHT = 2
#: the actors' concurrency group for calls that must not wait behind items (``pid``)
INFO_GROUP = "info"
#: texts per tokenize call when the actors tokenize the batch for its order
TOKENIZE_CHUNK = 512


def import_ray() -> Any:
    """``ray``, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"--ray/--workers need Ray ({exc}); install it with pip install 'skippy-llama[ray]'"
        ) from None
    return ray


@dataclass
class RayBatchSummary(BatchSummary):
    """A :class:`BatchSummary` with the Ray run's workers and its prefill accounting.

    ``elapsed_s`` counts from connecting to Ray (actors starting and loading the model
    included); ``loop_s`` from the moment every actor was ready to the last result.
    ``schedule_speedup`` is the estimated speedup the schedule allows over one actor (all the
    work over the busiest actor's, from the trie, see :class:`.shards.AffineScheduler`);
    ``busy_s`` sums the actors' item times (``busy_s / loop_s``: the parallelism reached).
    ``prefilled_tokens`` is measured (the actors' caches); the ``*_prefill`` figures are computed
    from the token trie of the items run: ``plan_prefill`` for the order each actor got its
    items in, ``one_process_prefill`` for one process in trie order, ``round_robin_prefill`` for
    the same items dealt round-robin to as many actors (each running its share in trie order).
    """

    loop_s: float = 0.0
    workers: int = 0
    cpus_per_worker: int = 0
    shards: int = 0
    steals: int = 0
    actors_lost: int = 0
    items_retried: int = 0
    items_given_up: int = 0
    prefilled_tokens: int = 0
    schedule_speedup: float = 1.0
    busy_s: float = 0.0
    plan_prefill: int = 0
    one_process_prefill: int = 0
    round_robin_prefill: int = 0
    items_per_actor: dict[str, int] = field(default_factory=dict)

    def render(self) -> str:
        rr = f" ({self.round_robin_prefill / self.plan_prefill:.2f}x)" if self.plan_prefill else ""
        lost = (
            f"; {self.actors_lost} actors lost, {self.items_retried} items retried, "
            f"{self.items_given_up} given up"
            if self.actors_lost
            else ""
        )
        return (
            f"{super().render()}\n"
            f"ray: {self.workers} actors x {self.cpus_per_worker} CPUs, {self.shards} shards, "
            f"{self.steals} split at the end{lost}, schedule speedup "
            f"{self.schedule_speedup:.2f}x; prefilled {self.prefilled_tokens} prompt "
            f"tokens (trie estimate {self.plan_prefill}; one process {self.one_process_prefill}; "
            f"round-robin over {self.workers} actors {self.round_robin_prefill}{rr})"
        )


def _connect(ray: Any, address: str | None, local_cpus: int) -> bool:
    """Connect to Ray; returns whether this call started it (and should shut it down)."""
    if ray.is_initialized():
        return False
    # the actors' own output stays in Ray's session logs: stdout carries only --json's summary
    quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    try:
        if address == "local":
            ray.init(num_cpus=local_cpus, include_dashboard=False, **quiet)
        else:  # None: RAY_ADDRESS or a Ray instance running on this machine, else a new one
            ray.init(address=address, **quiet)
    except (ConnectionError, TimeoutError, ValueError) as exc:
        where = "a local Ray instance" if address == "local" else f"Ray at {address or 'auto'}"
        raise ConfigError(f"--ray: could not start or reach {where}: {exc}") from None
    return True


def _size(ray: Any, workers: int | None, cpus_per_worker: int | None) -> tuple[int, int]:
    total = int(ray.cluster_resources().get("CPU", 0))
    if total < 1:
        raise ConfigError("the Ray cluster has no CPUs to run workers on")
    if cpus_per_worker is None:
        cpus_per_worker = max(1, total // workers) if workers else min(4, total)
    if workers is None:
        workers = max(1, total // cpus_per_worker)
    if workers * cpus_per_worker > total:
        raise ConfigError(
            f"--workers {workers} x --cpus-per-worker {cpus_per_worker} needs "
            f"{workers * cpus_per_worker} CPUs; the Ray cluster has {total}"
        )
    return workers, cpus_per_worker


def rewrite_in_input_order(path: Path, items: Sequence[BatchItem]) -> None:
    """``--keep-order`` for a Ray batch: OUT's lines in input order (atomically replaced)."""
    lines = {json.loads(line)["id"]: line for line in path.read_text("utf-8").splitlines()}
    tmp = path.with_name(path.name + ".reorder")
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            if item.id in lines:
                f.write(lines.pop(item.id) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_batch_ray(
    items: Sequence[BatchItem],
    out: OutputFile,
    spec: WorkerSpec,
    *,
    address: str | None,
    workers: int | None = None,
    cpus_per_worker: int | None = None,
    keep_order: bool = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    progress: bool = True,
    max_suspect: int = 2,
) -> RayBatchSummary:
    """Run every item not yet in ``out`` on Ray actors; see the module docstring.

    ``address``: ``"local"`` starts a Ray instance on this machine for this batch; None
    connects as ``ray.init()`` does; anything else is a Ray cluster address.

    Raises:
        ConfigError: Ray is missing, or the workers asked for do not fit the cluster.
        BatchError: every actor died and no replacement could be started.
    """
    ray = import_ray()
    done_ids = out.finished_ids({item.id for item in items})
    pending = [i for i, item in enumerate(items) if item.id not in done_ids]
    if not pending:  # nothing left to run: no Ray, no model
        if keep_order:
            rewrite_in_input_order(out.path, items)
        return RayBatchSummary(
            items=len(items), already_done=len(done_ids), run=0, errors=0, prompt_tokens=0,
            cached_tokens=0, elapsed_s=0.0, est_cold_s=None, order="prefix-affine shards",
        )  # fmt: skip
    local_cpus = max(os.cpu_count() or 1, (workers or 1) * (cpus_per_worker or 1))
    started_ray = _connect(ray, address, local_cpus)
    pool = _Pool(ray, spec, max_tokens, temperature)
    started = time.perf_counter()
    try:
        n_workers, cpw = _size(ray, workers, cpus_per_worker)
        pool.start(n_workers, cpw)
        keys = pool.tokenize([items[i].order_text() for i in pending])
        pool.wait_ready()
        loop_started = time.perf_counter()
        order = prefix_order(keys)  # --keep-order only rewrites OUT at the end
        item_cost = DECODE_WEIGHT * max_tokens
        shards = plan_shards(keys, order, n_workers, item_cost=item_cost)
        sched = AffineScheduler(keys, shards, item_cost=item_cost, max_suspect=max_suspect)
        stats = pool.drive(sched, [items[i] for i in pending], out, progress)
        loop_s = time.perf_counter() - loop_started
    finally:
        out.close()
        pool.stop()
        if started_ray:
            ray.shutdown()
    if keep_order:
        rewrite_in_input_order(out.path, items)
    summary = RayBatchSummary(
        items=len(items),
        already_done=len(done_ids),
        run=len(pending),
        errors=stats.errors,
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens,
        elapsed_s=round(time.perf_counter() - started, 3),
        est_cold_s=None,
        order="prefix-affine shards" + (", OUT rewritten in input order" if keep_order else ""),
        loop_s=round(loop_s, 3),
        workers=n_workers,
        cpus_per_worker=cpw,
        shards=len(shards),
        steals=sched.steals,
        schedule_speedup=round(sched.schedule_speedup, 3),
        busy_s=round(stats.busy_s, 3),
        actors_lost=pool.lost,
        items_retried=sched.requeued,
        items_given_up=stats.given_up,
        prefilled_tokens=stats.prefilled_tokens,
        plan_prefill=sched.prefill_by_plan,
        one_process_prefill=chain_prefill(keys, prefix_order(keys)),
        round_robin_prefill=round_robin_prefill(keys, prefix_order(keys), n_workers),
        items_per_actor={str(k): v for k, v in sorted(stats.per_actor.items())},
    )
    return summary


@dataclass
class _Stats:
    errors: int = 0
    given_up: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    busy_s: float = 0.0
    per_actor: Counter[int] = field(default_factory=Counter)


class _Pool:
    """The batch's actors: started, replaced when they die, fed by the scheduler."""

    def __init__(self, ray: Any, spec: WorkerSpec, max_tokens: int, temperature: float) -> None:
        self.ray = ray
        self.spec = spec
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.actors: dict[int, Any] = {}
        self.serial = 0
        self.lost = 0
        self.restarts_left = 0
        self.cpus = 1

    def start(self, workers: int, cpus: int) -> None:
        self.cpus = cpus
        self.restarts_left = 2 * workers
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        name = self.serial
        self.serial += 1
        # `pid` answers from its own thread while items run (tests kill actors by it)
        actor_class = self.ray.remote(concurrency_groups={INFO_GROUP: 1})(BatchWorker)
        self.actors[name] = actor_class.options(
            num_cpus=self.cpus,
            name=f"batch-{os.getpid()}-{name}",
            namespace=NAMESPACE,
            max_restarts=0,
        ).remote(self.spec)

    def wait_ready(self) -> None:
        """Wait until every actor has loaded its model (one that failed is replaced)."""
        while True:
            calls = {
                n: a.pid.options(concurrency_group=INFO_GROUP).remote()
                for n, a in self.actors.items()
            }
            failed = None
            for name, ref in calls.items():
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayActorError as exc:
                    failed = exc
                    self._lose(name)
            if failed is None:
                return
            if not self.actors:
                raise self._no_workers(failed)

    def _lose(self, name: int) -> None:
        actor = self.actors.pop(name)
        self.lost += 1
        self.ray.kill(actor, no_restart=True)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self._spawn()

    def _no_workers(self, cause: BaseException | None) -> BatchError:
        return BatchError(
            f"every Ray worker died and no more may be started ({self.lost} lost); finished "
            f"items are in OUT, run the same command again to resume. Last failure: {cause}"
        )

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """The texts' tokens, chunks spread over the actors (an actor that fails to load the
        model fails here, before any item runs)."""
        chunks = [texts[i : i + TOKENIZE_CHUNK] for i in range(0, len(texts), TOKENIZE_CHUNK)]
        keys: list[list[int]] = []
        done: dict[int, list[list[int]]] = {}
        todo = list(range(len(chunks)))
        cause: BaseException | None = None
        while todo:
            if not self.actors:
                raise self._no_workers(cause)
            names = list(self.actors)
            refs = {
                self.actors[names[n % len(names)]].tokenize.remote(chunks[c]): (
                    c,
                    names[n % len(names)],
                )
                for n, c in enumerate(todo)
            }
            todo = []
            for ref, (c, name) in refs.items():
                try:
                    done[c] = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as exc:
                    cause = exc
                    todo.append(c)
                    if name in self.actors:
                        self._lose(name)
        for c in range(len(chunks)):
            keys.extend(done[c])
        return keys

    def drive(
        self,
        sched: AffineScheduler,
        items: Sequence[BatchItem],
        out: OutputFile,
        progress: bool,
    ) -> _Stats:
        """Hand out items until the scheduler has none left; write each result as it comes."""
        stats = _Stats()
        bar = BatchProgress(len(items), enabled=progress)
        flight: dict[Any, tuple[int, int]] = {}  # ObjectRef -> (actor, item)
        finished = 0
        cause: BaseException | None = None

        def fill(name: int) -> None:
            state = sched.workers.get(name)
            while state is None or len(state.in_flight) < IN_FLIGHT:
                index = sched.next_item(name)
                if index is None:
                    return
                state = sched.workers[name]
                ref = self.actors[name].run.remote(items[index], self.max_tokens, self.temperature)
                flight[ref] = (name, index)

        while not sched.done:
            for name in list(self.actors):
                fill(name)
            if not flight:
                raise self._no_workers(cause)
            (ref,), _ = self.ray.wait(list(flight), num_returns=1)
            name, index = flight.pop(ref)
            try:
                result: ItemResult = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as exc:
                cause = exc
                for other in [r for r, (n, _) in flight.items() if n == name]:
                    del flight[other]
                for lost in sched.worker_lost(name):
                    stats.errors += 1
                    stats.given_up += 1
                    finished += 1
                    out.write(
                        {
                            "id": items[lost].id,
                            "error": f"WorkerDied: a Ray worker died while running this item, "
                            f"{sched.max_suspect} of {sched.max_suspect} tries "
                            f"({type(exc).__name__})",
                        }
                    )
                if name in self.actors:
                    self._lose(name)
                continue
            sched.finished(name, index)
            finished += 1
            if "error" in result.record:
                stats.errors += 1
            stats.prompt_tokens += result.prompt_tokens
            stats.cached_tokens += result.cached_tokens
            stats.prefilled_tokens += result.prefilled_tokens
            stats.busy_s += result.seconds
            stats.per_actor[result.pid] += 1
            out.write(result.record)
            bar.update(
                finished, stats.prompt_tokens, stats.cached_tokens, f"{len(self.actors)} actors"
            )
        return stats

    def stop(self) -> None:
        for actor in self.actors.values():
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(actor, no_restart=True)
        self.actors.clear()


def with_threads(spec: WorkerSpec, threads: int | None) -> WorkerSpec:
    """``spec`` with ``n_threads`` set when given (else each actor takes its CPUs)."""
    return spec if threads is None else replace(spec, n_threads=threads)
