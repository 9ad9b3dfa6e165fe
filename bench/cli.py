"""`pdserve bench`: the TTFT/TBT SLO benchmark for any OpenAI-compatible server.

    pdserve bench [run] --base-url http://127.0.0.1:8000 --request-rate 4 --slo ttft=500ms,tbt_p99=100ms
    pdserve bench sweep --rates 1:8:1 --slo ttft=500ms,tbt_p99=100ms
    pdserve bench compare --deployment a=CMD --deployment b=CMD --slo ...

Every option `--foo-bar` takes its default from the environment variable `PDSERVE_FOO_BAR`
when that is set. The run options are accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.client import Api
from pdserve.bench.loadgen import LoadConfig, LoadMode
from pdserve.bench.metrics import SLO
from pdserve.bench.workloads import Arrival, WorkloadConfig, WorkloadKind
from pdserve.config.envs import flag_default


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0 (or inf)")
    return value


# (flag, type or "flag", default, help) per group; dest is the flag without dashes.
_RUN_OPTIONS: dict[str, list[tuple[str, Any, Any, str]]] = {
    "target": [
        ("--base-url", str, "http://127.0.0.1:8000", "server to benchmark"),
        ("--endpoint", str, "chat", "chat (/v1/chat/completions) or completions (/v1/completions)"),
        ("--model", str, None, "model name to send (default: the first one /v1/models lists)"),
        ("--api-key", str, None, "sent as 'Authorization: Bearer KEY'"),
    ],
    "workload": [
        ("--workload", str, "random", "random | conversation | code | shared-prefix | interference"),
        ("--workload-file", str, None, "read the requests from this JSONL instead of generating them"),
        ("--save-workload", str, None, "write the generated requests to this JSONL"),
        ("--num-requests", int, None, "measured requests (default 100, or enough for --duration)"),
        ("--input-len", int, 256, "mean prompt tokens (short chats in 'interference')"),
        ("--output-len", int, 64, "mean output tokens"),
        ("--range-ratio", float, 0.5, "random lengths are uniform in mean*[1-r, 1+r]"),
        ("--prefix-len", int, 128, "shared-prefix: tokens shared by a group"),
        ("--num-prefixes", int, 4, "shared-prefix: number of groups"),
        ("--long-input-len", int, 2048, "interference: tokens of each long prompt"),
        ("--long-output-len", int, 16, "interference: output tokens of each long prompt"),
        ("--long-interval", float, 2.0, "interference: seconds between long prompts"),
        ("--tokenizer", str, None, "tokenizer.json for exact prompt token counts (else ~1 token/word)"),
        ("--seed", int, 0, "seed of prompts, lengths and arrival times"),
        ("--no-exact-output", "flag", False, "do not send ignore_eos/min_tokens (outputs may stop early)"),
    ],
    "load": [
        ("--request-rate", _rate, math.inf, "open-loop requests/s (inf: all at once)"),
        ("--arrival", str, "poisson", "poisson | gamma | constant inter-arrival times"),
        ("--burstiness", float, 1.0, "gamma shape: < 1 burstier, > 1 steadier than Poisson"),
        ("--concurrency", int, None, "closed loop with this many clients (overrides --request-rate)"),
        ("--max-concurrency", int, None, "open loop: cap on requests in flight (late ones show as send lag)"),
        ("--warmup", int, 0, "requests sent first and excluded from results"),
        ("--duration", float, None, "seconds of measured load; no new requests after it"),
        ("--request-timeout", float, 600.0, "seconds before a request counts as failed"),
    ],
    "metrics": [
        ("--slo", str, "", "per-request SLO, e.g. ttft=500ms,tbt_p99=100ms,tpot=50ms,e2e=10s"),
        ("--slo-from", str, "intended", "measure SLO ttft/e2e from the 'intended' or actual ('sent') send time"),
    ],
    "output": [
        ("--output-dir", str, "bench-results", "directory for summary.json, requests.jsonl and PNGs"),
        ("--no-plots", "flag", False, "skip the PNG plots"),
        ("--no-progress", "flag", False, "no progress bar"),
        ("--client-cpus", str, None, "pin the load generator to these CPUs while it sends, e.g. '0' or '0,1' "
                                     "(keeps it off the cores a local server's workers are pinned to)"),
    ],
}


def _add_run_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """Add the run options; with `suppress` they set nothing unless given, so values given
    before the subcommand survive."""
    for group_name, options in _RUN_OPTIONS.items():
        group = p.add_argument_group(group_name)
        for flag, conv, default, text in options:
            dest = flag[2:].replace("-", "_")
            shown = "inf" if default == math.inf else default
            help_text = f"{text} (default: {shown}; env PDSERVE_{dest.upper()})"
            if conv == "flag":
                d = argparse.SUPPRESS if suppress else flag_default(dest, default, bool)
                group.add_argument(flag, action="store_true", default=d, help=help_text)
            else:
                d = argparse.SUPPRESS if suppress else flag_default(dest, default, conv)
                group.add_argument(flag, type=conv, default=d, help=help_text)


def _build(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_run_options(p, suppress=False)
    sub = p.add_subparsers(dest="bench_command", metavar="{run,sweep,compare}")
    fmt = argparse.RawDescriptionHelpFormatter
    run = sub.add_parser("run", help="one benchmark run (the default)", formatter_class=fmt,
                         description="Send one workload and report TTFT, TBT, TPOT, E2E, goodput.")
    _add_run_options(run, suppress=True)
    sweep = sub.add_parser("sweep", help="SLO attainment over a range of request rates", formatter_class=fmt,
                           description="Run the workload at each rate; report attainment vs rate and the highest rate meeting the SLO.")
    sweep.add_argument("--rates", default=flag_default("rates", "1,2,4,8"),
                       help="rates as 1,2,4 or start:stop:step (default: 1,2,4,8; env PDSERVE_RATES)")
    sweep.add_argument("--attainment-target", type=float, default=flag_default("attainment_target", 0.9, float),
                       help="fraction of requests that must meet the SLO (default: 0.9)")
    _add_run_options(sweep, suppress=True)
    cmp = sub.add_parser("compare", help="start each deployment, benchmark it, stop it; one table", formatter_class=fmt,
                         description="Start each deployment on localhost, wait for GET /ready, run the same "
                                     "workload, SIGTERM its process group; write compare.md, compare.json, PNGs.")
    env_deps = flag_default("deployment", None)
    cmp.add_argument("--deployment", action="append", default=None,
                     help="NAME=COMMAND with {port} in COMMAND; repeat for each (default: static, prefill-first, "
                          "mixed, chunked colocated and disaggregated 'pdserve up'; env PDSERVE_DEPLOYMENT, one per line)")
    cmp.set_defaults(env_deployments=env_deps)
    cmp.add_argument("--ready-timeout", type=float, default=flag_default("ready_timeout", 600.0, float),
                     help="seconds to wait for GET /ready == 200 (default: 600)")
    cmp.add_argument("--stop-timeout", type=float, default=flag_default("stop_timeout", 30.0, float),
                     help="seconds between SIGTERM and SIGKILL (default: 30)")
    cmp.add_argument("--rates", default=flag_default("rates", None),
                     help="also sweep each deployment over these rates (default: no sweep)")
    cmp.add_argument("--attainment-target", type=float, default=flag_default("attainment_target", 0.9, float),
                     help="sweep target attainment (default: 0.9)")
    _add_run_options(cmp, suppress=True)
    p.set_defaults(func=run_cli)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `bench` to the `pdserve` command's subparsers; `args.func(args)` runs it."""
    p = subparsers.add_parser("bench", help="TTFT/TBT SLO benchmark of an OpenAI-compatible server",
                              description=__doc__)
    _build(p)
    return p


