"""An L1 prefix continued by L3 pages (append import) vs the same prefix restored from L3 alone.

SmolLM2 (CPU, F16 K/V, flash attention off), a ``--long``-token document whose pages L3 holds.
Before each measured request the live sequence is set to the document's first ``--short`` tokens
followed by something else (an L1 prefix shorter than L3's). The measured request is the whole
document plus four tokens, served in alternating order, ``--reps`` times each (median reported):

- append:  the L1 prefix is kept (cut on the device) and only the pages past it are read from L3
  and append-imported (``skippy_state_seq_append_data``; the patched, certified path);
- l3_only: every page of the prefix is read from L3 and restored with one ``set_data`` (the stock
  path, taken on the same library by a verdict without the ``append_import_exact`` lane: the
  planner's ``Prompt.can_append`` is off, as on an uncertified or stock build).

Each measured request must have been served the way its arm says (append: an L1 prefix and
appended pages; l3_only: neither), or the benchmark stops: both arms must measure what they name.

TTFT is the request's time to its first token (lookup, L3 reads, restore, the suffix's prefill);
the logits of both ways are compared with each other bit for bit. Needs the patched library
(``scripts/setup.sh``'s default build); nothing here is a timed assertion.

The JSON keeps the load average at the start and the end (``load_avg``) and the
``LLCPP_FORCE_*`` settings of ``tests/force_ngl`` (``env``). Usage::

    PYTHONPATH=$PWD/tests/force_ngl LLCPP_FORCE_NGL=0 LLCPP_FORCE_THREADS=1 \\
        .venv/bin/python benchmarks/bench_append.py --reps 10 \\
        --out benchmarks/results/append-s48.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from patched_common import TEXT, provenance
from restore_common import last_logits

from skippy_llama.config import Settings
from skippy_llama.models import resolve_model_path
from skippy_llama.runtime import native_ext
from skippy_llama.runtime.llama import SkippyLlama

OTHER = "Bread and butter, cheese and apples, a jug of cider and a loaf still warm from the oven. "


FIELDS = (
    "tier", "cached_tokens", "l1_tokens", "appended_tokens", "restored_bytes",
    "lookup_ms", "restore_ms", "prefill_ms", "ttft_ms",
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2)")
    parser.add_argument("--long", type=int, default=1792, help="document tokens L3 holds")
    parser.add_argument("--short", type=int, default=1280, help="tokens of it L1 holds")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if native_ext.abi_version() is None:
        print("bench_append: needs the patched llama.cpp build", file=sys.stderr)
        return 2
    model = resolve_model_path(args.model)
    # a shared machine: the load the arms ran under goes with the result
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        l3 = {"mode": "fixed", "budget": "4GiB", "directory": tmp, "minimum_free": "1GiB"}
        # no resident checkpoints (a budget under one page): the L1 prefix is the live
        # sequence's; a checkpoint of the whole document, parked when the set-up request
        # displaces it, would serve the measured request from L1 in both arms
        l1 = {"budget_tokens": 1}
        llm = SkippyLlama(
            str(model), cache_settings=Settings(l1=l1, l3=l3), n_ctx=2048, n_batch=512,
            flash_attn=False, verbose=False,
        )  # fmt: skip
        doc = llm.tokenize((TEXT * 40).encode())[: args.long]
        assert len(doc) == args.long, "the document text is too short"
        other = llm.tokenize(OTHER.encode(), add_bos=False)
        tail = llm.tokenize(b" The keeper", add_bos=False)[:4]
        prompt = doc + tail
        setup = doc[: args.short] + other
        verdict = llm.native_verdict
        if not verdict.append_import:
            print(f"bench_append: the append import is not certified here ({verdict.describe()})",
                  file=sys.stderr)  # fmt: skip
            llm.close()
            return 2
        # the same verdict without the append lane: what an uncertified build plans with
        no_append = dataclasses.replace(
            verdict, lanes=tuple(lane for lane in verdict.lanes if lane != "append_import_exact")
        )
        assert not no_append.append_import
        llm.create_completion(prompt, max_tokens=1)  # cold: L3 records the document's pages
        assert llm.prefix_cache.disk is not None and llm.prefix_cache.disk.flush()
        runs: dict[str, list[dict[str, Any]]] = {"append": [], "l3_only": []}
        logits: dict[str, np.ndarray[Any, Any]] = {}
        for rep in range(args.reps):
            order = ("append", "l3_only") if rep % 2 == 0 else ("l3_only", "append")
            for mode in order:
                llm.create_completion(setup, max_tokens=1)  # the live L1 prefix: short tokens
                # the verdict SkippyLlama read at load (its ``native_verdict``), swapped per arm
                llm.working.verdict = verdict if mode == "append" else no_append
                llm.create_completion(prompt, max_tokens=1)
                event = llm.last_cache_event
                assert event is not None and event.tier == "l3", event
                appended = event.l1_tokens > 0 and event.appended_tokens > 0
                if appended != (mode == "append"):
                    raise SystemExit(f"bench_append: the {mode} arm was served otherwise: {event}")
                logits.setdefault(mode, last_logits(llm))
                runs[mode].append({k: getattr(event, k) for k in FIELDS})
                print(
                    f"{mode:8s} rep {rep}: {event.tier} cached {event.cached_tokens} "
                    f"(L1 {event.l1_tokens} + appended {event.appended_tokens}) "
                    f"restored {event.restored_bytes / 1e6:.1f} MB  ttft {event.ttft_ms:.1f} ms"
                )
        llm.close()
    load_end = os.getloadavg()
    summary = {
        mode: {
            key: statistics.median(r[key] for r in rows)
            for key in ("lookup_ms", "restore_ms", "prefill_ms", "ttft_ms")
        }
        for mode, rows in runs.items()
    }
    for mode, rows in runs.items():
        # the cache's own share of TTFT (L3 reads in the lookup + restore): the suffix prefill
        # is the same 4 tokens both ways, and on shared cores it is what the noise lands on
        summary[mode]["lookup_restore_ms"] = statistics.median(
            r["lookup_ms"] + r["restore_ms"] for r in rows
        )
    ratio = summary["l3_only"]["ttft_ms"] / summary["append"]["ttft_ms"]
    cache_ratio = summary["l3_only"]["lookup_restore_ms"] / summary["append"]["lookup_restore_ms"]
    equal = bool(np.array_equal(logits["append"], logits["l3_only"]))
    print(
        f"median TTFT: append {summary['append']['ttft_ms']:.1f} ms, l3_only "
        f"{summary['l3_only']['ttft_ms']:.1f} ms, ratio {ratio:.2f}x; lookup+restore: append "
        f"{summary['append']['lookup_restore_ms']:.1f} ms, l3_only "
        f"{summary['l3_only']['lookup_restore_ms']:.1f} ms, ratio {cache_ratio:.2f}x; "
        f"logits equal: {equal}; load {load_start[0]:.1f} -> {load_end[0]:.1f}"
    )
    result = {
        **provenance("append"),
        "verdict": verdict.kind,
        # the settings the command ran with that are not in its arguments (tests/force_ngl)
        "env": {k: v for k, v in os.environ.items() if k.startswith("LLCPP_FORCE")},
        "load_avg": {"start": load_start, "end": load_end},
        "long": args.long,
        "short": args.short,
        "median": summary,
        "ttft_ratio_l3_only_over_append": ratio,
        "lookup_restore_ratio_l3_only_over_append": cache_ratio,
        "logits_equal": equal,
        "runs": runs,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
