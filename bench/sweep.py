"""Running the benchmark: one point (a run at one request rate) and a sweep over rates.

A `Plan` is everything a run needs except the target's address and the rate, so `compare` can
replay one plan against several deployments and `sweep` at several rates. Every point writes
`summary.json`, `requests.jsonl` and its PNGs into its own directory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench import handoff_scrape, plots, report, stage_scrape
from pdserve.bench.client import Api, Endpoint, default_model
from pdserve.bench.loadgen import LoadConfig, LoadMode, run_load_sync
from pdserve.bench.metrics import SLO, RunInfo, summarize
from pdserve.bench.workloads import (
    RequestSpec,
    WorkloadConfig,
    build_workload,
    read_jsonl,
    restamp,
    write_jsonl,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send and how to judge it; the same plan gives the same requests every time."""

    workload: WorkloadConfig
    load: LoadConfig
    slo: SLO
    base_url: str = "http://127.0.0.1:8000"
    api: Api = Api.CHAT
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    exact_output_len: bool = True
    workload_file: str | None = None  # read the requests from this JSONL instead of generating
    save_workload: str | None = None  # write the generated requests here
    plots: bool = True
    # Pin the load generator to these CPUs while it sends (None: wherever the OS puts it), so a
    # client on the same machine does not steal the cores the server's workers are pinned to.
    client_cpus: tuple[int, ...] | None = None

    def with_target(self, base_url: str) -> Plan:
        return dataclasses.replace(self, base_url=base_url)


def _pinned(cpus: tuple[int, ...] | None, fn):
    """Run fn with this process pinned to `cpus`, restoring the affinity after."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return fn()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, before)


def specs_for(plan: Plan, rate: float | None = None) -> list[RequestSpec]:
    """The plan's requests; at `rate` when given (else the workload's own rate or file times)."""
    wl = plan.workload
    if plan.workload_file:
        specs = read_jsonl(plan.workload_file)
        if rate is not None:
            specs = restamp(specs, rate, wl.arrival, wl.burstiness, wl.seed)
    else:
        specs = build_workload(wl if rate is None else dataclasses.replace(wl, request_rate=rate))
    if plan.save_workload:
        write_jsonl(plan.save_workload, specs)
    return specs


def resolve_model(plan: Plan) -> str:
    if plan.model:
        return plan.model
    import asyncio

    async def ask() -> str:
        async with httpx.AsyncClient(timeout=30.0) as client:
            return await default_model(client, plan.base_url, plan.api_key)

    return asyncio.run(ask())


def run_point(plan: Plan, out_dir: Path, rate: float | None = None, label: str = "") -> dict:
    """One benchmark run: send the workload, write summary.json, requests.jsonl and plots."""
    specs = specs_for(plan, rate)
    model = resolve_model(plan)
    endpoint = Endpoint(base_url=plan.base_url, model=model, api=plan.api, api_key=plan.api_key,
                        exact_output_len=plan.exact_output_len)
    log.info("benchmark %s: %d requests against %s (%s)", label or "run", len(specs), plan.base_url, model)
    page_before = stage_scrape.metrics_page(plan.base_url)
    stages_before = stage_scrape.stage_seconds(page_before)
    result = _pinned(plan.client_cpus, lambda: run_load_sync(specs, endpoint, plan.load))
    page_after = ""
    if page_before:
        if stages_before:  # heartbeats carry the stage counters: one beat more has the run's last steps
            time.sleep(stage_scrape.HEARTBEAT_WAIT_S)
        page_after = stage_scrape.metrics_page(plan.base_url)
    bubbles = stage_scrape.bubble_fractions(stages_before, stage_scrape.stage_seconds(page_after)) \
        if stages_before else {}
    handoffs = handoff_scrape.handoff_split(handoff_scrape.handoff_moments(page_before),
                                            handoff_scrape.handoff_moments(page_after))
    effective_rate = rate if rate is not None else plan.workload.request_rate
    if plan.workload_file and rate is None:
        effective_rate = math.nan  # the file's own arrival times
    info = RunInfo(
        duration_s=result.duration_s, request_rate=effective_rate, burstiness=plan.workload.burstiness,
        max_concurrency=plan.load.concurrency,
        extra={"label": label, "model": model, "base_url": plan.base_url, "endpoint": plan.api.path,
               "workload": plan.workload_file or plan.workload.kind.value,
               "load_mode": plan.load.mode.value, "seed": plan.workload.seed})
    summary = summarize(result.records, info, plan.slo)
    if bubbles:
        summary["bubble_fraction"] = bubbles  # worker -> per stage, over the run
    if handoffs:
        summary["handoff_split"] = handoffs  # the router's means over the run's hand-offs
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "summary.json", summary)
    report.write_records(out_dir / "requests.jsonl", result.records)
    if plan.plots:
        ttft_slo = plan.slo.ttft_s * 1e3 if plan.slo.ttft_s is not None else None
        tbt_slo = max((v for _, v in plan.slo.tbt), default=None)
        plots.run_plots(result.records, out_dir, ttft_slo, tbt_slo * 1e3 if tbt_slo is not None else None)
    return summary


def max_rate_meeting(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The highest rate whose attainment reaches `target` with every lower rate reaching it too
    (a noisy pass above a failed rate is not trusted)."""
    best = None
    for rate, attainment in sorted(points):
        if attainment < target:
            break
        best = rate
    return best


