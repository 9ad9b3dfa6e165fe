"""Which workers exist, how loaded they are, and which of them serves the next request.

The registry is owned by the router's event loop (no locks): the control server feeds it
Register / Heartbeat / Goodbye, the HTTP handlers ask it for a `Route`. Load between two
heartbeats is estimated: every request the router sends is added to the target's pending
counters, which the next heartbeat (whose numbers already include it) resets.
"""

from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pdserve.config.router import KV_TRANSPORT_CHOICES
from pdserve.protocol.messages import Heartbeat, ModelFingerprint, Register

log = logging.getLogger(__name__)

# hash_blocks(token_ids, block_size) -> chained hashes of the full blocks (engine/block_hash.py).
Hasher = Callable[[Sequence[int], int], list[bytes]]

MAX_PREFIX_ENTRIES = 100_000


# "auto": the zero-copy kind both ends offer when they share a host (CUDA IPC first), else tcp.
SAME_HOST_PREFERENCE = ("cuda_ipc", "shm")


@dataclass(slots=True)
class WorkerState:
    """The router's view of one worker: what it registered, its last heartbeat, our estimates."""

    info: Register
    last_seen: float
    free_blocks: int
    total_blocks: int
    queued_prefill_tokens: int = 0
    running: int = 0
    waiting: int = 0
    draining: bool = False
    # Sent by the router since the last heartbeat (reset by it).
    pending_tokens: int = 0
    pending_blocks: int = 0
    pending_requests: int = 0
    # Prompt block hashes routed here, least recently used first (prefill / colocated only).
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    requests: set[str] = field(default_factory=set)
    last_heartbeat: Heartbeat | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def kv_resident(self) -> bool:
        """Its KV cache faulted in, as its last heartbeat says (unknown, so False, before one)."""
        return self.last_heartbeat is not None and self.last_heartbeat.kv_resident

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def block_size(self) -> int:
        return max(1, self.info.fingerprint.block_size)

    @property
    def queued_tokens(self) -> int:
        return self.queued_prefill_tokens + self.pending_tokens

    @property
    def free_now(self) -> int:
        return self.free_blocks - self.pending_blocks

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:  # chained hashes: the first miss ends the shared prefix
            if h not in self.prefixes:
                break
            n += 1
        return n

    def remember_prefix(self, hashes: Sequence[bytes]) -> None:
        cap = min(MAX_PREFIX_ENTRIES, max(1, self.info.num_blocks))
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > cap:
            self.prefixes.popitem(last=False)


class Route(NamedTuple):
    """Where one request goes. Colocated: `first` does everything and `decode` is None."""

    mode: Literal["disaggregated", "colocated"]
    first: str
    decode: str | None = None
    decode_kv_address: str = ""
    kv_transport: str = "tcp"
    cached_prefix_tokens: int = 0

    @property
    def workers(self) -> tuple[str, ...]:
        return (self.first,) if self.decode is None else (self.first, self.decode)


