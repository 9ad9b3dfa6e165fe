"""One HTTP request's spans on the router (docs/tracing.md has the whole tree):

    request                       received -> finished / aborted / error   (root, SERVER)
      tokenize                    chat template, tokenizer, prefix hashes
      route                       workers picked and the work sent, every choice
      dispatch  (per choice and attempt)   work sent -> that choice ends or moves; its context
                                  travels in PrefillRequest / GenerateRequest.trace_context;
                                  event `first_token`
      migration (per re-dispatch) cause, tokens already generated, from -> to workers

`request_trace` gives a `NoTrace` (every method a no-op, no span object anywhere) while tracing
is off. Event-loop owned, like the RequestState that holds it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace

from pdserve.telemetry import tracing

if TYPE_CHECKING:
    from pdserve.router.registry import Route
    from pdserve.router.requests import Choice

# The router's statuses that are not an error of the service: the request ran its course, or
# its client left (499, nginx's "client closed request").
_FINISHED, _ABORTED = "200", "499"
_NOTHING = contextlib.nullcontext()  # reusable: tracing off allocates nothing per request


class NoTrace:
    """A request's tracing while tracing is off: nothing is recorded."""

    def describe(self, *, model: str, n: int, prompt_tokens: int, max_tokens: int, stream: bool) -> None:
        """The request's shape, once it is parsed and tokenized."""

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A child span of the request around a phase (tokenize, route)."""
        return _NOTHING

    def routed(self, choices: Sequence[Choice]) -> None:
        """Which workers the choices went to."""

    def dispatch(self, choice: Choice) -> str:
        """Work for `choice` is being sent: the `traceparent` it carries ("" : none)."""
        return ""

    def migration(self, choice: Choice, cause: str, old: Route, old_id: str) -> None:
        """`choice` (dispatched as `old_id` on `old`) is re-dispatched because of `cause`."""

    def first_token(self, choice: Choice) -> None:
        """The choice's first token reached the router."""

    def choice_finished(self, choice: Choice) -> None:
        """The choice produced its last token."""

    def end(self, status: str, completion_tokens: int = 0) -> None:
        """The request is over with HTTP `status` ("200", "499", ...). Idempotent."""


NO_TRACE = NoTrace()


def request_trace(request_id: str, endpoint: str) -> NoTrace:
    """The spans of one new HTTP request: a RequestTrace while tracing is on, else NO_TRACE."""
    tracer = tracing.tracer()
    return NO_TRACE if tracer is None else RequestTrace(tracer, request_id, endpoint)


class RequestTrace(NoTrace):
    """The root span and its children for one request; span maps die with the request."""

    def __init__(self, tracer: trace.Tracer, request_id: str, endpoint: str) -> None:
        self._tracer = tracer
        self._arrival_ns = time.time_ns()
        self._root = tracer.start_span("request", kind=trace.SpanKind.SERVER, start_time=self._arrival_ns,
                                       attributes={"request_id": request_id, "http.route": endpoint})
        self._ctx = tracing.child_of(self._root)
        self._dispatches: dict[int, trace.Span] = {}  # choice index -> its open dispatch span
        self._first_token_seen = False
        self._ended = False

    def describe(self, *, model: str, n: int, prompt_tokens: int, max_tokens: int, stream: bool) -> None:
        self._root.set_attributes({"model": model, "n": n, "prompt_tokens": prompt_tokens,
                                   "max_tokens": max_tokens, "stream": stream})

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._span(name)

    @contextlib.contextmanager
    def _span(self, name: str) -> Iterator[None]:
        span = self._tracer.start_span(name, context=self._ctx)
        try:
            yield
        except BaseException as exc:
            tracing.error(span, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            span.end()

    def routed(self, choices: Sequence[Choice]) -> None:
        self._root.set_attribute("workers", sorted({w for c in choices for w in c.route.workers}))

    def dispatch(self, choice: Choice) -> str:
        old = self._dispatches.pop(choice.index, None)
        if old is not None:  # not ended by `migration`: a re-dispatch by another path
            old.end()
        r = choice.route
        span = self._tracer.start_span("dispatch", context=self._ctx, attributes={
            "request_id": choice.request_id, "choice": choice.index, "attempt": choice.migrations,
            "mode": r.mode, "worker_id": r.first, "decode_worker_id": r.decode or "",
            "kv_transport": r.kv_transport if r.decode else "", "resumed_tokens": len(choice.token_ids)})
        self._dispatches[choice.index] = span
        return tracing.traceparent(span)

    def migration(self, choice: Choice, cause: str, old: Route, old_id: str) -> None:
        now = time.time_ns()
        gone = self._dispatches.pop(choice.index, None)
        if gone is not None:
            gone.set_attribute("outcome", "migrated")
            tracing.error(gone, f"re-dispatched: {cause}")
            gone.end(end_time=now)
        span = self._tracer.start_span("migration", context=self._ctx, start_time=now, attributes={
            "request_id": choice.request_id, "from_request_id": old_id, "choice": choice.index,
            "cause": cause, "tokens_generated": len(choice.token_ids), "attempt": choice.migrations,
            "from_workers": list(old.workers), "to_workers": list(choice.route.workers)})
        span.end()

    def first_token(self, choice: Choice) -> None:
        now = time.time_ns()
        span = self._dispatches.get(choice.index)
        if span is not None:
            span.add_event("first_token", timestamp=now)
        if not self._first_token_seen:  # the request's TTFT: its first choice's
            self._first_token_seen = True
            self._root.set_attribute("ttft_ms", (now - self._arrival_ns) / 1e6)

    def choice_finished(self, choice: Choice) -> None:
        span = self._dispatches.pop(choice.index, None)
        if span is not None:
            span.set_attributes({"outcome": "finished", "finish_reason": choice.finish_reason or "",
                                 "completion_tokens": choice.completion_tokens})
            span.end()

    def end(self, status: str, completion_tokens: int = 0) -> None:
        if self._ended:
            return
        self._ended = True
        outcome = "finished" if status == _FINISHED else "aborted" if status == _ABORTED else "error"
        for span in self._dispatches.values():
            span.set_attribute("outcome", outcome)
            if outcome != "finished":
                tracing.error(span, f"request ended with status {status}")
            span.end()
        self._dispatches.clear()
        self._root.set_attributes({"http.response.status_code": int(status) if status.isdigit() else 0,
                                   "outcome": outcome, "completion_tokens": completion_tokens})
        if outcome != "finished":
            tracing.error(self._root, f"{outcome} (status {status})")
        self._root.end()
