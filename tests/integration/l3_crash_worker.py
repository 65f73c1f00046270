"""A model-free L3 writer for the crash tests: check the store as a fresh process, then write
synthetic records through ``DiskTier`` (the real writer thread, commit and eviction) until killed.

Run as ``python l3_crash_worker.py SPEC_JSON``. SPEC keys: ``dir`` (the store), ``log`` (a file
this process appends each record's index to *before* recording it, so the checker knows every
record that may be in the store), ``start`` (first record index), ``fsize`` (optional: an
RLIMIT_FSIZE in bytes, for the disk-full test), ``big`` (optional: indices whose question page
is ``big`` bytes), ``count`` (optional: stop after that many records instead of running on),
``budget`` (optional: the store's byte budget instead of the 64 MiB floor).

Prints one JSON line ``{"check": {...}}`` after checking, then ``{"ready": true}`` before
writing, and ``{"done": {...}}`` when ``count`` records were written.
"""

from __future__ import annotations

import json
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import xxhash

from skippy_llama.config import L3Settings
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.records import PageBlob, PrefixRecord

ROOT = b"\0" * 16
KiB = 1 << 10
#: Documents every record starts with (shared, deduplicated pages), and page sizes that put some
#: payloads in the database row and some in value files (diskcache's threshold is 32 KiB).
DOCS = 4
SIZES = (8 * KiB, 48 * KiB, 160 * KiB)


def record(i: int, big: dict[int, int] | None = None) -> PrefixRecord:
    """Record ``i``: a document page then a question page; deterministic payloads per key."""
    pages, parent = [], ROOT
    for j, label in enumerate((f"doc{i % DOCS}", f"q{i}")):
        key = xxhash.xxh3_128_digest(parent + label.encode())
        size = (big or {}).get(i, SIZES[i % len(SIZES)]) if j else SIZES[1]
        payload = b"SKPG" + random.Random(key).randbytes(size - 4)
        tokens = random.Random(label).randbytes(4 * 128)
        pages.append(PageBlob(key, parent, 128, tokens, payload, 128))
        parent = key
    return PrefixRecord("c" * 32, "m1", "Model m1", 256, tuple(pages))


#: The store's budget unless ``budget`` is given: the floor, which a long kill loop writes past,
#: so eviction runs too.
FLOOR = "64MiB"


def settings(directory: str, budget: str = FLOOR) -> L3Settings:
    return L3Settings(
        mode="fixed",
        budget=budget,
        directory=directory,
        minimum_free="1GiB",
        compression="none",
    )


def check(tier: DiskTier, indices: list[int], big: dict[int, int]) -> dict[str, Any]:
    """Read every record that may be stored: each page served must be exactly its payload."""
    served = wrong = 0
    for i in indices:
        rec = record(i, big)
        pages = tier.read([p.key for p in rec.pages])
        for page, want in zip(pages, rec.pages, strict=False):
            served += 1
            wrong += int(page != want.payload)
    return {"state": tier.state, "records": len(indices), "served": served, "wrong": wrong}


def main(spec: dict[str, Any]) -> None:
    if spec.get("fsize"):
        # a write past the limit fails with EFBIG (a real kernel error at the OS boundary)
        # instead of killing the process with SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    big = {int(k): int(v) for k, v in spec.get("big", {}).items()}
    log = Path(spec["log"])
    tier = DiskTier(settings(spec["dir"], spec.get("budget", FLOOR)))
    written = [int(x) for x in log.read_text().split()] if log.exists() else []
    print(json.dumps({"check": check(tier, written, big)}), flush=True)
    print(json.dumps({"ready": True}), flush=True)
    i = spec["start"]
    stop = i + spec["count"] if spec.get("count") else None
    recorded = []
    with log.open("a") as f:
        while stop is None or i < stop:
            f.write(f"{i}\n")
            f.flush()
            recorded.append(tier.record(record(i, big)))
            tier.flush(30)
            i += 1
    time.sleep(0)
    status = tier.status()
    out = {
        "recorded": recorded,
        "state": tier.state,
        "activity": status.process_activity.to_json(),
        "check": check(tier, list(range(spec["start"], i)), big),
    }
    tier.close()
    print(json.dumps({"done": out}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
