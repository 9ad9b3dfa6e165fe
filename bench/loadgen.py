"""The load generator: drives a workload against an endpoint, open-loop or closed-loop.

Open loop: each request has an intended send time from the schedule, whatever happened to the
requests before it. When the client cannot keep up (a `max_concurrency` cap, an exhausted
connection pool, a late event loop), the request goes late and the record keeps both times, so
latency measured from the intended time shows the queueing a closed-loop client would hide
(coordinated omission).

Closed loop: `concurrency` workers each send their next request when the previous one ends;
intended time equals the moment the worker was free.

Warm-up: the first `num_warmup` requests of the workload are sent first (at most `concurrency`
at a time), all of them answered before measurement starts, and are kept in the records marked
warm-up; cold-start costs (lazy imports, first connections, compilation) stay out of the results.
The measured window opens when the measured schedule starts (its arrival times are shifted to
start there) and closes when the last measured request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import httpx
import msgspec
from tqdm import tqdm

from pdserve.bench.client import Clock, Endpoint, send_request
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import RequestSpec

log = logging.getLogger(__name__)


class LoadMode(str, Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to drive the workload. `concurrency` is the worker count (closed) or an optional cap
    on requests in flight (open)."""

    mode: LoadMode = LoadMode.OPEN
    concurrency: int | None = None
    num_warmup: int = 0
    duration_s: float | None = None  # stop issuing new measured requests after this long
    max_requests: int | None = None  # measured requests at most
    request_timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode is LoadMode.CLOSED and not self.concurrency:
            raise ValueError("closed-loop load needs a concurrency (number of workers) >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup must be >= 0, got {self.num_warmup}")


@dataclass(slots=True)
class LoadResult:
    """Every record of the run (warm-up included, marked) and the measured window."""

    records: list[RequestRecord]
    window_start_s: float
    window_end_s: float

    @property
    def duration_s(self) -> float:
        return max(self.window_end_s - self.window_start_s, 0.0)

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]


def _split(specs: Sequence[RequestSpec], cfg: LoadConfig) -> tuple[list[RequestSpec], Iterator[RequestSpec]]:
    """(warm-up specs, measured specs in order); a closed loop with a duration cycles the workload."""
    warmup = list(specs[: cfg.num_warmup])
    rest = specs[cfg.num_warmup:]
    if not rest:
        raise ValueError(f"the workload has {len(specs)} requests, all of them warm-up: nothing to measure")
    if cfg.mode is LoadMode.CLOSED and cfg.duration_s is not None:
        measured: Iterator[RequestSpec] = (
            msgspec.structs.replace(s, request_id=f"{s.request_id}-r{lap}") if lap else s
            for lap in itertools.count() for s in rest)
    else:
        measured = iter(rest)
    return warmup, itertools.islice(measured, cfg.max_requests)


async def run_load(specs: Sequence[RequestSpec], endpoint: Endpoint, cfg: LoadConfig) -> LoadResult:
    """Run the workload to completion and return every record; failures are records, not raises."""
    if not specs:
        raise ValueError("the workload has no requests")
    warmup, measured = _split(specs, cfg)
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency or 100)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(cfg.request_timeout_s, 30.0))
    total = None
    if cfg.duration_s is None:
        total = len(specs) - len(warmup) if cfg.max_requests is None else min(cfg.max_requests, len(specs) - len(warmup))
    clock = Clock()
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        cap = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None

        async def one(spec: RequestSpec, intended: float, warm: bool, bar: tqdm | None = None) -> None:
            if cap is None:
                rec = await send_request(client, endpoint, spec, intended, clock, warmup=warm)
            else:
                async with cap:
                    rec = await send_request(client, endpoint, spec, intended, clock, warmup=warm)
            records.append(rec)
            if bar is not None:
                bar.update(1)

        if warmup:
            log.info("warm-up: %d requests", len(warmup))
            now = clock.now()
            await asyncio.gather(*(one(s, now, True) for s in warmup))
        window_start = clock.now()
        with tqdm(total=total, desc="requests", unit="req", disable=not cfg.progress, leave=False) as bar:
            if cfg.mode is LoadMode.OPEN:
                await _open_loop(measured, cfg, clock, window_start, lambda s, t: one(s, t, False, bar))
            else:
                await _closed_loop(measured, cfg, clock, window_start, lambda s, t: one(s, t, False, bar))
    end = max((r.end_s for r in records if not r.warmup), default=window_start)
    records.sort(key=lambda r: (r.intended_s, r.request_id))
    return LoadResult(records=records, window_start_s=window_start, window_end_s=end)


async def _open_loop(measured: Iterator[RequestSpec], cfg: LoadConfig, clock: Clock, start: float, one) -> None:
    tasks: list[asyncio.Task] = []
    first_arrival: float | None = None
    try:
        for spec in measured:
            if first_arrival is None:
                first_arrival = spec.arrival_s
            offset = spec.arrival_s - first_arrival
            if cfg.duration_s is not None and offset > cfg.duration_s:
                break
            intended = start + offset
            delay = intended - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, intended)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _closed_loop(measured: Iterator[RequestSpec], cfg: LoadConfig, clock: Clock, start: float, one) -> None:
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            spec = next(measured, None)
            if spec is None:
                return
            now = clock.now()
            if cfg.duration_s is not None and now - start > cfg.duration_s:
                stop.set()
                return
            await one(spec, now)

    assert cfg.concurrency is not None  # checked by LoadConfig
    workers = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*workers, return_exceptions=True)


def run_load_sync(specs: Sequence[RequestSpec], endpoint: Endpoint, cfg: LoadConfig) -> LoadResult:
    """`run_load` from synchronous code (the CLI, sweep and compare)."""
    return asyncio.run(run_load(specs, endpoint, cfg))

