"""L2 restores on the CPU before and after the host arena (issue 45), with flash attention on and off.

For each flash-attention setting: a recorder writes a document of ``--tokens`` tokens to L3; then
two readers (L1 off, L2 on, restores forced) each ask the document plus a 64-token question
``2 + --runs`` times. The first two requests read L3 (the second promotes the pages into L2),
the rest are served by L2:

- ``arena``: the runtime's default where the roster certifies ``layer_copy_exact`` (patch 0006):
  L2 keeps pages in a host arena laid out as the KV tensors, a restore copies each run of pages
  per layer straight into the context;
- ``blob``: the arena detached and L3's pages not copied per layer (``page_copies`` off): L2 keeps
  page bytes and a restore assembles them into one state blob that ``llama_state_seq_set_data``
  parses (the path before issue 45);
- ``arena_unfaulted`` (with ``--arms``): ``arena`` without the background prefault of the arena's
  memory at load, so the first promotion pays the page faults of slots never written before.

``wall_ms`` is each request's whole time; the second request's ``phases_ms.promote`` and
``wall_ms`` show what the first promotion into the arena costs. The first request is the
process's first L3 restore (``first_l3_restore_ms``: the read buffers and connections of a
fresh process).

Each L2 restore gives its time (``restore_ms``: the seam's execution of the plan, lookup and
pages included), its rate (``restore_gbps``: K/V bytes over that time), where the time went
(``phases_ms``, see ``restore_common.RESTORE_PHASES``) and the max |Δ| of the continuation's logits
against a one-shot cold prefill. ``memcpy_gbps`` is one host memory copy of the same bytes (the
CPU's "bus"), measured in the same process. On a shared machine a restore's wall time mostly
waits for a core, so each restore also gives the CPU time of the threads doing it
(``cpu_ms``: ``main`` the request's thread, ``read`` the read-ahead threads of a restore by
page copies), the memcpy its own, and every arm the load average before and after it. With
``--boost N`` every thread of the process runs at niceness ``-N`` (root only) during each timed
request and the memcpy (never during the cold prefills): on a loaded machine that gives the
wall time of a restore that gets the cores it asks for, as on an idle machine, though the
other processes' use of memory bandwidth and caches remains.

    PYTHONPATH=$PWD/tests/force_ngl LLCPP_FORCE_NGL=0 LLCPP_FORCE_THREADS=1 \\
        python benchmarks/bench_arena.py --tokens 3900 --out benchmarks/results/arena-cpu-s45.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

import skippy_llama

sys.path.insert(0, str(Path(__file__).resolve().parent))

from restore_common import last_logits, report_head, timed_eval, timed_phases, timed_request

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.models import default_model_path
from skippy_llama.runtime import arena_setup
from skippy_llama.runtime.llama import SkippyLlama

SUFFIX = 64


def _settings(store: Path, l2: str | None) -> Settings:
    return Settings(
        l1={"enabled": False},
        l2={"budget": l2},
        l3={"mode": "fixed", "budget": "8GiB", "directory": str(store), "minimum_free": "1GiB"},
    )


def _memcpy(nbytes: int) -> dict[str, float]:
    """Five host copies of ``nbytes``: the best one's GB/s, and its wall and CPU times (best
    and median) in ms."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(5):
        cpu = time.thread_time()
        started = time.perf_counter()
        np.copyto(dst, src)
        walls.append(time.perf_counter() - started)
        cpus.append(time.thread_time() - cpu)
    return {
        "gbps": round(nbytes / min(walls) / 1e9, 2),
        "ms_min": round(min(walls) * 1e3, 2),
        "ms_median": round(float(np.median(walls)) * 1e3, 2),
        "cpu_ms_min": round(min(cpus) * 1e3, 2),
        "cpu_ms_median": round(float(np.median(cpus)) * 1e3, 2),
    }


