"""Routes skippy adds to llama_cpp.server's router, and the completion routes it replaces.

The completion and chat routes are llama_cpp.server's, with three changes: the usage of every
response carries ``prompt_tokens_details.cached_tokens``; ``stream_options.include_usage``
adds OpenAI's final usage chunk to a stream; and each request is counted in the metrics and the
status page's history. Streamed chat calls the model's own ``create_chat_completion`` (the
upstream route calls ``Llama``'s unbound one, which would skip the reply repair for the next
turn). Serialization per model is upstream's: the same lock dependency, ``get_llama_proxy``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import time
from collections.abc import Iterator
from functools import partial
from typing import Annotated, Any, cast

import anyio
from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from llama_cpp.server.app import (
    authenticate,
    bearer_scheme,
    get_llama_proxy,
    prepare_request_resources,
)
from llama_cpp.server.errors import RouteErrorHandler
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ..errors import SkippyError
from ..runtime.recipe import native_status
from ..sizes import parse_size
from ..tiers.l3.report import status_report
from ..tiers.l3.tier import DiskTier
from .page import index_html
from .proxy import ServedLlama
from .queue import Ticket
from .state import ServingState
from .worker import close_on_thread, step

router = APIRouter(route_class=RouteErrorHandler)

#: request fields llama_cpp.server does not pass to the model, plus the one skippy handles
_NOT_MODEL_ARGS = {"n", "best_of", "logit_bias_type", "user", "min_tokens", "stream_options"}


class StreamOptions(BaseModel):
    include_usage: bool = Field(
        default=False, description="Send a last chunk with the usage of the whole request."
    )


class CompletionBody(CreateCompletionRequest):  # type: ignore[misc]
    stream_options: StreamOptions | None = None


class ChatBody(CreateChatCompletionRequest):  # type: ignore[misc]
    stream_options: StreamOptions | None = None


def serving(request: Request) -> ServingState:
    state: ServingState = request.app.state.skippy
    return state


def _usage(llm: ServedLlama) -> dict[str, Any]:
    event = llm.last_cache_event
    prompt = event.prompt_tokens if event is not None else llm.prompt_token_count
    completion = llm.completion_tokens()
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens if event else 0},
    }


def _run(state: ServingState, llm: ServedLlama, endpoint: str, kwargs: dict[str, Any]) -> Any:
    method = llm.create_completion if endpoint == "completions" else llm.create_chat_completion
    llm.last_cache_event = None
    at = time.time()
    try:
        result = method(**kwargs)
    except BaseException:
        state.observe(endpoint, at, llm, "error")
        raise
    usage = result.get("usage")
    if isinstance(usage, dict):
        event = llm.last_cache_event
        usage["prompt_tokens_details"] = {"cached_tokens": event.cached_tokens if event else 0}
    state.observe(endpoint, at, llm, "ok")
    return result


def _relay(
    state: ServingState,
    llm: ServedLlama,
    endpoint: str,
    chunks: Iterator[Any],
    include_usage: bool,
) -> Iterator[Any]:
    at = time.time()
    outcome, last = "error", None
    try:
        for chunk in chunks:
            last = chunk
            yield chunk
        outcome = "ok"
    except GeneratorExit:
        outcome = "cancelled"
        raise
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # the model parks and records the prefix when its generator closes
        state.observe(endpoint, at, llm, outcome)
    if include_usage and last is not None:
        yield {
            "id": last["id"],
            "object": last["object"],
            "created": last["created"],
            "model": last["model"],
            "choices": [],
            "usage": _usage(llm),
        }


def _open_stream(
    state: ServingState, llm: ServedLlama, endpoint: str, kwargs: dict[str, Any], include: bool
) -> Iterator[Any]:
    """The request's chunks (called on the model thread: the call may already prefill)."""
    llm.last_cache_event = None
    method = llm.create_completion if endpoint == "completions" else llm.create_chat_completion
    return _relay(state, llm, endpoint, method(**kwargs), include)


