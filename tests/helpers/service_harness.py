"""Start router + workers as real processes on loopback, with known ports, for end-to-end tests."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.config.ports import free_port
from tests.helpers.paths import REPO
from tests.helpers.up_harness import FAULTS


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    health: str | None = None  # worker probe base URL
    kv_port: int | None = None
    argv: list[str] = field(default_factory=list)  # the command line, for a restart


@dataclass
class Cluster:
    """Routers and their workers. `mode` is 'disaggregated' or 'colocated' (with `policy`).

    With `num_routers` > 1 every worker registers with every router (`--router-address` lists
    them all); the first router is `router` (at `base_url`), the others `router-1`, ..."""

    tmp: Path
    model: str
    mode: str = "disaggregated"
    policy: str = "chunked"
    transport: str = "tcp"  # the decode workers' receiving transport
    prefill_transports: str = "tcp,shm"  # what the prefill workers offer
    num_prefill: int = 1
    num_decode: int = 1
    num_routers: int = 1
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    faults: str = ""  # PDSERVE_TEST_FAULTS for every process (tests/helpers/faults)
    procs: list[Proc] = field(default_factory=list)
    # The deployment secret every process gets through the environment ('' runs --insecure).
    secret: str = field(default_factory=lambda: secrets.token_hex(32))

    def __post_init__(self) -> None:
        self.ports = [free_port() for _ in range(self.num_routers)]
        self.controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(self.num_routers)]
        self.base_urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.port, self.control, self.base_url = self.ports[0], self.controls[0], self.base_urls[0]

    def _spawn(self, name: str, args: list[str], **kw) -> Proc:
        log = self.tmp / f"{name}.log"
        if not self.secret:
            args = [*args, "--insecure"]
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", *args]
        proc = Proc(name, self._popen(cmd, log, "w"), log, argv=cmd, **kw)
        self.procs.append(proc)
        return proc

    def _popen(self, cmd: list[str], log: Path, mode: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PDSERVE_SECRET_FILE", None)
        if self.faults:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(FAULTS), str(REPO), env.get("PYTHONPATH"))))
            env["PDSERVE_TEST_FAULTS"] = self.faults
        if self.secret:
            env["PDSERVE_SECRET"] = self.secret
        else:
            env.pop("PDSERVE_SECRET", None)
        return subprocess.Popen(
            cmd, stdout=log.open(mode), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def start(self, timeout: float = 180.0) -> Cluster:
        """Start every process and wait until all are ready. If any fails to start, stop the ones
        that did before raising: a fixture whose setup raises never reaches its teardown, and
        its router and workers went on running (and taking CPU) for the rest of the session."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> Cluster:
        for i in range(self.num_routers):
            self.start_router(i)
        common = ["--router-address", ",".join(self.controls), "--model", self.model, "--threads", "1",
                  "--heartbeat-interval", "0.5", *self.engine_args]
        roles = [("decode", i) for i in range(self.num_decode)]
        if self.mode == "disaggregated":
            roles = [("prefill", i) for i in range(self.num_prefill)] + roles
        for role, i in roles:
            hp = free_port()
            args = [role, *common, "--health-port", str(hp), "--worker-id", f"{role}-{i}"]
            kv = None
            if role == "decode":
                kv = free_port()
                args += ["--kv-port", str(kv)]
                if self.mode == "colocated":
                    args += ["--mode", "colocated", "--policy", self.policy]
                else:
                    args += ["--kv-transport", self.transport]
            else:
                args += ["--kv-transport", self.prefill_transports]
            self._spawn(f"{role}-{i}", args, health=f"http://127.0.0.1:{hp}", kv_port=kv)
        self.wait_ready(timeout)
        return self

    def kill(self, name: str, group: bool = False) -> float:
        """SIGKILL one process, or with `group` its whole process group (the process and the helpers
        it started, e.g. multiprocessing's resource tracker), and reap it. Returns the kill's
        `time.monotonic()`."""
        p = self.proc(name)
        if group:
            os.killpg(p.popen.pid, signal.SIGKILL)
        else:
            p.popen.kill()
        killed_at = time.monotonic()
        p.popen.wait()
        return killed_at

    def restart(self, name: str, timeout: float = 60.0) -> float:
        """Start a dead process again with the same command line (same ports, same worker id) and
        wait until it and the router are ready. Returns the restart's `time.monotonic()`."""
        p = self.proc(name)
        assert p.popen.poll() is not None, f"{name} is still running"
        started_at = time.monotonic()
        with p.log.open("a") as f:
            f.write("\n--- restarted ---\n")
        p.popen = self._popen(p.argv, p.log, "a")
        self.wait_ready(timeout)
        return started_at

    def router_name(self, index: int = 0) -> str:
        return "router" if index == 0 else f"router-{index}"

    def start_router(self, index: int = 0) -> Proc:
        """(Re)start router `index` on its HTTP port and control address."""
        name = self.router_name(index)
        self.procs = [p for p in self.procs if p.name != name]
        proc = self._spawn(name, ["router", "--port", str(self.ports[index]), "--control-address",
                                  self.controls[index], "--model", self.model, "--heartbeat-timeout", "3",
                                  *self.router_args])
        self.procs.insert(index, self.procs.pop())
        return proc

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        urls = [u + "/ready" for u in self.base_urls] + [p.health + "/ready" for p in self.procs if p.health]
        while time.time() < deadline:
            for p in self.procs:
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{p.log.read_text()[-3000:]}")
            try:
                if all(httpx.get(u, timeout=2).status_code == 200 for u in urls):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("cluster not ready:\n" + "\n".join(p.log.read_text()[-1500:] for p in self.procs))

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def info(self, name: str) -> dict:
        return httpx.get(self.proc(name).health + "/info", timeout=5).json()

    def workers(self) -> list[str]:
        return [p.name for p in self.procs if p.health]

    def wait_idle(self, timeout: float = 2.0) -> dict[str, dict]:
        """Every worker's info once none holds a block for a live request (or at the timeout)."""
        deadline = time.time() + timeout
        while True:
            infos = {w: self.info(w) for w in self.workers()}
            if all(i["used_blocks"] == 0 for i in infos.values()) or time.time() > deadline:
                return infos
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                os.killpg(p.popen.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
