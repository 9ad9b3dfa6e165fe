"""Per-request state on the router: the token stream of each choice turned into text.

One HTTP request has n `Choice`s (n sub-requests on the workers, ids `<request_id>-<i>`). The
control server drops each worker's `TokenEvent` into the request's single asyncio.Queue; the
HTTP handler drains it through `RequestState.deltas()`, which orders events, detokenizes, cuts
at stop strings (holding back text that might begin one), collects logprobs, times TTFT/TBT
and fails the request on an error event, a lost worker, a disconnect or a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from pdserve.protocol.messages import TokenEvent
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Route
from pdserve.router.tracing import NO_TRACE, NoTrace

log = logging.getLogger(__name__)

AbortFn = Callable[[Sequence[str], Sequence[str]], None]  # (worker_ids, request_ids)
# (request, choice, the worker that gave it up, the event's retry cause) -> re-dispatched?
RetryFn = Callable[["RequestState", "Choice", str, str], bool]


class Failure(NamedTuple):
    """Put in a request's queue by the router itself: ends the request with `error`."""

    error: APIError


class StopMatcher:
    """Cuts text at the first stop string; holds back any suffix that may begin one.

    Text given out never contains a stop string nor ends with a proper prefix of one, so a stop
    string split across tokens is still cut before any of it leaks.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


@dataclass(slots=True)
class LogprobEntry:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced from one event: new text, its tokens' logprobs, maybe the end."""

    index: int
    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None


class Choice:
    """One of a request's n outputs: its route, detokenizer, stop matcher and counters."""

    def __init__(
        self, index: int, request_id: str, route: Route, detokenizer: Any, stops: Sequence[str],
        sampling: SamplingParams | None = None,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.route = route
        self.sampling = sampling
        self.token_ids: list[int] = []  # generated so far, in order (what a migration resends)
        self.migrations = 0
        self.base_id = request_id  # each dispatch gets its own id: base_id, then base_id~1, ...
        self.decode_started = False  # a token came from the decode worker: it holds the KV
        self.prefill_token_at: float | None = None  # when the router received the prefill worker's token
        self.detokenizer = detokenizer
        self.stop = StopMatcher(stops)
        self.completion_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.last_event_at = time.monotonic()
        self._next_position = 0
        self._early: dict[int, TokenEvent] = {}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def redispatch(self, route: Route) -> tuple[str, Route]:
        """Give the choice its next sub-request id on `route`; returns the old (id, route).
        Events of the old id still on their way are dropped from now on."""
        old = self.request_id, self.route
        self.migrations += 1
        self.request_id = f"{self.base_id}~{self.migrations}"
        self.route, self.decode_started, self.prefill_token_at = route, False, None
        self._early.clear()  # ahead-of-order tokens of the old dispatch are not ours any more
        return old

    def in_order(self, ev: TokenEvent) -> list[TokenEvent]:
        """Events ready to apply, by output position (events without one pass straight on)."""
        if ev.position < 0:
            self._next_position += len(ev.token_ids)
            return [ev]
        if ev.position > self._next_position:
            self._early[ev.position] = ev
            return []
        if ev.position < self._next_position:  # a repeat: keep only what is new
            skip = self._next_position - ev.position
            if skip >= len(ev.token_ids) and ev.finish_reason is None and ev.error is None:
                return []
            ev = _drop_first(ev, skip)
        ready = [ev]
        self._next_position += len(ev.token_ids)
        while (nxt := self._early.pop(self._next_position, None)) is not None:
            ready.append(nxt)
            self._next_position += len(nxt.token_ids)
        return ready

    def apply(self, ev: TokenEvent, want_logprobs: bool) -> ChoiceDelta:
        """Detokenize one in-order event; sets `finish_reason` when the choice ends."""
        delta = ChoiceDelta(self.index)
        if ev.num_prompt_tokens:
            self.num_prompt_tokens = ev.num_prompt_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, ev.num_cached_tokens)
        pieces = []
        for i, token_id in enumerate(ev.token_ids):
            self.completion_tokens += 1
            self.token_ids.append(token_id)
            if want_logprobs and ev.logprobs is not None and i < len(ev.logprobs):
                top = (
                    ev.top_logprobs[i]
                    if ev.top_logprobs is not None and i < len(ev.top_logprobs)
                    else ()
                )
                delta.logprobs.append(LogprobEntry(token_id, ev.logprobs[i], tuple(top)))
            text, hit = self.stop.push(self.detokenizer.push([token_id]))
            pieces.append(text)
            if hit:
                self.finish_reason = delta.finish_reason = "stop"
                break
        if not self.finished and ev.finish_reason in ("stop", "length"):
            text, hit = self.stop.push(self.detokenizer.flush())
            pieces.append(text if hit else text + self.stop.flush())
            self.finish_reason = delta.finish_reason = "stop" if hit else ev.finish_reason
        delta.text = "".join(pieces)
        return delta


