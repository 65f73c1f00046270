"""What the CacheGen quality benchmarks (bench_cachegen_floor.py, bench_remote_cachegen.py,
bench_cachegen_decode.py) share: the qualifier script as a module and the provenance fields
their results record."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def qualifier() -> Any:
    """``scripts/qualify_cachegen.py`` as a module (its texts, restore and scoring helpers)."""
    spec = importlib.util.spec_from_file_location(
        "qualify_cachegen", ROOT / "scripts" / "qualify_cachegen.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def commit() -> str:
    """The checkout's short commit ('' outside git)."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip()


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages ([] where /proc has none)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []
