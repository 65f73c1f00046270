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
``wall_ms`` show what the first promotion into the arena costs.

Each L2 restore gives its time (``restore_ms``: the seam's execution of the plan, lookup and
pages included), its rate (``restore_gbps``: K/V bytes over that time), where the time went
(``phases_ms``, see ``restore_common.RESTORE_PHASES``) and the max |Δ| of the continuation's logits
against a one-shot cold prefill. ``memcpy_gbps`` is one host memory copy of the same bytes (the
CPU's "bus"), measured in the same process.

    PYTHONPATH=$PWD/tests/force_ngl LLCPP_FORCE_NGL=0 LLCPP_FORCE_THREADS=1 \\
        python benchmarks/bench_arena.py --tokens 3900 --out benchmarks/results/arena-cpu-s45.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

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


def _memcpy_gbps(nbytes: int) -> float:
    """Best of five host copies of ``nbytes``, in GB/s."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return round(nbytes / best / 1e9, 2)


def bench_layout(
    model: str, n: int, runs: int, flash_attn: bool, arms: list[str]
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
            rows: list[dict[str, Any]] = []
            for _ in range(2 + runs):
                row, seconds = timed_request(llm, query, cold, cold_s, phases)
                event = llm.last_cache_event
                assert event is not None
                row["wall_ms"] = round(seconds * 1e3, 2)
                row["restored_bytes"] = event.restored_bytes
                # the phases this request went through only
                row["phases_ms"] = {k: round(v * 1e3, 2) for k, v in phases.items() if v}
                rows.append(row)
            l2 = [r for r in rows if r["tier"] == "l2"]
            out[arm] = {
                "arena": llm.seam.layer_copies,
                "arena_refusal": llm.arena_refusal,
                "l2_restore_ms_median": float(np.median([r["restore_ms"] for r in l2]))
                if l2
                else None,
                "l2_restore_ms_min": min((r["restore_ms"] for r in l2), default=None),
                "l2_gbps_median": float(np.median([r["restore_gbps"] or 0 for r in l2]))
                if l2
                else None,
                "runs": rows,
            }
            llm.close()
            print(arm, json.dumps({k: v for k, v in out[arm].items() if k != "runs"}), flush=True)
    restored = next(
        (r["restored_bytes"] for arm in arms for r in out[arm]["runs"] if r["tier"] == "l2"), 0
    )
    out["memcpy_gbps"] = _memcpy_gbps(restored) if restored else None
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    report: dict[str, Any] = {**report_head(), "layouts": []}
    for fa in args.flash_attn:
        row = bench_layout(model, args.tokens, args.runs, bool(fa), args.arms)
        arms = ", ".join(
            f"{arm} {row[arm]['l2_restore_ms_median']} ms ({row[arm]['l2_gbps_median']} GB/s; "
            f"promoting request {row[arm]['runs'][1]['wall_ms']} ms, promote "
            f"{row[arm]['runs'][1]['phases_ms'].get('promote')} ms)"
            for arm in args.arms
        )
        print(
            f"flash_attn={fa}: cold {row['cold_s']} s; L2 restore median {arms}; "
            f"memcpy {row['memcpy_gbps']} GB/s",
            flush=True,
        )
        report["layouts"].append(row)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