class Registry:
    """Live workers by id. Not thread-safe: used from the router's event loop only."""

    def __init__(
        self,
        hasher: Hasher | None = None,
        kv_transport: str = "auto",
        prefill_fallback: bool = True,
    ) -> None:
        if kv_transport not in KV_TRANSPORT_CHOICES:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORT_CHOICES}, got {kv_transport!r}")
        self.hasher = hasher
        self.kv_transport = kv_transport
        # With no prefill worker left (or none of the decode's model), a decode worker serves the
        # whole request itself: conditional disaggregation as the fallback, not an outage.
        self.prefill_fallback = prefill_fallback
        self.workers: dict[str, WorkerState] = {}
        self.ever_registered: set[str] = set()  # worker ids seen since start (readiness counts them)

    # --- membership ----------------------------------------------------------------------

    def register(self, msg: Register, now: float) -> tuple[str | None, WorkerState | None]:
        """Add or replace a worker. Returns (refusal reason or None, the replaced incarnation)."""
        if not msg.worker_id:
            return "worker_id must not be empty", None
        if msg.num_blocks <= 0 or msg.max_model_len <= 0:
            return "num_blocks and max_model_len must be positive", None
        if msg.role == "decode" and not msg.kv_address:
            return "a decode worker must register its kv_address", None
        old = self.workers.get(msg.worker_id)
        if old is not None and old.info == msg:
            old.last_seen = now  # a repeated Register (its ack crossed it): keep our estimates
            return None, None
        self.workers[msg.worker_id] = WorkerState(
            info=msg, last_seen=now, free_blocks=msg.num_blocks, total_blocks=msg.num_blocks
        )
        self.ever_registered.add(msg.worker_id)
        return None, old

    def heartbeat(self, msg: Heartbeat, now: float) -> WorkerState | None:
        w = self.workers.get(msg.worker_id)
        if w is None:
            return None
        w.last_seen = now
        w.free_blocks, w.total_blocks = msg.free_blocks, msg.total_blocks
        w.queued_prefill_tokens, w.running, w.waiting = (
            msg.queued_prefill_tokens,
            msg.running,
            msg.waiting,
        )
        w.draining = msg.draining
        w.pending_tokens = w.pending_blocks = w.pending_requests = 0
        w.last_heartbeat = msg
        return w

    def touch(self, worker_id: str, now: float) -> bool:
        w = self.workers.get(worker_id)
        if w is not None:
            w.last_seen = now
        return w is not None

    def remove(self, worker_id: str) -> WorkerState | None:
        return self.workers.pop(worker_id, None)

    def expire(
        self, now: float, timeout: float, arrived: Mapping[str, float] | None = None
    ) -> list[WorkerState]:
        """Remove and return the workers silent for longer than `timeout` seconds.

        `arrived`: when each worker's last frame reached the socket (maybe later than `last_seen`,
        which is when the event loop handled it).
        """
        arrived = arrived or {}
        dead = [
            w
            for w in self.workers.values()
            if now - max(w.last_seen, arrived.get(w.worker_id, 0.0)) > timeout
        ]
        for w in dead:
            del self.workers[w.worker_id]
        return dead

    def forget_request(self, request_id: str, workers: Sequence[str]) -> None:
        for wid in workers:
            w = self.workers.get(wid)
            if w is not None:
                w.requests.discard(request_id)

    # --- capacity ------------------------------------------------------------------------

    def _usable(self, role: str, avoid: Collection[str] = ()) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role and not w.draining and w.worker_id not in avoid]

    def has_path(self) -> bool:
        return bool(self._usable("colocated")) or bool(
            self._usable("decode") and (self._usable("prefill") or self.prefill_fallback)
        )

    def max_model_len(self) -> int | None:
        """The context length every usable worker accepts (the smallest), None when none."""
        lens = [w.info.max_model_len for w in self.workers.values() if not w.draining]
        return min(lens) if lens else None

    # --- picking -------------------------------------------------------------------------

    def pick(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
             avoid: Collection[str] = ()) -> Route | None:
        """Choose the workers for one request and charge them its load; None when no path.

        `avoid`: workers that just failed this request; they are used only when no route
        without them exists (a retry on the same worker beats no retry)."""
        hashes = _Hashes(self.hasher, token_ids)
        route = self._route(hashes, max_tokens, set(avoid)) if avoid else None
        route = route or self._route(hashes, max_tokens, set())
        if route is not None:
            self._charge(request_id, route, hashes, max_tokens)
        return route

    def _route(self, hashes: _Hashes, max_tokens: int, avoid: set[str]) -> Route | None:
        prefills, decodes = self._usable("prefill", avoid), self._usable("decode", avoid)
        if prefills and decodes:
            route = self._pick_disaggregated(prefills, decodes, hashes, max_tokens)
            if route is not None:
                return route
        colocated = self._usable("colocated", avoid)
        if not colocated and self.prefill_fallback and decodes:
            colocated = decodes  # no prefill path: a decode worker prefills the request itself
        if not colocated:
            return None

        def load(w: WorkerState) -> tuple[int, int, int]:
            cached = w.cached_prefix_blocks(hashes.get(w.block_size)) * w.block_size
            return (
                w.queued_tokens + len(hashes.token_ids) - cached,
                w.running + w.waiting + w.pending_requests,
                -w.free_now,
            )

        best = _least(colocated, load)
        cached = best.cached_prefix_blocks(hashes.get(best.block_size)) * best.block_size
        return Route("colocated", best.worker_id, cached_prefix_tokens=cached)

    def _pick_disaggregated(
        self,
        prefills: list[WorkerState],
        decodes: list[WorkerState],
        hashes: _Hashes,
        max_tokens: int,
    ) -> Route | None:
        n = len(hashes.token_ids)

        # Tokens this prefill must compute before our request is done: its queue plus our
        # uncached suffix. A held prefix wins exactly when it saves more than the queue costs.
        # Ties go to the less loaded worker (running + queued, then free blocks), then at random:
        # never by worker id, which would pile every tie onto one worker.
        def prefill_cost(w: WorkerState) -> tuple[int, int, int, float]:
            cached = w.cached_prefix_blocks(hashes.get(w.block_size)) * w.block_size
            return (
                w.queued_tokens + n - cached,
                w.running + w.waiting + w.pending_requests,
                -w.free_now,
                random.random(),
            )

        for p in sorted(prefills, key=prefill_cost):
            compatible = [d for d in decodes if _same_model(p.info.fingerprint, d.info.fingerprint)]
            if not compatible:
                continue
            d = self._pick_decode(compatible, n + max_tokens)
            cached = p.cached_prefix_blocks(hashes.get(p.block_size)) * p.block_size
            return Route(
                "disaggregated",
                p.worker_id,
                d.worker_id,
                d.info.kv_address,
                self._transport(p, d),
                cached,
            )
        log.warning("no decode worker runs the same model (fingerprint) as any prefill worker")
        return None

    @staticmethod
    def _pick_decode(decodes: list[WorkerState], total_tokens: int) -> WorkerState:
        def need(d: WorkerState) -> int:
            return math.ceil(total_tokens / d.block_size)

        fitting = [d for d in decodes if d.free_now >= need(d)]
        # None fits now: the most free one will queue it until blocks free up. Ties: the fewest
        # requests (running, waiting, just routed), then at random, never by worker id.
        return _least(
            fitting or decodes, lambda d: (-d.free_now, d.running + d.waiting + d.pending_requests)
        )

    def _transport(self, p: WorkerState, d: WorkerState) -> str:
        if self.kv_transport == "tcp":
            return "tcp"
        if not p.info.host_id or p.info.host_id != d.info.host_id:
            return "tcp"
        wanted = SAME_HOST_PREFERENCE if self.kv_transport == "auto" else (self.kv_transport,)
        for t in wanted:
            if t in p.info.kv_transports and t in d.info.kv_transports:
                return t
        return "tcp"

    def _charge(self, request_id: str, route: Route, hashes: _Hashes, max_tokens: int) -> None:
        n = len(hashes.token_ids)
        first = self.workers[route.first]
        first.pending_tokens += n - route.cached_prefix_tokens
        first.pending_requests += 1
        first.requests.add(request_id)
        first.remember_prefix(hashes.get(first.block_size))
        holder = self.workers[route.decode] if route.decode else first
        holder.pending_blocks += math.ceil((n + max_tokens) / holder.block_size)
        if route.decode:
            holder.pending_requests += 1
            holder.requests.add(request_id)


class _Hashes:
    """Block hashes of one prompt, computed once per block size on first use."""

    def __init__(self, hasher: Hasher | None, token_ids: Sequence[int]) -> None:
        self.hasher, self.token_ids = hasher, token_ids
        self._by_size: dict[int, list[bytes]] = {}

    def get(self, block_size: int) -> list[bytes]:
        if self.hasher is None:
            return []
        if block_size not in self._by_size:
            self._by_size[block_size] = self.hasher(self.token_ids, block_size)
        return self._by_size[block_size]


def _least(workers: Sequence[WorkerState], load: Callable[[WorkerState], tuple]) -> WorkerState:
    """The least loaded worker; equally loaded ones are picked from at random."""
    best = min(load(w) for w in workers)
    return random.choice([w for w in workers if load(w) == best])


def _same_model(a: ModelFingerprint, b: ModelFingerprint) -> bool:
    return a == b
