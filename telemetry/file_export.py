"""Finished spans as JSON lines in a local file (`--trace-file`): one object per span per line.

    {"trace_id": "4bf9...", "span_id": "00f0...", "parent_span_id": "a3ce..." | null,
     "name": "prefill", "kind": "INTERNAL", "start_ns": ..., "end_ns": ...,
     "service": "pdserve-prefill", "instance": "prefill-0",
     "status": "OK" | "ERROR" | "UNSET", "status_message": "",
     "attributes": {"request_id": "cmpl-...-0", "worker_id": "prefill-0", ...},
     "events": [{"name": "...", "time_ns": ..., "attributes": {...}}],
     "links": [{"trace_id": "...", "span_id": "..."}]}

Each export is one `write` of whole lines to a descriptor opened with O_APPEND, so several
processes may share one file on a local filesystem without tearing a line (`pdserve up` still
gives each child its own file). Imported only when tracing is on: it needs the SDK.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as the JSON object above."""
    ctx, parent, res = span.context, span.parent, span.resource.attributes
    assert ctx is not None, "a finished span has a context"
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "service": res.get("service.name", ""),
        "instance": res.get("service.instance.id", ""),
        "status": span.status.status_code.name,
        "status_message": span.status.description or "",
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):  # attribute sequences
        return list(value)
    return str(value)


class JsonLinesExporter(SpanExporter):
    """Appends each batch of finished spans to `path` (created if missing)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), separators=(",", ":"), default=_jsonable) + "\n"
                       for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError as exc:
                log.warning("trace file %s: %d spans lost: %s", self.path, len(spans), exc)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written through at once
