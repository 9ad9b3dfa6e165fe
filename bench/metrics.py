"""Per-request records and the metrics computed from them: TTFT, TBT, TPOT, E2E, goodput.

Every timestamp of a record is seconds on one monotonic clock whose zero is the run's start.
The formulas are written out in docs/bench.md; the names of the summary's common fields are
those of `vllm bench serve` so results can be compared with it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

PERCENTILES = (50, 90, 95, 99)


class RequestRecord(msgspec.Struct, kw_only=True):
    """What the client saw of one request. `chunk_times[i]` carries `chunk_tokens[i]` tokens.

    Only content-bearing chunks are listed (a role-only or finish-only chunk is not a token).
    `end_s` is when the stream ended ([DONE], an error, or a cut connection).
    """

    request_id: str
    tag: str = "default"
    prompt_tokens: int = 0
    max_tokens: int = 0
    intended_s: float = 0.0  # when the schedule said to send it
    sent_s: float = 0.0  # when its request headers were actually written
    end_s: float = 0.0
    chunk_times: list[float] = msgspec.field(default_factory=list)
    chunk_tokens: list[int] = msgspec.field(default_factory=list)
    output_tokens: int = 0  # from the server's usage when reported, else the sum of chunk_tokens
    success: bool = False
    error: str = ""
    server_queue_s: float | None = None  # queueing the server reported, if it did
    warmup: bool = False

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_s if self.chunk_times else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def send_lag_s(self) -> float:
        return self.sent_s - self.intended_s


def tbt_gaps(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Every gap between consecutive tokens; a chunk of k tokens splits its gap into k equal ones.

    The first chunk's gap is the TTFT, not a TBT; tokens that came with the first token have no
    observable gap and add none.
    """
    gaps: list[float] = []
    for i in range(1, len(chunk_times)):
        k = max(chunk_tokens[i], 1)
        gaps.extend([(chunk_times[i] - chunk_times[i - 1]) / k] * k)
    return gaps


def first_to_second_s(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> float | None:
    """When the second token arrived after the first, unsplit: on a disaggregated server, the
    hand-off gap; elsewhere the first TBT. 0 when the first chunk carried both; None below two."""
    if chunk_tokens and chunk_tokens[0] >= 2:
        return 0.0
    return chunk_times[1] - chunk_times[0] if len(chunk_times) >= 2 else None


def itl_gaps(chunk_times: Sequence[float]) -> list[float]:
    """vLLM's ITL: one gap per chunk after the first, unsplit."""
    return [b - a for a, b in itertools.pairwise(chunk_times)]


def tpot_s(rec: RequestRecord) -> float | None:
    """TPOT = (e2e - ttft) / (output_tokens - 1); undefined below two output tokens."""
    ttft = rec.ttft_s
    if ttft is None or rec.output_tokens < 2:
        return None
    return (rec.e2e_s - ttft) / (rec.output_tokens - 1)


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")
_SLO_KEY = re.compile(r"^(ttft|tpot|e2e|tbt(?:_max|_p\d{1,2}(?:\.\d+)?)?)$")


def _seconds(text: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"bad SLO duration {text!r}: use e.g. 500ms, 0.5s or 250us")
    value, unit = float(m.group(1)), m.group(2) or "ms"
    return value * {"ms": 1e-3, "s": 1.0, "us": 1e-6}[unit]


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency limits in seconds. A request meets the SLO when it succeeded and meets
    every limit set. `tbt` maps a percentile of the request's own TBT gaps (100 = max) to a limit.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tbt: tuple[tuple[float, float], ...] = ()
    from_intended: bool = True  # ttft/e2e measured from the intended send time

    @classmethod
    def parse(cls, text: str | None, from_intended: bool = True) -> SLO:
        """Parse `ttft=500ms,tbt_p99=100ms,tpot=50ms,e2e=10s` (tbt or tbt_max: every gap)."""
        values: dict[str, float] = {}
        tbt: list[tuple[float, float]] = []
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            key, sep, val = part.partition("=")
            key = key.strip().lower()
            if not sep or not _SLO_KEY.match(key):
                raise ValueError(f"bad SLO term {part!r}: use ttft=, tpot=, e2e=, tbt=, tbt_max= or tbt_pNN=")
            if key.startswith("tbt"):
                pct = 100.0 if key in ("tbt", "tbt_max") else float(key[5:])
                tbt.append((pct, _seconds(val)))
            else:
                values[f"{key}_s"] = _seconds(val)
        return cls(tbt=tuple(tbt), from_intended=from_intended, **values)

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None and not self.tbt

    def describe(self) -> dict[str, float]:
        out = {f"{k}_ms": v * 1e3 for k, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2e_s)) if v is not None}
        out.update({("tbt_max_ms" if p == 100 else f"tbt_p{p:g}_ms"): v * 1e3 for p, v in self.tbt})
        return out

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.success or rec.ttft_s is None:
            return False
        base = rec.intended_s if self.from_intended else rec.sent_s
        if self.ttft_s is not None and rec.chunk_times[0] - base > self.ttft_s:
            return False
        if self.e2e_s is not None and rec.end_s - base > self.e2e_s:
            return False
        if self.tpot_s is not None:
            tpot = tpot_s(rec)
            if tpot is not None and tpot > self.tpot_s:
                return False
        gaps = tbt_gaps(rec.chunk_times, rec.chunk_tokens)
        return all(not gaps or float(np.percentile(gaps, p)) <= limit for p, limit in self.tbt)


