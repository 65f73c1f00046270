"""L3 open cost against store size: time from ``DiskTier(...)`` to the first served page.

For stores of 1k, 10k and 50k synthetic pages (model-free; the real record path builds them:
``DiskTier.record`` → writer thread → commit), a fresh Python process (imports done before the
clock starts) opens the store and reads one stored prefix; the clock stops when its pages are
decoded. Each size is measured in two states:

- ``clean``: the store was closed cleanly and reconciled within the hour: nothing is due;
- ``crashed``: a process died with the store open (a session row of a dead pid is planted), so
  a reconciliation is due: it must run in the background, not before the first page.

For ``crashed`` the child also reports how long the background walk took to finish after open
(it serves requests meanwhile). Target (issue 9): ≤ 0.3 s at 10k pages, flat in store size.

Usage::

    .venv/bin/python benchmarks/bench_l3_open.py [--sizes 1000,10000,50000] [--repeats 5]
        [--scratch DIR] [--out benchmarks/results/l3_open.json]

The same script measures an older build when its package comes first on ``PYTHONPATH`` (the
children inherit it), e.g. the code before issue 9, which reconciled the whole store at open:
``git archive 2a4a0c1 skippy_llama | tar -x -C /tmp/old && PYTHONPATH=/tmp/old ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Pages per record: records are chains of this many pages, committed in one transaction.
PAGES_PER_RECORD = 50
#: Bytes per page: small, so a 50k-page store builds in minutes (payloads stay in SQLite rows;
#: the open path does not depend on payload size).
PAGE_BYTES = 2048

CHILD = r"""
import json, sys, time
from skippy_llama.config import L3Settings
from skippy_llama.tiers.disk import DiskTier
spec = json.loads(sys.argv[1])
keys = [bytes.fromhex(k) for k in spec["keys"]]
settings = L3Settings(mode="fixed", budget="8GiB", directory=spec["dir"],
                      minimum_free="1GiB", compression="none")
t0 = time.perf_counter()
tier = DiskTier(settings)
pages = tier.read(keys)
t1 = time.perf_counter()
walk = None
if spec["wait_walk"]:
    while not tier.reconciliation.ran and time.perf_counter() - t1 < 600:
        time.sleep(0.01)
    walk = time.perf_counter() - t0 if tier.reconciliation.ran else None
tier.close()
print(json.dumps({"open_to_first_page_s": t1 - t0, "pages": len(pages), "walk_done_s": walk}))
"""


def chain(labels: list[str]) -> Any:
    """A record whose page i is keyed by the labels up to i; random (incompressible) payloads."""
    import random

    import xxhash

    from skippy_llama.tiers.records import PageBlob, PrefixRecord

    pages, parent = [], b"\0" * 16
    for label in labels:
        key = xxhash.xxh3_128_digest(parent + label.encode())
        payload = b"SKPG" + random.Random(key).randbytes(PAGE_BYTES - 4)
        tokens = random.Random(label).randbytes(4 * 128)
        pages.append(PageBlob(key, parent, 128, tokens, payload, 128))
        parent = key
    return PrefixRecord("c" * 32, "m1", "name-m1", 128 * len(pages), tuple(pages))


def build(directory: Path, n_pages: int) -> list[str]:
    """A store of ``n_pages`` pages; returns the hex keys of one stored prefix (3 pages)."""
    from skippy_llama.config import L3Settings
    from skippy_llama.tiers.disk import DiskTier

    settings = L3Settings(
        mode="fixed",
        budget="8GiB",
        directory=directory,
        minimum_free="1GiB",
        compression="none",
        writer_queue=64,
    )
    probe: list[str] = []
    with DiskTier(settings, close_at_exit=False) as tier:
        for r in range(n_pages // PAGES_PER_RECORD):
            labels = [f"r{r}p{i}" for i in range(PAGES_PER_RECORD)]
            rec = chain(labels)
            while not tier.record(rec):
                tier.flush(60)
            if r == n_pages // PAGES_PER_RECORD // 2:
                probe = [p.key.hex() for p in rec.pages[:3]]
        assert tier.flush(600)
        if hasattr(tier, "reconcile"):  # (a build before issue 9 reconciles when it opens)
            tier.reconcile()  # a clean, recently reconciled store
    return probe


def plant_dead_session(directory: Path) -> None:
    """What a process killed with the store open leaves: its session row (pid 2**22 + 7 does
    not run; the start time would not match anyway)."""
    row = {"v": 1, "pid": 2**22 + 7, "start": "1", "host": os.uname().nodename, "at": time.time()}
    row["keys"] = []
    with sqlite3.connect(str(directory / "cache.db")) as db:
        db.execute(
            "INSERT OR REPLACE INTO Cache (key, raw, store_time, expire_time, access_time, "
            "access_count, tag, size, mode, filename, value) "
            "VALUES (?, 1, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
            (sqlite3.Binary(b"\x03session:dead"), json.dumps(row).encode()),
        )


def measure(directory: Path, keys: list[str], *, wait_walk: bool) -> dict[str, Any]:
    spec = {"dir": str(directory), "keys": keys, "wait_walk": wait_walk}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        cwd=directory.parent,  # not the checkout: ``-c`` puts the cwd before PYTHONPATH
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pages"] == len(keys), result
    return result


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        run = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return run.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "skippy_llama_dirty": bool(git("status", "--porcelain", "--", "skippy_llama")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scratch", default=None, help="where stores are built (kept)")
    parser.add_argument("--out", default="benchmarks/results/l3_open.json")
    args = parser.parse_args(argv)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="l3open-"))
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_l3_open.py", *sys.argv[1:]]),
        **git_state(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_at_start": os.getloadavg(),
        },
        "page_bytes": PAGE_BYTES,
        "pages_per_record": PAGES_PER_RECORD,
        "sizes": [],
    }
    for n in (int(s) for s in args.sizes.split(",")):
        directory = scratch / f"store-{n}"
        shutil.rmtree(directory, ignore_errors=True)
        t0 = time.perf_counter()
        keys = build(directory, n)
        built = time.perf_counter() - t0
        entry: dict[str, Any] = {"pages": n, "build_s": round(built, 1)}
        for state in ("clean", "crashed"):
            runs = []
            for _ in range(args.repeats):
                if state == "crashed":
                    plant_dead_session(directory)
                runs.append(measure(directory, keys, wait_walk=state == "crashed"))
            times = [r["open_to_first_page_s"] for r in runs]
            entry[state] = {
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "runs": runs,
            }
            walks = [r["walk_done_s"] for r in runs if r["walk_done_s"] is not None]
            if walks:
                entry[state]["background_walk_median_s"] = statistics.median(walks)
            print(
                f"{n:>6} pages {state:>7}: open→first page median "
                f"{entry[state]['median_s'] * 1000:7.1f} ms (min {min(times) * 1000:.1f}, "
                f"max {max(times) * 1000:.1f})"
                + (
                    f"; background walk done after {statistics.median(walks):.2f} s"
                    if walks
                    else ""
                ),
                flush=True,
            )
        report["sizes"].append(entry)
        if args.scratch is None:
            shutil.rmtree(directory, ignore_errors=True)
    report["machine"]["load_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