async def _publish(
    request: Request,
    send_chan: Any,
    body: CompletionBody | ChatBody,
    kwargs: dict[str, Any],
    endpoint: str,
    include_usage: bool,
    ticket: Ticket,
) -> None:
    """Stream one request's chunks into ``send_chan``: llama_cpp.server's event publisher, with
    every model step on the model thread and the stream closed there when it ends.

    A client that goes away cancels this task (sse-starlette watches the connection): the
    token being decoded finishes, the generator is closed on the model thread (the model parks
    and records the prefix), and the model lock and the queue place are given back at once.
    """
    state = serving(request)
    try:
        async with contextlib.asynccontextmanager(get_llama_proxy)() as proxy, send_chan:
            llm = prepare_request_resources(body, proxy, body.model, kwargs)
            assert isinstance(llm, ServedLlama)
            held = time.perf_counter()
            chunks = await state.worker.run(
                _open_stream, state, llm, endpoint, kwargs, include_usage
            )
            try:
                while True:
                    done, chunk = await state.worker.run(step, chunks)
                    if done:
                        break
                    await send_chan.send({"data": json.dumps(chunk)})
                await send_chan.send({"data": "[DONE]"})
            finally:
                # shielded inside run(): done also when this task is being cancelled
                await state.worker.run(close_on_thread, chunks)
                state.queue.observe(time.perf_counter() - held)
    finally:
        ticket.release()


def _busy_response(state: ServingState) -> JSONResponse:
    """503 with Retry-After, in OpenAI's error shape (its clients retry after that long)."""
    seconds = state.queue.retry_after()
    line = state.queue.status()
    message = (
        f"the server is busy: {line.inflight} requests are running or waiting for the model "
        f"(--max-queue {line.max_queue}); retry after {seconds} s"
    )
    return JSONResponse(
        {"error": {"message": message, "type": "server_busy", "param": None, "code": None}},
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": str(seconds)},
    )


async def _serve(
    request: Request, body: CompletionBody | ChatBody, kwargs: dict[str, Any], endpoint: str
) -> Any:
    state = serving(request)
    state.last_activity = time.monotonic()
    ticket = state.queue.enter()
    if ticket is None:
        return _busy_response(state)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        send_chan, recv_chan = anyio.create_memory_object_stream[Any](10)
        # upstream's way of disabling pings: a factory of empty messages
        pings = cast(Any, lambda: b"") if state.server.disable_ping_events else None
        return EventSourceResponse(
            recv_chan,
            data_sender_callable=partial(
                _publish, request, send_chan, body, kwargs, endpoint, include, ticket
            ),
            sep="\n",
            ping_message_factory=pings,
            # the place goes back even if the stream never started (a ticket is released once)
            background=BackgroundTask(ticket.release),
        )
    try:
        async with contextlib.asynccontextmanager(get_llama_proxy)() as proxy:
            llm = prepare_request_resources(body, proxy, body.model, kwargs)
            assert isinstance(llm, ServedLlama)
            if await request.is_disconnected():
                raise HTTPException(status.HTTP_400_BAD_REQUEST, detail="Client closed request")
            held = time.perf_counter()
            try:
                return await state.worker.run(_run, state, llm, endpoint, kwargs)
            finally:
                state.queue.observe(time.perf_counter() - held)
    finally:
        ticket.release()


@router.post("/v1/completions", summary="Completion", dependencies=[Depends(authenticate)])
async def create_completion(request: Request, body: CompletionBody) -> Any:
    """OpenAI completions; ``usage.prompt_tokens_details.cached_tokens`` says what was reused."""
    if isinstance(body.prompt, list):
        if len(body.prompt) > 1:
            raise HTTPException(
                status.HTTP_400_BAD_REQUEST, detail="send one prompt per request, not a list"
            )
        body.prompt = body.prompt[0] if body.prompt else ""
    return await _serve(request, body, body.model_dump(exclude=_NOT_MODEL_ARGS), "completions")


@router.post("/v1/chat/completions", summary="Chat", dependencies=[Depends(authenticate)])
async def create_chat_completion(request: Request, body: ChatBody) -> Any:
    """OpenAI chat completions, streaming or not, with cached-token usage."""
    return await _serve(request, body, body.model_dump(exclude=_NOT_MODEL_ARGS), "chat")


