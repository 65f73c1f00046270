"""One matrix run: every (backend, K/V type) group, then portability, then the report."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from . import gates, portability
from .config import Backend, MatrixConfig
from .families import Family, run_families
from .runner import Cell, GroupRunner, Say


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cell_line(done: int, total: int, row: dict[str, Any]) -> str:
    failed = [g for g, v in row["gates"].items() if v is False]
    ratio = row["ttft_ratio"]
    wa = row["write_amplification"]
    return (
        f"[{done}/{total}] {row['backend']} {row['kv']} {row['workload']} {row['tier']}: "
        f"TTFT {'-' if ratio is None else f'{ratio:.3f}'}x cold, "
        f"exact {row['identical_outputs']}/{row['requests']}, "
        f"WA {'-' if wa is None else f'{wa:.2f}'}, "
        f"gates {'all pass' if not failed else 'FAILED ' + ','.join(failed)}"
    )


def run_matrix(
    cfg: MatrixConfig,
    model: str,
    backends: list[Backend],
    build: str,
    work: Path,
    *,
    with_portability: bool,
    command: list[str] | None = None,
    say: Say = print,
    families: Sequence[Family] = (),
    remote: tuple[str, Path] | None = None,
) -> dict[str, Any]:
    """Run the matrix and return the report (see ``report.write`` for the files); with
    ``families``, their rows too (``families.py``; ``remote``: the server's URL and secret
    file for the remote column)."""
    started = time.perf_counter()
    started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    total = len(backends) * len(cfg.kv_types) * len(cfg.workloads) * len(cfg.tiers)
    rows: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    noreuse_raw: list[dict[str, Any]] = []
    low_space: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []

    def failed(backend: Backend, kv: str, step: str, exc: Exception) -> None:
        # a build that cannot do one cell (a K/V type its kernels lack, out of memory) must not
        # cost the rest of the matrix: the failure is reported as a row of its own
        error = f"{type(exc).__name__}: {exc}"
        errors.append({"backend": backend.name, "kv": kv, "step": step, "error": error})
        say(f"!! {backend.name} {kv} {step} failed: {error}")

    for backend in backends:
        for kv in cfg.kv_types:
            say(f"== {backend.name} {kv}: loading the cold baseline")
            try:
                group = GroupRunner(cfg, model, backend, kv, work, say)
            except Exception as exc:
                failed(backend, kv, "load", exc)
                continue
            try:
                done: list[Cell] = []
                for workload in cfg.workloads:
                    t0 = time.perf_counter()
                    say(f"-- {backend.name} {kv} {workload}: cold + {', '.join(cfg.tiers)}")
                    try:
                        done += group.run_workload(workload)
                    except Exception as exc:
                        failed(backend, kv, workload, exc)
                        continue
                    say(f"   {time.perf_counter() - t0:.1f} s")
                low = None
                if any(t != "l1" for t in cfg.tiers):
                    try:
                        low = group.low_space()
                    except Exception as exc:
                        failed(backend, kv, "low space", exc)
                if low is not None:
                    low_space.append({"backend": backend.name, "kv": kv, **low})
                    say(
                        f"   low space: {low['writes']} writes, state {low['state']}, "
                        f"outputs equal cold: {low['outputs_equal_cold']}"
                    )
                for cell in done:
                    l1 = next(
                        (c for c in done if c.workload == cell.workload and c.tier == "l1"), None
                    )
                    ref = [a.text for a in (l1.answers if l1 else cell.cold)]
                    row = gates.summarize(cell, ref, low)
                    rows.append(row)
                    cells.append(cell.to_dict())
                    say(_cell_line(len(rows), total, row))
                if cfg.n_noreuse and kv == cfg.kv_types[0]:
                    say(f"-- {backend.name} {kv} noreuse: plain, skippy, skippy_l3")
                    try:
                        noreuse_raw += group.noreuse()
                    except Exception as exc:
                        failed(backend, kv, "noreuse", exc)
            finally:
                group.close()
    port: dict[str, Any] | None = None
    if with_portability:
        try:
            port = portability.run(cfg, model, backends, work, say)
        except Exception as exc:
            port = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"!! portability failed: {port['error']}")
        if port.get("skipped"):
            say(f"portability skipped: {port['skipped']}")
    family_report: dict[str, Any] | None = None
    if families:
        threads = cfg.threads or 1
        family_report = run_families(families, work, threads=threads, remote=remote, say=say)
    return {
        "families": family_report,
        "command": command or sys.argv,
        "commit": _commit(),
        "started": started_at,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "llama_cpp_python": _version("llama_cpp_python"),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "model": model,
        "build_backend": build,
        "backends": [b.to_dict() for b in backends],
        "config": cfg.to_dict(),
        "rows": rows,
        "gate_totals": gates.overall(rows),
        "noreuse": gates.summarize_noreuse(noreuse_raw),
        "low_space": low_space,
        "portability": port,
        "errors": errors,
        "cells": cells,
        "noreuse_raw": noreuse_raw,
    }
