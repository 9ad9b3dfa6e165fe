"""Command-line plumbing shared by `pdserve prefill` and `pdserve decode`."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.envs import env_default
from engine.worker import Worker, WorkerOptions

log = logging.getLogger(__name__)


def add_worker_arguments(p: argparse.ArgumentParser, kv_port: int, health_port: int, transports: str) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--router-address", default=env_default("router-address", "tcp://127.0.0.1:5550"),
                   help="the router's control socket (ZMQ)")
    g.add_argument("--host", default=env_default("host", "127.0.0.1"), help="address every socket of this worker binds")
    g.add_argument("--advertise-host", default=env_default("advertise-host", None),
                   help="address other workers dial to reach this one (default: --host)")
    g.add_argument("--kv-port", type=int, default=env_default("kv-port", kv_port), help="KV channel port (0: any free)")
    g.add_argument("--health-port", type=int, default=env_default("health-port", health_port),
                   help="HTTP port of /health and /ready (0: any free)")
    g.add_argument("--kv-transport", default=env_default("kv-transport", transports),
                   help="comma-separated KV transports this worker offers, preferred first: tcp, shm, cuda_ipc")
    g.add_argument("--host-id", default=env_default("host-id", ""),
                   help="workers with the same host id may use shm / CUDA IPC (default: the hostname)")
    g.add_argument("--worker-id", default=env_default("worker-id", None), help="unique name (default: role-host-pid)")
    g.add_argument("--drain-timeout", type=float, default=env_default("drain-timeout", 20.0),
                   help="seconds to finish in-flight requests after SIGTERM")
    g.add_argument("--heartbeat-interval", type=float, default=env_default("heartbeat-interval", 1.0))
    add_engine_arguments(p)


def worker_options(args) -> WorkerOptions:
    kinds = tuple(k.strip() for k in args.kv_transport.split(",") if k.strip())
    bad = [k for k in kinds if k not in ("tcp", "shm", "cuda_ipc")]
    if bad or not kinds:
        raise SystemExit(f"pdserve: --kv-transport: unknown transport(s) {bad or kinds}; use tcp, shm, cuda_ipc")
    return WorkerOptions(
        router_address=args.router_address, host=args.host, advertise_host=args.advertise_host,
        kv_port=args.kv_port, health_port=args.health_port, kv_transports=kinds, host_id=args.host_id,
        worker_id=args.worker_id, drain_timeout=args.drain_timeout, heartbeat_interval=args.heartbeat_interval,
    )


def serve(worker_factory, args, policy: str = "chunked") -> int:
    """Load the model, start the worker, run its loop until drained."""
    import torch

    from engine.weights import ModelLoadError

    if args.threads:
        torch.set_num_threads(args.threads)
    options = worker_options(args)
    try:
        worker: Worker = worker_factory(options, engine_config_from_args(args, policy))
    except ModelLoadError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    worker.install_signal_handlers()
    worker.start()
    worker.run()
    log.info("worker %s stopped", worker.worker_id)
    return 0
