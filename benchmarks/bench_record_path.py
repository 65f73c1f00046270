"""Issue 45 (items 4 and 5) on the CPU: what L3 costs where nothing is reused, phase by phase,
and a fresh process's first L3 restore.

**Nothing reused** (``--rounds``): the one-shot workload of ``bench_overhead.py`` (distinct
~500-token documents, 16 greedy tokens each, ``tests/overhead_workloads.py``) on plain
``llama_cpp.Llama`` and on ``SkippyLlama`` with L3 on (1 GiB, a fresh directory per run), one
run per mode and round, the modes of a round in an order rotated by the round (drift on a shared
machine must not decide a ratio; compare ratios, not absolute times). Each L3 mode stores pages
with its own ``l3.compression`` (``l3:zstd``, ``l3:lz4``, ``l3:none``; ``l3`` is the default,
``auto``; ``l3_before``: the default with the record path and park rule before issue 45 item 4,
``record_paths.py``). For the L3 modes the run also times, per request, the request path's part
of a record (``Recorder.after_request``: capture, parse, plan, queue; with the export of item 4:
plan, export started, queue) and its capture alone, the park before the prompt
(``CacheEvent.park_ms``) and the wait for a previous record's export (``KVSeam.settle``), and per
record the writer thread's wall and CPU time (cutting, compressing, hashing, writing), with the
tier's ``encode_us`` counter; ``close()`` (which waits for the writer) is timed apart. Replies
must equal plain's.

**First L3 restore** (``--restore-tokens N``, 0 to skip): per compression, a child process
prefills an ``N``-token prompt with L3 on and closes (its pages land), then a fresh child process
on that store asks the prompt plus 16 tokens once (its first L3 restore: ``lookup_ms`` +
``restore_ms`` of the event) and, with L1 off, a second time (the next restore). The page cache
is warm (the pages were just written), as issue 45's "tried as a new user would" measured.
``--restore-arms`` names how the reading processes restore, on the same store, the arms of a read
in an order rotated by the read: ``copies`` (the default where the roster certifies
``layer_copy_exact``: each page's cells copied per layer from its own bytes into the KV tensors,
the next chunk read and verified meanwhile) and ``blob`` (``page_copies`` off: pages assembled into
one state blob and imported, the path before issue 45 item 3). ``copy_ms`` is the copies' time, ``cpu_s`` the process's CPU
time over the request (restore and the 16-token suffix; on a loaded machine the wall time is
mostly waiting). ``--restore-store DIR`` keeps the written store there and reuses it next time.

Usage::

    PYTHONPATH=$PWD/tests/force_ngl LLCPP_FORCE_NGL=0 LLCPP_FORCE_THREADS=1 \\
        .venv/bin/python benchmarks/bench_record_path.py --rounds 3 \\
        --modes plain l3:zstd l3:lz4 --restore-tokens 3900 \\
        --out benchmarks/results/record-path-s45.json

Nothing here is a timed assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))  # record_paths

N_CTX = 4096


def _git_commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE, check=False
    )
    return done.stdout.strip()


def _settings(mode: str, directory: str, *, l1: bool = True) -> Any:
    from skippy_llama.config import Settings

    compression = mode.split(":", 1)[1] if ":" in mode else "auto"  # l3_before: auto
    l3 = {
        "mode": "fixed",
        "budget": "1GiB",
        "directory": directory,
        "minimum_free": "1GiB",
        "compression": compression,
    }
    return Settings(l3=l3, l1={"enabled": l1})


def run_oneshot(mode: str) -> dict[str, Any]:
    """One run of the one-shot workload on a fresh model of ``mode``."""
    import llama_cpp
    from overhead_workloads import SIZES, documents

    from skippy_llama.models import default_model_path
    from skippy_llama.runtime.llama import SkippyLlama

    common: dict[str, Any] = {"n_ctx": N_CTX, "verbose": False, "seed": 1}
    path = str(default_model_path())
    tmp = tempfile.TemporaryDirectory(prefix="skippy-record-path-")
    phases: dict[str, list[float]] = {
        "record_path_s": [],
        "capture_s": [],
        "park_s": [],
        "export_wait_s": [],
        "writer_wall_s": [],
        "writer_cpu_s": [],
    }
    llm: Any
    if mode == "plain":
        llm = llama_cpp.Llama(path, **common)
    else:
        if mode == "l3_before":
            from record_paths import ParksAsBefore, capture_as_before

            before = SkippyLlama(
                path,
                cache_settings=_settings(mode, tmp.name),
                cost_model=ParksAsBefore(),
                **common,
            )
            llm = capture_as_before(before)
        else:
            llm = SkippyLlama(path, cache_settings=_settings(mode, tmp.name), **common)
        recorder, seam = llm.recorder, llm.seam
        after, capture, settle = recorder.after_request, seam.capture, seam.settle

        def timed_settle() -> None:
            t0 = time.perf_counter()
            settle()
            phases["export_wait_s"].append(time.perf_counter() - t0)

        seam.settle = timed_settle  # type: ignore[method-assign]

        def timed_after(event: Any) -> None:
            t0 = time.perf_counter()
            after(event)
            phases["record_path_s"].append(time.perf_counter() - t0)

        def timed_capture(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return capture(*args, **kwargs)
            finally:
                phases["capture_s"].append(time.perf_counter() - t0)

        recorder.after_request = timed_after  # type: ignore[method-assign]
        seam.capture = timed_capture  # type: ignore[method-assign]
        disk = llm.prefix_cache.disk
        if disk is not None:
            writer = disk._writer
            write = writer._write

            def timed_write(rec: Any) -> None:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    write(rec)
                finally:
                    phases["writer_wall_s"].append(time.perf_counter() - t0)
                    phases["writer_cpu_s"].append(time.thread_time() - c0)

            writer._write = timed_write
    tokenize = llm.tokenize
    prompts = documents(lambda text: list(tokenize(text.encode(), add_bos=False, special=False)))
    request_s: list[float] = []
    request_cpu_s: list[float] = []
    replies: list[str] = []
    for prompt in prompts:
        t0, c0 = time.perf_counter(), time.process_time()
        out: Any = llm.create_completion(prompt, max_tokens=SIZES.oneshot_tokens, temperature=0.0)
        request_s.append(time.perf_counter() - t0)
        request_cpu_s.append(time.process_time() - c0)
        replies.append(out["choices"][0]["text"])
        event = getattr(llm, "last_cache_event", None)
        if event is not None:
            phases["park_s"].append(event.park_ms / 1e3)
    counters: dict[str, Any] = {}
    bus = getattr(llm, "bus", None)
    t0 = time.perf_counter()
    if mode != "plain":
        disk = llm.prefix_cache.disk
        if disk is not None:
            disk.flush(60.0)
            counters = {
                k: v
                for k, v in disk.status().to_json().get("activity", {}).items()
                if k in ("writes", "bytes_written", "encode_us", "encoded_bytes", "dropped_writes")
            }
    llm.close()
    close_s = time.perf_counter() - t0
    tmp.cleanup()
    return {
        "mode": mode,
        "total_s": sum(request_s),
        "cpu_s": sum(request_cpu_s),
        "request_s": [round(s, 4) for s in request_s],
        "request_cpu_s": [round(s, 4) for s in request_cpu_s],
        "close_s": round(close_s, 4),
        "phases_ms": {k: [round(v * 1e3, 3) for v in vals] for k, vals in phases.items()},
        "counters": counters,
        "bus": bus.to_json() if bus is not None else None,
        "replies": replies,
    }


RESTORE_CHILD = r"""
import json, sys, time
import numpy as np
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.models import default_model_path
sys.path.insert(0, sys.argv[4])
from bench_record_path import _settings
mode, directory, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
step, arm = sys.argv[5], sys.argv[6]
llm = SkippyLlama(str(default_model_path()), n_ctx=4096, verbose=False, seed=1,
                  cache_settings=_settings(mode, directory, l1=step != "read"))
