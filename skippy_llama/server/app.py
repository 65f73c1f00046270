"""``create_app``: llama_cpp.server's FastAPI stack serving a ``SkippyLlama``.

The app is llama_cpp.server's: its router (models, tokenize, embeddings), authentication,
error handling, settings and per-model lock. skippy puts its own router first, so its
completion and chat routes (see :mod:`.routes`) answer instead of upstream's, and adds
``/metrics``, ``/v1/kv-cache/*`` and the status page.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import llama_cpp.server.app as upstream
from fastapi import FastAPI
from fastapi.middleware import Middleware
from fastapi.middleware.cors import CORSMiddleware
from llama_cpp.server.settings import ModelSettings, ServerSettings
from starlette_context.middleware import RawContextMiddleware
from starlette_context.plugins.request_id import RequestIdPlugin

from .. import __version__
from ..config import LoadedSettings
from .idle import prepare_when_idle
from .memory import MemoryPlan
from .proxy import ModelSource, SkippyLlamaProxy
from .queue import RequestQueue
from .routes import router
from .state import ServingState
from .worker import ModelThread


@dataclass(frozen=True)
class ServeConfig:
    """What ``skippy-llama serve`` resolved from its flags."""

    source: ModelSource
    cache: LoadedSettings
    model: ModelSettings
    server: ServerSettings
    #: seconds of no requests after which the last reply is re-decoded for its chat's next
    #: turn (:mod:`.idle`); None: never
    idle_repair_after: float | None
    #: what ``--memory-budget`` sized L1 to (None: the model's metadata did not say)
    memory: MemoryPlan | None = None
    #: requests that may wait for the model while one runs (``--max-queue``)
    max_queue: int = 32


def create_app(config: ServeConfig) -> FastAPI:
    """Load the model and build the app. One app per process: llama_cpp.server keeps its
    model proxy and settings in module globals, which its routes read.

    Raises:
        SkippyError: the model or the cache settings cannot be used (before anything listens).
    """
    upstream.set_server_settings(config.server)
    worker = ModelThread()
    try:
        # loaded on the thread every later model call runs on (see .worker)
        proxy = worker.call(SkippyLlamaProxy, [config.model], config.source, config.cache)
    except BaseException:
        worker.shutdown()
        raise
    # upstream's set_llama_proxy() would build a plain LlamaProxy; its routes read this global
    upstream._llama_proxy = proxy
    alias = config.model.model_alias or config.model.model
    state = ServingState(
        proxy=proxy,
        worker=worker,
        cache=config.cache,
        server=config.server,
        model_alias=alias,
        memory=config.memory,
        queue=RequestQueue(config.max_queue),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            async with anyio.create_task_group() as tasks:
                if config.idle_repair_after is not None:
                    tasks.start_soon(prepare_when_idle, state, config.idle_repair_after)
                yield
                tasks.cancel_scope.cancel()
        finally:
            state.close()  # flushes pending L3 writes before the process exits

    app = FastAPI(
        title="skippy-llama",
        version=__version__,
        root_path=config.server.root_path,
        lifespan=lifespan,
        middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
    )
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_credentials=True,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.state.skippy = state
    app.include_router(router)
    app.include_router(upstream.router)
    return app