def peak_goodput(points: Sequence[dict]) -> tuple[float, float] | None:
    """(goodput, rate) of the sweep point with the most requests per second meeting the SLO: what a
    deployment delivers under the SLO at its best offered load, which can lie above the highest
    rate where 90% still meet it (a server past that rate may still serve more of them per second)."""
    best = max(points, key=lambda p: (p["goodput"], -p["request_rate"]), default=None)
    return (best["goodput"], best["request_rate"]) if best is not None else None


def parse_rates(text: str) -> list[float]:
    """`1,2,4,8` or `start:stop:step` (inclusive of stop)."""
    text = text.strip()
    if ":" in text:
        start, stop, step = (float(x) for x in text.split(":"))
        if step <= 0 or stop < start:
            raise ValueError(f"bad rate range {text!r}: need start:stop:step with step > 0 and stop >= start")
        n = int(math.floor((stop - start) / step + 1e-9)) + 1
        rates = [round(start + i * step, 9) for i in range(n)]
    else:
        rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"bad rates {text!r}: give positive request rates, e.g. 1,2,4 or 1:8:1")
    return rates


def run_sweep(plan: Plan, rates: Sequence[float], out_dir: Path, target: float, label: str = "") -> dict:
    """Run the plan at each rate; return attainment per rate and the highest rate meeting the SLO."""
    if plan.load.mode is LoadMode.CLOSED:
        raise ValueError("a rate sweep needs open-loop load: drop --concurrency (use --max-concurrency to cap)")
    if plan.slo.empty:
        raise ValueError("a sweep looks for the highest rate meeting the SLO: give one with --slo")
    points = []
    for i, rate in enumerate(rates):
        # Fresh prompts at every point (seed + 1 + i; the plan's own run, if any, had the seed):
        # repeated prompts would hit the server's prefix cache and skip their prefill, and the
        # later points would measure cached prompts. A workload file's prompts are fixed.
        point_plan = dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, seed=plan.workload.seed + 1 + i))
        s = run_point(point_plan, out_dir / f"rate_{rate:g}", rate=rate, label=label)
        points.append({key: s[key] for key in (
            "request_rate", "slo_attainment", "goodput", "request_throughput", "output_throughput",
            "completed", "failed", "p50_ttft_ms", "p99_ttft_ms", "p50_tbt_ms", "p99_tbt_ms")})
    curve = [(p["request_rate"], p["slo_attainment"]) for p in points]
    peak, peak_rate = peak_goodput(points) or (None, None)
    result = {"label": label, "attainment_target": target, "slo": plan.slo.describe(),
              "max_rate_meeting_slo": max_rate_meeting(curve, target), "peak_goodput": peak,
              "peak_goodput_rate": peak_rate, "points": points}
    report.write_json(out_dir / "sweep.json", result)
    if plan.plots:
        plots.attainment_vs_rate({label or "run": curve}, out_dir / "attainment_vs_rate.png", target)
    return result


def sweep_table(result: dict) -> str:
    rows = [[p["request_rate"], 100 * p["slo_attainment"], p["goodput"], p["request_throughput"],
             p["p99_ttft_ms"], p["p99_tbt_ms"], p["failed"]] for p in result["points"]]
    table = report.format_table(["rate (req/s)", "attainment %", "goodput", "req/s", "p99 TTFT ms",
                                 "p99 TBT ms", "failed"], rows)
    best, peak = result["max_rate_meeting_slo"], result["peak_goodput"]
    text = table + f"\nhighest rate meeting the SLO at {100 * result['attainment_target']:g}%: " + (
        f"{best:g} req/s" if best is not None else "none of the rates tried")
    if peak is not None:
        text += f"\npeak goodput: {peak:.2f} req/s meeting the SLO, at {result['peak_goodput_rate']:g} req/s offered"
    return text