if arm == "blob":
    llm.seam.page_copies = False
rng = np.random.default_rng(45)
tokens = [int(t) for t in rng.integers(100, llm.n_vocab() - 100, n + 16)]
out = {"mode": mode, "step": step, "arm": arm, "bus": llm.bus.to_json() if llm.bus else None,
       "page_copies": llm.seam.page_copies,
       "page_copy_refusal": getattr(llm, "page_copy_refusal", "not in this build")}
# where a restore's time goes: the pages' fetch (read, verify, decode), their assembly into one
# state blob, its import (wrapped here, in the benchmark only)
# (and, for the copies, the per-layer copies from the pages' bytes; reads overlap them)
phases = {"fetch_ms": 0.0, "assemble_ms": 0.0, "import_ms": 0.0, "copy_ms": 0.0}
def timed(obj, name, key):
    real = getattr(obj, name)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            phases[key] += (time.perf_counter() - t0) * 1e3
    setattr(obj, name, wrapper)
timed(llm.prefix_cache.pages, "fetch", "fetch_ms")
timed(llm.seam, "_assemble", "assemble_ms")
timed(llm.seam, "_import", "import_ms")
if hasattr(llm.seam, "_copy_pages"):
    timed(llm.seam, "_copy_pages", "copy_ms")
if step == "write":
    t0 = time.perf_counter()
    llm.eval(tokens[:n])
    out["cold_s"] = time.perf_counter() - t0
    out["flushed"] = llm.flush_cache(120.0)
