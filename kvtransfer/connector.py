"""The two KV connectors of a disaggregated deployment (the seam is engine/kv_connector.py).

PrefillConnector, on a prefill worker. The engine runs each request capped at one output token.
When the cap ends it but the request would go on (its real `max_tokens`, EOS and the context
allow), the connector holds its blocks, saves them out to the decode worker the router named
once the first token is published, and releases them on that worker's KVAck or the transport's
lease expiry (which also yields a NACK):

    request_finished -> held + KVSave  -> save(): read_blocks -> sender.send   (in flight)
    poll_acks(): KVAck -> released -> the scheduler frees the blocks (they stay in the prefix cache)

With streaming (`--kv-streaming layer`, the default) the KV does not wait for the prompt's end:
each prompt chunk that lands ships the blocks it completed, every layer, as a KVPart, and the
transfer at the end carries only the rest (the last chunk's blocks), naming how many parts came
before it. The decode worker verifies each part as it arrives and admits the request only when the
transfer that ends the stream has arrived and verified too:

    chunk_computed -> KVStream -> stream(): read_blocks -> sender.send_part   (part k)
    ... request_finished -> save(): the remaining blocks -> sender.send (parts=k+1)
    a request that ends at its first token, or is aborted: sender.cancel_stream

DecodeConnector, on a decode worker. A transfer that arrived and verified is kept here while its
request waits for admission; admission allocates blocks for the transferred tokens, and the
step's load copies the payload into them before the model runs:

    expect(ReceivedKV) -> num_external_tokens -> on_allocated -> KVLoad -> load(): write_blocks
    -> result (ACK, or NACK with the reason) for the decode worker to send back

Streamed parts need not wait for admission: as each one arrives (`on_part`, from the
receiver's `poll_parts`), the connector sets aside blocks for the whole stream and copies the part
into them, so that at admission only the blocks the transfer itself carries are left to load:

    PartArrived -> on_part(): blocks set aside (pool.allocate), write_blocks
    ReceivedKV of the same stream -> admission adopts those blocks (adopt_blocks) -> load(): the rest
    StreamEnded, a transfer of another stream, a refusal, an abort, idleness -> the blocks are freed

The copy is trusted only when the transfer that ends the stream names the same stream number:
the prefill worker holds every part until that transfer's ACK or lease expiry, so a part copied
before the transfer arrived was read while its sender still held it. Blocks are set aside only
while a quarter of the cache stays available and at most half of it is set aside; otherwise the
parts load at admission as before.

A decode worker never computes a prompt. When it runs out of blocks and pre-empts a request, the
connector offloads that request's computed KV to host memory before the step reuses its blocks,
and loads it back when the request is admitted again (the same path as a transfer).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache import KVPayloadError
from pdserve.engine.kv_connector import (
    BlockStore,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVLoad,
    KVSave,
    KVStream,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvtransfer.payload import blocks_shape
from pdserve.kvtransfer.tensors import ALLOWED_DTYPES, describe
from pdserve.kvtransfer.transport import KVSender, PartArrived, ReceivedKV, StreamEnded, make_sender
from pdserve.kvtransfer.transport.tcp import PAYLOAD_FRAME_BYTES, STREAM_IDLE_S
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import HandoffTiming, KVPart, KVTransfer, ModelFingerprint
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


PART_BYTES = PAYLOAD_FRAME_BYTES  # the most KV one message carries: one tcp frame, never joined


@dataclass(slots=True)
class HandoffTarget:
    """Where a prefill request's KV goes, and the sampling it continues with there."""

    address: str
    transport: str
    sampling: SamplingParams  # the request's own; the engine here runs it capped at one token
    epoch: str = ""  # the epoch of the router the request came from: its KVTransfer carries it
    receiver_id: str = ""  # the decode worker's id: its KVTransfer names it (replay to another fails)
    first_token_at: float = 0.0  # its first token was out (handed to the router link)
    sent_at: float = 0.0  # KV handed to the transport
    nbytes: int = 0
    parts: int = 0  # streamed parts sent
    streamed_blocks: int = 0  # blocks [0, streamed_blocks) went in those parts
    broken: bool = False  # a part could not go: the KV goes whole at the end instead


class HandoffResult(NamedTuple):
    request_id: str
    ok: bool
    reason: str


def _untraced(request_id: str) -> str:
    return ""


