"""A peer without the deployment secret cannot make a process hold memory: 256 MiB sent as one
message that never ends (every frame with the "more" flag) into the router's control socket and a
decode worker's KV socket leaves each process's RSS within `RSS_BOUND`, and the deployment serves."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.service_harness import Cluster

pytestmark = pytest.mark.timeout(300)

FLOOD_BYTES = 256 << 20
FRAME_BYTES = 1 << 20
# What the flood may add to a process: libzmq holds at most one frame of a peer that has not
# finished its handshake (1 MiB here), plus allocator and interpreter noise.
RSS_BOUND = 32 << 20


def chat(cluster: Cluster) -> httpx.Response:
    model = httpx.get(cluster.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return httpx.post(cluster.base_url + "/v1/chat/completions", json=body, timeout=60)


def zmtp_null_greeting() -> bytes:
    """A ZMTP 3.0 greeting with the NULL mechanism and its READY, as a DEALER without a secret."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    props = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    ready = b"\x05READY" + props
    return greeting + b"\x04" + bytes([len(ready)]) + ready


def flood(port: int, total: int = FLOOD_BYTES, deadline_s: float = 60.0) -> tuple[int, socket.socket | None]:
    """Send `total` bytes of never-ending multipart frames to 127.0.0.1:`port`, connecting again
    whenever the peer cuts us off. Returns the bytes the kernel took and the last connection, left
    open (a closed connection would let libzmq free what it held)."""
    frame = b"\x03" + FRAME_BYTES.to_bytes(8, "big") + b"\0" * FRAME_BYTES  # more | long, never last
    sent, conn = 0, None
    deadline = time.monotonic() + deadline_s
    while sent < total and time.monotonic() < deadline:
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            conn.sendall(zmtp_null_greeting())
            while sent < total:
                conn.sendall(frame)
                sent += len(frame)
        except OSError:  # cut off: the peer did not take us
            conn.close()
            conn = None
            time.sleep(0.01)
    return sent, conn


def settled_rss(pid: int, timeout: float = 60.0) -> int:
    """RSS once it stops moving (a worker faults its KV cache in on a thread after it starts)."""
    last, deadline = rss(pid), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss(pid)
        if abs(now - last) < (1 << 20):
            return now
        last = now
    return last


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module", params=["tcp", "shm"])
def cluster(request, tiny_dir, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp(f"flood-{request.param}"), str(tiny_dir), transport=request.param).start()
    yield c
    c.stop()


@pytest.mark.parametrize("target", ["router", "decode-0"])
def test_a_never_ending_message_from_a_peer_without_the_secret_costs_no_memory(cluster, target):
    proc = cluster.proc(target)
    port = int(cluster.control.rsplit(":", 1)[1]) if target == "router" else proc.kv_port
    assert chat(cluster).status_code == 200
    before = settled_rss(proc.popen.pid)
    sent, conn = flood(port)
    try:
        time.sleep(1.0)  # what libzmq read is in its buffers by now
        grown = rss(proc.popen.pid) - before
        print(f"{target} ({cluster.transport}): {sent >> 20} MiB sent, RSS {before >> 20} MiB -> "
              f"{(before + grown) >> 20} MiB ({grown / 2**20:+.1f} MiB)")
        assert sent >= FLOOD_BYTES
        assert grown < RSS_BOUND, f"{target}'s RSS grew {grown >> 20} MiB (bound {RSS_BOUND >> 20} MiB)"
        r = chat(cluster)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    finally:
        if conn is not None:
            conn.close()
