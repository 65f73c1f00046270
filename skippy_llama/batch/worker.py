"""One batch worker: a ``SkippyLlama`` that runs items and says what its cache did.

The Ray actors of ``batch --ray`` and the Ray Data class (:mod:`.ray_data`) are this class
wrapped; it imports no Ray itself, so it is the same code a single process would run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..packages import LoadedPackage
from ..packages.kvdtype import KVDtypeResolution
from .items import BatchItem


@dataclass(frozen=True)
class WorkerSpec:
    """How every worker of a batch loads its model (the same for all; picklable).

    ``n_threads`` None takes the CPUs Ray gave the worker (all of this machine's outside Ray).
    """

    model_path: str
    settings: Settings
    llama_kwargs: dict[str, Any]
    n_threads: int | None = None
    kv_dtype: KVDtypeResolution | None = None
    package: LoadedPackage | None = None


def assigned_cpus() -> int:
    """CPUs this process was given: Ray's assignment inside a Ray worker, else all of them."""
    try:
        import ray  # inside an actor, ray is there; outside, ask the machine

        if ray.is_initialized():
            resources = ray.get_runtime_context().get_assigned_resources()  # type: ignore[no-untyped-call]
            cpus = resources.get("CPU")
            if cpus:
                return max(1, int(cpus))
    except ImportError:
        pass
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ItemResult:
    """One item's output record and what the worker's cache did for it."""

    record: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    seconds: float
    pid: int


class BatchWorker:
    """Holds one ``SkippyLlama`` (loaded in the constructor) and runs items on it."""

    def __init__(self, spec: WorkerSpec) -> None:
        from ..runtime.llama import SkippyLlama

        kwargs = dict(spec.llama_kwargs)
        threads = spec.n_threads or assigned_cpus()
        kwargs.setdefault("n_threads", threads)
        kwargs.setdefault("n_threads_batch", threads)
        kwargs.setdefault("verbose", False)
        self.n_threads = int(kwargs["n_threads"])
        self.llm = SkippyLlama(spec.model_path, cache_settings=spec.settings, **kwargs)
        if spec.kv_dtype is not None:
            self.llm.kv_dtype = spec.kv_dtype
        self.llm.model_package = spec.package

    def pid(self) -> int:
        return os.getpid()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token lists that order items (no BOS), as :func:`.runner.order_items` makes them."""
        return [self.llm.tokenize(t.encode("utf-8"), add_bos=False) for t in texts]

    def run(self, item: BatchItem, max_tokens: int, temperature: float) -> ItemResult:
        """Run one item as single-process ``batch`` does; a failure becomes an error record."""
        from .runner import _call, _output

        started = time.perf_counter()
        self.llm.last_cache_event = None
        try:
            record = _output(item, _call(self.llm, item, max_tokens, temperature))
        except Exception as exc:  # a failed item is recorded; the batch goes on
            record = {"id": item.id, "error": f"{type(exc).__name__}: {exc}"}
        event = self.llm.last_cache_event
        return ItemResult(
            record=record,
            prompt_tokens=event.prompt_tokens if event else 0,
            cached_tokens=event.cached_tokens if event else 0,
            prefilled_tokens=event.suffix_tokens if event else 0,
            seconds=time.perf_counter() - started,
            pid=os.getpid(),
        )

    def close(self) -> None:
        self.llm.close()
