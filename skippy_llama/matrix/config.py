"""What one matrix run covers: workloads, tiers, K/V types, backends, sizes (pure data).

The ``small`` preset is the CI configuration (a few minutes on 2 CPU cores); ``full`` is what an
operator runs on their own machine or GPU, with long shared documents so restores matter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from ..errors import ConfigError

Workload = Literal["chats", "documents", "restart"]
TierName = Literal["l1", "l2", "l3"]
KVName = Literal["f16", "q8_0"]

WORKLOADS: tuple[Workload, ...] = ("chats", "documents", "restart")
TIERS: tuple[TierName, ...] = ("l1", "l2", "l3")
KV_TYPES: tuple[KVName, ...] = ("f16", "q8_0")

#: What each tier column means (a cell enables exactly these).
TIER_DESCRIPTIONS: dict[TierName, str] = {
    "l1": "L1 only: resident prefixes in the live context (L2/L3 off)",
    "l2": "L2 + L3: L1 resident prefixes off, RAM mirror over a disk store",
    "l3": "L3 only: L1 resident prefixes off, disk store",
}


@dataclass(frozen=True)
class Backend:
    """One backend column: a name and the ``Llama`` arguments that select it."""

    name: str
    llama_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_backend(gpu_build: bool) -> Backend:
    """The CPU column. On a GPU build nothing may reach the GPU: no layers, no K/V, and no
    offload of host-weight matrix products (``op_offload``), which llama.cpp otherwise does
    for large batches even at ``n_gpu_layers=0``."""
    if not gpu_build:
        return Backend("CPU", {"n_gpu_layers": 0})
    return Backend("CPU", {"n_gpu_layers": 0, "offload_kqv": False, "op_offload": False})


def backends_for_build(build: str) -> list[Backend]:
    """The backends a build offers: the CPU always; the build's GPU backend with every layer
    offloaded when it has one (``build`` is ``native.backend_name()``)."""
    if build == "CPU":
        return [cpu_backend(False)]
    return [cpu_backend(True), Backend(build, {"n_gpu_layers": -1})]


def select_backends(available: list[Backend], wanted: list[str] | None) -> list[Backend]:
    """``available`` filtered by ``--backends`` names (case-insensitive).

    Raises:
        ConfigError: a wanted backend is not in this build.
    """
    if not wanted:
        return available
    by_name = {b.name.lower(): b for b in available}
    chosen = []
    for name in wanted:
        backend = by_name.get(name.strip().lower())
        if backend is None:
            raise ConfigError(
                f"--backends: {name!r} is not available in this llama.cpp build; available: "
                f"{', '.join(b.name for b in available)}"
            )
        chosen.append(backend)
    return chosen


@dataclass(frozen=True)
class MatrixConfig:
    """Sizes of one matrix run. Every field is recorded in the JSON report."""

    preset: str = "full"
    workloads: tuple[Workload, ...] = WORKLOADS
    tiers: tuple[TierName, ...] = TIERS
    kv_types: tuple[KVName, ...] = KV_TYPES
    #: chats run round-robin by turn: ``n_chats`` chats × ``n_turns`` turns
    n_chats: int = 3
    n_turns: int = 3
    #: documents: ``n_docs`` documents × ``n_questions`` questions, interleaved across documents
    n_docs: int = 2
    n_questions: int = 3
    #: closed-ticket lines appended to each document (~45 tokens each): long shared prefixes
    doc_tickets: int = 20
    #: keep only the first N sentences of each document (None: all, ~260 tokens)
    doc_sentences: int | None = None
    #: restart: phase 1 asks question 1 of each of ``restart_docs`` documents, fresh instances
    #: ask the other questions
    restart_docs: int = 2
    restart_questions: int = 3
    #: no-reuse row (with the first K/V type only): distinct one-shot prompts
    n_noreuse: int = 4
    max_tokens: int = 16
    n_ctx: int = 4096
    #: n_batch = n_ubatch: the canonical granule where reuse is batch-aligned (GPU, flash on)
    n_batch: int = 128
    page_tokens: int = 128
    threads: int | None = None
    #: ``auto``: on for a quantized V cache (llama.cpp needs it), off otherwise
    flash_attn: Literal["auto", "on", "off"] = "auto"

    def with_overrides(self, **changes: Any) -> MatrixConfig:
        """A copy with the given fields changed (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, MatrixConfig] = {
    "full": MatrixConfig(),
    # CI: about 2-3 minutes on 2 CPU cores with SmolLM2-135M
    "small": MatrixConfig(
        preset="small",
        n_chats=2,
        n_turns=2,
        n_docs=2,
        n_questions=2,
        doc_tickets=0,
        doc_sentences=4,
        restart_docs=1,
        restart_questions=2,
        n_noreuse=2,
        max_tokens=8,
        n_ctx=2048,
        n_batch=64,
        page_tokens=64,
        # one thread: on a shared 2-core machine two threads stall each other at every graph
        # barrier and small batches swing from 0.1 s to 4 s (benchmarks/experiments/NOTEBOOK.md)
        threads=1,
    ),
}
