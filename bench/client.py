"""The streaming client: sends one request to an OpenAI-compatible server and timestamps its SSE.

A request's send time is taken when httpx writes its headers (httpcore's trace hook), so time
spent waiting for a pooled connection counts as client-side lag, not as server latency.
Tokens per chunk: the delta of `usage.completion_tokens` when the server streams cumulative usage
(vLLM's `continuous_usage_stats`), else one per content chunk. Usage counts as cumulative only
once it has come on a content chunk that did not finish the stream: llama.cpp's llama-server puts
the *total* usage on its finishing chunk only, which must not be read as that chunk's tokens.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from enum import Enum

import httpx

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import RequestSpec

log = logging.getLogger(__name__)


class Api(str, Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Api.CHAT else "/v1/completions"

    @classmethod
    def parse(cls, text: str) -> Api:
        """Accept `chat`, `completions` or the endpoint path."""
        t = text.strip().rstrip("/")
        for api in cls:
            if t in (api.value, api.path):
                return api
        raise ValueError(f"unknown endpoint {text!r}: use chat, completions, {Api.CHAT.path} or {Api.COMPLETIONS.path}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str
    model: str
    api: Api = Api.CHAT
    api_key: str | None = None
    exact_output_len: bool = True  # send ignore_eos and min_tokens (vLLM-compatible extra fields)
    extra_body: dict = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "temperature": 0.0,
        }
        if self.api is Api.CHAT:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.exact_output_len:
            body["ignore_eos"] = True
            body["min_tokens"] = spec.max_tokens
        body.update(self.extra_body)
        return body


class Clock:
    """Seconds since the run's start on a monotonic clock shared by every record of the run."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


async def default_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model `/v1/models` lists; an error a user can act on when there is none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(f"{base_url.rstrip('/')}/v1/models", headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"could not list models at {base_url}/v1/models ({e}); pass --model") from e
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def _chunk_text(api: Api, choice: dict) -> str:
    if api is Api.CHAT:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


class _StreamState:
    """Folds SSE events into a record; owns the cumulative-usage bookkeeping."""

    def __init__(self, rec: RequestRecord, api: Api, clock: Clock) -> None:
        self.rec, self.api, self.clock = rec, api, clock
        self.usage_tokens = 0  # last cumulative completion_tokens the server reported
        self.cumulative = False  # the server streams usage on its content chunks
        self.counted = 0
        self.finished = False
        self.done = False

    def feed(self, data: str) -> None:
        now = self.clock.now()
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            raise RuntimeError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
        usage = event.get("usage") or {}
        choices = event.get("choices") or []
        text = "".join(_chunk_text(self.api, c) for c in choices)
        new_usage = usage.get("completion_tokens")
        finishing = any(c.get("finish_reason") for c in choices)
        if text and isinstance(new_usage, int) and not finishing:
            self.cumulative = True
        if self.cumulative and choices and isinstance(new_usage, int) and new_usage > self.usage_tokens:
            n_tok = new_usage - self.usage_tokens
        else:
            n_tok = 1 if text else 0
        if n_tok:
            self.rec.chunk_times.append(now)
            self.rec.chunk_tokens.append(n_tok)
            self.counted += n_tok
        if isinstance(new_usage, int):
            self.usage_tokens = max(self.usage_tokens, new_usage)
        if "queue_time_ms" in usage:
            self.rec.server_queue_s = float(usage["queue_time_ms"]) / 1e3
        if finishing:
            self.finished = True


async def send_request(
    client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec, intended_s: float,
    clock: Clock, warmup: bool = False,
) -> RequestRecord:
    """Send `spec` and stream its answer; never raises for a server or network failure."""
    rec = RequestRecord(request_id=spec.request_id, tag=spec.tag, prompt_tokens=spec.prompt_tokens,
                        max_tokens=spec.max_tokens, intended_s=intended_s, warmup=warmup)
    sent: list[float] = []

    async def trace(event: str, info: dict) -> None:
        if event.endswith("send_request_headers.started") and not sent:
            sent.append(clock.now())

    state = _StreamState(rec, endpoint.api, clock)
    url = endpoint.base_url.rstrip("/") + endpoint.api.path
    fallback_sent = clock.now()
    try:
        async with client.stream("POST", url, json=endpoint.body(spec), headers=endpoint.headers(),
                                 extensions={"trace": trace}) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:200].decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body}")
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    state.feed(line[5:].strip())
                    if state.done:
                        break
        if not (state.done or state.finished):
            raise RuntimeError("stream ended before [DONE] or a finish_reason")
        rec.success = True
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
        log.info("request %s failed: %s", spec.request_id, rec.error)
    rec.end_s = clock.now()
    rec.sent_s = sent[0] if sent else fallback_sent
    rec.output_tokens = max(state.usage_tokens, state.counted)
    return rec