def handoff_timing(rkv: ReceivedKV, nbytes: int) -> HandoffTiming:
    """Where a loaded transfer's hand-off went (protocol/messages.py HandoffTiming). The prefill's
    timestamps are its host's clock: between hosts a skewed clock shows as 0, never below."""
    meta, loaded_at = rkv.meta, time.time()
    return HandoffTiming(wait=max(0.0, meta.sent_at - meta.first_token_at) if meta.first_token_at else 0.0,
                         send=max(0.0, rkv.arrived_at - meta.sent_at) if meta.sent_at else 0.0,
                         verify=max(0.0, rkv.verified_at - rkv.arrived_at),
                         load=max(0.0, loaded_at - rkv.verified_at), nbytes=nbytes, parts=meta.parts + 1)


def _check_tiling(pieces: list[tuple[int, torch.Tensor]], num_blocks: int) -> None:
    """Raise KVPayloadError unless the pieces cover blocks 0..num_blocks, each once, in order."""
    at = 0
    for first, part in pieces:
        if first != at or part.dim() != 6:
            raise KVPayloadError(f"KV pieces do not follow each other: one starts at block {first}, expected {at}")
        at += part.shape[2]
    if at != num_blocks:
        raise KVPayloadError(f"the KV covers {at} blocks, the request was given {num_blocks}")


def first_token_only(sampling: SamplingParams, num_generated: int = 0) -> SamplingParams:
    """What a prefill engine runs: the same sampling, stopped after its next token (the first,
    or the one after `num_generated` already generated elsewhere)."""
    cap = num_generated + 1
    return msgspec.structs.replace(sampling, max_tokens=cap, min_tokens=min(sampling.min_tokens, cap))


