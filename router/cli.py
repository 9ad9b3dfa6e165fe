"""`pdserve router`: the OpenAI-compatible HTTP router under uvicorn.

Every option `--foo-bar` defaults to the environment variable PDSERVE_FOO_BAR when it is set.
SIGTERM: readiness turns 503 and no request is admitted, in-flight ones may finish for up to
--drain-timeout seconds, then whatever remains fails with an error and the process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from typing import Any

from pdserve.config.engine import ConfigError
from pdserve.config.envs import flag_default
from pdserve.config.router import add_router_arguments, router_config
from pdserve.config.tracing import add_tracing_arguments, tracing_options
from pdserve.config.worker import add_secret_arguments
from pdserve.telemetry import tracing

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve router`'s flags: the router's and HTTP edge's (config/router.py), the secret, the log level."""
    add_router_arguments(p)
    add_secret_arguments(p.add_argument_group("internal planes"))  # --secret-file / --insecure
    # SUPPRESS: under `pdserve router` the top-level --log-level keeps its value.
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR")


def register(sub: Any) -> None:
    """Add `router` to `pdserve`'s subcommands."""
    p = sub.add_parser(
        "router",
        help="the OpenAI-compatible HTTP router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    add_tracing_arguments(p)
    p.set_defaults(func=run)


def control_auth(args: argparse.Namespace):
    """The control channel's authenticator from --secret-file / $PDSERVE_SECRET (or --insecure)."""
    from pdserve.config.worker import resolve_secret
    from pdserve.protocol.auth import FrameAuth

    return FrameAuth.from_secret(resolve_secret(args.secret_file, args.insecure))


def run(args: argparse.Namespace) -> int:
    """Load the tokenizer, build the app, serve until SIGTERM/SIGINT (then drain)."""
    import uvicorn

    from pdserve.router.app import create_app
    from pdserve.router.http_server import EdgeLimits, server_config
    from pdserve.text.loader import load_tokenizer

    level = getattr(args, "log_level", None) or flag_default("log-level", "INFO")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger().setLevel(level.upper())
    try:
        auth = control_auth(args)
        traces = tracing_options(args)
        config = router_config(args)  # refuses a non-loopback --host without an API key, before any work
    except ConfigError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    try:
        source = load_tokenizer(args.model)
    except Exception as exc:  # ModelLoadError says what to do; anything else is still fatal
        log.error("cannot load the tokenizer for --model %r: %s", args.model, exc)
        return 2
    config = dataclasses.replace(config, served_model_name=config.served_model_name or source.name)
    try:
        tracing.setup("pdserve-router", f"router-{socket.gethostname()}-{os.getpid()}",
                      otlp_endpoint=traces.traces_url, trace_file=traces.trace_file)
    except OSError as exc:
        print(f"pdserve: --trace-file {traces.trace_file}: {exc.strerror}", file=sys.stderr)
        return 2
    app = create_app(config, source.tokenizer)
    service = app.state.service
    service.control.configure(auth=auth, model_name=source.name)
    if config.allow_unauthenticated and not config.api_key:
        log.warning("--allow-unauthenticated: /v1/* on %s answers without an API key; authentication must be "
                    "done in front of the router", config.host)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Readiness flips first so load balancers stop sending; uvicorn then drains.
            service.draining = True
            log.info("signal %d: draining (up to %.0f s)", sig, config.drain_timeout)
            super().handle_exit(sig, frame)

    server = _Server(
        server_config(
            app,
            EdgeLimits.of(config),
            host=config.host,
            port=config.port,
            log_level=level.lower(),
            timeout_graceful_shutdown=max(1, int(config.drain_timeout)),
        )
    )
    log.info(
        "router for model %r on http://%s:%d, control %s",
        config.served_model_name,
        config.host,
        config.port,
        config.control_address,
    )
    try:
        server.run()
    finally:
        tracing.shutdown()  # the last spans out before the process goes
    return 0
