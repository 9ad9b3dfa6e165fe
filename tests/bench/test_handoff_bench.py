"""bench/handoff_bench.py against a stand-in server: the same prompts go to every mode and peer,
the warm-up request is left out, and the table sets pdserve's gap beside the peer's."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.bench import handoff_bench


class _Server(BaseHTTPRequestHandler):
    prompts: list[list[int]] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, [json.dumps({"data": [{"id": "stand-in"}]}).encode()], "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).prompts.append(body["prompt"])
        events = [f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode()
                  for i in range(body["max_tokens"])] + [b"data: [DONE]\n\n"]
        self._send(200, events, "text/event-stream")

    def _send(self, code: int, pieces: list[bytes], kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(sum(map(len, pieces))))
        self.end_headers()
        for piece in pieces:  # a token every 2 ms (a loaded machine may still read two at once)
            self.wfile.write(piece)
            self.wfile.flush()
            time.sleep(0.002)


@pytest.fixture
def server():
    _Server.prompts = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_peer_gets_the_same_prompts_and_the_table_gives_the_ratios(server):
    args = argparse.Namespace(requests=3, prompt_tokens=20, max_tokens=5, timeout=10.0, seed=7)
    peer = handoff_bench.measure(server, "stand-in", "vllm", args)
    again = handoff_bench.measure(server, "stand-in", "vllm", args)
    assert peer["requests"] == again["requests"] == 3 and peer["gap_p50_ms"] > 0.0 and peer["decode_step_p50_ms"] > 0.0
    assert len(_Server.prompts) == 8 and _Server.prompts[:4] == _Server.prompts[4:]  # warm-up + 3, twice
    assert all(len(p) == 20 for p in _Server.prompts)

    split = {"mean_wait_ms": 1.0, "mean_send_ms": 2.0, "mean_verify_ms": 0.5, "mean_load_ms": 3.0, "mean_parts": 8.0}
    ours = dict(peer, mode="layer", gap_p50_ms=2 * peer["gap_p50_ms"] + 1, ttft_p50_s=peer["ttft_p50_s"] * 0.5,
                split=split)
    text = handoff_bench.table([ours, peer])
    assert "| layer |" in text and "1.0 / 2.0 / 0.5 / 3.0" in text and "| vllm |" in text
    ratio = ours["gap_p50_ms"] / peer["gap_p50_ms"]
    assert f"layer: gap {ratio:.2f}x and TTFT 0.50x vllm's" in text


def test_a_peer_started_by_its_command_is_timed_and_stopped_after(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pidfile = tmp_path / "pid"
    args = argparse.Namespace(requests=2, prompt_tokens=10, max_tokens=4, timeout=60.0, seed=1,
                              peer_url=f"http://127.0.0.1:{port}", peer_name="stand-in",
                              peer_cmd=f"echo $$ > {pidfile}; exec {sys.executable} -m tests.bench.test_handoff_bench {port}")
    row = handoff_bench.run_peer(args, tmp_path)
    assert row["mode"] == "stand-in" and row["requests"] == 2 and row["gap_p50_ms"] > 0.0
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped (and reaped) once timed
    with pytest.raises(httpx.ConnectError):
        httpx.get(args.peer_url + "/v1/models", timeout=2)


if __name__ == "__main__":  # the stand-in as a server of its own: --peer-cmd's test
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _Server).serve_forever()
