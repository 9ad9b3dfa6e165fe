"""The HTTP edge: no client can hold the router up, by sending slowly, lying about its length,
opening too many connections or sending a huge head, and every refusal is an enveloped answer."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from pdserve.config.router import router_config
from pdserve.router.http_server import EdgeLimits
from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)

LIMITS = EdgeLimits(header_timeout=1.0, body_timeout=1.0, max_connections=8, max_header_bytes=8192)
OK_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def router():
    with RouterHarness(edge=LIMITS) as h:
        h.worker("colo-0")
        yield h


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes (or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        out += chunk
    return out


def raw(router, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(data)
        return read_all(s, timeout)


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), response[:200]
    assert b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return int(head.split()[1]), err


def still_serves(router) -> None:
    with httpx.Client(base_url=router.base_url, timeout=10) as c:
        assert c.post("/v1/chat/completions", json=OK_CHAT).status_code == 200


def test_slowloris_headers_are_cut_with_408_within_the_header_timeout(router):
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        start = time.monotonic()
        cut_at = None
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaa":
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)  # 10 bytes/s: the head would take 5 s
            s.settimeout(0.001)
            try:
                got = s.recv(4096)
            except TimeoutError:
                continue
            cut_at = time.monotonic() - start
            status, err = status_and_error(got + read_all(s, 1.0))
            assert status == 408 and err["code"] == "request_timeout"
            break
    assert cut_at is not None and cut_at < LIMITS.header_timeout + 0.5, cut_at
    still_serves(router)


def test_a_silent_connection_is_closed_after_the_header_timeout(router):
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        start = time.monotonic()
        status, _ = status_and_error(read_all(s, 5.0))
        assert status == 408 and time.monotonic() - start < LIMITS.header_timeout + 0.5


def test_a_body_that_stops_coming_is_cut_with_408_within_the_body_timeout(router):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"Content-Length: 5000\r\n\r\n"
    )
    start = time.monotonic()
    response = raw(router, head + b'{"model": "fake-model", "mess')  # then nothing
    elapsed = time.monotonic() - start
    status, err = status_and_error(response)
    assert status == 408 and err["code"] == "request_timeout"
    assert elapsed < LIMITS.body_timeout + 0.5, elapsed
    assert router.service.inflight == 0
    still_serves(router)


def test_connections_over_the_cap_get_an_enveloped_503(router):
    held = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.1)  # let the server accept them all
        with socket.create_connection(("127.0.0.1", router.port)) as extra:
            status, err = status_and_error(read_all(extra, 3.0))
        assert status == 503 and err["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    assert RouterHarness.wait_until(lambda: len(router.server.server_state.connections) < 2)
    still_serves(router)


@pytest.mark.parametrize(
    ("name", "data", "status"),
    [
        ("garbage request line", b"GARBAGE\r\n\r\n", 400),
        ("binary noise", b"\x00\x01\x02\xff\r\n\r\n", 400),
        ("header without colon", b"GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400),
        ("100 KB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431),
        ("head over the limit in pieces", b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 2000, 431),
        (
            "duplicate Content-Length",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
            400,
        ),
        (
            "conflicting Content-Length",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            400,
        ),
        (
            "Content-Length and Transfer-Encoding",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (
            "Content-Length not a number",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
            400,
        ),
        (
            "unknown transfer coding",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
            501,
        ),
        (
            "bad chunk size",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            400,
        ),
        (
            "Content-Length larger than the body",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}",
            408,
        ),
    ],
)
def test_malformed_http_gets_an_enveloped_answer(router, name, data, status):
    got, err = status_and_error(raw(router, data))
    assert got == status, (name, err)
    still_serves(router)


def test_request_body_under_the_limits_still_flows_in_pieces(router):
    """Deadlines are per phase, not per byte: a body sent in a few pieces inside them is fine."""
    body = json.dumps(OK_CHAT).encode()
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        for i in range(0, len(body), 20):
            s.sendall(body[i : i + 20])
            time.sleep(0.05)
        response = read_all(s, 5.0)
    assert response.startswith(b"HTTP/1.1 200"), response[:200]


def test_edge_flags_default_from_the_environment(monkeypatch):
    import argparse

    from pdserve.router import cli

    monkeypatch.setenv("PDSERVE_HEADER_TIMEOUT", "3.5")
    monkeypatch.setenv("PDSERVE_MAX_CONNECTIONS", "7")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    limits = EdgeLimits.of(router_config(p.parse_args(["--max-header-bytes", "4096"])))
    assert limits == EdgeLimits(header_timeout=3.5, body_timeout=30.0, max_connections=7, max_header_bytes=4096)
