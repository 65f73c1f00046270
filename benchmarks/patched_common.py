"""What the benchmarks of the patched library (bench_append.py, bench_capture.py) share: the
prompt text and the provenance every result JSON starts with."""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from skippy_llama.runtime import native_ext

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as "
    "his father had done before him. At the top he trimmed the wick, polished the great lens and "
    "wound the clockwork that turned the light. Ships far out at sea watched for its pulse, and "
    "in storms the tower shook while the windows wept with spray; he wrote the wind, the swell "
    "and the passing vessels in the logbook between his rounds. "
)


def provenance(benchmark: str) -> dict[str, Any]:
    """The command, commit, date, machine and native recipe a result was measured with."""
    return {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "abi": native_ext.abi_version(),
        "queue_sha256": native_ext.queue_sha256(),
    }