else:
    events = []
    for _ in range(2):
        llm.reset()
        for key in phases:
            phases[key] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        llm.eval(tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        e = llm.last_cache_event
        events.append({"tier": e.tier, "cached_tokens": e.cached_tokens,
                       "lookup_ms": e.lookup_ms, "restore_ms": e.restore_ms,
                       "prefill_ms": e.prefill_ms, "wall_s": wall, "cpu_s": cpu,
                       **{k: round(v, 3) for k, v in phases.items()}})
    out["restores"] = events
llm.close()
print(json.dumps(out))
"""


def _child(mode: str, directory: str, n: int, step: str, arm: str = "copies") -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", RESTORE_CHILD, mode, directory, str(n), str(HERE), step, arm],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def first_restores(
    modes: list[str],
    n: int,
    reads: int,
    arms: list[str] | None = None,
    store: Path | None = None,
) -> list[dict[str, Any]]:
    """Per L3 mode: a store written by one process (or kept under ``store`` by an earlier run),
    then ``reads`` rounds of fresh processes restoring, one per arm (``copies``, ``blob``) in an
    order rotated by the round."""
    arms = arms or ["copies"]
    out = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="skippy-first-restore-") as tmp:
            if store is not None:
                # a store kept from an earlier run of the same mode and size: no prefill
                tmp = str(store / f"{mode.replace(':', '-')}-{n}")
                done = Path(tmp) / "written.json"
                Path(tmp).mkdir(parents=True, exist_ok=True)
                if done.exists():
                    wrote = json.loads(done.read_text())
                else:
                    wrote = _child(mode, tmp, n, "write")
                    done.write_text(json.dumps(wrote))
            else:
                wrote = _child(mode, tmp, n, "write")
            runs = []
            for i in range(reads):
                for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
                    runs.append(_child(mode, tmp, n, "read", arm))
        row: dict[str, Any] = {"mode": mode, "tokens": n, "cold_s": wrote["cold_s"], "reads": runs}
        for arm in arms:
            firsts = [r["restores"][0] for r in runs if r["arm"] == arm]
            row[f"first_total_ms_{arm}"] = sorted(
                round(f["lookup_ms"] + f["restore_ms"], 1) for f in firsts
            )
            row[f"first_cpu_ms_{arm}"] = sorted(round(f["cpu_s"] * 1e3, 1) for f in firsts)
        for i, run in enumerate(runs):
            first, second = run["restores"]
            print(
                f"{mode} {run['arm']} read {i}: first {first['tier']} {first['cached_tokens']} tok "
                f"lookup {first['lookup_ms']:.1f} + restore {first['restore_ms']:.1f} ms; "
                f"next {second['tier']} {second['lookup_ms']:.1f} + "
                f"{second['restore_ms']:.1f} ms; cold {wrote['cold_s']:.2f} s; first: fetch "
                f"{first['fetch_ms']:.1f}, assemble {first['assemble_ms']:.1f}, import "
                f"{first['import_ms']:.1f}, copy {first['copy_ms']:.1f} ms; request CPU "
                f"{first['cpu_s'] * 1e3:.0f} ms",
                flush=True,
            )
        out.append(row)
    return out


def summarize(rounds: list[list[dict[str, Any]]], modes: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in modes:
        if mode == "plain":
            continue
        ratios = []
        cpu_ratios = []
        for runs in rounds:
            by = {r["mode"]: r for r in runs}
            ratios.append(by[mode]["total_s"] / by["plain"]["total_s"])
            cpu_ratios.append(by[mode]["cpu_s"] / by["plain"]["cpu_s"])
        path = [
            v
            for runs in rounds
            for r in runs
            if r["mode"] == mode
            for v in r["phases_ms"]["record_path_s"]
        ]
        cap = [
            v
            for runs in rounds
            for r in runs
            if r["mode"] == mode
            for v in r["phases_ms"]["capture_s"]
        ]
        wcpu = [
            v
            for runs in rounds
            for r in runs
            if r["mode"] == mode
            for v in r["phases_ms"]["writer_cpu_s"]
        ]
        park = [
            sum(r["phases_ms"].get("park_s", []))
            for runs in rounds
            for r in runs
            if r["mode"] == mode
        ]
        wait = [
            sum(r["phases_ms"].get("export_wait_s", []))
            for runs in rounds
            for r in runs
            if r["mode"] == mode
        ]
        summary[mode] = {
            "total_over_plain_median": round(statistics.median(ratios), 4),
            "total_over_plain_min_max": [round(min(ratios), 4), round(max(ratios), 4)],
            "cpu_over_plain_median": round(statistics.median(cpu_ratios), 4),
            "record_path_ms_median": round(statistics.median(path), 3) if path else None,
            "capture_ms_median": round(statistics.median(cap), 3) if cap else None,
            "writer_cpu_ms_median": round(statistics.median(wcpu), 3) if wcpu else None,
            # per run (8 requests): the parks' time and the waits for an export, summed
            "park_ms_per_run_median": round(statistics.median(park), 3) if park else None,
            "export_wait_ms_per_run_median": round(statistics.median(wait), 3) if wait else None,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["plain", "l3"])
    parser.add_argument("--restore-tokens", type=int, default=0)
    parser.add_argument("--restore-reads", type=int, default=2)
    parser.add_argument("--restore-arms", nargs="+", choices=["copies", "blob"], default=["copies"])
    parser.add_argument(
        "--restore-store",
        type=Path,
        default=None,
        help="keep the written stores here and reuse them on the next run (no prefill)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    modes = list(args.modes)
    if "plain" not in modes:
        modes.insert(0, "plain")
    rounds: list[list[dict[str, Any]]] = []
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        runs = [run_oneshot(mode) for mode in order]
        plain = next(x for x in runs if x["mode"] == "plain")
        for run in runs:
            if run["replies"] != plain["replies"]:
                raise SystemExit(f"round {r}: {run['mode']} replies differ from plain's")
            print(
                f"round {r} {run['mode']}: total {run['total_s']:.3f} s "
                f"({run['total_s'] / plain['total_s']:.3f}x plain), record path "
                f"{statistics.median(run['phases_ms']['record_path_s'] or [0]):.2f} ms/request, "
                f"writer cpu {sum(run['phases_ms']['writer_cpu_s']):.0f} ms",
                flush=True,
            )
        rounds.append(runs)
    restores = []
    if args.restore_tokens:
        l3_modes = [m for m in modes if m != "plain"]
        restores = first_restores(
            l3_modes, args.restore_tokens, args.restore_reads, args.restore_arms, args.restore_store
        )
    result = {
        "benchmark": "bench_record_path.py",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": _git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("LLCPP_", "SKIPPY_"))},
        "load": os.getloadavg(),
        "rounds": rounds,
        "summary": summarize(rounds, modes) if rounds else {},
        "first_restores": restores,
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
