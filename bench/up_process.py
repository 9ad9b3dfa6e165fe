"""`pdserve up` as a child process, for the failover benchmark and the end-to-end tests: start
it, wait until the router sees its workers, find a child's pid in its log, signal children, read
the router's metrics and routing decisions, stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.config import envs
from pdserve.config.ports import free_port


class UpProcess:
    """`pdserve up --num-prefill P --num-decode D` on loopback, its output in `log_path`."""

    def __init__(self, model: str, log_path: Path, *, num_prefill: int = 2, num_decode: int = 2,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 kv_cache_gb: float | None = 0.05, threads: int = 1) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.want = {"prefill": num_prefill, "decode": num_decode, "colocated": 0}
        self.cmd = [sys.executable, "-m", "pdserve", "--log-level", "INFO", "up", "--model", model,
                    "--port", str(self.port), "--num-prefill", str(num_prefill), "--num-decode",
                    str(num_decode), "--no-pin", "--threads", str(threads), "--restart-backoff", "0.5",
                    "--ready-timeout", "300", *args]
        if kv_cache_gb is not None:
            self.cmd += ["--kv-cache-memory-gb", str(kv_cache_gb)]
        self.env = envs.child_environ(env)
        self.proc: subprocess.Popen | None = None
        self._model: str | None = None

    def start(self, timeout: float = 300.0) -> UpProcess:
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        self.wait_workers(self.want, timeout)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> dict[str, float] | None:
        """Live workers by role, as the router sees them (None while it does not answer)."""
        try:
            text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        return {m[0]: float(m[1]) for m in re.findall(r'pdserve_router_workers\{role="(\w+)"\} ([0-9.]+)', text)}

    def wait_workers(self, want: dict[str, int], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while self.workers() != want:
            assert self.proc is not None and self.proc.poll() is None, "pdserve up exited:\n" + self.log()[-3000:]
            assert time.monotonic() < deadline, f"workers {self.workers()} != {want}:\n" + self.log()[-3000:]
            time.sleep(0.2)

    def pid(self, name: str) -> int:
        pids = re.findall(rf"(?:started|restarted) {name} \(pid (\d+)", self.log())
        assert pids, f"no pid for {name}"
        return int(pids[-1])

    def signal(self, name: str, sig: int) -> int:
        pid = self.pid(name)
        os.kill(pid, sig)
        return pid

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        m = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def model(self) -> str:
        if self._model is None:
            self._model = str(httpx.get(f"{self.base_url}/v1/models", timeout=5).json()["data"][0]["id"])
        return self._model

    def routes(self, request_id_prefix: str = "") -> dict[str, list[str]]:
        """Where the router sent each sub-request, from its log: id -> the workers of its route."""
        out: dict[str, list[str]] = {}
        for rid, first, decode in re.findall(r"request (\S+): \d+ prompt tokens, max_tokens \d+ -> (\S+)(?: -> (\S+) via)?",
                                             self.log()):
            if rid.startswith(request_id_prefix):
                out[rid] = [first, decode] if decode else [first]
        return out