def _drop_first(ev: TokenEvent, k: int) -> TokenEvent:
    return msgspec.structs.replace(
        ev,
        token_ids=ev.token_ids[k:],
        logprobs=None if ev.logprobs is None else ev.logprobs[k:],
        top_logprobs=None if ev.top_logprobs is None else ev.top_logprobs[k:],
        position=ev.position + k,
    )


class RequestState:
    """One HTTP request in flight: its choices and the queue their events arrive on.

    Owned by the HTTP handler that created it; `close()` (idempotent) aborts whatever is
    still running on the workers and releases the request's bookkeeping.
    """

    def __init__(
        self,
        request_id: str,
        choices: list[Choice],
        *,
        prompt_tokens: int,
        want_logprobs: bool,
        timeout: float,
        metrics: RouterMetrics,
        send_abort: AbortFn,
        on_close: Callable[[RequestState], None],
        arrival: float,
        retry: RetryFn | None = None,
    ) -> None:
        self.request_id = request_id
        self.choices = choices
        self.prompt_tokens = prompt_tokens
        self.prompt_ids: tuple[int, ...] = ()  # what a migration resends (with the choice's tokens)
        self.want_logprobs = want_logprobs
        self.timeout = timeout
        self.metrics = metrics
        self.arrival = arrival
        self.queue: asyncio.Queue[tuple[int, str, TokenEvent | Failure]] = asyncio.Queue()
        self._send_abort = send_abort
        self._on_close = on_close
        self._retry = retry
        self.closed = False
        self.status = "200"
        self.trace: NoTrace = NO_TRACE  # its spans (router/tracing.py), set by the service

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def fail(self, error: APIError) -> None:
        """Called from outside the handler (lost worker, disconnect): ends the request soon."""
        self.queue.put_nowait((-1, "", Failure(error)))

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's progress as it arrives, until all finish. Raises APIError on failure."""
        while not self.finished:
            oldest = min(c.last_event_at for c in self.choices if not c.finished)
            wait = oldest + self.timeout - time.monotonic()
            try:
                index, worker_id, item = await asyncio.wait_for(self.queue.get(), max(wait, 0.0))
            except TimeoutError:
                raise APIError(
                    504, f"no token from the workers for {self.timeout:g} s", code="request_timeout"
                ) from None
            if isinstance(item, Failure):
                raise item.error
            choice = self.choices[index]
            if choice.finished or item.request_id != choice.request_id:
                continue  # late events: the router stopped the choice, or re-dispatched it
            choice.last_event_at = time.monotonic()
            for ev in choice.in_order(item):
                if ev.error is not None and choice.decode_started and worker_id == choice.route.first \
                        and choice.route.decode is not None:
                    continue  # the decode worker holds the request now: the prefill side's end is no news
                if ev.error is not None and ev.retry and self._retry is not None \
                        and self._retry(self, choice, worker_id, ev.retry):
                    break  # re-dispatched: what was queued behind it belongs to the old id
                if ev.error is not None or ev.finish_reason in ("abort", "error"):
                    reason = ev.error or f"the worker ended the request ({ev.finish_reason})"
                    raise APIError(
                        502,
                        f"worker {worker_id} failed request {choice.request_id}: {reason}",
                        code="worker_error",
                    )
                self._time_tokens(choice, len(ev.token_ids))
                delta = choice.apply(ev, self.want_logprobs)
                if choice.finished:
                    self._stop_others(choice, worker_id, ev)
                    self.trace.choice_finished(choice)
                yield delta
                if choice.finished:
                    break

    def _time_tokens(self, choice: Choice, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        if choice.first_token_at is None:
            choice.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.first_token()
            self.trace.first_token(choice)
            n -= 1
        elif n:
            gap = (now - choice.last_token_at) / n
            for _ in range(n):
                self.metrics.tbt.observe(gap)
        choice.last_token_at = now

    def _stop_others(self, choice: Choice, worker_id: str, ev: TokenEvent) -> None:
        """After a choice ends, abort the workers that may still act on it."""
        workers = choice.route.workers
        if ev.finish_reason is None:  # the router cut it (stop string): everyone still runs
            targets = workers
        else:  # the reporting worker is done; only those after it (decode after prefill) may run
            targets = workers[workers.index(worker_id) + 1 :] if worker_id in workers else ()
        if targets:
            self._send_abort(targets, (choice.request_id,))

    def usage(self) -> tuple[int, int, int | None]:
        """(prompt_tokens, completion_tokens, cached_tokens or None when no worker said)."""
        completion = sum(c.completion_tokens for c in self.choices)
        reported = [c for c in self.choices if c.num_prompt_tokens]
        cached = max(c.num_cached_tokens for c in reported) if reported else None
        return self.prompt_tokens, completion, cached

    def close(self, status: str) -> None:
        """Abort what still runs, record the outcome, release bookkeeping. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.status = status
        for c in self.choices:
            if not c.finished:
                self._send_abort(c.route.workers, (c.request_id,))
            self.metrics.request_ended(c.first_token_at is not None)
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.requests.labels(status).inc()
        self.trace.end(status, self.usage()[1])
        log.info(
            "request %s closed: status %s, %d completion tokens",
            self.request_id,
            status,
            self.usage()[1],
        )
        self._on_close(self)


class RequestTracker:
    """Sub-request id -> (request, choice index), for routing worker events. Loop-owned."""

    def __init__(self) -> None:
        self._subs: dict[str, tuple[RequestState, int]] = {}

    def __len__(self) -> int:
        return len({id(s) for s, _ in self._subs.values()})

    def add(self, state: RequestState) -> None:
        for c in state.choices:
            self._subs[c.request_id] = (state, c.index)

    def remove(self, state: RequestState) -> None:
        for c in state.choices:
            self._subs.pop(c.request_id, None)

    def deliver(self, worker_id: str, ev: TokenEvent, received: float) -> bool:
        """Queue a worker's event for its request's handler (False: no request of ours). `received`
        is when the router read it off the socket: the hand-off gap is timed from it."""
        entry = self._subs.get(ev.request_id)
        if entry is None:
            return False
        state, index = entry
        if worker_id not in state.choices[index].route.workers:
            log.warning(
                "request %s: event from worker %s, which it was not sent to; dropped",
                ev.request_id,
                worker_id,
            )
            return False
        choice = state.choices[index]
        route = choice.route
        if ev.token_ids and route.decode is not None:
            if worker_id != route.decode:
                choice.prefill_token_at = received
            elif not choice.decode_started:  # the decode worker's first token: the hand-off is over
                state.metrics.handoff_done(choice.prefill_token_at, received, ev.handoff)
                choice.decode_started = True
        state.queue.put_nowait((index, worker_id, ev))
        return True

    def affected(self, worker_id: str) -> list[tuple[RequestState, Choice]]:
        """The unfinished choices that losing `worker_id` stops: those it generates for, and
        those whose prefill it ran while their decode worker has not started yet (the KV may
        never arrive). A decode that has started needs its prefill worker no more."""
        out = []
        for state, index in list(self._subs.values()):
            c = state.choices[index]
            if c.finished or state.closed or worker_id not in c.route.workers:
                continue
            if worker_id == c.route.first and c.route.decode is not None and c.decode_started:
                continue
            out.append((state, c))
        return out

    def rekey(self, old_id: str, new_id: str) -> None:
        """A choice re-dispatched under a new id: late events of the old one are dropped."""
        entry = self._subs.pop(old_id, None)
        if entry is not None:
            self._subs[new_id] = entry

    def all(self) -> list[RequestState]:
        return list({id(s): s for s, _ in self._subs.values()}.values())
