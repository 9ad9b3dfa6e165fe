"""`pdserve bench compare` with several workloads per start: each deployment is started once and
sent every workload meant for it, for runs where a start costs more than a workload (vLLM
compiles its model for minutes at each start).

    python -m pdserve.bench.multi_compare --output-dir DIR --deployment NAME=CMD [...] \\
        --run NAME='BENCH OPTIONS' [...] [--only RUN=DEPLOYMENT,...] [BENCH OPTIONS]

A run's BENCH OPTIONS are those of `pdserve bench compare` (workload, load, SLO, `--rates`),
read after the bench options given outside any run, so a run's own options win. Deployments
start one after another, as compare starts them (`{port}`, ready at `/ready?warm=1` or
`/health`, SIGTERM to the process group), and each goes through its runs in the order given.
`--only` keeps a run to some deployments (default: every one).

DIR/RUN/ then reads as one compare run of that workload: `compare.json` with every
deployment's summary (its start-up time included), `compare.md`, the comparison plots,
`plan.json` (the workload, the load and the SLO, for a reader of the results), and
DIR/RUN/DEPLOYMENT/ with `summary.json` and `requests.jsonl`. A run with `--rates` is the
sweep alone: DIR/RUN/DEPLOYMENT/sweep/sweep.json, and in compare.json its SLO capacity and peak
goodput. The servers' logs go to DIR/servers/DEPLOYMENT/server.log. A deployment that does
not start, or fails, gets the error in each of its runs that did not finish; the others go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench import compare, plots, report
from pdserve.bench.cli import build_parser, plan_from_args
from pdserve.bench.compare import Deployment, DeploymentError
from pdserve.bench.sweep import Plan, parse_rates, run_point, run_sweep, sweep_table
from pdserve.config.envs import flag_default

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a run's name is a folder name
_SWEEP_KEYS = ("max_rate_meeting_slo", "peak_goodput", "peak_goodput_rate", "slo", "attainment_target")


@dataclass(frozen=True, slots=True)
class Run:
    """A named workload: its plan, the rates it sweeps (None: one point at the plan's own load),
    and the deployments it is for (None: every one)."""

    name: str
    plan: Plan
    rates: tuple[float, ...] | None = None
    attainment_target: float = 0.9
    deployments: frozenset[str] | None = None

    def is_for(self, deployment: str) -> bool:
        return self.deployments is None or deployment in self.deployments


def parse_run(text: str, common: Sequence[str] = ()) -> Run:
    """`NAME=OPTIONS` with `common` bench options before OPTIONS; a ValueError names what is wrong."""
    name, sep, options = text.partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise ValueError(f"bad run {text!r}: use NAME=OPTIONS, NAME a folder name, e.g. "
                         "'burst=--request-rate inf --num-requests 32'")
    try:
        args = build_parser().parse_args(["compare", *common, *shlex.split(options)])
    except SystemExit:  # argparse has printed what it could not parse
        raise ValueError(f"run {name!r}: bad bench options {options!r}") from None
    plan = plan_from_args(args)
    rates = tuple(parse_rates(args.rates)) if args.rates else None
    if rates and plan.slo.empty:
        raise ValueError(f"run {name!r}: a sweep looks for the highest rate meeting the SLO: give --slo")
    return Run(name, plan, rates, args.attainment_target)


def restrict(runs: Sequence[Run], only: Sequence[str], deployments: Sequence[Deployment]) -> list[Run]:
    """`runs` with each `RUN=DEP,DEP` of `only` keeping that run to those deployments."""
    by_name = {r.name: r for r in runs}
    names = {d.name for d in deployments}
    kept = dict(by_name)
    for text in only:
        run, sep, deps = text.partition("=")
        wanted = frozenset(d.strip() for d in deps.split(",") if d.strip())
        if not sep or run not in by_name:
            raise ValueError(f"bad --only {text!r}: use RUN=DEPLOYMENT,... with RUN one of {', '.join(by_name)}")
        if unknown := wanted - names:
            raise ValueError(f"--only {text!r}: no deployment named {', '.join(sorted(unknown))}")
        kept[run] = Run(run, by_name[run].plan, by_name[run].rates, by_name[run].attainment_target, wanted)
    return list(kept.values())


def _run_one(run: Run, base_url: str, startup_s: float, out_dir: Path, label: str) -> tuple[dict, dict | None]:
    """(compare.json's summary, the sweep or None) of one run against a started deployment."""
    target = run.plan.with_target(base_url)
    if run.rates is None:
        summary = run_point(target, out_dir, label=label)
        summary["startup_s"] = startup_s
        return summary, None
    sweep = run_sweep(target, run.rates, out_dir / "sweep", run.attainment_target, label=label)
    return {**{k: sweep[k] for k in _SWEEP_KEYS}, "rates": list(run.rates), "startup_s": startup_s}, sweep


def plan_record(run: Run) -> dict:
    """What plan.json holds: the run's workload (its tokenizer's path left out), load, SLO and rates."""
    workload = {k: v for k, v in dataclasses.asdict(run.plan.workload).items() if k != "tokenizer"}
    load = run.plan.load
    return {"workload": workload, "load": {"mode": load.mode.value, "concurrency": load.concurrency,
                                           "num_warmup": load.num_warmup},
            "slo": run.plan.slo.describe(), "rates": list(run.rates) if run.rates else None,
            "attainment_target": run.attainment_target}


def _write(run: Run, folder: Path, results: dict[str, dict], sweeps: dict[str, dict]) -> None:
    report.write_json(folder / "plan.json", plan_record(run))
    report.write_json(folder / "compare.json", {"deployments": results})
    if run.rates is None:
        text = compare.compare_table(results)
    else:
        text = "\n\n".join(f"{name}: " + (f"error: {s['error']}" if "error" in s else sweep_table(sweeps[name]))
                           for name, s in results.items())
    (folder / "compare.md").write_text(text + "\n")


def run_all(deployments: Sequence[Deployment], runs: Sequence[Run], out_dir: Path,
            ready_timeout_s: float = 600.0, stop_timeout_s: float = 30.0) -> dict[str, dict[str, dict]]:
    """Start each deployment once, send it its runs, stop it; run name -> deployment -> summary."""
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise ValueError(f"deployment names must be unique, got {names}")
    if len({r.name for r in runs}) != len(runs):
        raise ValueError(f"run names must be unique, got {[r.name for r in runs]}")
    results: dict[str, dict[str, dict]] = {r.name: {} for r in runs}
    sweeps: dict[str, dict[str, dict]] = {r.name: {} for r in runs}
    for dep in deployments:
        mine = [r for r in runs if r.is_for(dep.name)]
        if not mine:
            continue
        try:
            with compare.running(dep, out_dir / "servers" / dep.name, ready_timeout_s, stop_timeout_s) as started:
                for run in mine:
                    summary, sweep = _run_one(run, started.base_url, started.startup_s,
                                              out_dir / run.name / dep.name, dep.name)
                    results[run.name][dep.name] = summary
                    if sweep is not None:
                        sweeps[run.name][dep.name] = sweep
                    _write(run, out_dir / run.name, results[run.name], sweeps[run.name])
        except (DeploymentError, RuntimeError, httpx.HTTPError) as e:
            # One broken deployment must not cost the others' results.
            log.error("deployment %s failed: %s", dep.name, e)
            for run in mine:
                if dep.name not in results[run.name]:
                    results[run.name][dep.name] = {"error": str(e)}
                    _write(run, out_dir / run.name, results[run.name], sweeps[run.name])
    for run in runs:
        if run.plan.plots and results[run.name]:
            _plots(run, out_dir / run.name, results[run.name], sweeps[run.name])
    return results


def _plots(run: Run, folder: Path, results: dict[str, dict], sweeps: dict[str, dict]) -> None:
    if run.rates is None:
        compare.replot(folder, run.attainment_target)
    elif sweeps:
        curves = {n: [(p["request_rate"], p["slo_attainment"]) for p in s["points"]] for n, s in sweeps.items()}
        plots.attainment_vs_rate(curves, folder / "attainment_vs_rate.png", run.attainment_target)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.multi_compare", allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("--output-dir", required=True, type=Path, help="one folder per run, and servers/ for the logs")
    p.add_argument("--deployment", action="append", required=True, help="NAME=COMMAND with {port}; repeat for each")
    p.add_argument("--run", action="append", required=True, help="NAME=BENCH_OPTIONS; repeat for each")
    p.add_argument("--only", action="append", default=[], help="RUN=DEPLOYMENT,...: that run for those only")
    p.add_argument("--ready-timeout", type=float, default=flag_default("ready_timeout", 600.0, float),
                   help="seconds to wait for a deployment to be ready (default: 600; env PDSERVE_READY_TIMEOUT)")
    p.add_argument("--stop-timeout", type=float, default=flag_default("stop_timeout", 30.0, float),
                   help="seconds between SIGTERM and SIGKILL (default: 30; env PDSERVE_STOP_TIMEOUT)")
    args, common = p.parse_known_args(argv)
    try:
        deployments = [Deployment.parse(t) for t in args.deployment]
        runs = restrict([parse_run(t, common) for t in args.run], args.only, deployments)
        results = run_all(deployments, runs, args.output_dir, args.ready_timeout, args.stop_timeout)
    except (ValueError, FileNotFoundError) as e:
        print(f"multi_compare: error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        if (table := args.output_dir / run.name / "compare.md").is_file():
            print(f"{run.name}:\n{table.read_text()}")
    return 1 if any("error" in s for r in results.values() for s in r.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
