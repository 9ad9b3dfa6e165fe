"""OpenTelemetry for every process: tracer setup, traceparent in and out, JSON-lines span export
(torch-free)."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
