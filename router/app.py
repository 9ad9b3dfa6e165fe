"""The router's HTTP face: an OpenAI-compatible starlette app.

Handlers validate at the edge (every client mistake is a 4xx OpenAI envelope), hand the work
to `RouterService`, and stream or collect the result. A client that goes away, streaming or
not, is noticed by a task watching `http.disconnect`, and its request is aborted on the workers.
Answers name the workers that served them (router/served_by.py); `/` is the chat page
(router/chat_page.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.config.log_limits import RateLimitedLog
from pdserve.config.router import RouterConfig
from pdserve.protocol.block_hash import hash_blocks
from pdserve.router.chat_page import ChatPage
from pdserve.router.errors import APIError, bad_request
from pdserve.router.metrics import CONTENT_TYPE
from pdserve.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    encode,
    parse_request,
    stop_strings,
)
from pdserve.router.registry import Hasher
from pdserve.router.render import ChatRenderer, CompletionRenderer, Renderer, make_usage
from pdserve.router.requests import RequestState
from pdserve.router.served_by import route_comment, route_headers
from pdserve.router.service import RouterService
from pdserve.router.tracing import request_trace
from pdserve.text.loader import default_detokenizer_factory

log = logging.getLogger(__name__)
# Refusals are the client's doing: a flood of bad requests must cost a count, not a disk.
_log_refused = RateLimitedLog(log, logging.INFO, per_seconds=10.0)
_log_gone = RateLimitedLog(log, logging.INFO, per_seconds=10.0)

_DEFAULT = object()
CLIENT_GONE = 499  # nginx's "client closed request": only ever seen in logs and metrics


def create_app(
    config: RouterConfig,
    tokenizer: Any,
    *,
    detokenizer_factory: Callable[[Any], Any] = default_detokenizer_factory,
    hasher: Hasher | None | object = _DEFAULT,
) -> Starlette:
    """The router app; its lifespan binds the control socket. `app.state.service` is the core."""
    service = RouterService(
        config,
        tokenizer,
        detokenizer_factory=detokenizer_factory,
        hasher=hash_blocks if hasher is _DEFAULT else hasher,  # type: ignore[arg-type]
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.drain(config.drain_timeout)
            await service.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *ChatPage().routes(),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.service = service
    return app


def _service(request: Request) -> RouterService:
    return request.app.state.service


# --- small routes ----------------------------------------------------------------------------


async def health(request: Request) -> Response:
    alive = _service(request).control.alive
    return JSONResponse({"status": "ok" if alive else "down"}, status_code=200 if alive else 503)


async def ready(request: Request) -> Response:
    svc = _service(request)
    if svc.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not svc.registry.has_path():
        return JSONResponse(
            {"status": "no workers", "workers": len(svc.registry.workers)}, status_code=503
        )
    expected, seen = svc.config.expect_workers, len(svc.registry.ever_registered)
    if seen < expected:  # e.g. `pdserve up` before its prefill worker is in: a burst would all fall back
        return JSONResponse({"status": "starting", "workers": seen, "expected": expected}, status_code=503)
    workers = len(svc.registry.workers)
    cold = sorted(w.worker_id for w in svc.registry.workers.values() if not w.kv_resident)
    if cold and request.query_params.get("warm", "0").lower() not in ("0", "false"):
        # ?warm=1: also wait for every worker's KV cache to be faulted in (benchmarks, or a probe
        # that would rather wait seconds than send a first burst to a cold cache).
        return JSONResponse({"status": "warming", "workers": workers, "cold": cold}, status_code=503)
    return JSONResponse({"status": "ready", "workers": workers, "warm": not cold})


async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE)


async def models(request: Request) -> Response:
    svc = _service(request)
    try:
        svc.check_auth(request.headers.get("authorization"))
    except APIError as exc:
        return exc.response()
    card = ModelCard(svc.config.served_model_name, int(time.time()))
    return Response(encode(ModelList([card])), media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = APIError(
            405,
            f"method {request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
        )
    else:
        err = APIError(exc.status_code, str(exc.detail))
    err.headers.update(exc.headers or {})
    return err.response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error; see the router's log").response()


# --- generation ------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, ChatCompletionRequest, "chatcmpl-", ChatRenderer)


async def completions(request: Request) -> Response | SSEResponse:
    return await _generate(request, CompletionRequest, "cmpl-", CompletionRenderer)


async def read_body(request: Request, limit: int, hold: Callable[[int], None]) -> bytes:
    """The request body, refusing (413) more than `limit` bytes, declared or streamed. `hold`
    counts the bytes against the router-wide body budget (or refuses): a declared length at
    once, before anything is read, a chunked body chunk by chunk."""
    declared = request.headers.get("content-length")
    size = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("Content-Length is not a number") from None
        if size > limit:
            raise APIError(
                413,
                f"request body of {size} bytes exceeds the limit of {limit}",
                code="body_too_large",
            )
        hold(size)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(
                413, f"request body exceeds the limit of {limit} bytes", code="body_too_large"
            )
        if size is None:
            hold(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


async def _generate(
    request: Request, kind: type, id_prefix: str, renderer_cls: type[Renderer]
) -> Response | SSEResponse:
    svc = _service(request)
    arrival = time.monotonic()
    request_id = id_prefix + uuid.uuid4().hex
    trace = request_trace(request_id, request.scope["path"])
    slot = None
    state: RequestState | None = None
    try:
        svc.check_auth(request.headers.get("authorization"))
        slot = svc.admit()
        body = await read_body(request, svc.config.max_body_bytes, slot.hold_body)
        req = parse_request(body, kind)
        svc.check_model(req.model)
        structured = await svc.structured_output(req)
        with trace.span("tokenize"):
            prompt_ids, prompt_param = await svc.prompt_ids(req, len(body))
        params = svc.sampling_params(req, len(prompt_ids), prompt_param, structured)
        want_logprobs = params[0].logprobs is not None
        trace.describe(model=req.model, n=len(params), prompt_tokens=len(prompt_ids),
                       max_tokens=params[0].max_tokens, stream=bool(req.stream))
        with trace.span("route"):  # prefix hashes for routing, workers picked, work sent
            await svc.prefix_hashes(prompt_ids)
            state = svc.submit(
                request_id, prompt_ids, params, stop_strings(req), want_logprobs, arrival, trace
            )
            trace.routed(state.choices)
        renderer = renderer_cls(
            request_id, svc.config.served_model_name, len(params), svc.tokenizer, want_logprobs,
            tool_calls=svc.tool_plan(req) is not None,
        )
    except APIError as exc:
        if slot is not None:
            slot.release()
        svc.metrics.requests.labels(str(exc.status)).inc()
        trace.end(str(exc.status))
        _log_refused("request %s refused: %d %s", request_id, exc.status, exc.message)
        return exc.response()
    except ClientDisconnect:
        if slot is not None:
            slot.release()
        svc.metrics.requests.labels(str(CLIENT_GONE)).inc()
        trace.end(str(CLIENT_GONE))
        _log_gone("request %s: client went away while sending its body", request_id)
        return Response(status_code=CLIENT_GONE)
    except Exception:  # a bug: answer 500, and never keep the slot nor the workers busy
        log.exception("request %s: unexpected error before its answer began", request_id)
        if state is not None:
            state.close("500")
        else:
            svc.metrics.requests.labels("500").inc()
        trace.end("500")  # a no-op once state.close ended it
        if slot is not None:
            slot.release()
        return APIError(500, "internal server error; see the router's log").response()
    except BaseException:  # cancelled: the same release, then let the cancellation go on
        if state is not None:
            state.close(str(CLIENT_GONE))
        trace.end(str(CLIENT_GONE))
        if slot is not None:
            slot.release()
        raise
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        outcome = [str(CLIENT_GONE)]  # until the stream says otherwise
        held = slot

        def on_close() -> None:
            state.close(outcome[0])
            held.release()

        return SSEResponse(
            _sse(state, renderer, include_usage, outcome), on_close, route_headers(state.choices)
        )
    try:
        return await _collect(state, renderer, request.receive)
    except Exception:
        log.exception("request %s: unexpected error while collecting", request_id)
        return APIError(500, "internal server error; see the router's log").response()
    finally:
        state.close("500")  # a no-op when _collect closed it; else an exception escaped it
        slot.release()


# Characters that JSON leaves raw inside strings but that line readers splitting the way
# str.splitlines does (httpx's iter_lines, among others) take for line ends: escaped, an SSE
# event stays one line for every client.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_data(payload: bytes) -> bytes:
    """One `data:` event of a JSON payload, with U+2028, U+2029 and U+0085 escaped."""
    for raw, escaped in _LINE_BREAKS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"


async def _sse(
    state: RequestState, renderer: Renderer, include_usage: bool, outcome: list[str]
) -> AsyncIterator[bytes]:
    for first in renderer.start():
        yield sse_data(first)
    try:
        async for delta in state.deltas():
            chunk = renderer.chunk(delta)
            if chunk is not None:
                yield sse_data(chunk)
        if include_usage:
            yield sse_data(renderer.usage_chunk(make_usage(*state.usage())))
        outcome[0] = "200"
    except APIError as exc:
        outcome[0] = str(exc.status)
        log.warning("request %s failed while streaming: %s", state.request_id, exc.message)
        yield sse_data(msgspec.json.encode(exc.body()))
    yield route_comment(state.choices)  # the final workers: a choice may have migrated
    yield b"data: [DONE]\n\n"


async def _collect(state: RequestState, renderer: Renderer, receive: Receive) -> Response:
    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        _log_gone("request %s: client disconnected while waiting", state.request_id)
        state.fail(APIError(CLIENT_GONE, "client disconnected", code="client_disconnected"))

    watcher = asyncio.create_task(watch_disconnect())
    try:
        async for delta in state.deltas():
            renderer.add(delta)
    except APIError as exc:
        state.close(str(exc.status))
        log.warning("request %s failed: %d %s", state.request_id, exc.status, exc.message)
        return exc.response()
    finally:
        watcher.cancel()
    state.close("200")
    return Response(
        renderer.body(make_usage(*state.usage())),
        media_type="application/json",
        headers=route_headers(state.choices),
    )


class SSEResponse:
    """A text/event-stream response that notices a client disconnect even between chunks.

    Starlette's StreamingResponse only notices it on the next write under ASGI spec 2.4; a
    request waiting for a slow token must be aborted at once. `on_close` runs exactly once.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self.on_close = on_close
        self.headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream(cancel: anyio.CancelScope) -> None:
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no"),
                            *self.headers,
                        ],
                    }
                )
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away mid-write
                pass
            cancel.cancel()

        async def watch(cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg.cancel_scope)
                tg.start_soon(watch, tg.cancel_scope)
        finally:
            self.on_close()
