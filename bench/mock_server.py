"""A scripted OpenAI-compatible server for testing the benchmark: known delays, no model.

Every request streams `max_tokens` tokens: the first `ttft_ms` after the request gets a slot,
then one every `tbt_ms`, grouped `tokens_per_chunk` to an SSE chunk (a chunk is sent when its
last token is due). With `max_concurrency` > 0 at most that many requests are served at once;
the rest wait, and the wait is reported as `usage.queue_time_ms`. A prompt containing
`MOCK_HTTP_500` is answered with HTTP 500; one containing `MOCK_CUT_STREAM` has its connection
dropped half way through the stream. `--final-usage` streams the way llama.cpp's llama-server
does: no usage in any content chunk, the total usage in the chunk that carries the finish reason
(together with the last tokens), no separate usage chunk.

    python -m pdserve.bench.mock_server --port 8123 --ttft-ms 50 --tbt-ms 10 --tokens-per-chunk 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.config.envs import flag_default

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MockConfig:
    """The script every request follows."""

    model: str = "mock-model"
    ttft_ms: float = 50.0
    tbt_ms: float = 10.0
    tokens_per_chunk: int = 1
    max_concurrency: int = 0  # 0: unlimited
    chunk_usage: bool = True  # cumulative usage in every chunk when the client asks for it
    final_usage: bool = False  # llama-server: total usage only in the finishing chunk
    ready_delay_ms: float = 0.0
    warm_delay_ms: float = 0.0  # /ready?warm=1 answers 503 this long after start (pdserve's KV fault-in)
    ready_route: bool = True  # False: no /ready (404), as vLLM and llama-server; /health tells
    api_key: str | None = None  # when set, completions need 'Authorization: Bearer <key>'


class _CutStream(Exception):
    """Raised inside the body iterator so the server drops the connection mid-stream."""


def _prompt_text(body: dict, chat: bool) -> str:
    if chat:
        return " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


def build_app(cfg: MockConfig) -> Starlette:
    """The mock's ASGI app: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/ready`."""
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency > 0 else None
    started = time.monotonic()

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": "mock"}]})

    async def ready(request: Request) -> Response:
        up_ms = (time.monotonic() - started) * 1e3
        ok = up_ms >= cfg.ready_delay_ms
        wants_warm = request.query_params.get("warm", "0").lower() not in ("0", "false")  # as the router reads it
        if ok and wants_warm and up_ms < cfg.warm_delay_ms:
            return JSONResponse({"ready": True, "warm": False}, status_code=503)
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def health(_: Request) -> Response:
        if cfg.ready_route:
            return JSONResponse({"status": "ok"})
        # llama-server's way: 503 while the model loads, 200 after.
        ok = (time.monotonic() - started) * 1e3 >= cfg.ready_delay_ms
        return JSONResponse({"status": "ok" if ok else "loading model"}, status_code=200 if ok else 503)

    async def completions(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return JSONResponse({"error": {"message": "bad api key", "type": "auth_error"}}, status_code=401)
        body = json.loads(await request.body())
        prompt = _prompt_text(body, chat)
        if "MOCK_HTTP_500" in prompt:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}}, status_code=500)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        opts = body.get("stream_options") or {}
        stream = _stream(chat, n, len(prompt.split()), cut="MOCK_CUT_STREAM" in prompt,
                         include_usage=bool(opts.get("include_usage")),
                         chunk_usage=cfg.chunk_usage and not cfg.final_usage and bool(opts.get("continuous_usage_stats")))
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _stream(chat: bool, n: int, prompt_tokens: int, cut: bool, include_usage: bool, chunk_usage: bool):
        loop = asyncio.get_running_loop()
        received = loop.time()
        if slots is not None:
            await slots.acquire()
        try:
            start = loop.time()
            queue_ms = (start - received) * 1e3
            rid = f"mock-{int(received * 1e6)}"

            def event(text: str | None, finish: str | None = None, done_tokens: int | None = None) -> bytes:
                if chat:
                    delta = {} if text is None else {"content": text}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text or "", "finish_reason": finish}
                obj: dict = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                             "model": cfg.model, "choices": [choice]}
                if chunk_usage and done_tokens is not None:
                    obj["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done_tokens,
                                    "total_tokens": prompt_tokens + done_tokens}
                return f"data: {json.dumps(obj)}\n\n".encode()

            if chat:  # like OpenAI and vLLM: a role-only chunk first, which is not a token
                yield f"data: {json.dumps({'id': rid, 'model': cfg.model, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}, 'finish_reason': None}]})}\n\n".encode()
            # Token i (0-based) is due at start + ttft + i * tbt; the first token goes alone.
            bounds = [0, 1] + list(range(1 + cfg.tokens_per_chunk, n, cfg.tokens_per_chunk))
            bounds = sorted(set(b for b in bounds if b < n)) + [n]
            for lo, hi in itertools.pairwise(bounds):
                if cut and lo >= n // 2:
                    raise _CutStream("scripted cut")
                due = start + (cfg.ttft_ms + (hi - 1) * cfg.tbt_ms) / 1e3
                await asyncio.sleep(max(0.0, due - loop.time()))
                if hi < n:
                    yield event("tok " * (hi - lo), done_tokens=hi)
                    continue
                # The last token, the finish, the usage and [DONE] leave in one write, so the
                # stream ends when its last token is due.
                if cfg.final_usage:
                    last = json.loads(event("tok " * (hi - lo), "length")[6:])
                    last["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                     "total_tokens": prompt_tokens + n}
                    yield f"data: {json.dumps(last)}\n\n".encode() + b"data: [DONE]\n\n"
                    return
                tail = [event("tok " * (hi - lo), done_tokens=hi), event(None if chat else "", "length", n)]
                if include_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                             "total_tokens": prompt_tokens + n, "queue_time_ms": queue_ms}
                    tail.append(f"data: {json.dumps({'id': rid, 'model': cfg.model, 'choices': [], 'usage': usage})}\n\n".encode())
                yield b"".join(tail) + b"data: [DONE]\n\n"
        finally:
            if slots is not None:
                slots.release()

    routes = [
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
    ]
    if cfg.ready_route:
        routes.append(Route("/ready", ready))
    return Starlette(routes=routes)


