"""What the restore benchmarks (bench_gpu.py, bench_arena.py) share: timing a request, the
phases a restore's time goes to, and the row each timed request reports."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.runtime import native
from skippy_llama.runtime.llama import SkippyLlama


def report_head() -> dict[str, Any]:
    """What a result JSON starts with: the command, the commit (None in a copy without git,
    as on the lent GPU machines) and the backend that held the KV cache."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "command": " ".join(sys.argv),
        "commit": commit or None,
        "backend": native.backend_name(),
    }


def spread(ratios: list[float]) -> dict[str, float]:
    """The median, min and max of ``ratios`` (one a round), rounded to 4 places."""
    ordered = sorted(ratios)
    return {
        "median": round(float(np.median(ordered)), 4),
        "min": round(ordered[0], 4),
        "max": round(ordered[-1], 4),
    }


def last_logits(llm: llama_cpp.Llama) -> np.ndarray[Any, Any]:
    """Logits of the last decoded token (copied)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def timed_eval(llm: llama_cpp.Llama, tokens: list[int]) -> float:
    """Seconds ``llm`` takes to evaluate ``tokens`` from a reset, synchronized with the device."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(tokens)
    llama_cpp.llama_synchronize(llm.ctx)
    return time.perf_counter() - started


def gbps(event: Any) -> float | None:
    """K/V bytes a restore moved over its time, in GB/s (None: nothing restored)."""
    if event is None or not event.restored_bytes or not event.restore_ms:
        return None
    return round(float(event.restored_bytes) / (float(event.restore_ms) * 1e-3) / 1e9, 2)


#: Where a restore's time goes (inclusive wall time of each step, summed over one request):
#: ``fetch`` reads and verifies pages, ``take`` hands out a host buffer (waiting for its
#: registration when it is still being pinned), ``assemble`` builds a blob from pages,
#: ``promote`` copies pages read from L3 into L2, ``import`` loads a blob into llama.cpp,
#: ``capture`` copies a waiting record's cells out before the prompt overwrites them. In a
#: chunked restore fetch, assemble and promote run on the read-ahead thread, beside import.
#: ``arena`` is a restore from L2's host arena by per-layer copies (its own lookup included).
#: A restore of pages by per-layer copies (``KVSeam._direct``): ``read`` is a read-ahead
#: thread's stage (fetch, parse, promote, and the copy into a staging arena on a device; beside
#: ``copy``), ``copy`` the per-layer copies of a chunk into the KV tensors.
RESTORE_PHASES = (
    "fetch",
    "take",
    "assemble",
    "promote",
    "import",
    "capture",
    "arena",
    "read",
    "copy",
)


def timed_phases(llm: SkippyLlama) -> dict[str, float]:
    """Wrap ``llm``'s restore steps (instance attributes) to sum their wall time per phase."""
    kv = llm.seam
    owners = {
        "fetch": (llm.prefix_cache.pages, "fetch"),
        "take": (kv.buffers, "take"),
        "assemble": (kv, "_assemble"),
        "promote": (llm.prefix_cache.pages, "promote"),
        "import": (kv, "_import"),
        "capture": (kv, "capture"),
        "arena": (kv, "_from_arena"),
        "read": (kv, "_read_pages"),
        "copy": (kv, "_copy_fetched"),
    }
    return wrap_timed({name: owners[name] for name in RESTORE_PHASES})


def wrap_timed(targets: dict[str, tuple[Any, str]]) -> dict[str, float]:
    """Replace each ``(owner, attribute)`` method by one that adds its wall time to the
    returned dict under its name (reset the values to measure a span)."""
    spent = dict.fromkeys(targets, 0.0)

    def wrap(name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return timed

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    return spent


def timed_request(
    llm: SkippyLlama,
    prompt: list[int],
    cold: np.ndarray[Any, Any],
    cold_s: float,
    phases: dict[str, float],
) -> tuple[dict[str, Any], float]:
    """One request of ``prompt`` on ``llm`` from a reset, its restore phases (``timed_phases``'
    dict, reset here) measured; the row a restore benchmark reports for it (time over the cold
    prefill's ``cold_s``, what served, the restore's time and rate, the max |Δ| of its last
    logits against ``cold``, milliseconds per phase) and its seconds."""
    for key in phases:
        phases[key] = 0.0
    seconds = timed_eval(llm, prompt)
    event = llm.last_cache_event
    row = {
        "warm_over_cold": round(seconds / cold_s, 4),
        "cached": event.cached_tokens if event else 0,
        "tier": event.tier if event else None,
        "restore_ms": round(event.restore_ms, 2) if event else None,
        "restore_gbps": gbps(event),
        "max_abs_dlogit": float(np.abs(last_logits(llm) - cold).max()),
        "phases_ms": {k: round(v * 1e3, 2) for k, v in phases.items()},
    }
    return row, seconds
