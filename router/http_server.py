"""The router's HTTP/1.1 edge: uvicorn's h11 protocol with deadlines, a connection cap and strict
framing, answering every refusal with the OpenAI error envelope.

Per connection, in the order a request arrives (docs/http_edge.md has the full table):

    connect ──> header deadline ──> h11.Request ──> body deadline ──> EndOfMessage ──> app
      │ over --max-connections: 503      │ framing checked: 400 / 431 / 501
      │                                  │ headers slower than --header-timeout: 408
      │                                  │ body slower than --body-timeout: 408
      └─ every refusal closes the connection; h11's own parse errors get the envelope too

uvicorn's `H11Protocol` does the HTTP work; this subclass only adds the limits and replaces its
plain-text "Invalid HTTP request received." with an enveloped answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.config.log_limits import RateLimitedLog
from pdserve.config.router import RouterConfig

log = logging.getLogger(__name__)
_log_refused = RateLimitedLog(log, logging.INFO, per_seconds=10.0)
_DEFAULTS = RouterConfig()
_uvicorn_warn = RateLimitedLog(logging.getLogger("uvicorn.error"), logging.WARNING, 10.0)

_CODES = {
    400: "invalid_http_request",
    408: "request_timeout",
    431: "headers_too_large",
    501: "not_implemented",
    503: "too_many_connections",
}


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """What one connection may cost. Seconds for the timeouts; bytes for the header block."""

    header_timeout: float = _DEFAULTS.header_timeout
    body_timeout: float = _DEFAULTS.body_timeout
    max_connections: int = _DEFAULTS.max_connections
    max_header_bytes: int = _DEFAULTS.max_header_bytes

    @classmethod
    def of(cls, config: RouterConfig) -> EdgeLimits:
        return cls(header_timeout=config.header_timeout, body_timeout=config.body_timeout,
                   max_connections=config.max_connections, max_header_bytes=config.max_header_bytes)


def error_response(status: int, message: str, code: str | None = None) -> bytes:
    """A complete HTTP/1.1 response carrying the OpenAI envelope; the connection then closes."""
    body = msgspec.json.encode(
        {
            "error": {
                "message": message,
                "type": "server_error" if status >= 500 else "invalid_request_error",
                "param": None,
                "code": code or _CODES.get(status),
            }
        }
    )
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class FramingError(h11.RemoteProtocolError):
    """A request h11 accepts but we refuse (ambiguous length, oversized header block)."""


def check_head(head: bytes, max_header_bytes: int) -> None:
    """Refuse a request head (request line + headers, up to the blank line) that is too big or
    whose body length is ambiguous: the request-smuggling shapes of RFC 9112 section 6.3."""
    if len(head) > max_header_bytes:
        raise FramingError(
            f"the request head is {len(head)} bytes; the limit is {max_header_bytes}",
            error_status_hint=431,
        )
    names = [line.split(b":", 1)[0].strip().lower() for line in head.split(b"\r\n")[1:] if line]
    lengths = names.count(b"content-length")
    if lengths > 1:
        raise FramingError("more than one Content-Length header")
    if lengths and b"transfer-encoding" in names:
        raise FramingError("both Content-Length and Transfer-Encoding are set")


class _Conn(h11.Connection):
    """h11's connection, telling its protocol about each event (to arm and clear deadlines)."""

    def __init__(self, protocol: EdgeProtocol, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.protocol = protocol
        self.last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request | h11.EndOfMessage):
                self.protocol.on_h11_event(event)
            return event
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


class _QuietLogger:
    """uvicorn's logger with its client-triggered warnings ("Invalid HTTP request received.")
    rate-limited across all connections."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def warning(self, msg: str, *args: object) -> None:
        _uvicorn_warn(msg, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol plus EdgeLimits; subclassed per server by `edge_protocol`."""

    limits = EdgeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Conn(self, self.limits.max_header_bytes)
        self.logger = _QuietLogger(self.logger)  # type: ignore[assignment]
        self._deadline: asyncio.TimerHandle | None = None
        self._head = bytearray()  # the raw head of the request being received
        self._refused = False

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # asyncio sets TCP_NODELAY only when the listening socket says IPPROTO_TCP; one made
        # by `socket.socket()` says 0, and Nagle + delayed ACK then add 40 ms to each answer.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.connections) > self.limits.max_connections:
            self.refuse(
                503, f"too many connections (limit {self.limits.max_connections}); retry shortly"
            )
            return
        self._arm(self.limits.header_timeout, "the request headers")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE:
            if self._deadline is None:
                self._arm(self.limits.header_timeout, "the request headers")
            # Kept only up to the limit (+4 to see the blank line): check_head judges it.
            room = self.limits.max_header_bytes + 4 - len(self._head)
            if room > 0:
                self._head += data[:room]
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # --- deadlines and framing -----------------------------------------------------------

    def on_h11_event(self, event: h11.Request | h11.EndOfMessage) -> None:
        self._disarm()
        if isinstance(event, h11.EndOfMessage):
            return
        head, sep, _ = bytes(self._head).partition(b"\r\n\r\n")
        self._head.clear()
        check_head(head + sep if sep else head, self.limits.max_header_bytes)
        if _has_body(event):
            self._arm(self.limits.body_timeout, "the request body")

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, seconds, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, seconds: float, what: str) -> None:
        self._deadline = None
        self.refuse(408, f"{what} did not arrive within {seconds:g} s")

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn on any h11 parse error: answer with the envelope instead."""
        exc = self.conn.last_error if isinstance(self.conn, _Conn) else None
        status = getattr(exc, "error_status_hint", 400) if exc is not None else 400
        detail = str(exc) if exc is not None and str(exc) else msg
        self.refuse(status, f"invalid HTTP request: {detail}")

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` with the envelope (unless a response has begun) and close."""
        self._disarm()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        _log_refused("HTTP %d to %s: %s", status, client, message, key=f"edge-{status}")
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(error_response(status, message))
        if cycle is not None:  # the app, if it is reading the body, sees a disconnect
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def _has_body(event: h11.Request) -> bool:
    for name, value in event.headers:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
    return False


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """An EdgeProtocol class bound to `limits` (uvicorn builds one instance per connection)."""
    return type("BoundEdgeProtocol", (EdgeProtocol,), {"limits": limits})


def server_config(app: Any, limits: EdgeLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for the router: the edge protocol, no websockets, no access log."""
    kwargs.setdefault("access_log", False)
    return uvicorn.Config(
        app,
        http=edge_protocol(limits),
        ws="none",
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kwargs,
    )