def _renice(nice: int) -> None:
    """Set every thread of this process to niceness ``nice`` (``--boost``; below 0 needs
    root). Threads started later inherit their creator's."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _timed_cpu(llm: SkippyLlama) -> dict[str, float]:
    """Sum the CPU time of ``llm``'s restores per thread kind: ``main`` (the seam's execution
    on the request's thread) and ``read`` (the read-ahead threads of a restore by page
    copies, ``KVSeam._read_pages``). Reset the values to measure a request."""
    spent = {"main": 0.0, "read": 0.0}

    def wrap(name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - started

        return timed

    kv = llm.seam
    kv.execute = wrap("main", kv.execute)  # type: ignore[method-assign]
    kv._read_pages = wrap("read", kv._read_pages)  # type: ignore[method-assign]
    return spent


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return float(np.median(values)) if values else None


def bench_layout(
    model: str, n: int, runs: int, flash_attn: bool, arms: list[str], boost: int = 0
) -> dict[str, Any]:
    common: dict[str, Any] = {"n_ctx": n + 1024, "flash_attn": flash_attn, "verbose": False}
    plain = llama_cpp.Llama(model, **common)
    rng = np.random.default_rng(0)
    vocab = plain.n_vocab()
    base = [int(t) for t in rng.integers(100, vocab - 100, n)]
    query = base + [int(t) for t in rng.integers(100, vocab - 100, SUFFIX)]
    other = [int(t) for t in rng.integers(100, vocab - 100, SUFFIX)]
    cold_s = timed_eval(plain, query)
    cold = last_logits(plain)
    plain.close()
    out: dict[str, Any] = {"flash_attn": flash_attn, "tokens": n, "cold_s": round(cold_s, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        recorder = SkippyLlama(model, cache_settings=_settings(store, None), **common)
        recorder.eval(base + other)
        recorder.recorder.flush()
        recorder.close()
        for arm in arms:
            where = Path(tmp) / arm
            shutil.copytree(store, where)
            arena_setup.PREFAULT = arm != "arena_unfaulted"
            try:
                llm = SkippyLlama(
                    model,
                    cache_settings=_settings(where, "1GiB"),
                    cost_model=AlwaysRestore(),
                    **common,
                )
            finally:
                arena_setup.PREFAULT = True
            ram = llm.prefix_cache.ram
            assert ram is not None
            if arm == "blob":
                ram.detach_arena()
                llm.seam.layer_copies = False
                llm.seam.page_copies = False
            phases = timed_phases(llm)
            cpu = _timed_cpu(llm)
            rows: list[dict[str, Any]] = []
            load_before = os.getloadavg()
            for _ in range(2 + runs):
                for key in cpu:
                    cpu[key] = 0.0
                if boost:
                    _renice(-boost)
                try:
                    row, seconds = timed_request(llm, query, cold, cold_s, phases)
                finally:
                    if boost:
                        _renice(0)
                event = llm.last_cache_event
                assert event is not None
                row["wall_ms"] = round(seconds * 1e3, 2)
                row["restored_bytes"] = event.restored_bytes
                # the phases this request went through only
                row["phases_ms"] = {k: round(v * 1e3, 2) for k, v in phases.items() if v}
                row["cpu_ms"] = {k: round(v * 1e3, 2) for k, v in cpu.items()}
                row["main_cpu_ms"] = round(cpu["main"] * 1e3, 2)
                rows.append(row)
            l2 = [r for r in rows if r["tier"] == "l2"]
            first = rows[0]
            out[arm] = {
                "arena": llm.seam.layer_copies,
                "arena_refusal": llm.arena_refusal,
                "page_copies": llm.seam.page_copies,
                "first_l3_restore_ms": first["restore_ms"] if first["tier"] == "l3" else None,
                "first_l3_cpu_ms": first["cpu_ms"] if first["tier"] == "l3" else None,
                "l2_restore_ms_median": _median(l2, "restore_ms"),
                "l2_restore_ms_min": min((r["restore_ms"] for r in l2), default=None),
                "l2_main_cpu_ms_median": _median(l2, "main_cpu_ms"),
                "l2_gbps_median": float(np.median([r["restore_gbps"] or 0 for r in l2]))
                if l2
                else None,
                "load_avg": [round(x, 2) for x in (*load_before, *os.getloadavg())],
                "runs": rows,
            }
            llm.close()
            print(arm, json.dumps({k: v for k, v in out[arm].items() if k != "runs"}), flush=True)
    restored = next(
        (r["restored_bytes"] for arm in arms for r in out[arm]["runs"] if r["tier"] == "l2"), 0
    )
    if boost:
        _renice(-boost)
    try:
        memcpy = _memcpy(restored) if restored else None
    finally:
        if boost:
            _renice(0)
    out["memcpy"] = memcpy
    out["memcpy_gbps"] = memcpy["gbps"] if memcpy else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--tokens", type=int, default=3900)
    parser.add_argument("--runs", type=int, default=5, help="L2 restores per arm")
    parser.add_argument("--flash-attn", type=int, nargs="*", default=[0, 1])
    parser.add_argument(
        "--arms", nargs="+", default=["arena", "blob"], choices=["arena", "blob", "arena_unfaulted"]
    )
    parser.add_argument(
        "--boost",
        type=int,
        default=0,
        help="niceness -N for every thread during the timed requests and the memcpy (root)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    package = Path(skippy_llama.__file__).resolve().parent.parent
    package_commit = subprocess.run(
        ["git", "-C", str(package), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    report: dict[str, Any] = {
        **report_head(),
        # the skippy_llama measured (PYTHONPATH may point at another checkout than this one)
        "package": str(package),
        "package_commit": package_commit or None,
        "boost": args.boost,
        "layouts": [],
    }
    for fa in args.flash_attn:
        row = bench_layout(model, args.tokens, args.runs, bool(fa), args.arms, args.boost)
        arms = ", ".join(
            f"{arm} {row[arm]['l2_restore_ms_median']} ms ({row[arm]['l2_gbps_median']} GB/s, "
            f"CPU {row[arm]['l2_main_cpu_ms_median']} ms; first L3 restore "
            f"{row[arm]['first_l3_restore_ms']} ms, CPU {row[arm]['first_l3_cpu_ms']}; "
            f"promoting request {row[arm]['runs'][1]['wall_ms']} ms, promote "
            f"{row[arm]['runs'][1]['phases_ms'].get('promote')} ms; load {row[arm]['load_avg']})"
            for arm in args.arms
        )
        print(
            f"flash_attn={fa}: cold {row['cold_s']} s; L2 restore median {arms}; "
            f"memcpy {row['memcpy']}",
            flush=True,
        )
        report["layouts"].append(row)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
