"""The worker's probe port: idle connections cost no thread, a cap bounds them, the probe answers."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from pdserve.worker import health
from pdserve.worker.health import MAX_CONNECTIONS, HealthServer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(health, "HEADER_TIMEOUT_S", 1.0)
    s = HealthServer("127.0.0.1", 0, live=lambda: True, ready=lambda: True, info=lambda: {"role": "test"}).start()
    yield s
    s.close()


def idle_connections(server: HealthServer, n: int) -> list[socket.socket]:
    host, port = server.address.removeprefix("http://").rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(n)]


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_the_probe_answers_while_idle_connections_are_open_and_they_hold_no_thread(server):
    threads = threading.active_count()
    conns = idle_connections(server, MAX_CONNECTIONS - 1)
    try:
        r = httpx.get(server.address + "/health", timeout=2)
        assert r.status_code == 200 and r.json()["ok"] is True
        assert threading.active_count() == threads
    finally:
        for c in conns:
            c.close()


def test_connections_beyond_the_cap_are_refused_at_once_and_idle_ones_time_out(server):
    conns = idle_connections(server, MAX_CONNECTIONS + 16)
    try:
        over = conns[MAX_CONNECTIONS:]
        for c in over:
            assert read_all(c).startswith(b"HTTP/1.1 503 ")
        assert server.refused == 16
        started = time.monotonic()
        for c in conns[:MAX_CONNECTIONS]:  # the read deadline closes every idle one
            assert read_all(c).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < health.HEADER_TIMEOUT_S + 2
        assert httpx.get(server.address + "/ready", timeout=2).status_code == 200
    finally:
        for c in conns:
            c.close()


def test_a_request_head_over_the_limit_is_refused(server):
    (conn,) = idle_connections(server, 1)
    with conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nX: " + b"a" * (health.MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
        assert read_all(conn).startswith(b"HTTP/1.1 431 ")


def test_unknown_paths_are_404_and_a_failing_probe_is_503():
    s = HealthServer("127.0.0.1", 0, live=lambda: False, ready=lambda: False, info=lambda: {}).start()
    try:
        assert httpx.get(s.address + "/nope", timeout=2).status_code == 404
        assert httpx.get(s.address + "/health", timeout=2).status_code == 503
        assert httpx.get(s.address + "/info", timeout=2).json() == {"ok": True}
    finally:
        s.close()