# ---------------------------------------------------------------------- operator surface


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format (requests, tokens, tiers, TTFT, fallbacks)."""
    body = await run_in_threadpool(serving(request).metrics.render)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


def _status(state: ServingState) -> dict[str, Any]:
    tier = state.status_tier()
    snap = state.snapshots.get(fresh=True)
    report = status_report(state.cache, snap.l3 or tier.status(), tier)
    llm = state.model()
    report["kv_dtype"] = llm.kv_dtype.to_dict() if llm is not None else None
    # the verdict ServedLlama decided at load: reading it here decodes nothing
    report["native"] = (
        native_status(llm.native_verdict, llm.model_path) if llm is not None else native_status()
    )
    report["l1"] = snap.l1.to_json()
    report["l2"] = snap.l2.to_json() if snap.l2 is not None else {"enabled": False}
    report["tiers"] = snap.others  # the remote tier and any other, through the tier protocol
    report["process"] = {**snap.counters_json(), "requests": state.history.totals()}
    report["server"] = state.summary()
    return report


@router.get("/v1/kv-cache/status", dependencies=[Depends(authenticate)])
async def kv_cache_status(request: Request) -> dict[str, Any]:
    """What ``skippy-llama kv-cache status --json`` prints, plus L1, L2 and this process."""
    return await run_in_threadpool(_status, serving(request))


def _is_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _require_admin(
    request: Request,
    authorization: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> None:
    """Prune and clear: with an API key configured, the key; without one, loopback only."""
    key = serving(request).server.api_key
    if key is not None:
        if authorization is None or authorization.credentials != key:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="Invalid API key")
        return
    if not _is_loopback(request):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail="prune and clear are allowed from loopback only; start the server with "
            "--api-key to allow them remotely with that key",
        )


class PruneBody(BaseModel):
    target: str | None = Field(default=None, description="prune down to this size, e.g. 10GiB")
    model_identity: str | None = Field(default=None, description="only this model's entries")


class ClearBody(BaseModel):
    model_identity: str | None = Field(default=None, description="only this model's entries")


def _change(state: ServingState, action: str, body: PruneBody | ClearBody) -> dict[str, Any]:
    llm = state.model()
    disk = llm.prefix_cache.tier("l3") if llm is not None else None
    if not isinstance(disk, DiskTier):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail=f"L3 is not in use by this server: nothing to {action}",
        )
    try:
        disk.check_model_identity(body.model_identity)
        if isinstance(body, PruneBody):
            target = None
            if body.target is not None:
                try:
                    target = parse_size(body.target)
                except ValueError as exc:
                    raise HTTPException(
                        status.HTTP_400_BAD_REQUEST, detail=f"invalid target {body.target!r}: {exc}"
                    ) from None
            result: Any = disk.prune(target, body.model_identity)
        else:
            result = disk.clear(body.model_identity)
    except SkippyError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail=str(exc)) from None
    out: dict[str, Any] = result.to_json()
    return out


@router.post("/v1/kv-cache/prune", dependencies=[Depends(_require_admin)])
async def kv_cache_prune(request: Request, body: PruneBody) -> dict[str, Any]:
    """Evict LRU L3 entries down to ``target`` (or one model's); between requests."""
    async with contextlib.asynccontextmanager(get_llama_proxy)():
        return await run_in_threadpool(_change, serving(request), "prune", body)


@router.post("/v1/kv-cache/clear", dependencies=[Depends(_require_admin)])
async def kv_cache_clear(request: Request, body: ClearBody) -> dict[str, Any]:
    """Remove every L3 entry (or one model's); between requests."""
    async with contextlib.asynccontextmanager(get_llama_proxy)():
        return await run_in_threadpool(_change, serving(request), "clear", body)


# ---------------------------------------------------------------------- status page


def _page_data(state: ServingState) -> dict[str, Any]:
    snap = state.snapshots.get()
    l3 = snap.l3
    return {
        "server": state.summary(),
        "now": time.time(),
        "totals": state.history.totals(),
        "l1": snap.l1.to_json(),
        "l2": snap.l2.to_json() if snap.l2 is not None else {"enabled": False},
        "l3": {
            "state": l3.state if l3 else "off",
            "reason": l3.reason if l3 else None,
            **(l3.usage.to_json() if l3 else {}),
        },
        "counters": snap.counters_json(),
        "recent": [r.to_json() for r in state.history.recent()],
    }


@router.get("/status.json", include_in_schema=False)
async def page_data(request: Request) -> JSONResponse:
    """The status page's data: totals, tier sizes, counters and recent requests."""
    return JSONResponse(await run_in_threadpool(_page_data, serving(request)))


@router.get("/", include_in_schema=False)
async def status_page() -> HTMLResponse:
    """The operator's status page (no external assets)."""
    return HTMLResponse(index_html())
