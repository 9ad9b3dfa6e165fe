"""The tracing options every process takes (router, prefill, decode, colocated, `pdserve up`).

    --otlp-endpoint URL   send spans over OTLP/HTTP (e.g. http://localhost:4318, Jaeger's or a
                          Collector's; `/v1/traces` is added when the URL has no path)
    --trace-file PATH     append one JSON object per finished span per line (telemetry/file_export.py)

Both default from $PDSERVE_OTLP_ENDPOINT / $PDSERVE_TRACE_FILE; neither set, tracing is off.
`pdserve up` hands each child its own file: PATH with the child's name before the suffix
(`traces.jsonl` -> `traces.router.jsonl`, `traces.prefill-0.jsonl`, ...). docs/tracing.md.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.config.engine import ConfigError
from pdserve.config.envs import add_env_argument

OTLP_TRACES_PATH = "/v1/traces"


@dataclass(frozen=True, slots=True)
class TracingOptions:
    otlp_endpoint: str = ""
    trace_file: str = ""

    def __post_init__(self) -> None:
        if self.otlp_endpoint:
            url = urlsplit(self.otlp_endpoint)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ConfigError(f"--otlp-endpoint {self.otlp_endpoint!r}: give an http(s) URL, "
                                  "e.g. http://localhost:4318 (OTLP over HTTP)")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.trace_file)

    @property
    def traces_url(self) -> str:
        """The OTLP/HTTP traces URL: the endpoint, with `/v1/traces` when it names no path."""
        if not self.otlp_endpoint:
            return ""
        url = urlsplit(self.otlp_endpoint)
        if url.path in ("", "/"):
            return url._replace(path=OTLP_TRACES_PATH).geturl()
        return self.otlp_endpoint


def add_tracing_arguments(p: argparse.ArgumentParser) -> None:
    """--otlp-endpoint and --trace-file, in a group of their own."""
    flag = functools.partial(add_env_argument, p.add_argument_group("tracing (docs/tracing.md)"))
    flag("--otlp-endpoint", "", "send OpenTelemetry spans over OTLP/HTTP to this URL, e.g. http://localhost:4318 "
                                "(default: off)")
    flag("--trace-file", "", "append one JSON line per finished span to this file (default: off)")


def tracing_options(args: argparse.Namespace) -> TracingOptions:
    return TracingOptions(otlp_endpoint=args.otlp_endpoint or "", trace_file=args.trace_file or "")


def child_trace_file(path: str, child: str) -> str:
    """`path` with `child` before its suffix: one file per process of `pdserve up`."""
    root, ext = os.path.splitext(path)
    return f"{root}.{child}{ext}"


def tracing_argv(options: TracingOptions, child: str) -> list[str]:
    """The flags that turn the same tracing on in `pdserve up`'s child `child`."""
    out = []
    if options.otlp_endpoint:
        out += ["--otlp-endpoint", options.otlp_endpoint]
    if options.trace_file:
        out += ["--trace-file", child_trace_file(options.trace_file, child)]
    return out
