#!/usr/bin/env python
"""Check the matrix's once-inexact cell: an L1 hit with a Q8_0 K/V cache (issue 13).

Before ``dfe8345`` (quantized K/V in llama.cpp device checkpoints: 1/32 of each range copied)
rows 16..127 differed; with host checkpoints for quantized caches no row differs.

Runs the small matrix's ``documents`` requests (tides q1, bread q1, tides q2) on a SkippyLlama
with L1 only and on a cold ``Llama``, then compares the working sequence's K/V after tides q2
(128 tokens from an L1 checkpoint + the suffix) with the cold prefill's, row by row. Layer-0 K
depends only on a token and its position, so rows that differ there hold other tokens' K.

    .venv/bin/python benchmarks/experiments/probe_q8_l1.py            # q8_0: none (16..127 before the fix)
    .venv/bin/python benchmarks/experiments/probe_q8_l1.py f16 on     # F16, flash attention on: none
"""

from __future__ import annotations

import sys

import numpy as np

from skippy_llama.matrix import workloads
from skippy_llama.matrix.config import PRESETS, cpu_backend
from skippy_llama.matrix.runner import TimedCold, TimedSkippy, ask, llama_kwargs, tier_settings
from skippy_llama.models import resolve_model_path
from skippy_llama.runtime import native
from skippy_llama.state import parse_state


def main() -> None:
    kv = sys.argv[1] if len(sys.argv) > 1 else "q8_0"
    flash = sys.argv[2] if len(sys.argv) > 2 else "auto"
    cfg = PRESETS["small"].with_overrides(flash_attn=flash)
    model = str(resolve_model_path(None))
    kwargs = llama_kwargs(cfg, cpu_backend(False), kv)  # type: ignore[arg-type]
    llm = TimedSkippy(model, cache_settings=tier_settings(cfg, "l1", None), **kwargs)
    cold = TimedCold(model, **kwargs)
    requests = workloads.documents(cfg)[:3]
    for req in requests:
        got = ask(llm, req, [], 8)
    want = ask(cold, requests[2], [], 8)
    event = llm.last_cache_event
    assert event is not None
    print(
        f"{kv}, flash {kwargs['flash_attn']}: tides q2 from {event.tier}, {event.cached_tokens} cached"
    )
    print(f"  skippy {got.text!r}\n  cold   {want.text!r}")
    # compare the prompt's cells (the reply's cells are decoded one at a time on both sides)
    n = want.prompt_tokens
    a = parse_state(bytes(native.get_seq_state(llm.ctx, 0)))
    b = parse_state(bytes(native.get_seq_state(cold.ctx, 0)))
    for layer in (0, 1, a.layout.n_layer - 1):
        rows = np.nonzero((a.k[layer][:n] != b.k[layer][:n]).any(axis=1))[0]
        span = f"{rows.min()}..{rows.max()}" if len(rows) else "-"
        print(f"  layer {layer}: {len(rows)} of {n} K rows differ ({span})")
    llm.close()
    cold.close()


if __name__ == "__main__":
    main()