class PrefillConnector(KVConnectorScheduler, KVConnectorWorker):
    """Holds, ships and releases the KV of requests that continue on a decode worker."""

    def __init__(self, fingerprint: ModelFingerprint, worker_id: str, max_model_len: int,
                 lease_s: float = 5.0, auth: FrameAuth | None = None, streaming: bool = True) -> None:
        self.fingerprint = fingerprint
        self.streaming = streaming  # ship each prompt chunk's blocks as it lands (--kv-streaming layer)
        block_bytes = math.prod(blocks_shape(fingerprint, 1)) * ALLOWED_DTYPES[fingerprint.dtype].itemsize
        self._blocks_per_part = max(1, PART_BYTES // block_bytes)
        self.auth = auth  # signs every KV frame (None: unauthenticated, --insecure)
        self.worker_id = worker_id
        self.max_model_len = max_model_len
        self.lease_s = lease_s
        self.targets: dict[str, HandoffTarget] = {}  # accepted, not finished here yet
        self.in_flight: dict[str, HandoffTarget] = {}  # saved; waiting for the ack
        self.handoffs: deque[dict] = deque(maxlen=64)  # recent hand-off timelines, for /info
        self.bytes_sent = 0
        self.transfer_seconds = 0.0
        self._held: dict[str, HandoffTarget] = {}  # held by the scheduler, not yet saved
        self._released: list[str] = []
        self._failed: list[HandoffResult] = []  # saves that never left
        self._senders: dict[str, KVSender] = {}
        # The `traceparent` each KVTransfer carries (the worker's kv_send span; "" : untraced).
        self.trace_context: Callable[[str], str] = _untraced

    # --- the prefill worker's side -----------------------------------------------------------
    def expect(self, request_id: str, target: HandoffTarget) -> None:
        self.targets[request_id] = target

    def forget(self, request_id: str) -> None:
        """The request was aborted: nothing more to ship (a transfer in flight still ends in an
        ack or a lease expiry; parts streamed before it are dropped on both sides)."""
        target = self.targets.pop(request_id, None) or self._held.pop(request_id, None)
        if target is not None:
            self._cancel_stream(request_id, target)

    def _cancel_stream(self, request_id: str, target: HandoffTarget) -> None:
        if target.parts:
            self._sender(target.transport).cancel_stream(request_id)
            target.parts = target.streamed_blocks = 0

    def poll_acks(self) -> list[HandoffResult]:
        """Acks that came back since the last call (and saves that failed here); each releases
        its request's blocks."""
        out, self._failed = self._failed, []
        for sender in self._senders.values():
            for ack in sender.poll_acks():
                self._released.append(ack.request_id)
                target = self.in_flight.pop(ack.request_id, None)
                if target is None:
                    continue
                now = time.time()
                self.handoffs.append({"request_id": ack.request_id, "ok": ack.ok, "bytes": target.nbytes,
                                      "first_token_at": target.first_token_at, "kv_sent_at": target.sent_at,
                                      "kv_acked_at": now})
                if ack.ok:
                    self.bytes_sent += target.nbytes
                    self.transfer_seconds += now - target.sent_at
                out.append(HandoffResult(ack.request_id, ack.ok, ack.reason))
        return out

    def open(self, kinds: tuple[str, ...]) -> None:
        """Start the senders of these transports now, not at the first hand-off: a shm sender
        unlinks the segments a killed predecessor of this worker left behind as it starts."""
        for kind in kinds:
            self._sender(kind)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()

    # --- scheduler half ----------------------------------------------------------------------
    def num_external_tokens(self, req: Request) -> int:
        return 0

    def on_allocated(self, req: Request, block_ids: list[int], num_external: int, meta: KVConnectorMetadata) -> None:
        raise AssertionError("a prefill worker loads no KV")

    def request_finished(self, req: Request, meta: KVConnectorMetadata) -> bool:
        target = self.targets.pop(req.request_id, None)
        if target is None:
            return False
        if (req.status is not RequestStatus.FINISHED_LENGTH  # stopped for good (EOS, a stop token), aborted
                or req.num_output_tokens >= target.sampling.max_tokens or req.num_tokens >= self.max_model_len):
            self._cancel_stream(req.request_id, target)  # its own limit, not the cap: it ends here
            return False
        self._held[req.request_id] = target
        meta.saves.append(KVSave(req, list(req.block_ids)))
        return True

    def take_released(self) -> list[str]:
        out, self._released = self._released, []
        return out

    def chunk_computed(self, req: Request, num_tokens: int, meta: KVConnectorMetadata) -> None:
        target = self.targets.get(req.request_id)
        if target is None or target.broken:
            return
        full = num_tokens // self.fingerprint.block_size  # complete blocks: no later token writes them
        if full > target.streamed_blocks:
            meta.streams.append(KVStream(req, req.block_ids[target.streamed_blocks:full], target.streamed_blocks))
            target.streamed_blocks = full

    # --- worker half -------------------------------------------------------------------------
    def load(self, loads: list[KVLoad], runner: BlockStore) -> dict[str, str]:
        raise AssertionError("a prefill worker loads no KV")

    def stream(self, streams: list[KVStream], runner: BlockStore) -> None:
        for st in streams:
            req = st.request
            target = self.targets.get(req.request_id)
            if target is None or target.broken:
                continue  # aborted since, or its stream broke: the KV goes whole at the end
            total = -(-req.num_tokens // self.fingerprint.block_size)  # every token it computes here
            try:
                self._send_parts(req, target, runner, st.block_ids, st.first_block, total)
            except Exception as exc:  # e.g. an address the transport cannot dial
                log.warning("request %s: streaming KV part %d failed, sending the rest at the end: %r",
                            req.request_id, target.parts, exc)
                self._cancel_stream(req.request_id, target)
                target.broken = True

    def _send_parts(self, req: Request, target: HandoffTarget, runner: BlockStore, block_ids: list[int],
                    first_block: int, total: int) -> None:
        """Send these blocks as parts of at most PART_BYTES each; raises where one cannot go."""
        sender = self._sender(target.transport)
        for at in range(0, len(block_ids), self._blocks_per_part):
            payload = self._gather(sender, runner, block_ids[at : at + self._blocks_per_part])
            part = KVPart(request_id=req.request_id, prefill_worker_id=self.worker_id,
                          receiver_id=target.receiver_id, seq=target.parts, first_block=first_block + at,
                          total_blocks=total, fingerprint=self.fingerprint,
                          tensor=describe(payload, with_checksum=False), transport=target.transport)
            sender.send_part(target.address, part, payload)
            target.parts += 1
            target.nbytes += part.tensor.nbytes

    def save(self, saves: list[KVSave], runner: BlockStore) -> None:
        published = time.time()  # the engine saves only after the step's tokens were handed on
        for save in saves:
            req = save.request
            target = self._held.pop(req.request_id, None)
            if target is None:
                continue
            target.first_token_at = published
            try:
                self._ship(req, save.block_ids, target, runner)
            except Exception as exc:  # e.g. a decode address the transport cannot dial
                log.warning("request %s: KV hand-off to %s failed: %r", req.request_id, target.address, exc)
                self._cancel_stream(req.request_id, target)
                self.in_flight.pop(req.request_id, None)
                self._released.append(req.request_id)
                self._failed.append(HandoffResult(req.request_id, False, f"cannot send the KV: {exc}"))

    def _ship(self, req: Request, block_ids: list[int], target: HandoffTarget, runner: BlockStore) -> None:
        first = target.streamed_blocks if target.parts else 0  # the parts carried the rest
        # What is left goes in parts of at most PART_BYTES too: the receiver checks one while the
        # next is on its way, and never joins frames. The transfer carries the last of them.
        ahead = (len(block_ids) - first - 1) // self._blocks_per_part * self._blocks_per_part
        if ahead > 0:
            total = -(-req.num_computed_tokens // self.fingerprint.block_size)
            self._send_parts(req, target, runner, block_ids[first : first + ahead], first, total)
            first += ahead
        sender = self._sender(target.transport)
        payload = self._gather(sender, runner, block_ids[first:])
        meta = KVTransfer(
            request_id=req.request_id, prefill_worker_id=self.worker_id,
            prompt_token_ids=tuple(req.prompt_token_ids), output_token_ids=tuple(req.output_token_ids),
            sampling=target.sampling, num_computed_tokens=req.num_computed_tokens,
            fingerprint=self.fingerprint, tensor=describe(payload, with_checksum=False),
            transport=target.transport, arrival_time=req.arrival_time, epoch=target.epoch,
            trace_context=self.trace_context(req.request_id), receiver_id=target.receiver_id,
            first_block=first, parts=target.parts, first_token_at=target.first_token_at,
        )
        target.sent_at = time.time()
        target.nbytes += payload.numel() * payload.element_size()
        self.in_flight[req.request_id] = target
        sender.send(target.address, msgspec.structs.replace(meta, sent_at=target.sent_at), payload)

    def _gather(self, sender: KVSender, runner: BlockStore, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV, gathered straight into the transport's own buffer where it has one
        (a shm segment: no copy after this one)."""
        staging = getattr(sender, "staging", None)
        if staging is None:
            return runner.read_blocks(block_ids)
        buf = staging(blocks_shape(self.fingerprint, len(block_ids)), ALLOWED_DTYPES[self.fingerprint.dtype])
        try:
            return runner.read_blocks(block_ids, out=buf)
        except BaseException:
            sender.release_staging(buf)  # type: ignore[attr-defined]
            raise

    def _sender(self, kind: str) -> KVSender:
        if kind not in self._senders:
            options: dict[str, object] = {"lease_s": self.lease_s, "auth": self.auth}
            if kind == "shm":
                options["owner"] = self.worker_id  # a restarted worker reaps its predecessor's segments
            self._senders[kind] = make_sender(kind, **options)
        return self._senders[kind]


@dataclass(slots=True)
class _SetAside:
    """Blocks a decode worker set aside for a stream's KV before its request was admitted."""

    stream: int
    block_ids: list[int]
    loaded: dict[int, int]  # first block -> blocks, of the parts copied in
    last_at: float  # time.monotonic() of its last part


SET_ASIDE_IDLE_S = STREAM_IDLE_S + 30.0  # a set-aside with no news that long is freed (lost events)
_ENDED_STREAMS = 4096  # stream numbers remembered as ended, so that a late part event sets nothing aside


class DecodeConnector(KVConnectorScheduler, KVConnectorWorker):
    """Keeps arrived transfers until their requests are admitted, then loads them; copies
    streamed parts into blocks set aside for them as they arrive (module docstring)."""

    def __init__(self, early_load: bool = True) -> None:
        self.arrived: dict[str, ReceivedKV] = {}  # verified, its request waiting for blocks
        self.offloaded: dict[str, tuple[torch.Tensor, int]] = {}  # pre-empted: (KV copy, tokens)
        self.bytes_received = 0
        self.num_offloads = 0
        self._results: list[HandoffResult] = []
        # Loaded transfers' hand-off timings, until the worker sends the request's first token.
        self.timings: dict[str, HandoffTiming] = {}
        # Streamed parts copied in before admission (off for a pipelined engine: its stages own
        # their layers' blocks, written at a step's launch).
        self.early_load = early_load
        self.set_aside: dict[str, _SetAside] = {}
        self._pool: BlockPool | None = None  # the engine's, known from the first part
        self._ended: OrderedDict[int, None] = OrderedDict()
        self._preloaded: dict[str, dict[int, int]] = {}  # adopted at admission: parts not to load again
        # Parts copied in as they arrived, and their bytes; of those, parts the load then skipped
        # (adopted); streams refused a set-aside for want of room.
        self.early = {"parts": 0, "bytes": 0, "adopted": 0, "no_room": 0}

    # --- the decode worker's side ------------------------------------------------------------
    def expect(self, rkv: ReceivedKV) -> None:
        rid = rkv.meta.request_id
        self.arrived[rid] = rkv
        self._end_stream(rkv.stream)
        aside = self.set_aside.get(rid)
        if aside is not None and aside.stream != rkv.stream:
            self.drop_set_aside(rid)

    def give_up(self, request_id: str, reason: str) -> None:
        """Refuse an arrived transfer that was not loaded (NACK with `reason`)."""
        self.drop_set_aside(request_id)
        if self.arrived.pop(request_id, None) is not None:
            self._results.append(HandoffResult(request_id, False, reason))

    def on_part(self, event: PartArrived | StreamEnded, pool: BlockPool, runner: BlockStore) -> None:
        """A receiver's part event (engine thread, between steps): copy a part into the blocks
        set aside for its stream, setting them aside at its first part; free them when the
        stream ended without a transfer."""
        rid = event.request_id
        self._pool = pool
        aside = self.set_aside.get(rid)
        if isinstance(event, StreamEnded):
            self._end_stream(event.stream)
            if aside is not None and aside.stream == event.stream:
                self.drop_set_aside(rid)
            return
        if not self.early_load or rid in self.arrived or event.stream in self._ended:
            return  # its transfer came first (the load will copy this part), or the stream is over
        if aside is not None and aside.stream != event.stream:
            self.drop_set_aside(rid)  # the request's KV comes again, from part 0
            aside = None
        if aside is None:
            if event.first_block != 0:
                return  # the stream's first part was not seen: its parts load at admission
            n = event.total_blocks
            reserved = sum(len(a.block_ids) for a in self.set_aside.values())
            if pool.num_available - n < pool.num_blocks // 4 or reserved + n > pool.num_blocks // 2:
                self.early["no_room"] += 1
                return
            aside = self.set_aside[rid] = _SetAside(event.stream, pool.allocate(n), {}, time.monotonic())
        first, count = event.first_block, event.view.shape[2]
        if first + count > len(aside.block_ids):
            self.drop_set_aside(rid)
            return
        try:
            runner.write_blocks(aside.block_ids[first : first + count], event.view)
        except (KVPayloadError, RuntimeError) as exc:
            log.warning("request %s: early copy of blocks %d.. failed (%s); it loads at admission", rid, first, exc)
            self.drop_set_aside(rid)
            return
        aside.loaded[first] = count
        aside.last_at = time.monotonic()
        self.early["parts"] += 1
        self.early["bytes"] += event.view.nbytes

    def drop_set_aside(self, request_id: str) -> None:
        """Free the blocks set aside for the request's stream, if any."""
        aside = self.set_aside.pop(request_id, None)
        if aside is not None:
            assert self._pool is not None  # a set-aside exists only once on_part has seen the pool
            self._pool.free(aside.block_ids)

    def expire_set_asides(self, now: float | None = None) -> list[str]:
        """Free set-asides whose stream has had no news for SET_ASIDE_IDLE_S (its StreamEnded
        event was lost) and whose transfer has not arrived."""
        if not self.set_aside:  # every turn of the worker's loop: nothing to walk, most of the time
            return []
        now = time.monotonic() if now is None else now
        stale = [rid for rid, a in self.set_aside.items()
                 if rid not in self.arrived and now - a.last_at > SET_ASIDE_IDLE_S]
        for rid in stale:
            self.drop_set_aside(rid)
        return stale

    def _end_stream(self, stream: int) -> None:
        if stream:
            self._ended[stream] = None
            while len(self._ended) > _ENDED_STREAMS:
                self._ended.popitem(last=False)

    def expired(self) -> list[str]:
        """Arrived transfers whose sender's lease ran out before their request was admitted."""
        now = time.time()
        return [rid for rid, rkv in self.arrived.items() if not rkv.within_lease(now)]

    def take_results(self) -> list[HandoffResult]:
        """Loads done or refused since the last call: the ACKs and NACKs to send."""
        out, self._results = self._results, []
        return out

    # --- scheduler half ----------------------------------------------------------------------
    def num_external_tokens(self, req: Request) -> int:
        rkv = self.arrived.get(req.request_id)
        if rkv is not None:
            return rkv.meta.num_computed_tokens
        kept = self.offloaded.get(req.request_id)
        return kept[1] if kept is not None else 0

    def num_set_aside(self, req: Request) -> int:
        aside = self.set_aside.get(req.request_id)
        rkv = self.arrived.get(req.request_id)
        if aside is None or rkv is None or aside.stream != rkv.stream or self._pool is None:
            return 0
        fits = len(aside.block_ids) == -(-rkv.meta.num_computed_tokens // self._pool.block_size)
        return len(aside.block_ids) if fits else 0

    def adopt_blocks(self, req: Request) -> list[int]:
        if not self.num_set_aside(req):
            return []
        aside = self.set_aside.pop(req.request_id)
        self._preloaded[req.request_id] = aside.loaded
        return aside.block_ids

    def on_allocated(self, req: Request, block_ids: list[int], num_external: int, meta: KVConnectorMetadata) -> None:
        self.drop_set_aside(req.request_id)  # one admission did not adopt (its size did not fit)
        meta.loads.append(KVLoad(req.request_id, block_ids, num_external))

    def request_finished(self, req: Request, meta: KVConnectorMetadata) -> bool:
        self._preloaded.pop(req.request_id, None)
        self.give_up(req.request_id, "aborted" if req.status is RequestStatus.FINISHED_ABORTED else req.status.value)
        self.offloaded.pop(req.request_id, None)
        if req.status is RequestStatus.FINISHED_ABORTED:
            self.timings.pop(req.request_id, None)  # no token will carry it
        return False

    def request_preempted(self, req: Request, meta: KVConnectorMetadata) -> bool:
        self._preloaded.pop(req.request_id, None)  # the adopted blocks go with its others
        if req.request_id in self.arrived:
            return True  # its transfer was never loaded: it is still here to load
        n = req.num_computed_tokens
        if n <= 0:
            return False
        meta.offloads.append(KVSave(req, list(req.block_ids)))
        self.offloaded[req.request_id] = (torch.empty(0), n)
        return True

    def take_released(self) -> list[str]:
        return []

    # --- worker half -------------------------------------------------------------------------
    def offload(self, offloads: list[KVSave], runner: BlockStore) -> None:
        for save in offloads:
            rid = save.request.request_id
            _, n = self.offloaded[rid]
            self.offloaded[rid] = (runner.read_blocks(save.block_ids[: -(-n // runner.block_size)]), n)
            self.num_offloads += 1

    def load(self, loads: list[KVLoad], runner: BlockStore) -> dict[str, str]:
        failures: dict[str, str] = {}
        for load in loads:
            kept = self.offloaded.pop(load.request_id, None)
            if kept is not None:
                runner.write_blocks(load.block_ids, kept[0])
                continue
            rkv = self.arrived.pop(load.request_id, None)
            pieces = rkv.pieces() if rkv is not None else []
            preloaded = self._preloaded.pop(load.request_id, {})
            if rkv is None or not pieces:
                failures[load.request_id] = "KV transfer is gone"
                continue
            if rkv.within_lease():
                try:
                    _check_tiling(pieces, len(load.block_ids))
                    for first, part in pieces:  # streamed parts, then the transfer's own blocks
                        if preloaded.get(first) == part.shape[2]:  # copied in as it arrived
                            self.early["adopted"] += 1
                        else:
                            runner.write_blocks(load.block_ids[first : first + part.shape[2]], part)
                except (KVPayloadError, RuntimeError) as exc:
                    failures[load.request_id] = f"KV transfer refused: {exc}"
                    self._results.append(HandoffResult(load.request_id, False, str(exc)))
                    continue
            # The sender may reuse a shm / CUDA IPC region after its lease: trust only a copy
            # that finished within it.
            if not rkv.within_lease():
                failures[load.request_id] = "KV transfer lease expired"
                self._results.append(HandoffResult(load.request_id, False, "lease expired"))
                continue
            nbytes = sum(part.numel() * part.element_size() for _, part in pieces)
            self.bytes_received += nbytes
            self.timings[load.request_id] = handoff_timing(rkv, nbytes)
            self._results.append(HandoffResult(load.request_id, True, ""))
        return failures

    def save(self, saves: list[KVSave], runner: BlockStore) -> None:
        raise AssertionError("a decode worker saves no KV")
