"""What the server's routes share: the model proxy, settings, metrics, history and snapshots."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from llama_cpp.server.settings import ServerSettings

from ..config import LoadedSettings
from ..tiers.disk import DiskTier
from .history import RequestHistory
from .memory import MemoryPlan
from .metrics import ServerMetrics, record_from_event
from .proxy import ServedLlama, SkippyLlamaProxy
from .queue import RequestQueue
from .recent import RecentConversations
from .snapshot import SnapshotCache
from .worker import ModelThread


@dataclass
class ServingState:
    """Everything one ``skippy-llama serve`` process holds besides the llama_cpp.server globals."""

    proxy: SkippyLlamaProxy
    #: the one thread every model call runs on
    worker: ModelThread
    cache: LoadedSettings
    server: ServerSettings
    model_alias: str
    #: what ``--memory-budget`` sized L1 to (None: not sized from a budget)
    memory: MemoryPlan | None = None
    #: the bounded line in front of the model (``--max-queue``)
    queue: RequestQueue = field(default_factory=lambda: RequestQueue(32))
    started_at: float = field(default_factory=time.time)
    history: RequestHistory = field(default_factory=RequestHistory)
    closed: bool = False
    #: requests finished so far, and when one last started or finished (``time.monotonic``):
    #: the idle work (:mod:`.idle`) runs in the gaps between them
    requests_finished: int = 0
    last_activity: float = field(default_factory=time.monotonic)
    #: the conversations served last, as tokens (what the idle work prefetches)
    recent: RecentConversations = field(default_factory=RecentConversations)

    def __post_init__(self) -> None:
        self.snapshots = SnapshotCache(self.model)
        self.metrics = ServerMetrics(self.snapshots)
        self._close_lock = threading.Lock()
        self._off_tier: DiskTier | None = None

    def model(self) -> ServedLlama | None:
        """The loaded model; None once the server has shut down."""
        return None if self.closed else self.proxy.current()

    def observe(self, endpoint: str, at: float, llm: ServedLlama, outcome: str) -> None:
        """Count a finished request in the metrics and the status page's history, and note
        its conversation (called on the model thread, where the working sequence is stable)."""
        self.recent.add(llm.input_ids[: llm.n_tokens])
        self.requests_finished += 1
        self.last_activity = time.monotonic()
        record = record_from_event(
            endpoint, at, llm.last_cache_event, llm.completion_tokens(), outcome
        )
        self.history.add(record)
        self.metrics.observe(record)

    def status_tier(self) -> DiskTier:
        """The model's L3 tier, or a closed ``off`` one whose status says L3 is not in use."""
        llm = self.model()
        disk = llm.prefix_cache.tier("l3") if llm is not None else None
        if isinstance(disk, DiskTier):
            return disk
        if self._off_tier is None:
            off = self.cache.settings.l3.model_copy(update={"mode": "off"})
            self._off_tier = DiskTier(off, reconcile=False, close_at_exit=False)
        return self._off_tier

    def close(self) -> None:
        """Close the model: pending L3 writes are flushed (``SkippyLlama.close``)."""
        with self._close_lock:
            if self.closed:
                return
            llm = self.proxy.current()
            self.closed = True
            if llm is not None:
                self.worker.call(llm.close)
            self.worker.shutdown()

    def summary(self) -> dict[str, Any]:
        llm = self.model()
        return {
            "model": self.model_alias,
            "model_path": llm.model_path if llm is not None else None,
            "started_at": self.started_at,
            "memory": self.memory.to_json() if self.memory is not None else None,
            "queue": self.queue.status().to_json(),
        }
