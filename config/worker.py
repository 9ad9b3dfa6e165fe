"""A worker's configuration (prefill, decode or colocated): where it listens, whom it reports to.

`add_worker_arguments` declares the flags, `worker_options` builds the validated WorkerOptions,
and `worker_argv` turns options back into flags for `pdserve up`'s children. Each flag
`--foo-bar` defaults to $PDSERVE_FOO_BAR when that is set.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from pdserve.config import envs
from pdserve.config.engine import ConfigError, add_engine_arguments
from pdserve.config.envs import add_env_argument, flag_default
from pdserve.config.names import KV_STREAMING, KV_TRANSPORTS
from pdserve.config.router_address import parse_router_addresses
from pdserve.config.tracing import add_tracing_arguments

log = logging.getLogger(__name__)

PLACEHOLDER = b"REPLACE-ME"  # the stand-in older manifests shipped, refused so that no deployment runs on it
SECRET_ENV = "PDSERVE_SECRET"  # the secret itself (how `pdserve up` hands it to its children)
NO_SECRET = ("no deployment secret: pass --secret-file PATH (or set PDSERVE_SECRET or PDSERVE_SECRET_FILE), "
             "or --insecure to run the internal planes unauthenticated (docs/security.md)")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    router_address: str = "tcp://127.0.0.1:5550"  # one or more routers (config/router_address.py)
    router_resolve_interval: float = 5.0  # seconds between lookups of a dns:// router address
    host: str = "127.0.0.1"  # every socket of the worker binds here
    advertise_host: str | None = None  # what others dial; defaults to host
    kv_port: int = 0
    health_port: int = 0
    kv_transports: tuple[str, ...] = ("tcp",)
    host_id: str = ""
    worker_id: str | None = None
    drain_timeout: float = 20.0
    heartbeat_interval: float = 1.0
    stuck_after: float = 60.0  # seconds without a loop tick before /health fails
    kv_lease: float = 5.0
    kv_streaming: str = "layer"  # a prefill worker ships each prompt chunk's KV as it lands; "request": at the end
    # The deployment secret (None only with insecure=True); never printed, never on argv.
    secret: bytes | None = field(default=None, repr=False)
    insecure: bool = False

    def __post_init__(self) -> None:
        bad = [k for k in self.kv_transports if k not in KV_TRANSPORTS]
        if bad or not self.kv_transports:
            raise ConfigError(f"--kv-transport: unknown transport(s) {bad or list(self.kv_transports)}; "
                              f"use {', '.join(KV_TRANSPORTS)}")
        if self.kv_streaming not in KV_STREAMING:
            raise ConfigError(f"--kv-streaming must be one of {', '.join(KV_STREAMING)}, got {self.kv_streaming!r}")
        if self.heartbeat_interval <= 0 or self.drain_timeout < 0:
            raise ConfigError("--heartbeat-interval must be positive and --drain-timeout not negative")
        parse_router_addresses(self.router_address)
        if self.router_resolve_interval <= 0:
            raise ConfigError("--router-resolve-interval must be positive")


def add_worker_arguments(p: argparse.ArgumentParser, kv_port: int, health_port: int, transports: str) -> None:
    """The flags of a worker process, the engine's included."""
    g = p.add_argument_group("worker")
    g.add_argument("--router-address", default=flag_default("router-address", "tcp://127.0.0.1:5550"),
                   help="the routers' control sockets (ZMQ); the worker registers with every one: "
                        "tcp://HOST:PORT, several comma-separated, or dns://NAME:PORT for every address "
                        "NAME resolves to (IPv4 and IPv6, looked up again every --router-resolve-interval "
                        "seconds: a Kubernetes headless Service)")
    add_env_argument(g, "--router-resolve-interval", 5.0,
                     "seconds between lookups of a dns:// --router-address; a router whose address is "
                     "gone for a minute is dropped, with its requests")
    g.add_argument("--host", default=flag_default("host", "127.0.0.1"), help="address every socket of this worker binds")
    g.add_argument("--advertise-host", default=flag_default("advertise-host", None),
                   help="address other workers dial to reach this one (default: --host)")
    g.add_argument("--kv-port", type=int, default=flag_default("kv-port", kv_port), help="KV channel port (0: any free)")
    g.add_argument("--health-port", type=int, default=flag_default("health-port", health_port),
                   help="HTTP port of /health and /ready (0: any free)")
    g.add_argument("--kv-transport", default=flag_default("kv-transport", transports),
                   help=f"comma-separated KV transports this worker offers, preferred first: {', '.join(KV_TRANSPORTS)}")
    g.add_argument("--host-id", default=flag_default("host-id", ""),
                   help="workers with the same host id may use shm / CUDA IPC (default: the hostname)")
    g.add_argument("--worker-id", default=flag_default("worker-id", None), help="unique name (default: role-host-pid)")
    g.add_argument("--kv-streaming", choices=KV_STREAMING, default=flag_default("kv-streaming", "layer"),
                   help="when a prefill worker ships a request's KV: layer (default) sends the blocks of each "
                        "prompt chunk, every layer, as soon as the chunk has computed them, so only the last "
                        "chunk's KV is left when the first token is out; request sends it all after the prompt")
    g.add_argument("--drain-timeout", type=float, default=flag_default("drain-timeout", 20.0),
                   help="seconds to finish in-flight requests after SIGTERM")
    g.add_argument("--heartbeat-interval", type=float, default=flag_default("heartbeat-interval", 1.0))
    add_secret_arguments(g)
    add_tracing_arguments(p)
    add_engine_arguments(p)


