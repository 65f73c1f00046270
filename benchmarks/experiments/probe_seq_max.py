"""Prefill time of bare llama.cpp contexts by ``n_seq_max`` (unified K/V), side by side.

Each context is built from the same model with ``llama_init_from_model``; every round
prefills one prompt of random tokens in each context, in an order rotated by the round, and the
table gives each context's median paired ratio to the first. Found that 3, 5 and 6 sequences
prefilled 6-7 % slower than 1, 2, 4 or 8 on the 2-core CPU machine, which is why SkippyLlama
rounds its ``n_seq_max`` up to a power of two (``runtime/llama.py``, ``_sequence_count``).

Usage::

    .venv/bin/python benchmarks/experiments/probe_seq_max.py --seqs 1 2 3 4 5 6 8 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.models import resolve_model_path


def context(model: Any, n_seq_max: int, threads: int) -> Any:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
    params.n_seq_max, params.kv_unified = n_seq_max, True
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return llama_cpp.llama_init_from_model(model, params)


def prefill(ctx: Any, tokens: list[int]) -> float:
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), -1, -1, -1)
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        started = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - started
    finally:
        llama_cpp.llama_batch_free(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    loader = llama_cpp.Llama(str(resolve_model_path(args.model)), n_ctx=8, verbose=False)
    contexts = {n: context(loader.model, n, args.threads) for n in args.seqs}
    rng = np.random.default_rng(0)
    times: dict[int, list[float]] = {n: [] for n in contexts}
    for r in range(args.rounds):
        tokens = [int(t) for t in rng.integers(100, loader.n_vocab() - 100, args.tokens)]
        order = args.seqs[r % len(args.seqs) :] + args.seqs[: r % len(args.seqs)]
        for n in order:
            times[n].append(prefill(contexts[n], tokens))
    first = times[args.seqs[0]]
    print(f"| n_seq_max | median prefill | paired ratio to n_seq_max {args.seqs[0]} |")
    print("|---|---|---|")
    for n, got in times.items():
        ratio = statistics.median(a / b for a, b in zip(got, first, strict=True))
        print(f"| {n} | {statistics.median(got):.3f} s | {ratio:.3f} |")
    for ctx in contexts.values():
        llama_cpp.llama_free(ctx)


if __name__ == "__main__":
    main()
