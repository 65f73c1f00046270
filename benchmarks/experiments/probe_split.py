"""Probe: do a prompt's last logits depend on where its prefill is split (CPU, flash attention off)?

SkippyLlama reuses cached cells at any token boundary on the CPU with flash attention off
(``SkippyLlama._canonical_granule`` returns 1 there), which is exact only if a prefill's results
do not depend on how the prompt is split into batches. This decodes a 171-token prompt in one
batch, then split at every point k in [100, 170) (k tokens, then the rest), and counts the splits
whose last logits differ (max |delta|). Plain ``llama_cpp.Llama`` only, no cache.

    .venv/bin/python benchmarks/experiments/probe_split.py smol|gemma|PATH.gguf [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.models import default_model_path, gemma3_model_path
from skippy_llama.runtime import native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="smol, gemma or a GGUF path")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    named: dict[str, Callable[[], Path]] = {"smol": default_model_path, "gemma": gemma3_model_path}
    path = str(named[args.model]() if args.model in named else args.model)
    llm = llama_cpp.Llama(path, n_ctx=1024, n_batch=512, flash_attn=False, verbose=False)
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, 20000, 171)]

    def last_logits(splits: list[int]) -> np.ndarray[Any, Any]:
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        start = 0
        for end in [*splits, len(tokens)]:
            llm.eval(tokens[start:end])
            start = end
        return native.last_logits(llm.ctx, llm.n_vocab())

    cold = last_logits([])
    differing = []
    for k in range(100, 170):
        delta = float(np.abs(last_logits([k]) - cold).max())
        if delta:
            differing.append({"split": k, "max_abs_dlogit": delta})
    report = {
        "model": Path(path).name,
        "splits": 70,
        "differing": len(differing),
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "cases": differing,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
