"""CacheGen decode speed on one core, against an older revision of the codec (issue 43.5).

Pages shaped like SmolLM2-135M's (30 layers, K and V of 192 F16 channels, 128 tokens: 2.95 MB
native), filled with the unit tests' KV-like values (``tests/unit/cachegen_pages.py``), with V
transposed (flash attention off) and not. Each decode writes into a reused buffer; the time is
the calling thread's CPU time (``time.thread_time``), so other processes on a shared machine
slow it only through the caches they share. With ``--against REV`` the codec module of that git
revision is loaded beside this one and the two decoders alternate on the same payloads, so both
see the same load; the output bytes of the two are compared too.

Usage::

    .venv/bin/python benchmarks/bench_cachegen_decode.py [--repeats 40] [--against f5036c3]
        [--out benchmarks/results/cachegen-decode.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from cachegen_common import load_average  # noqa: E402
from cachegen_pages import make_page  # noqa: E402

from skippy_llama.codecs import cachegen  # noqa: E402
from skippy_llama.codecs.cachegen import CacheGenParams  # noqa: E402

BITS = (8, 6, 4)


def _load_revision(rev: str) -> ModuleType:
    """``skippy_llama/codecs/cachegen.py`` as of git revision ``rev``, as a sibling module."""
    source = subprocess.run(
        ["git", "show", f"{rev}:skippy_llama/codecs/cachegen.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = ROOT / "skippy_llama" / "codecs" / "_bench_old_cachegen.py"
    path.write_text(source, "utf-8")
    try:
        spec = importlib.util.spec_from_file_location("skippy_llama.codecs._bench_old", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        path.unlink()


def _cpu_seconds(codec: Any, stored: bytes, out: bytearray) -> float:
    t = time.thread_time()
    codec.decode_into(stored, memoryview(out))
    return time.thread_time() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--against", default=None, help="git revision of the older codec")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    old = _load_revision(args.against) if args.against else None
    rows = []
    for v_trans in (True, False):
        page, _, _ = make_page(n_layer=30, channels=192, v_trans=v_trans, n_tokens=128)
        native = page.to_bytes()
        for bits in BITS:
            stored = cachegen.encode(native, CacheGenParams((bits,) * 3, (bits,) * 3))
            new_buf, old_buf = bytearray(len(native)), bytearray(len(native))
            cachegen.decode_into(stored, memoryview(new_buf))
            row: dict[str, Any] = {
                "v_trans": v_trans, "bits": bits, "native_bytes": len(native),
                "size_ratio": round(len(stored) / len(native), 4),
            }  # fmt: skip
            new_t: list[float] = []
            old_t: list[float] = []
            for _ in range(args.repeats):  # alternate, so both see the same load
                new_t.append(_cpu_seconds(cachegen, stored, new_buf))
                if old is not None:
                    old_t.append(_cpu_seconds(old, stored, old_buf))
            row["decode_gbps"] = round(len(native) / statistics.median(new_t) / 1e9, 3)
            row["decode_gbps_best"] = round(len(native) / min(new_t) / 1e9, 3)
            if old is not None:
                row["old_decode_gbps"] = round(len(native) / statistics.median(old_t) / 1e9, 3)
                row["old_decode_gbps_best"] = round(len(native) / min(old_t) / 1e9, 3)
                a = np.frombuffer(new_buf, np.uint8)
                b = np.frombuffer(old_buf, np.uint8)
                row["bytes_differing_from_old"] = int((a != b).sum())
            print(json.dumps(row), flush=True)
            rows.append(row)
    doc = {
        "benchmark": "bench_cachegen_decode",
        "against": args.against,
        "repeats": args.repeats,
        "machine": {"cpu": platform.processor() or platform.machine(), "load": load_average()},
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n", "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
