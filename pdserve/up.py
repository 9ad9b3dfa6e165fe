"""`pdserve up`: the router and its workers on this machine, as child processes.

Disaggregated by default (one prefill and one decode worker, each pinned to its own CPU core,
KV over shared memory); `--colocated --policy X` starts the colocated baseline instead. A child
that dies is started again with backoff while the others keep serving (pdserve/supervisor.py).
Ctrl-C or SIGTERM drains the workers, then stops the router.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace

import httpx

from pdserve.config import envs
from pdserve.config.engine import (
    ConfigError,
    EngineConfig,
    add_engine_arguments,
    add_policy_arguments,
    engine_argv,
    engine_config,
)
from pdserve.config.envs import flag_default
from pdserve.config.names import COLOCATED_POLICIES, KV_STREAMING, KV_TRANSPORTS
from pdserve.config.router import (
    API_KEY_ENV,
    add_router_arguments,
    router_argv,
    router_config,
    router_environ,
)
from pdserve.config.tracing import add_tracing_arguments, tracing_argv, tracing_options
from pdserve.config.worker import SECRET_ENV, WorkerOptions, worker_argv
from pdserve.gpus import Placement, gpus_for, place_workers
from pdserve.protocol.auth import new_secret
from pdserve.supervisor import Supervisor

log = logging.getLogger(__name__)

# RouterConfig fields that `pdserve up` sets from its own flags (or, for the engine's, shares).
ROUTER_FIELDS_SET_BY_UP = frozenset({"host", "port", "control_address", "model", "api_key", "kv_transport",
                                     "drain_timeout", "expect_workers", "max_model_len"})

def register(sub) -> None:
    p = sub.add_parser("up", help="router + prefill + decode on this machine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=flag_default("host", "127.0.0.1"), help="address the router's HTTP API binds")
    p.add_argument("--port", type=int, default=flag_default("port", 8000), help="the router's HTTP port")
    p.add_argument("--colocated", action="store_true", default=flag_default("colocated", False),
                   help="run colocated workers (prefill and decode in one engine) instead of disaggregated ones")
    add_policy_arguments(p, COLOCATED_POLICIES)
    p.add_argument("--num-prefill", type=int, default=flag_default("num-prefill", 1))
    p.add_argument("--num-decode", type=int, default=flag_default("num-decode", 1),
                   help="decode workers (colocated workers with --colocated)")
    p.add_argument("--kv-transport", default=flag_default("kv-transport", "shm"), choices=KV_TRANSPORTS)
    p.add_argument("--kv-streaming", default=flag_default("kv-streaming", "layer"), choices=KV_STREAMING,
                   help="layer (default): prefill workers send each prompt chunk's KV, every layer, as soon as the "
                        "chunk has computed it; request: all of it after the prompt")
    p.add_argument("--gpus", default=flag_default("gpus", ""),
                   help="with --device cuda: the GPUs to spread the workers over, e.g. 0,1 (default: every visible "
                        "one); one worker per GPU, in turn, those sharing a GPU splitting --gpu-memory-utilization "
                        "(pdserve/gpus.py)")
    p.add_argument("--prefill-pipeline-parallel-size", type=int,
                   default=flag_default("prefill-pipeline-parallel-size", 0),
                   help="pipeline stages of each prefill worker (0: --pipeline-parallel-size's)")
    p.add_argument("--decode-pipeline-parallel-size", type=int,
                   default=flag_default("decode-pipeline-parallel-size", 0),
                   help="pipeline stages of each decode worker, and of each colocated worker with --colocated "
                        "(0: --pipeline-parallel-size's)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin processes to cores (by default decode workers get cores of their own; "
                        "prefill workers and the router share the rest)")
    p.add_argument("--api-key", default=flag_default("api-key", None),
                   help="require this bearer token (prefer PDSERVE_API_KEY: a command line is visible to every "
                        "local user; the router gets it in its environment)")
    p.add_argument("--ready-timeout", type=float, default=flag_default("ready-timeout", 600.0))
    p.add_argument("--restart-backoff", type=float, default=flag_default("restart-backoff", 1.0),
                   help="seconds before a dead child is started again (doubles while it keeps dying)")
    p.add_argument("--drain-timeout", type=float, default=flag_default("drain-timeout", 20.0),
                   help="seconds a stopping worker (or the router) finishes its requests; the router moves what a "
                        "worker leaves unfinished to another")
    add_tracing_arguments(p)  # each child gets the same; a trace file of its own (config/tracing.py)
    add_engine_arguments(p)
    # The router's other settings, passed on as flags (--model and --max-model-len are the engine's).
    add_router_arguments(p, skip=ROUTER_FIELDS_SET_BY_UP)
    p.set_defaults(func=run)


def core_set(pool: list[int], start: int, count: int) -> tuple[int, ...]:
    """`count` cores of `pool` from index `start`, wrapping round (repeats dropped)."""
    return tuple(sorted({pool[(start + k) % len(pool)] for k in range(count)}))


def plan(args) -> list[tuple[str, list[str], tuple[int, ...] | None]]:
    """(name, argv, the CPU cores it is pinned to or None) of every child process."""
    base = [sys.executable, "-m", "pdserve", "--log-level", logging.getLevelName(logging.getLogger().level)]
    control = private_control_address()
    workers = args.num_decode + (0 if args.colocated else args.num_prefill)
    router_settings = router_config(args, host=args.host, port=args.port, control_address=control,
                                    model=args.model, api_key=args.api_key, kv_transport="auto",
                                    drain_timeout=args.drain_timeout, expect_workers=workers,
                                    max_model_len=args.max_model_len)
    router = [*base, "router", *router_argv(router_settings)]
    traces = tracing_options(args)
    router += tracing_argv(traces, "router")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    base_stages = args.pipeline_parallel_size
    stages = {"prefill": args.prefill_pipeline_parallel_size or base_stages,
              "decode": args.decode_pipeline_parallel_size or base_stages}
    if args.colocated:
        # One engine does everything: give it every core (threads), pin nothing (its pipeline
        # stages, if any, split the cores among themselves: engine/pipeline.py).
        threads = args.threads or len(cores)
        pins: list[tuple[int, ...] | None] = [None] * args.num_decode
        router_core: tuple[int, ...] | None = None
    else:
        # Decode workers get cores of their own (their steps set TBT); prefill workers and the
        # router share what is left, so neither ever preempts a decode step. A worker of S
        # pipeline stages gets S cores of its pool (wrapping round where the pool is smaller:
        # its stages share them), one a stage.
        threads = args.threads or 1
        n_dec = min(args.num_decode * stages["decode"], max(1, len(cores) - 1))
        dec_cores, rest = cores[len(cores) - n_dec:], cores[: len(cores) - n_dec] or cores
        pins = [core_set(rest, i * stages["prefill"], stages["prefill"]) for i in range(args.num_prefill)]
        pins += [core_set(dec_cores, i * stages["decode"], stages["decode"]) for i in range(args.num_decode)]
        router_core = (rest[0],)
    if args.no_pin:
        pins = [None] * len(pins)
        router_core = None
    config = engine_config(args)
    engine = engine_argv(config, threads=threads)
    children: list[tuple[str, list[str], tuple[int, ...] | None]] = [("router", router, router_core)]
    roles = [("decode", i) for i in range(args.num_decode)]
    if not args.colocated:
        roles = [("prefill", i) for i in range(args.num_prefill)] + roles
    placements = gpu_placements(args, config, len(roles))
    for n, (role, i) in enumerate(roles):
        transports = (args.kv_transport,) if role == "decode" else KV_TRANSPORTS
        options = WorkerOptions(router_address=control, host="127.0.0.1", kv_transports=transports,
                                worker_id=f"{role}-{i}", drain_timeout=args.drain_timeout,
                                kv_streaming=args.kv_streaming)
        on_gpu = engine if placements is None else engine_argv(
            replace(config, device=placements[n].device, gpu_memory_utilization=placements[n].gpu_memory_utilization),
            threads=threads)
        cmd = [*base, role, *worker_argv(options), *on_gpu, *tracing_argv(traces, f"{role}-{i}")]
        if stages[role] != base_stages:  # the later flag wins
            cmd += ["--pipeline-parallel-size", str(stages[role])]
        if role == "decode" and args.colocated:
            cmd += ["--mode", "colocated", "--policy", args.policy,
                    "--waiting-served-ratio", str(args.waiting_served_ratio)]
        children.append((f"{role}-{i}", cmd, pins[n]))
    return children


def gpu_placements(args, config: EngineConfig, num_workers: int) -> list[Placement] | None:
    """Each worker's GPU and memory share (pdserve/gpus.py); None off CUDA."""
    if not config.device.startswith("cuda"):
        if args.gpus:
            raise ConfigError("--gpus places workers on GPUs: it needs --device cuda")
        return None

    def count_visible() -> int:
        import torch  # only here: `pdserve up` itself runs no model

        return torch.cuda.device_count()

    try:
        gpus = gpus_for(config.device, args.gpus, count_visible)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return place_workers(num_workers, gpus, config.gpu_memory_utilization)