_DEFAULT = MockConfig()


@contextlib.contextmanager
def launch(*args: str, host: str = "127.0.0.1", ready_timeout_s: float = 20.0) -> Iterator[str]:
    """Run the mock in a subprocess (its own process: its timing is not disturbed by the
    caller's event loop) on a free port; yield its base URL once `/ready` answers, then stop it."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    base_url = f"http://{host}:{port}"
    # A file, not a pipe: a pipe nobody reads would block the server once full.
    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_server", "--host", host, "--port", str(port),
                                 *args], cwd=root, stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            _wait_ready(proc, base_url, err_file, ready_timeout_s)
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _wait_ready(proc: subprocess.Popen, base_url: str, err_file, ready_timeout_s: float) -> None:
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            err_file.seek(0)
            raise RuntimeError(f"mock server exited: {err_file.read().decode(errors='replace')[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(base_url + "/ready", timeout=1.0).status_code
            if status == 404:  # --no-ready-route
                status = httpx.get(base_url + "/health", timeout=1.0).status_code
            if status == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"mock server not ready at {base_url} after {ready_timeout_s}s")
        time.sleep(0.05)



def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.mock_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=flag_default("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=flag_default("port", 8000))
    p.add_argument("--model", default=flag_default("model", _DEFAULT.model))
    p.add_argument("--ttft-ms", type=float, default=flag_default("ttft-ms", _DEFAULT.ttft_ms))
    p.add_argument("--tbt-ms", type=float, default=flag_default("tbt-ms", _DEFAULT.tbt_ms))
    p.add_argument("--tokens-per-chunk", type=int, default=flag_default("tokens-per-chunk", 1))
    p.add_argument("--max-concurrency", type=int, default=flag_default("max-concurrency", 0),
                   help="requests served at once (0: unlimited); the rest queue")
    p.add_argument("--no-chunk-usage", action="store_true",
                   help="never put cumulative usage in chunks (clients count one token per chunk)")
    p.add_argument("--final-usage", action="store_true",
                   help="stream like llama-server: total usage only in the chunk with the finish reason")
    p.add_argument("--ready-delay-ms", type=float, default=flag_default("ready-delay-ms", 0.0),
                   help="/ready (or, with --no-ready-route, /health) answers 503 for this long after start")
    p.add_argument("--warm-delay-ms", type=float, default=flag_default("warm-delay-ms", 0.0),
                   help="/ready?warm=1 answers 503 for this long after start, as pdserve's router while "
                        "its workers' KV caches fault in")
    p.add_argument("--no-ready-route", action="store_true",
                   help="serve no /ready, as vLLM and llama-server: /health says when the model is loaded")
    p.add_argument("--api-key", default=flag_default("api-key", ""), help="require this bearer token")
    args = p.parse_args(argv)
    if args.tokens_per_chunk < 1:
        p.error("--tokens-per-chunk must be >= 1")
    cfg = MockConfig(model=args.model, ttft_ms=args.ttft_ms, tbt_ms=args.tbt_ms,
                     tokens_per_chunk=args.tokens_per_chunk, max_concurrency=args.max_concurrency,
                     chunk_usage=not args.no_chunk_usage, final_usage=args.final_usage,
                     ready_delay_ms=args.ready_delay_ms, warm_delay_ms=args.warm_delay_ms,
                     ready_route=not args.no_ready_route,
                     api_key=args.api_key or None)
    import uvicorn

    uvicorn.run(build_app(cfg), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
