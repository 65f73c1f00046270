"""Synthetic L3 traces of the four traffic shapes the policies are judged on (pure, seeded).

Prompts are token arrays built from a shared system prompt, documents and unique questions; each
becomes a lookup (of all but its last token, as the runtime asks) and a record (of all but its
last two, as the runtime records), cut into page-aligned chains exactly as
:class:`~.trace.TraceWriter` cuts a live prompt. Used by the policy tests and
``benchmarks/bench_policies.py``.

* ``skewed``: Zipf-distributed questions over documents, and a one-off long prompt every few
  requests (scan pollution);
* ``uniform``: questions over documents picked uniformly;
* ``loop``: the documents in a fixed cycle (a working set larger than a small budget);
* ``scan``: every prompt is new.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .trace import LookupEvent, RecordEvent, TraceEvent, page_keys

#: SmolLM2-135M, F16 K/V: serialized state bytes per token (DESIGN.md §3).
BYTES_PER_TOKEN = 23_052
ROOT = b"\x00" * 16
WORKLOADS: tuple[str, ...] = ("skewed", "uniform", "loop", "scan")
_VOCAB = 49_152

Prompt = npt.NDArray[np.int32]


@dataclass(frozen=True)
class Shape:
    """Sizes of one synthetic workload (tokens)."""

    requests: int = 300
    documents: int = 24
    system_tokens: int = 64
    document_tokens: int = 512
    question_tokens: int = 40
    long_every: int = 5
    long_tokens: int = 1_536
    zipf: float = 1.1


def _text(rng: np.random.Generator, n: int) -> Prompt:
    return rng.integers(0, _VOCAB, size=n, dtype=np.int32)


def _corpus(
    rng: np.random.Generator, shape: Shape
) -> tuple[Prompt, list[Prompt], npt.NDArray[np.float64]]:
    """The system prompt, the documents and their Zipf weights (drawn first, in this order)."""
    system = _text(rng, shape.system_tokens)
    docs = [_text(rng, shape.document_tokens) for _ in range(shape.documents)]
    weights = 1.0 / np.arange(1, shape.documents + 1) ** shape.zipf
    return system, docs, weights / weights.sum()


def document_pages(
    shape: Shape = Shape(), seed: int = 0, page_tokens: int = 128
) -> dict[str, tuple[int, float]]:
    """Per full page of system prompt + document: the document's index and its probability in
    the ``skewed`` workload (what an oracle knows and an online policy must learn; used by
    ``benchmarks/experiments/policies_ceiling.py``)."""
    system, docs, weights = _corpus(np.random.default_rng(seed), shape)
    doc_share = 1.0 - 1.0 / shape.long_every if shape.long_every else 1.0
    out: dict[str, tuple[int, float]] = {}
    for index, doc in enumerate(docs):
        prefix = np.concatenate([system, doc])
        keys, counts = page_keys(ROOT, prefix, len(prefix), page_tokens)
        for key, n in zip(keys, counts, strict=True):
            if n == page_tokens:
                out[key] = (index, float(weights[index]) * doc_share)
    return out


def prompts(workload: str, shape: Shape = Shape(), seed: int = 0) -> list[Prompt]:
    """The prompts of ``workload`` (one of :data:`WORKLOADS`)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    rng = np.random.default_rng(seed)
    system, docs, weights = _corpus(rng, shape)
    out: list[Prompt] = []
    for i in range(shape.requests):
        question = _text(rng, shape.question_tokens)
        if workload == "scan":
            body = _text(rng, shape.document_tokens)
        elif workload == "loop":
            body = docs[i % shape.documents]
        elif workload == "uniform":
            body = docs[int(rng.integers(shape.documents))]
        elif shape.long_every and i % shape.long_every == shape.long_every - 1:
            body = _text(rng, shape.long_tokens)  # the one-off long prompt
        else:
            body = docs[int(rng.choice(shape.documents, p=weights))]
        out.append(np.concatenate([system, body, question]))
    return out


def events(
    prompts: Sequence[Prompt],
    *,
    page_tokens: int = 128,
    bytes_per_token: int = BYTES_PER_TOKEN,
    root: bytes = ROOT,
) -> list[TraceEvent]:
    """The trace a run of ``prompts`` (one after another) would write."""
    out: list[TraceEvent] = []
    for t, prompt in enumerate(prompts):
        n = len(prompt)
        keys, counts = page_keys(root, prompt, n - 1, page_tokens)
        out.append(LookupEvent(float(t), keys, counts, n))
        keys, counts = page_keys(root, prompt, n - 2, page_tokens)
        sizes = tuple(c * bytes_per_token for c in counts)
        out.append(RecordEvent(float(t), keys, counts, sizes, n - 2))
    return out


def workload_events(
    workload: str, shape: Shape = Shape(), seed: int = 0, page_tokens: int = 128
) -> list[TraceEvent]:
    """:func:`events` of :func:`prompts`."""
    return events(prompts(workload, shape, seed), page_tokens=page_tokens)
