"""The router's configuration: one frozen dataclass, its command-line flags, and the builder.

`pdserve router` declares the flags with `add_router_arguments` and builds its config with
`router_config`; `router_argv` turns a config back into flags and `router_environ` gives what must
not go on a command line (the API key), which is how `pdserve up` hands its own settings to the
router it starts. Each flag `--foo-bar` defaults to $PDSERVE_FOO_BAR when that is set
(config/envs.py). The defaults are the dataclass's, stated once.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass, fields
from typing import Any

from pdserve.config.engine import ConfigError
from pdserve.config.envs import add_env_argument, twin_of
from pdserve.config.names import KV_TRANSPORTS

KV_TRANSPORT_CHOICES = ("auto", *KV_TRANSPORTS)  # auto: shm / cuda_ipc between workers of one host
# The API key travels to a child router in its environment: a command line is readable by every
# local user (`ps`), a process's environment only by its own user.
API_KEY_ENV = twin_of("api-key")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router runs: where it listens, what it admits, how it treats workers and clients."""

    host: str = "127.0.0.1"
    port: int = 8000
    control_address: str = "tcp://127.0.0.1:5550"
    model: str = "default"
    served_model_name: str = ""  # "": the model's own name
    api_key: str | None = None
    # Without an API key the router serves /v1/* only on a loopback address, unless this is set
    # (authentication is done in front of it: an authenticating proxy, a mesh policy).
    allow_unauthenticated: bool = False
    max_inflight: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    max_model_len: int | None = None  # None: the smallest max_model_len the workers register
    heartbeat_timeout: float = 3.0
    kv_transport: str = "auto"
    request_timeout: float = 60.0
    migration_limit: int = 3  # re-dispatches of one choice: its worker was lost or gave it up
    prefill_fallback: bool = True  # no prefill worker left: a decode worker serves the request whole
    expect_workers: int = 0  # /ready waits until this many distinct workers have registered
    drain_timeout: float = 30.0
    grammar_timeout: float = 5.0  # seconds to compile a structured-output constraint
    grammar_threads: int = 1  # threads that compile constraints (never the tokenizing ones)
    # The HTTP edge (router/http_server.py; docs/http_edge.md).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 2048
    max_header_bytes: int = 16 * 1024
    tokenize_threads: int = 1
    # Bytes of request bodies all connections may hold buffered at once (503 past it). The router
    # pod's limit is 1 GiB (k8s/base/router.yaml); a buffered byte costs ~1.25 bytes of RSS.
    max_buffered_body_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORT_CHOICES:
            raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORT_CHOICES)}, "
                             f"got {self.kv_transport!r}")
        if not self.api_key and not self.allow_unauthenticated and not _is_loopback(self.host):
            raise ConfigError(f"no API key for a router whose HTTP API listens on {self.host}: set "
                              f"{API_KEY_ENV} (or --api-key), "
                              "or pass --allow-unauthenticated where authentication is done in front of the "
                              "router (docs/security.md)")