def plan_from_args(args: argparse.Namespace):
    """The run plan the options describe; a ValueError names the bad option."""
    from pdserve.bench.sweep import Plan

    try:
        kind, arrival, api = WorkloadKind(args.workload), Arrival(args.arrival), Api.parse(args.endpoint)
    except ValueError as e:
        raise ValueError(f"{e} (check --workload, --arrival and --endpoint)") from None
    if args.slo_from not in ("intended", "sent"):
        raise ValueError(f"--slo-from must be 'intended' or 'sent', got {args.slo_from!r}")
    closed = args.concurrency is not None
    num = args.num_requests
    if num is None:
        num = 100
        if args.duration and not closed and math.isfinite(args.request_rate):
            num = math.ceil(args.request_rate * args.duration * 1.2) + 10
    workload = WorkloadConfig(
        kind=kind, num_requests=num + args.warmup, seed=args.seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, request_rate=args.request_rate,
        arrival=arrival, burstiness=args.burstiness, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, long_input_len=args.long_input_len,
        long_output_len=args.long_output_len, long_interval_s=args.long_interval, tokenizer=args.tokenizer)
    load = LoadConfig(
        mode=LoadMode.CLOSED if closed else LoadMode.OPEN,
        concurrency=args.concurrency if closed else args.max_concurrency,
        num_warmup=args.warmup, duration_s=args.duration,
        max_requests=args.num_requests if args.workload_file else None,
        request_timeout_s=args.request_timeout,
        progress=not args.no_progress)
    return Plan(workload=workload, load=load, slo=SLO.parse(args.slo, from_intended=args.slo_from == "intended"),
                base_url=args.base_url, api=api, model=args.model, api_key=args.api_key,
                exact_output_len=not args.no_exact_output, workload_file=args.workload_file,
                save_workload=args.save_workload, plots=not args.no_plots,
                client_cpus=tuple(int(c) for c in args.client_cpus.split(",")) if args.client_cpus else None)


def run_cli(args: argparse.Namespace) -> int:
    """Run the parsed `bench` command; returns the process exit code."""
    from pdserve.bench import compare, report, sweep

    command = getattr(args, "bench_command", None) or "run"
    out = Path(args.output_dir)
    try:
        plan = plan_from_args(args)
        if command == "run":
            summary = sweep.run_point(plan, out)
            print(report.format_summary(summary))
            print(f"results in {out}/ (summary.json, requests.jsonl{', PNGs' if plan.plots else ''})")
            return 0
        if command == "sweep":
            result = sweep.run_sweep(plan, sweep.parse_rates(args.rates), out, args.attainment_target)
            print(sweep.sweep_table(result))
            return 0
        texts = args.deployment or (args.env_deployments.splitlines() if args.env_deployments else None) \
            or list(compare.DEFAULT_DEPLOYMENTS)
        deps = [compare.Deployment.parse(t) for t in texts if t.strip()]
        rates = sweep.parse_rates(args.rates) if args.rates else None
        results = compare.run_compare(deps, plan, out, args.ready_timeout, args.stop_timeout, rates,
                                      args.attainment_target)
        print(compare.compare_table(results))
        print(f"results in {out}/ (compare.md, compare.json, PNGs, one directory per deployment)")
        return 1 if any("error" in s for s in results.values()) else 0
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"pdserve bench {command}: error: {e}", file=sys.stderr)
        return 2


def build_parser(prog: str = "python -m pdserve.bench.cli") -> argparse.ArgumentParser:
    """The standalone `bench` parser (the same one `register` adds under `pdserve`)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    _build(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
