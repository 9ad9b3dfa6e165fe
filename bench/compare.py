"""`pdserve bench compare`: start each deployment on localhost, run one plan against it, stop it.

A deployment is a shell-free command line containing `{port}`; it is started in its own process
group, must answer `GET /ready` with 200 within the readiness timeout, is benchmarked, then gets
SIGTERM (SIGKILL after the stop timeout) on its whole group, so workers it spawned go too.
Results: one table, `compare.json`, and bar/CDF plots side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench import plots, report
from pdserve.bench.sweep import Plan, run_point, run_sweep
from pdserve.config.ports import free_port

log = logging.getLogger(__name__)

DEFAULT_DEPLOYMENTS = (
    "static=pdserve up --colocated --policy static --port {port}",
    "prefill-first=pdserve up --colocated --policy prefill-first --port {port}",
    "mixed=pdserve up --colocated --policy mixed --port {port}",
    "chunked=pdserve up --colocated --policy chunked --port {port}",
    "disaggregated=pdserve up --port {port}",
)


@dataclass(frozen=True, slots=True)
class Deployment:
    """A named command that serves the OpenAI API on 127.0.0.1:{port}."""

    name: str
    command: str

    @classmethod
    def parse(cls, text: str) -> Deployment:
        name, sep, command = text.partition("=")
        if not sep or not name.strip() or not command.strip():
            raise ValueError(f"bad deployment {text!r}: use NAME=COMMAND, e.g. 'chunked=pdserve up --colocated --policy chunked --port {{port}}'")
        if "{port}" not in command:
            raise ValueError(f"deployment {name!r}: the command must contain {{port}} so compare can pick a free port")
        return cls(name.strip(), command.strip())

    def argv(self, port: int) -> list[str]:
        argv = shlex.split(self.command.replace("{port}", str(port)))
        if argv and argv[0] == "pdserve" and shutil.which("pdserve") is None:
            # Run from a virtualenv that is not on PATH: use this interpreter's pdserve.
            argv = [sys.executable, "-m", "pdserve.cli", *argv[1:]]
        return argv


class DeploymentError(RuntimeError):
    """A deployment did not start or never became ready."""


def _log_tail(path: Path, n: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


# Where each kind of server says it is ready: pdserve's router answers /ready?warm=1 200 once a
# worker of each role is up and every worker's KV cache is faulted in (kernels/huge_pages.py: a
# burst into a cold cache pays for faulting it in, docs/cpu_kernels.md "Memory"; vLLM zeroes its
# cache before it is ready); vLLM and llama-server have no /ready (404) but answer /health 200
# once their model is loaded (llama-server: 503 while loading).
READY_PATH = "/ready?warm=1"
READY_FALLBACK = "/health"


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> str:
    """Poll `url` until it answers 200 and return the URL that did; a 404 there (a server with no
    such endpoint) moves the poll to /health. Fail early if the process exits."""
    deadline = time.monotonic() + timeout_s
    fallback = httpx.URL(url).copy_with(raw_path=READY_FALLBACK.encode())  # the query dropped too
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise DeploymentError(f"exited with code {proc.returncode} before ready; log tail:\n{_log_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                status = client.get(url).status_code
                if status == 200:
                    return str(url)
                if status == 404 and httpx.URL(url) != fallback:
                    log.info("%s answers 404: polling %s instead", url, fallback)
                    url = str(fallback)
                    continue
            if time.monotonic() > deadline:
                raise DeploymentError(f"not ready at {url} after {timeout_s:g}s; log tail:\n{_log_tail(log_path)}")
            time.sleep(0.1)


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    base_url: str
    startup_s: float  # from the process's start until it answered ready


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the deployment's process group, then SIGKILL it if it outlives `timeout_s`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("deployment pid %d ignored SIGTERM for %gs; killing its group", proc.pid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def running(dep: Deployment, out_dir: Path, ready_timeout_s: float, stop_timeout_s: float,
            ready_path: str = READY_PATH) -> Iterator[Started]:
    """Start `dep`, yield its base URL and start-up time once ready, and always stop it."""
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "server.log"
    argv = dep.argv(port)
    log.info("starting %s: %s", dep.name, shlex.join(argv))
    with open(log_path, "wb") as log_file:
        try:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as e:
            raise DeploymentError(f"cannot run {argv[0]!r}: {e}") from e
        try:
            base_url = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            wait_ready(proc, base_url + ready_path, ready_timeout_s, log_path)
            startup_s = time.monotonic() - started
            log.info("%s ready after %.1f s", dep.name, startup_s)
            yield Started(base_url, startup_s)
        finally:
            stop(proc, stop_timeout_s)


_COLUMNS = [("completed", "ok"), ("failed", "failed"), ("request_throughput", "req/s"),
            ("output_throughput", "out tok/s"), ("p50_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
            ("p50_tbt_ms", "TBT p50"), ("p99_tbt_ms", "TBT p99"), ("slo_attainment", "SLO %"),
            ("goodput", "goodput"), ("startup_s", "start-up s")]


# With --rates, each deployment's sweep adds its SLO capacity and its peak goodput (sweep.py).
_SWEEP_COLUMNS = [("max_rate_meeting_slo", "SLO capacity req/s"), ("peak_goodput", "peak goodput"),
                  ("peak_goodput_rate", "at req/s")]


def compare_table(results: dict[str, dict]) -> str:
    swept = any("peak_goodput" in s for s in results.values())
    columns = _COLUMNS + (_SWEEP_COLUMNS if swept else [])
    rows = []
    for name, s in results.items():
        if "error" in s:
            rows.append([name] + ["-"] * (len(columns) - 1) + [f"error: {s['error'].splitlines()[0][:40]}"])
            continue
        row = [100 * s[k] if k == "slo_attainment" else s.get(k, float("nan")) for k, _ in columns]
        rows.append([name] + ["none" if v is None else v for v in row])
    return report.format_table(["deployment"] + [h for _, h in columns], rows)


def run_compare(deployments: Sequence[Deployment], plan: Plan, out_dir: Path, ready_timeout_s: float = 600.0,
                stop_timeout_s: float = 30.0, rates: Sequence[float] | None = None,
                attainment_target: float = 0.9) -> dict[str, dict]:
    """Benchmark each deployment in turn with the same plan; write compare.json, compare.md, PNGs."""
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise ValueError(f"deployment names must be unique, got {names}")
    if rates and plan.slo.empty:
        raise ValueError("--rates in compare sweeps each deployment for the highest rate meeting the SLO: give --slo")
    results: dict[str, dict] = {}
    records: dict[str, list] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    for dep in deployments:
        dep_dir = out_dir / dep.name
        try:
            with running(dep, dep_dir, ready_timeout_s, stop_timeout_s) as started:
                target = plan.with_target(started.base_url)
                results[dep.name] = run_point(target, dep_dir, label=dep.name)
                results[dep.name]["startup_s"] = started.startup_s
                if rates:
                    sw = run_sweep(target, rates, dep_dir / "sweep", attainment_target, label=dep.name)
                    for key in ("max_rate_meeting_slo", "peak_goodput", "peak_goodput_rate"):
                        results[dep.name][key] = sw[key]
                    curves[dep.name] = [(p["request_rate"], p["slo_attainment"]) for p in sw["points"]]
            records[dep.name] = report.read_records(dep_dir / "requests.jsonl")
        except (DeploymentError, RuntimeError, httpx.HTTPError) as e:
            # One broken deployment must not cost the others' results.
            log.error("deployment %s failed: %s", dep.name, e)
            results[dep.name] = {"error": str(e)}
    report.write_json(out_dir / "compare.json", {"deployments": results})
    (out_dir / "compare.md").write_text(compare_table(results) + "\n")
    if plan.plots:
        _compare_plots(results, records, curves, out_dir, attainment_target)
    return results


def _compare_plots(results: dict[str, dict], records: dict[str, list], curves: dict, out_dir: Path,
                   target: float) -> None:
    ok = [n for n, s in results.items() if "error" not in s]
    if not ok:
        return
    get = lambda key: [results[n][key] for n in ok]  # noqa: E731
    plots.compare_bars(ok, {"output tok/s": get("output_throughput")}, "tokens/s", "Output throughput",
                       out_dir / "compare_throughput.png")
    plots.compare_bars(ok, {"p50": get("p50_ttft_ms"), "p99": get("p99_ttft_ms")}, "ms", "TTFT",
                       out_dir / "compare_ttft.png")
    plots.compare_bars(ok, {"p50": get("p50_tbt_ms"), "p99": get("p99_tbt_ms")}, "ms", "TBT",
                       out_dir / "compare_tbt.png")
    plots.compare_bars(ok, {"goodput": get("goodput"), "request throughput": get("request_throughput")},
                       "requests/s", "Goodput (requests/s meeting the SLO)", out_dir / "compare_goodput.png")
    plots.cdf_plot({n: plots.ttfts_ms(records[n]) for n in ok}, "TTFT (ms)", "TTFT CDF", out_dir / "compare_ttft_cdf.png")
    plots.cdf_plot({n: plots.tbts_ms(records[n]) for n in ok}, "TBT (ms)", "TBT CDF", out_dir / "compare_tbt_cdf.png")
    if curves:
        plots.attainment_vs_rate(curves, out_dir / "attainment_vs_rate.png", target)


def replot(out_dir: Path, attainment_target: float = 0.9) -> None:
    """Redraw a finished comparison's plots from its compare.json and requests.jsonl files."""
    results = json.loads((out_dir / "compare.json").read_text())["deployments"]
    records = {n: report.read_records(out_dir / n / "requests.jsonl") for n, s in results.items() if "error" not in s}
    _compare_plots(results, records, {}, out_dir, attainment_target)


if __name__ == "__main__":  # python -m pdserve.bench.compare DIR...: redraw the plots of finished runs
    import sys as _sys

    for _d in _sys.argv[1:]:
        replot(Path(_d))