def _is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (an unresolved name counts as not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# field -> (group, help, extra argparse keywords): every field is a flag, in --help order.
_FLAGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "host": ("router", "HTTP address to listen on", {}),
    "port": ("router", "HTTP port", {}),
    "control_address": ("router", "zmq address the workers' control connections reach (the router binds it)", {}),
    "model": ("router", "tokenizer source: 'default', a .gguf file or a Hugging Face directory (no weights are read)",
              {}),
    "served_model_name": ("router", "the model name clients send (default: the model's name)", {}),
    "api_key": ("router", "require `Authorization: Bearer <key>` on /v1/* (prefer the environment variable: a "
                          "command line is visible to every local user)", {}),
    "allow_unauthenticated": ("router", "serve /v1/* without an API key on a non-loopback --host (without it, the "
                                        "router refuses to start there): only where authentication is done in "
                                        "front of the router", {"action": argparse.BooleanOptionalAction}),
    "max_inflight": ("router", "HTTP requests in flight before answering 429", {}),
    "max_body_bytes": ("router", "largest request body accepted (413 above)", {}),
    "max_model_len": ("router", "context length cap (default: the smallest max_model_len the workers register)",
                      {"type": int}),
    "heartbeat_timeout": ("router", "seconds without a heartbeat before a worker is out of rotation", {}),
    "kv_transport": ("router", "KV transport between prefill and decode: auto picks shm / cuda_ipc on one host",
                     {"choices": KV_TRANSPORT_CHOICES}),
    "request_timeout": ("router", "seconds without any token before a request fails", {}),
    "migration_limit": ("router", "times one request may be re-dispatched (prompt + tokens so far) after its worker "
                                  "is lost, refused it or failed its KV hand-off; 0: fail it", {}),
    "prefill_fallback": ("router", "with no prefill worker left, a decode worker prefills a request itself "
                                   "(conditional disaggregation)", {"action": argparse.BooleanOptionalAction}),
    "expect_workers": ("router", "/ready answers 503 until this many distinct workers have registered (`pdserve up` "
                                 "passes the number it starts; 0: ready as soon as any worker can serve)", {}),
    "drain_timeout": ("router", "on SIGTERM, how long in-flight requests may still run", {}),
    "grammar_timeout": ("router", "seconds of compile time a request's structured-output constraint and tool "
                                  "schemas may take together, not counting time queued (400 after)", {}),
    "grammar_threads": ("router", "threads that compile structured-output constraints (tokenizing has its own)", {}),
    "header_timeout": ("HTTP edge", "seconds a client has to send its request line and headers (408 after)", {}),
    "body_timeout": ("HTTP edge", "seconds a client has to send its whole body once the headers are in (408 after)",
                     {}),
    "max_connections": ("HTTP edge", "open HTTP connections; one more is answered 503 and closed", {}),
    "max_header_bytes": ("HTTP edge", "largest request line + headers accepted (431 above)", {}),
    "tokenize_threads": ("HTTP edge", "threads that template and tokenize big prompts off the event loop", {}),
    "max_buffered_body_bytes": ("HTTP edge", "request body bytes all clients together may have buffered in the "
                                             "router; a body that would go past it is answered 503", {}),
}
assert set(_FLAGS) == {f.name for f in fields(RouterConfig)}, "every RouterConfig field is a flag"
_DEFAULTS = RouterConfig()


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_router_arguments(p: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """The router's flags, but for the fields in `skip` (a command that sets those itself)."""
    groups: dict[str, Any] = {}
    for field, (group, help_, extra) in _FLAGS.items():
        if field in skip:
            continue
        g = groups.setdefault(group, p.add_argument_group(group))
        add_env_argument(g, _flag(field), getattr(_DEFAULTS, field), help_, **extra)


def router_config(args: argparse.Namespace, **override: Any) -> RouterConfig:
    """The RouterConfig of parsed arguments; a field neither parsed nor overridden keeps its default."""
    values = {field: getattr(args, field, getattr(_DEFAULTS, field)) for field in _FLAGS}
    values.update(override)
    values["api_key"] = values["api_key"] or None
    values["max_model_len"] = values["max_model_len"] or None
    return RouterConfig(**values)


def router_argv(config: RouterConfig) -> list[str]:
    """The flags that rebuild `config` in another process, with `router_environ` in its environment;
    never the API key (argv is public to every local user)."""
    out: list[str] = []
    for field in _FLAGS:
        if field == "api_key":
            continue  # router_environ
        value = getattr(config, field)
        if isinstance(value, bool):
            out.append(_flag(field) if value else f"--no-{_flag(field)[2:]}")
        elif value is not None and value != "":
            out += [_flag(field), str(value)]
    return out


def router_environ(config: RouterConfig) -> dict[str, str]:
    """What a child router needs in its environment besides `router_argv`: the API key, if any."""
    return {API_KEY_ENV: config.api_key} if config.api_key else {}
