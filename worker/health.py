"""A worker's HTTP probes on their own thread: /health (liveness) and /ready (readiness).

Liveness means the engine loop is turning: it fails when the loop has not ticked for
`stuck_after` seconds, whatever the router is doing. Readiness means the model is loaded and the
router has accepted our registration. /metrics shows the worker's counters as Prometheus text.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)


class HealthServer:
    def __init__(self, host: str, port: int, live: Callable[[], bool], ready: Callable[[], bool],
                 info: Callable[[], dict]) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?")[0]
                if path == "/health":
                    ok = owner.live()
                elif path == "/ready":
                    ok = owner.ready()
                elif path == "/info":
                    ok = True
                else:
                    self._send(404, {"error": "not found"})
                    return
                self._send(200 if ok else 503, owner.info() | {"ok": ok})

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
                log.debug("health: " + format, *args)

        self.live, self.ready, self.info = live, ready, info
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.address = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which may never have run
            self.server.shutdown()
        self.server.server_close()
