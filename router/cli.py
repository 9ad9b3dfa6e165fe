"""`pdserve router`: the OpenAI-compatible HTTP router under uvicorn.

Every option `--foo-bar` defaults to the environment variable PDSERVE_FOO_BAR when it is set.
SIGTERM: readiness turns 503 and no request is admitted, in-flight ones may finish for up to
--drain-timeout seconds, then whatever remains fails with an error and the process exits.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import sys
from typing import Any

from pdserve.config.engine import ConfigError
from pdserve.config.env import add_env_argument, env_default
from pdserve.config.tracing import add_tracing_arguments, tracing_options
from pdserve.config.worker import add_secret_arguments
from pdserve.router.registry import KV_TRANSPORT_CHOICES
from pdserve.telemetry import tracing

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    flag = functools.partial(add_env_argument, g)
    flag("--host", "127.0.0.1", "HTTP address to listen on")
    flag("--port", 8000, "HTTP port")
    flag("--control-address", "tcp://127.0.0.1:5550",
         "zmq address the workers' control connections reach (the router binds it)")
    flag("--model", "default",
         "tokenizer source: 'default', a .gguf file or a Hugging Face directory (no weights are read)")
    flag("--served-model-name", None, "the model name clients send (default: the model's name)")
    flag("--api-key", None, "require `Authorization: Bearer <key>` on /v1/* (env PDSERVE_API_KEY)")
    flag("--max-inflight", 1024, "HTTP requests in flight before answering 429")
    flag("--max-body-bytes", 4 * 1024 * 1024, "largest request body accepted (413 above)")
    g.add_argument("--max-model-len", type=int, default=env_default("max-model-len", 0) or None,
                   help="context length cap (default: the smallest max_model_len the workers register)")
    flag("--heartbeat-timeout", 3.0, "seconds without a heartbeat before a worker is out of rotation")
    flag("--kv-transport", "auto", "KV transport between prefill and decode: auto picks shm / cuda_ipc on one host",
         choices=KV_TRANSPORT_CHOICES)
    flag("--request-timeout", 60.0, "seconds without any token before a request fails")
    flag("--migration-limit", 3,
         "times one request may be re-dispatched (prompt + tokens so far) after its worker is lost, refused it "
         "or failed its KV hand-off; 0: fail it")
    flag("--prefill-fallback", True,
         "with no prefill worker left, a decode worker prefills a request itself (conditional disaggregation)",
         action=argparse.BooleanOptionalAction)
    flag("--expect-workers", 0,
         "/ready answers 503 until this many distinct workers have registered (`pdserve up` passes the "
         "number it starts; 0: ready as soon as any worker can serve)")
    flag("--drain-timeout", 30.0, "on SIGTERM, how long in-flight requests may still run")
    flag("--grammar-timeout", 5.0,
         "seconds a structured-output constraint or tool schema may take to compile (400 after)")
    add_secret_arguments(g)  # --secret-file / --insecure: the control plane's authentication
    # SUPPRESS: under `pdserve router` the top-level --log-level keeps its value.
    g.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR")


def add_edge_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP edge's limits (router/http_server.py; docs/http_edge.md)."""
    flag = functools.partial(add_env_argument, p.add_argument_group("HTTP edge"))
    flag("--header-timeout", 10.0, "seconds a client has to send its request line and headers (408 after)")
    flag("--body-timeout", 30.0, "seconds a client has to send its whole body once the headers are in (408 after)")
    flag("--max-connections", 2048, "open HTTP connections; one more is answered 503 and closed")
    flag("--max-header-bytes", 16 * 1024, "largest request line + headers accepted (431 above)")
    flag("--tokenize-threads", 1, "threads that template and tokenize big prompts off the event loop")


def edge_limits_from_args(args: argparse.Namespace):
    from pdserve.router.http_server import EdgeLimits

    return EdgeLimits(
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        max_header_bytes=args.max_header_bytes,
    )


def register(sub: Any) -> None:
    """Add `router` to `pdserve`'s subcommands."""
    p = sub.add_parser(
        "router",
        help="the OpenAI-compatible HTTP router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    add_edge_arguments(p)
    add_tracing_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, model_name: str):
    from pdserve.router.service import RouterConfig

    return RouterConfig(
        control_address=args.control_address,
        served_model_name=args.served_model_name or model_name,
        api_key=args.api_key or None,
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        heartbeat_timeout=args.heartbeat_timeout,
        kv_transport=args.kv_transport,
        request_timeout=args.request_timeout,
        max_model_len=args.max_model_len,
        drain_timeout=args.drain_timeout,
        tokenize_threads=getattr(args, "tokenize_threads", 1),
        migration_limit=args.migration_limit,
        prefill_fallback=args.prefill_fallback,
        grammar_timeout=args.grammar_timeout,
        expect_workers=args.expect_workers,
    )


def control_auth(args: argparse.Namespace):
    """The control channel's authenticator from --secret-file / $PDSERVE_SECRET (or --insecure)."""
    from pdserve.config.worker import resolve_secret
    from pdserve.protocol.auth import FrameAuth

    return FrameAuth.from_secret(resolve_secret(args.secret_file, args.insecure))


def run(args: argparse.Namespace) -> int:
    """Load the tokenizer, build the app, serve until SIGTERM/SIGINT (then drain)."""
    import uvicorn

    from pdserve.router.app import create_app
    from pdserve.router.http_server import server_config
    from pdserve.text.loader import load_tokenizer

    level = getattr(args, "log_level", None) or env_default("log-level", "INFO")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger().setLevel(level.upper())
    try:
        auth = control_auth(args)
        traces = tracing_options(args)
    except ConfigError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    try:
        source = load_tokenizer(args.model)
    except Exception as exc:  # ModelLoadError says what to do; anything else is still fatal
        log.error("cannot load the tokenizer for --model %r: %s", args.model, exc)
        return 2
    config = config_from_args(args, source.name)
    try:
        tracing.setup("pdserve-router", f"router-{socket.gethostname()}-{os.getpid()}",
                      otlp_endpoint=traces.traces_url, trace_file=traces.trace_file)
    except OSError as exc:
        print(f"pdserve: --trace-file {traces.trace_file}: {exc.strerror}", file=sys.stderr)
        return 2
    app = create_app(config, source.tokenizer)
    service = app.state.service
    service.control.configure(auth=auth, model_name=source.name)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Readiness flips first so load balancers stop sending; uvicorn then drains.
            service.draining = True
            log.info("signal %d: draining (up to %.0f s)", sig, config.drain_timeout)
            super().handle_exit(sig, frame)

    server = _Server(
        server_config(
            app,
            edge_limits_from_args(args),
            host=args.host,
            port=args.port,
            log_level=level.lower(),
            timeout_graceful_shutdown=max(1, int(config.drain_timeout)),
        )
    )
    log.info(
        "router for model %r on http://%s:%d, control %s",
        config.served_model_name,
        args.host,
        args.port,
        config.control_address,
    )
    try:
        server.run()
    finally:
        tracing.shutdown()  # the last spans out before the process goes
    return 0