def private_control_address() -> str:
    """Where the router's control channel listens: a socket file in a new directory that only this
    user may write to (mkdtemp: mode 0700), removed at exit. A TCP port picked here and bound by the
    router seconds later could be taken meanwhile by another local user; this path cannot."""
    directory = tempfile.mkdtemp(prefix="pdserve-up-")
    atexit.register(shutil.rmtree, directory, True)
    return f"ipc://{directory}/control"


def run(args) -> int:
    try:
        children = plan(args)
    except ConfigError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # A fresh secret authenticates the children to each other; it and the API key go through the
    # environment, not argv, so `ps` does not show them.
    env = envs.child_environ({SECRET_ENV: new_secret(), **router_environ(router_config(args))},
                             drop=(envs.twin_of("secret-file"), API_KEY_ENV))
    supervisor = Supervisor(children, env, min_backoff=args.restart_backoff).start()
    url = f"http://{args.host}:{args.port}"
    ready = False
    deadline = time.time() + args.ready_timeout
    code = 0
    while not stopping:
        # A dead child is restarted (with backoff) while the others keep serving.
        supervisor.poll()
        if not ready:
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(f"{url}/ready", timeout=1.0).status_code == 200
            if ready:
                mode = f"colocated, policy {args.policy}" if args.colocated else f"disaggregated, KV over {args.kv_transport}"
                print(f"pdserve is up at {url} ({mode}); OpenAI base URL {url}/v1, chat page {url}/. "
                      "Ctrl-C stops it.", flush=True)
            elif time.time() > deadline:
                print(f"pdserve: not ready after {args.ready_timeout:.0f}s; shutting down", file=sys.stderr)
                code = 1
                break
        time.sleep(0.2)
    supervisor.stop()
    return code
