"""A worker's HTTP probes on their own thread: /health (liveness), /ready (readiness), /info,
and /metrics (Prometheus; a pipeline's stages, worker/stage_metrics.py).

Liveness means the engine loop is turning: it fails when the loop has not ticked for
`stuck_after` seconds, whatever the router is doing. Readiness means the model is loaded and the
router has accepted our registration. /info is the worker's counters as JSON.

The port is unauthenticated, so a connection costs what the router's HTTP edge lets one cost
(router/http_server.py): one asyncio event loop serves every connection (an idle one holds a
coroutine, never a thread), at most `MAX_CONNECTIONS` are open (more are answered 503 and closed),
the request head must arrive whole within `HEADER_TIMEOUT_S` and `MAX_HEAD_BYTES` (else 408 / 431),
and a connection answers one request and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 5.0  # the whole request head, from the connection's accept
MAX_CONNECTIONS = 64  # open at once; a probe needs one
MAX_HEAD_BYTES = 8192
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
WRITE_TIMEOUT_S = 5.0  # a peer that does not read its answer is cut off


class HealthServer:
    """Binds at construction (so `address` is known), serves from `start` until `close`."""

    def __init__(self, host: str, port: int, live: Callable[[], bool], ready: Callable[[], bool],
                 info: Callable[[], dict], metrics: Callable[[], bytes] | None = None) -> None:
        self.live, self.ready, self.info, self.metrics = live, ready, info, metrics
        self._sock = socket.create_server((host, port), backlog=128)
        self.address = f"http://{host}:{self._sock.getsockname()[1]}"
        self.open_connections = 0  # the serving thread's
        self.refused = 0  # connections over MAX_CONNECTIONS
        self._loop = asyncio.new_event_loop()
        self._serving = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        self._serving.wait(5.0)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._sock.close()

    # --- the serving thread ----------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, sock=self._sock, limit=MAX_HEAD_BYTES))
        self._serving.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.sleep(0))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        try:
            if self.open_connections > MAX_CONNECTIONS:
                self.refused += 1
                await self._answer(writer, 503, {"error": f"too many connections (limit {MAX_CONNECTIONS})"})
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
            except (asyncio.TimeoutError, TimeoutError):
                await self._answer(writer, 408, {"error": f"request head not received within {HEADER_TIMEOUT_S} s"})
                return
            except asyncio.LimitOverrunError:
                await self._answer(writer, 431, {"error": f"request head over {MAX_HEAD_BYTES} bytes"})
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            try:
                code, body = self._route(head)
            except Exception as exc:  # a probe's bug answers 500; the server goes on
                log.exception("health: %r failed", head[:80])
                code, body = 500, {"error": type(exc).__name__}
            await self._answer(writer, code, body)
        finally:
            self.open_connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _route(self, head: bytes) -> tuple[int, dict | bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, {"error": "not an HTTP request"}
        if parts[0] != b"GET":
            return 405, {"error": "only GET"}
        path = parts[1].split(b"?")[0]
        if path == b"/health":
            ok = self.live()
        elif path == b"/ready":
            ok = self.ready()
        elif path == b"/info":
            ok = True
        elif path == b"/metrics" and self.metrics is not None:
            return 200, self.metrics()
        else:
            return 404, {"error": "not found"}
        return (200 if ok else 503), self.info() | {"ok": ok}

    async def _answer(self, writer: asyncio.StreamWriter, code: int, body: dict | bytes) -> None:
        # /metrics answers Prometheus's text format; everything else JSON.
        data, kind = (body, PROMETHEUS_TEXT) if isinstance(body, bytes) else (json.dumps(body).encode(), "application/json")
        head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + data)
        with contextlib.suppress(Exception):  # a peer that went away or does not read
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