def add_secret_arguments(g) -> None:
    """--secret-file and --insecure (the router and every worker take both)."""
    g.add_argument("--secret-file", default=flag_default("secret-file", None),
                   help="file holding the deployment secret that authenticates the control and KV planes "
                        "(or env PDSERVE_SECRET_FILE, or the secret itself in PDSERVE_SECRET)")
    g.add_argument("--insecure", action="store_true", default=flag_default("insecure", False),
                   help="run the internal planes without authentication (tests, a trusted laptop)")


def resolve_secret(secret_file: str | None, insecure: bool) -> bytes | None:
    """The deployment secret from --secret-file or $PDSERVE_SECRET; None only under --insecure."""
    secret: bytes | None = None
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--secret-file {secret_file}: {exc.strerror}") from None
        if not secret:
            raise ConfigError(f"--secret-file {secret_file} is empty")
    elif envs.get(SECRET_ENV):
        secret = str(envs.get(SECRET_ENV)).strip().encode()
    if secret is not None:
        if secret.startswith(PLACEHOLDER):
            raise ConfigError("the deployment secret is still the placeholder older manifests shipped; "
                              "replace it with a random one (docs/kubernetes.md, Deploy)")
        if len(secret) < 16:
            raise ConfigError("the deployment secret must be at least 16 bytes (e.g. `openssl rand -hex 32`)")
        return secret
    if not insecure:
        raise ConfigError(NO_SECRET)
    log.warning("--insecure: the control and KV planes are NOT authenticated; anyone who reaches "
                "their ports can register workers and inject KV")
    return None


def parse_transports(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    return WorkerOptions(
        router_address=args.router_address, router_resolve_interval=args.router_resolve_interval,
        host=args.host, advertise_host=args.advertise_host,
        kv_port=args.kv_port, health_port=args.health_port, kv_transports=parse_transports(args.kv_transport),
        host_id=args.host_id, worker_id=args.worker_id, drain_timeout=args.drain_timeout,
        heartbeat_interval=args.heartbeat_interval, kv_streaming=args.kv_streaming,
        secret=resolve_secret(args.secret_file, args.insecure), insecure=args.insecure,
    )


def worker_argv(options: WorkerOptions) -> list[str]:
    """The flags that rebuild `options` in another process."""
    out = ["--router-address", options.router_address,
           "--router-resolve-interval", str(options.router_resolve_interval), "--host", options.host,
           "--kv-port", str(options.kv_port), "--health-port", str(options.health_port),
           "--kv-transport", ",".join(options.kv_transports),
           "--drain-timeout", str(options.drain_timeout), "--heartbeat-interval", str(options.heartbeat_interval),
           "--kv-streaming", options.kv_streaming]
    if options.advertise_host:
        out += ["--advertise-host", options.advertise_host]
    if options.host_id:
        out += ["--host-id", options.host_id]
    if options.worker_id:
        out += ["--worker-id", options.worker_id]
    if options.insecure:
        out += ["--insecure"]  # the secret itself travels in the environment, never on argv
    return out
