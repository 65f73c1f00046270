"""Restore-point exactness of every synthetic recurrent/hybrid family (issue 46, DESIGN.md §13).

Writes each family of ``skippy_llama.testing.synthetic`` to a temporary directory and runs
``skippy_llama.runtime.restore_probe`` on it with flash attention off (plain ``Llama``'s default)
and on: at prompt ends 1, 17, 64 and 100 a whole-sequence capture (host blob and device
checkpoint) is restored into a cleared context and a 24-token suffix decoded; its logits are
compared bit for bit with a cold prefill. Takes about a second on two cores. ``--model`` adds a
real GGUF (SmolLM2, say) as a pure-attention reference.

Usage::

    .venv/bin/python benchmarks/probe_restore_points.py --out benchmarks/results/restore-points-cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import llama_cpp
from patched_common import provenance

from skippy_llama.runtime.native import backend_name
from skippy_llama.runtime.restore_probe import probe_restore_points
from skippy_llama.testing.synthetic import FAMILIES, Shape, write_model

_quiet = llama_cpp.llama_log_callback(lambda *_: None)  # kept: llama.cpp holds the pointer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", action="append", default=[], help="also probe this GGUF")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llama_cpp.llama_log_set(_quiet, None)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [(f, write_model(Path(tmp) / f"{f}.gguf", f)) for f in FAMILIES]
        paths += [("reference", Path(m)) for m in args.model]
        for family, path in paths:
            for flash in (False, True):
                report = probe_restore_points(path, n_threads=args.threads, flash_attn=flash)
                row = {"family": family, "memory": FAMILIES.get(family, "attention")}
                row.update(report.as_dict())
                results.append(row)
                print(
                    f"{family:14s} flash={int(flash)} exact={report.exact} "
                    f"restore==split everywhere="
                    f"{all(p.restore_matches_split for p in report.points)}"
                )
    out = {
        **provenance("probe_restore_points.py"),
        "backend": backend_name(),
        "shape": vars(Shape()),
        "results": results,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
