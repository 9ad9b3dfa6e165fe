"""OpenTelemetry tracing for every pdserve process: off unless a flag turns it on.

    setup("pdserve-prefill", "prefill-0", trace_file="/tmp/traces.jsonl")  # once, at start
    t = tracer()          # None while tracing is off: callers then keep no span objects at all
    ... t.start_span("prefill", context=parent_context(work.trace_context)) ...
    shutdown()            # flush what is still queued (also runs at exit)

Off (no --otlp-endpoint, no --trace-file), nothing but the API is imported and no provider is
installed. On, an SDK TracerProvider for this process (service.name, service.instance.id) sends
finished spans through a BatchSpanProcessor (its own thread; the hot path only enqueues) to OTLP
over HTTP and/or a JSON-lines file (telemetry/file_export.py). The provider is this module's, not
the global one: a process configures it once, and tests can build one after another.

Trace context crosses processes as a W3C `traceparent` string inside the protocol's messages
(PrefillRequest, GenerateRequest, KVTransfer `trace_context`); `parent_context` validates one, and
a malformed one is no parent at all, never an error.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_EXPORT_DELAY_MS = 500  # how long a finished span may wait in the batch before it is written

_provider: Any = None  # the SDK TracerProvider while tracing is on
_tracer: trace.Tracer | None = None


def setup(service_name: str, instance_id: str, *, otlp_endpoint: str = "", trace_file: str = "") -> trace.Tracer | None:
    """Turn tracing on for this process when an endpoint or a file is given; the tracer, or None.

    `otlp_endpoint` is the full OTLP/HTTP traces URL (config/tracing.py adds `/v1/traces`).
    Replaces (after flushing) a setup made before, which only tests do.
    """
    global _provider, _tracer
    shutdown()
    if not otlp_endpoint and not trace_file:
        return None
    # The SDK and the exporters load only now: tracing off costs no import.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": service_name, "service.instance.id": instance_id})
    provider = TracerProvider(resource=resource, shutdown_on_exit=True)
    if trace_file:
        from pdserve.telemetry.file_export import JsonLinesExporter

        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(trace_file),
                                                       schedule_delay_millis=_EXPORT_DELAY_MS))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, timeout=10),
                                                       schedule_delay_millis=_EXPORT_DELAY_MS))
    _provider, _tracer = provider, provider.get_tracer("pdserve")
    log.info("tracing on: service %s (%s)%s%s", service_name, instance_id,
             f", OTLP to {otlp_endpoint}" if otlp_endpoint else "", f", spans to {trace_file}" if trace_file else "")
    return _tracer


def tracer() -> trace.Tracer | None:
    """This process's tracer, or None while tracing is off."""
    return _tracer


def shutdown() -> None:
    """Flush and stop the exporters; tracing is off afterwards. Idempotent."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def parent_context(traceparent: str) -> Context | None:
    """The remote span a W3C `traceparent` names, as a parent context; None when the string is
    empty or malformed (the caller then starts a trace of its own)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent(span: trace.Span) -> str:
    """The W3C `traceparent` that makes `span` the parent of another process's spans."""
    c = span.get_span_context()
    if not c.is_valid:
        return ""
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def child_of(span: trace.Span) -> Context:
    """A parent context for spans under a local `span`."""
    return trace.set_span_in_context(span)


def error(span: trace.Span, description: str) -> None:
    """Mark `span` failed, with what went wrong."""
    span.set_status(trace.Status(trace.StatusCode.ERROR, description))
