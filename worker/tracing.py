"""A worker's request spans: one open span per traced request, advanced by what the loop sees.

Every span of a request here has the same parent: the remote span named by the work's
`trace_context` (the router's `dispatch` for PrefillRequest / GenerateRequest, the prefill
worker's `kv_send` for KVTransfer); without a valid one the request starts a trace of its own.

    prefill worker:    queue -> prefill -> kv_send        (kv_send's context goes into KVTransfer)
    colocated worker:  queue -> prefill -> decode
    decode worker:     kv_admit -> decode

    queue     accepted -> first scheduled (a step computes some of its tokens)
    prefill   first scheduled -> first token sampled
    kv_send   first token out, KV handed to the transport -> the decode worker's ACK / NACK
    kv_admit  KV arrived -> admitted: the step that loads it into the cache
    decode    -> finished, aborted or failed

The map is bounded (`limit`, the oldest span ended as evicted) and emptied on abort, fence and
close. While tracing is off the worker holds NO_SPANS, whose methods do nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.config.log_limits import RateLimitedLog
from pdserve.engine.engine import RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.telemetry import tracing

log = logging.getLogger(__name__)
_log_trace = RateLimitedLog(log, logging.WARNING, per_seconds=10.0)

QUEUE, PREFILL, KV_SEND, KV_ADMIT, DECODE = "queue", "prefill", "kv_send", "kv_admit", "decode"
_AFTER_WAIT = {QUEUE: PREFILL, KV_ADMIT: DECODE}  # waiting phases and what scheduling starts
DEFAULT_LIMIT = 8192


class NoSpans:
    """A worker's request spans while tracing is off: nothing is recorded."""

    def started(self, request_id: str, traceparent: str, request: Request, phase: str) -> None:
        """`request` was taken in (phase QUEUE for new work, KV_ADMIT for an arrived transfer)."""

    def stepped(self, step_started_ns: int, outputs: list[RequestOutput]) -> None:
        """An engine step that began at `step_started_ns` produced `outputs` (already published)."""

    def kv_context(self, request_id: str) -> str:
        """The `traceparent` for the request's KVTransfer ("" : none)."""
        return ""

    def kv_acked(self, request_id: str, ok: bool, reason: str) -> None:
        """The decode worker answered the request's transfer."""

    def aborted(self, request_ids: Iterable[str], why: str = "aborted") -> None:
        """The requests were dropped here (router abort, fence)."""

    def clear(self, why: str) -> None:
        """End every open span (the worker stops)."""


NO_SPANS = NoSpans()


def worker_spans(worker_id: str, limit: int = DEFAULT_LIMIT) -> NoSpans:
    """RequestSpans while tracing is on in this process, else NO_SPANS."""
    tracer = tracing.tracer()
    return NO_SPANS if tracer is None else RequestSpans(tracer, worker_id, limit)


@dataclass(slots=True)
class _Traced:
    request: Request
    parent: Context | None
    attributes: dict[str, str | int]  # on each of its spans
    phase: str = ""
    span: trace.Span = trace.INVALID_SPAN


class RequestSpans(NoSpans):
    """Open spans by request id; loop-owned (every call comes from the worker's loop thread)."""

    def __init__(self, tracer: trace.Tracer, worker_id: str, limit: int = DEFAULT_LIMIT) -> None:
        self._tracer = tracer
        self.worker_id = worker_id
        self.limit = limit
        self.live: dict[str, _Traced] = {}

    def started(self, request_id: str, traceparent: str, request: Request, phase: str) -> None:
        parent = tracing.parent_context(traceparent)
        if traceparent and parent is None:
            _log_trace("request %s: malformed trace context %r ignored", request_id, traceparent[:80],
                       key="bad traceparent")
        self._end(request_id, "superseded")  # an id reused after an abort whose span survived
        while len(self.live) >= self.limit:
            oldest = next(iter(self.live))
            _log_trace("request %s: span evicted (more than %d traced requests in flight)", oldest, self.limit,
                       key="evicted")
            self._end(oldest, "evicted")
        t = _Traced(request, parent, {"request_id": request_id, "worker_id": self.worker_id,
                                      "prompt_tokens": request.num_prompt_tokens,
                                      "resumed_tokens": request.num_output_tokens})
        t.phase, t.span = phase, self._span(t, phase, time.time_ns())
        self.live[request_id] = t

    def stepped(self, step_started_ns: int, outputs: list[RequestOutput]) -> None:
        if not self.live:
            return
        now = time.time_ns()
        by_id = {o.request_id: o for o in outputs}
        for rid, t in list(self.live.items()):
            req, out = t.request, by_id.get(rid)
            if t.phase in _AFTER_WAIT and (req.num_computed_tokens > 0 or req.status is RequestStatus.RUNNING
                                           or (out is not None and out.new_token_ids)):
                self._advance(t, _AFTER_WAIT[t.phase], step_started_ns)
            if out is not None and t.phase == PREFILL and out.new_token_ids:
                t.span.set_attribute("cached_tokens", out.num_cached_tokens)
                if out.kv_held:
                    self._advance(t, KV_SEND, now)
                    continue
                if out.finish_reason is None:
                    self._advance(t, DECODE, now)
                    continue
            if out is not None and out.finish_reason is not None:
                self._end(rid, out.finish_reason, out.error, now)
            elif t.phase != KV_SEND and req.status.finished:  # ended without an output (an abort)
                self._end(rid, req.status.value, req.error, now)

    def kv_context(self, request_id: str) -> str:
        t = self.live.get(request_id)
        return tracing.traceparent(t.span) if t is not None and t.phase == KV_SEND else ""

    def kv_acked(self, request_id: str, ok: bool, reason: str) -> None:
        t = self.live.get(request_id)
        if t is not None and t.phase == KV_SEND:
            self._end(request_id, "stop" if ok else "error", None if ok else f"KV hand-off failed: {reason}")

    def aborted(self, request_ids: Iterable[str], why: str = "aborted") -> None:
        for rid in request_ids:
            self._end(rid, "abort", why)

    def clear(self, why: str) -> None:
        for rid in list(self.live):
            self._end(rid, "abort", why)

    # --- internals -------------------------------------------------------------------------
    def _span(self, t: _Traced, phase: str, start_ns: int) -> trace.Span:
        return self._tracer.start_span(phase, context=t.parent, start_time=start_ns, attributes=t.attributes)

    def _advance(self, t: _Traced, phase: str, at_ns: int) -> None:
        t.span.end(end_time=at_ns)
        t.phase, t.span = phase, self._span(t, phase, at_ns)

    def _end(self, request_id: str, reason: str, error: str | None = None, at_ns: int | None = None) -> None:
        """End the request's open span: `reason` is a finish reason ("stop", "length", "abort",
        "error") or why the span is dropped ("evicted", "superseded")."""
        t = self.live.pop(request_id, None)
        if t is None:
            return
        if t.phase in (DECODE, PREFILL):
            t.span.set_attribute("output_tokens", t.request.num_output_tokens)
        t.span.set_attribute("outcome", reason)
        if reason not in ("stop", "length"):
            tracing.error(t.span, error or reason)
        t.span.end(end_time=at_ns)
