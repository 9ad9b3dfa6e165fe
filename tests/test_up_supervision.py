"""`pdserve up` supervises: a worker killed with -9 is started again, and the rest keep serving."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.config.ports import free_port
from pdserve.supervisor import Supervisor

pytestmark = pytest.mark.timeout(240)


def workers_by_role(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {m[0]: float(m[1]) for m in re.findall(r'pdserve_router_workers\{role="(\w+)"\} ([0-9.]+)', text)}


def complete(base_url: str) -> httpx.Response:
    model = httpx.get(f"{base_url}/v1/models", timeout=5).json()["data"][0]["id"]
    return httpx.post(f"{base_url}/v1/completions", timeout=30,
                      json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0})


@pytest.fixture
def deployment(tiny_dir, tmp_path):
    port = free_port()
    log_path = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdserve", "--log-level", "INFO", "up", "--model", str(tiny_dir),
           "--port", str(port), "--num-prefill", "2", "--num-decode", "2", "--no-pin", "--threads", "1",
           "--kv-cache-memory-gb", "0.05", "--restart-backoff", "0.5", "--ready-timeout", "150"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while workers_or_none(base_url) != {"prefill": 2, "decode": 2, "colocated": 0}:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)
        yield proc, base_url, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def workers_or_none(base_url: str) -> dict[str, float] | None:
    try:
        return workers_by_role(base_url)
    except httpx.HTTPError:
        return None


def pid_of(log_path, name: str) -> int:
    pids = re.findall(rf"(?:started|restarted) {name} \(pid (\d+)", log_path.read_text())
    assert pids, f"no pid for {name}"
    return int(pids[-1])


@pytest.mark.parametrize("victim", ["decode-0", "prefill-1"])
def test_a_killed_worker_is_restarted_and_the_deployment_keeps_serving(deployment, victim):
    proc, base_url, log_path = deployment
    assert complete(base_url).status_code == 200
    old = pid_of(log_path, victim)
    os.kill(old, signal.SIGKILL)
    deadline, served = time.monotonic() + 15, 0
    while time.monotonic() < deadline and served < 3:  # the survivors serve meanwhile
        served += complete(base_url).status_code == 200
    assert served == 3
    deadline = time.monotonic() + 90
    while not (f"{victim} restarted" in log_path.read_text()
               and workers_or_none(base_url) == {"prefill": 2, "decode": 2, "colocated": 0}):
        assert proc.poll() is None, "pdserve up gave up: " + log_path.read_text()[-2000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.3)
    assert pid_of(log_path, victim) != old
    assert re.search(rf"{victim} \(pid {old}\) exited with status -9; restarting", log_path.read_text())
    assert complete(base_url).status_code == 200


def test_a_child_that_keeps_dying_backs_off_longer_each_time(tmp_path):
    now = [0.0]
    sup = Supervisor([("worker", [sys.executable, "-c", "raise SystemExit(3)"], None)], dict(os.environ),
                     min_backoff=1.0, max_backoff=4.0, stable_after=60.0, clock=lambda: now[0]).start()
    backoffs = []
    try:
        for _ in range(4):
            sup.children[0].popen.wait(30)
            sup.poll()  # notices the death, schedules the restart
            backoffs.append(sup.children[0].backoff)
            now[0] += backoffs[-1]
            assert [c.name for c in sup.poll()] == ["worker"]
        assert backoffs == [1.0, 2.0, 4.0, 4.0] and sup.children[0].history[:4] == [3, 3, 3, 3]
    finally:
        sup.stop(timeout=5)
