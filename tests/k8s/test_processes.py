"""The cpu overlay's containers, run as local processes, serve chat and survive a lost decode.

tests/helpers/k8s_render.py turns each container of `kubectl kustomize k8s/overlays/cpu` into a
process spec (ConfigMap envFrom resolved, pod IP and Service names -> 127.0.0.1, ports
remapped; the headless Service the workers dial becomes every router's address). This module
starts two routers, two prefill and two decode workers from those specs with `.venv/bin/pdserve`,
waits on the readiness probes the manifests declare, sends chat requests through the first
router, then kills a decode worker and drains a prefill worker.

It needs the real CLI: without `.venv/bin/pdserve` the module fails at import, on purpose.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest

from tests.helpers.k8s_render import REPO, ProcessSpec, local_process_specs, pod_env, render

# K8S_TEST_PDSERVE points at another pdserve executable (an installed image's, say).
PDSERVE = Path(os.environ.get("K8S_TEST_PDSERVE", REPO / ".venv" / "bin" / "pdserve"))
if not PDSERVE.exists():
    pytest.fail(
        f"{PDSERVE} is missing: install the project (`make setup`) so that the `pdserve` console "
        "script exists; this test runs the Kubernetes manifests' commands with it.",
        pytrace=False,
    )

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STARTUP_TIMEOUT_S = 180.0  # five processes loading the model on a shared two-core machine
REQUEST_TIMEOUT_S = 60.0


class LocalDeployment:
    """The overlay's processes on loopback; owns them and their logs until `stop()`."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        log_dir: Path,
        *,
        model: str,
        heartbeat_timeout_s: float,
        drain_timeout_s: float,
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log_files: list[BinaryIO] = []
        self.log_dir = log_dir
        self.model = model
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.drain_timeout_s = drain_timeout_s
        # The pods see only their own env; keep PATH and the like, drop any PDSERVE_* of ours.
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}

    def start(self) -> None:
        for name, spec in self.specs.items():
            log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
            self.log_files.append(log)
            self.procs[name] = subprocess.Popen(
                list(spec.argv),
                env={**self.base_env, **spec.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
        for log in self.log_files:
            log.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.stem} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def by_component(self, component: str) -> list[ProcessSpec]:
        return [s for s in self.specs.values() if s.component == component]

    @property
    def router(self) -> ProcessSpec:
        return self.by_component("router")[0]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.router.ports['http']}"

    def wait_until_ready(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(names)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                name = pending[0]
                if self.procs[name].poll() is not None:
                    raise AssertionError(
                        f"{name} exited with {self.procs[name].returncode}\n{self.logs()}"
                    )
                try:
                    if client.get(self.specs[name].probes["readinessProbe"]).status_code == 200:
                        pending.pop(0)
                        continue
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"not ready after {timeout_s} s: {pending}\n{self.logs()}")
                time.sleep(0.2)  # polling a readiness probe, as the kubelet does


def chat(base_url: str, model: str, content: str = "Say hello.") -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=REQUEST_TIMEOUT_S,
    )


def answers_consistently(base_url: str, model: str, deadline_s: float, needed: int = 3) -> bool:
    """Whether `needed` chat requests in a row succeed before the deadline.

    Requests caught on a worker that just died may fail (the router learns of the death by a
    missed heartbeat); the service must answer again once that timeout has passed.
    """
    deadline = time.monotonic() + deadline_s
    streak = 0
    while time.monotonic() < deadline:
        resp = chat(base_url, model)
        streak = streak + 1 if resp.status_code == 200 else 0
        if streak >= needed:
            return True
    return False


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    objects = render("cpu")
    specs = local_process_specs(objects, pdserve=str(PDSERVE))
    router_env = pod_env(objects, "pdserve-router")
    dep = LocalDeployment(
        specs,
        tmp_path_factory.mktemp("k8s-processes"),
        model=router_env["PDSERVE_SERVED_MODEL_NAME"],
        heartbeat_timeout_s=float(router_env["PDSERVE_HEARTBEAT_TIMEOUT"]),
        drain_timeout_s=float(pod_env(objects, "pdserve-prefill")["PDSERVE_DRAIN_TIMEOUT"]),
    )
    dep.start()
    try:
        dep.wait_until_ready(list(dep.specs), STARTUP_TIMEOUT_S)
        yield dep
    finally:
        dep.stop()


def test_manifest_processes_become_ready_through_their_probes(deployment):
    with httpx.Client(timeout=5.0) as client:
        for spec in deployment.specs.values():
            assert client.get(spec.probes["livenessProbe"]).status_code == 200, spec.name
            assert client.get(spec.probes["readinessProbe"]).status_code == 200, spec.name


def test_chat_request_through_the_router_is_answered(deployment):
    resp = chat(deployment.base_url, deployment.model)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1


def test_router_exports_the_autoscaling_metrics(deployment):
    text = httpx.get(f"{deployment.base_url}/metrics", timeout=5.0).text
    assert "pdserve_router_queue_depth" in text
    assert "pdserve_router_running_requests" in text


def test_service_still_answers_after_a_decode_worker_is_killed(deployment):
    victim = deployment.by_component("decode")[0].name
    deployment.procs[victim].kill()
    deployment.procs[victim].wait(timeout=10)
    assert answers_consistently(
        deployment.base_url, deployment.model, deadline_s=deployment.heartbeat_timeout_s * 4 + 30
    )
    assert httpx.get(deployment.router.probes["readinessProbe"], timeout=5.0).status_code == 200


def test_prefill_worker_drains_and_exits_zero_on_sigterm(deployment):
    victim = deployment.by_component("prefill")[0].name
    proc = deployment.procs[victim]
    proc.send_signal(signal.SIGTERM)
    # The pod's terminationGracePeriodSeconds is sized for this bound.
    assert proc.wait(timeout=deployment.drain_timeout_s + 5) == 0
    assert answers_consistently(
        deployment.base_url, deployment.model, deadline_s=deployment.heartbeat_timeout_s * 4 + 30
    )