def _stats(name: str, values_s: Sequence[float], out: dict) -> None:
    """mean/median/std/pNN/max of `values_s`, in ms, under vLLM's key names (0.0 when empty)."""
    arr = np.asarray(values_s, dtype=float) * 1e3
    empty = arr.size == 0
    out[f"mean_{name}_ms"] = 0.0 if empty else float(arr.mean())
    out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(arr))
    out[f"std_{name}_ms"] = 0.0 if empty else float(arr.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    out[f"max_{name}_ms"] = 0.0 if empty else float(arr.max())


@dataclass(slots=True)
class RunInfo:
    """How the run was driven; copied into the summary."""

    duration_s: float
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    extra: dict = field(default_factory=dict)


def summarize(records: Sequence[RequestRecord], info: RunInfo, slo: SLO) -> dict:
    """The result of a run: vLLM-compatible fields plus goodput, SLO attainment and TBT."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.success]
    duration = max(info.duration_s, 1e-9)
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    met = sum(slo.met_by(r) for r in measured)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    s: dict = {
        "duration": info.duration_s,
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "num_requests": len(measured),
        "num_warmup": sum(r.warmup for r in records),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "request_rate": info.request_rate if math.isfinite(info.request_rate) else "inf",
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "slo": slo.describe(),
        "slo_from": "intended" if slo.from_intended else "sent",
        "slo_met": met,
        "slo_attainment": met / len(measured) if measured else 0.0,
        "goodput": met / duration,
        "request_goodput": met / duration,
    }
    _stats("ttft", ttfts, s)
    _stats("tpot", [t for r in ok if (t := tpot_s(r)) is not None], s)
    _stats("itl", [g for r in ok for g in itl_gaps(r.chunk_times)], s)
    _stats("tbt", [g for r in ok for g in tbt_gaps(r.chunk_times, r.chunk_tokens)], s)
    _stats("first_to_second", [g for r in ok if (g := first_to_second_s(r.chunk_times, r.chunk_tokens)) is not None], s)
    _stats("e2el", [r.e2e_s for r in ok], s)
    _stats("ttft_intended", [r.chunk_times[0] - r.intended_s for r in ok if r.chunk_times], s)
    _stats("e2el_intended", [r.end_s - r.intended_s for r in ok], s)
    _stats("send_lag", [r.send_lag_s for r in measured], s)
    queues = [r.server_queue_s for r in ok if r.server_queue_s is not None]
    if queues:
        _stats("server_queue", queues, s)
    s["errors"] = dict(Counter(r.error for r in measured if not r.success).most_common(10))
    s.update(info.extra)
    return s
