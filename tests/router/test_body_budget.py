"""A router-wide budget for buffered request bodies: slow uploads cannot add up to the router's
memory limit; past the budget a body is answered 503 in the envelope, and the budget comes back
when a request ends."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from pdserve.router.http_server import EdgeLimits
from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)

BUDGET = 64 * 1024
OK_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture
def router():
    with RouterHarness(edge=EdgeLimits(body_timeout=10.0), max_buffered_body_bytes=BUDGET) as h:
        h.worker("colo-0")
        yield h


def head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"Content-Length: {length}\r\nConnection: close\r\n\r\n".encode())


def padded_chat(size: int) -> bytes:
    body = json.dumps(OK_CHAT).encode()
    return body + b" " * (size - len(body))


def answer(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return out
        if not chunk:
            return out
        out += chunk


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_body_past_the_budget_gets_an_enveloped_503_and_the_budget_returns(router):
    slow = socket.create_connection(("127.0.0.1", router.port))
    slow.sendall(head(40_000) + b'{"model"')  # then nothing for now: an upload in progress
    wait_for(lambda: router.service.buffered_body_bytes == 40_000)
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        start = time.monotonic()
        s.sendall(head(40_000))  # refused on its declared length, before it sends any of it
        response = answer(s)
    assert time.monotonic() - start < 2.0
    status_line, _, body = response.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 503"), response[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "body_budget_exceeded" and set(err) == {"message", "type", "param", "code"}
    with httpx.Client(base_url=router.base_url, timeout=10) as c:  # small bodies still fit
        assert c.post("/v1/chat/completions", json=OK_CHAT).status_code == 200
    slow.sendall(padded_chat(40_000)[len(b'{"model"'):])  # the slow upload ends and is served
    assert answer(slow).startswith(b"HTTP/1.1 200")
    slow.close()
    wait_for(lambda: router.service.buffered_body_bytes == 0 and router.service.inflight == 0)
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(head(40_000) + padded_chat(40_000))
        assert answer(s).startswith(b"HTTP/1.1 200")


def test_a_chunked_body_is_counted_as_it_arrives(router):
    slow = socket.create_connection(("127.0.0.1", router.port))
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % 50_000 + b" " * 50_000 + b"\r\n")
    wait_for(lambda: router.service.buffered_body_bytes == 50_000)
    slow.sendall(b"%x\r\n" % 20_000 + b" " * 20_000 + b"\r\n")  # 70,000 held: over the budget
    response = answer(slow)
    assert response.startswith(b"HTTP/1.1 503") and b"body_budget_exceeded" in response
    slow.close()
    wait_for(lambda: router.service.buffered_body_bytes == 0)


def test_the_budget_is_a_router_flag_with_its_environment_twin(monkeypatch):
    import argparse

    from pdserve.config.router import router_config
    from pdserve.router import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert router_config(p.parse_args([])).max_buffered_body_bytes == 256 * 1024 * 1024
    monkeypatch.setenv("PDSERVE_MAX_BUFFERED_BODY_BYTES", "1000")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert router_config(p.parse_args([])).max_buffered_body_bytes == 1000


def test_the_router_pods_budget_fits_their_memory_limit():
    """Sized as k8s/base/router.yaml says: ~300 MiB at rest, at most ~2.25 bytes of RSS per
    body byte held (the buffer, then its parsed copy)."""
    from tests.helpers.k8s_render import get_object, pod_env, render

    for overlay in ("cpu", "gpu"):
        objects = render(overlay)
        budget = int(pod_env(objects, "pdserve-router")["PDSERVE_MAX_BUFFERED_BODY_BYTES"])
        container = get_object(objects, "Deployment", "pdserve-router")["spec"]["template"]["spec"]["containers"][0]
        limit = container["resources"]["limits"]["memory"]
        assert limit.endswith("Gi") or limit.endswith("Mi"), limit
        limit_bytes = int(limit[:-2]) * (2**30 if limit.endswith("Gi") else 2**20)
        assert 300 * 2**20 + 2.25 * budget <= 0.9 * limit_bytes, (overlay, budget, limit)
