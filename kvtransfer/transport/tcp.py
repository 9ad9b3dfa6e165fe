"""KV over ZeroMQ: the channel every transport shares, and the TCP transport itself.

    prefill  DEALER (one per decode address) ──[KVPart ...][KVTransfer msgpack][payload frames?]─► ROUTER  decode
             DEALER ◄──────────────────────────────────────[KVAck msgpack]──────────────────────── ROUTER

A request's KV comes as zero or more KVParts (blocks streamed while its prompt is prefilled, and
pieces of at most 16 MiB of the rest) and the KVTransfer that ends the stream; only the
KVTransfer is acked. The receiver checks each part on arrival and keeps a view of it (an
`_Assembly`) until the transfer hands them all out as one ReceivedKV (`pieces()`).

TCP sends the payload as raw frames of at most `PAYLOAD_FRAME_BYTES` after the header (zero-copy
on send: `copy=False, track=True` over slices of the tensor; on receipt a view over the one zmq
Frame of a small payload, a joined copy of a larger one's). Frames that size let the receiver's
`MAXMSGSIZE` be small: it is what a peer that has not finished its handshake can make it buffer
(handshake.py). The shm and CUDA IPC transports subclass these classes and send no payload frame:
`location` names the bytes.

Every connection first proves the deployment secret (CURVE, handshake.py). Every message is then
`[auth frame, header, *payload]` (pdserve.protocol.auth): the MAC covers the header, which carries
the payload's checksum, and CURVE authenticates every frame (docs/security.md, "KV payload
integrity"), so a receiver never decodes a frame of an unauthenticated sender (it drops it,
counted in `stats()`); a header naming another receiver (`receiver_id`) is dropped too. Acks are
authenticated the same way. A transfer that fails on the receiver for any reason is NACKed at
once. Sender sockets (one per decode address) are closed when idle for `IDLE_SOCKET_S` and capped
at `MAX_PEER_SOCKETS`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from pdserve.config.log_limits import RateLimitedLog
from pdserve.engine.device import on_kv_stream
from pdserve.kvtransfer.payload import (
    KVHeader,
    fingerprint_mismatch,
    part_shape_mismatch,
    payload_shape_mismatch,
    with_header,
)
from pdserve.kvtransfer.tensors import (
    TensorFrameError,
    as_bytes,
    describe,
    tensor_from_buffer,
    verify_reason,
)
from pdserve.kvtransfer.transport.base import (
    IOLoop,
    KVReceiver,
    KVSender,
    PartArrived,
    ReceivedKV,
    StreamEnded,
    TransportError,
    drain,
)
from pdserve.kvtransfer.transport.handshake import ZapHandler, secure_client, secure_server
from pdserve.protocol.auth import (
    HANDSHAKE_FAILED,
    KV_TO_DECODE,
    KV_TO_PREFILL,
    AuthError,
    FrameAuth,
    is_auth_frame,
)
from pdserve.protocol.codec import ProtocolError, decode, encode, open_message
from pdserve.protocol.messages import KVAck, KVPart, KVTransfer, ModelFingerprint, TensorHeader

log = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://")
_BATCH = 64  # messages read per wake-up before other sockets get a turn
_MAX_PENDING_PEERS = 65536  # unacked request ids remembered for their ack's return address
MAX_QUEUED_SENDS = 4096  # sends handed to the I/O thread and not yet done: more fail at once
MAX_READY = 4096  # received transfers the engine has not polled: more are NACKed at once
IDLE_SOCKET_S = 60.0  # a sender's DEALER to a decode address with no traffic that long is closed
MAX_PEER_SOCKETS = 256  # DEALERs one sender keeps open (the least recently used idle one goes)
PAYLOAD_FRAME_BYTES = 16 << 20  # a tcp payload travels in frames of at most this
MAX_STREAMS = 1024  # incoming streams a receiver assembles at once: a part of one more is dropped
MAX_PART_EVENTS = 4096  # part / stream-end events the engine has not polled: more are not queued
STREAM_IDLE_S = 300.0  # a stream with no part that long, and no transfer ending it, is dropped
MAX_FRAME_BYTES = PAYLOAD_FRAME_BYTES + (16 << 20)  # a receiver's MAXMSGSIZE: a payload frame or a header

_log_bad = RateLimitedLog(log, logging.WARNING, per_seconds=10.0)


def check_address(address: str) -> None:
    if not address.startswith(_SCHEMES):
        raise ValueError(f"KV address must start with one of {_SCHEMES}, got {address!r}")


@dataclass(slots=True)
class _InFlight:
    address: str
    deadline: float  # time.monotonic()
    tracker: zmq.MessageTracker
    # Kept alive until the ack / lease expiry: tensors, shm segments, CUDA staging (the
    # transfer's own, and those of the parts streamed before it).
    holds: list


@dataclass(slots=True)
class _Stream:
    """The parts of one request's KV sent so far, not yet ended by its transfer (I/O thread)."""

    address: str
    part: KVPart  # the first one: who sends it, to whom, for which model
    holds: list = field(default_factory=list)
    sent: int = 0
    broken: str = ""  # why a part could not go: the transfer that would end the stream fails


@dataclass(slots=True)
class _Assembly:
    """The verified parts of one incoming stream, kept until its transfer ends it (I/O thread)."""

    sender: str  # prefill_worker_id
    total_blocks: int
    last_at: float  # time.monotonic() of its last part
    stream: int  # this receiver's number for it, unique: PartArrived / ReceivedKV.stream
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    releases: list = field(default_factory=list)
    next_seq: int = 0
    next_block: int = 0
    nbytes: int = 0
    failed: str = ""

    def release(self) -> None:
        self.parts.clear()
        releases, self.releases = self.releases, []
        for release in releases:
            with contextlib.suppress(Exception):
                release()


class ZmqKVSender(KVSender):
    """Sends KV to any number of decode workers (one DEALER each, made on first use)."""

    kind = "tcp"
    leases_region = False  # True where the receiver reads the sender's memory until the ack

    def __init__(self, *, lease_s: float = 5.0, name: str = "kv-sender", auth: FrameAuth | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        # A session of its own (same key): counters of two senders never interleave on one socket.
        self.auth = FrameAuth(auth.key) if auth is not None else FrameAuth(None)
        self._acks: queue.Queue[KVAck] = queue.Queue()
        self._inflight: dict[str, _InFlight] = {}
        self._draining: list[_InFlight] = []  # done with, but zmq may still read their frames
        self._streams: dict[str, _Stream] = {}  # request id -> its parts sent so far
        self._cooling: list[tuple[float, list]] = []  # (monotonic deadline, holds) of dropped streams
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self._last_used: dict[str, float] = {}
        self._queued = 0  # sends not yet taken by the I/O thread (engine thread +, I/O thread -)
        self._queued_lock = threading.Lock()
        self._loop = IOLoop(name, tick=self._tick)

    # --- engine thread -------------------------------------------------------------------

    def send(self, address: str, meta: KVTransfer, payload: torch.Tensor) -> bool:
        check_address(address)
        with self._queued_lock:
            full = self._queued >= MAX_QUEUED_SENDS
            if not full:
                self._queued += 1
        if full:
            self._loop.counters["queue_full"] += 1
            self._acks.put(KVAck(request_id=meta.request_id, ok=False, reason="KV send queue full"))
            return False
        ready = self._ready_event(payload)
        self._loop.call_soon(lambda: self._send_now(address, meta, payload, ready))
        return True

    def send_part(self, address: str, part: KVPart, payload: torch.Tensor) -> bool:
        check_address(address)
        with self._queued_lock:  # parts are never refused here: their request's send already counts
            self._queued += 1
        ready = self._ready_event(payload)
        self._loop.call_soon(lambda: self._send_part_now(address, part, payload, ready))
        return True

    def cancel_stream(self, request_id: str) -> None:
        self._loop.call_soon(lambda: self._cancel_now(request_id))

    @staticmethod
    def _ready_event(payload: torch.Tensor) -> object:
        if not payload.is_cuda:
            return None
        ready = torch.cuda.Event()  # the I/O thread must not read it before the engine's stream wrote it
        ready.record(torch.cuda.current_stream(payload.device))
        return ready

    def poll_acks(self, timeout: float = 0.0) -> list[KVAck]:
        return drain(self._acks, timeout)

    def stats(self) -> dict[str, int]:
        return {**self._loop.counters, "in_flight": len(self._inflight), "streams": len(self._streams)}

    def close(self) -> None:
        self._loop.stop(finalize=self._finalize)

    # --- transport hooks (I/O thread) ---------------------------------------------------

    def _stage(self, meta: KVHeader, payload: torch.Tensor) -> tuple[KVHeader, list, object]:
        """Return the meta to send, the raw frames after it, and what to hold until done."""
        t = payload.detach()
        with on_kv_stream(t.device):  # a device payload comes to the host on the KV stream
            t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
        meta = with_header(meta, tensor=describe(t))
        data = as_bytes(t).numpy().data
        return meta, [data[i : i + PAYLOAD_FRAME_BYTES] for i in range(0, len(data), PAYLOAD_FRAME_BYTES)] or [data], t

    def _unstage(self, hold: object) -> None:
        """The receiver is done with `hold` (acked, or its lease expired)."""

    def _close_resources(self) -> None:
        """Free transport resources at close (after every in-flight hold was unstaged)."""

    # --- I/O thread ---------------------------------------------------------------------

    def _send_now(
        self, address: str, meta: KVTransfer, payload: torch.Tensor, ready: object
    ) -> None:
        with self._queued_lock:
            self._queued -= 1
        rid = meta.request_id
        stream = self._streams.pop(rid, None)
        if rid in self._inflight:
            if stream is not None:
                self._drop_stream(rid, stream)
            self._fail(rid, "a KV transfer of this request is already in flight")
            return
        if meta.parts or stream is not None:  # it ends a stream: every part must have gone, in order
            why = ("no part of it was sent" if stream is None else stream.broken
                   or (f"{stream.sent} parts sent, the transfer says {meta.parts}" if stream.sent != meta.parts else "")
                   or (f"its parts went to {stream.address}" if stream.address != address else ""))
            if why:
                if stream is not None:
                    self._drop_stream(rid, stream)
                self._fail(rid, f"KV stream broken: {why}")
                return
        held = stream.holds if stream is not None else []
        try:
            if ready is not None:
                ready.synchronize()  # type: ignore[attr-defined]
            meta, frames, hold = self._stage(meta, payload)
        except Exception as exc:  # any failure must still end in exactly one ack
            expected = isinstance(exc, TransportError | TensorFrameError)
            log.warning("request %s: cannot stage KV payload: %s", rid, exc, exc_info=not expected)
            if stream is not None:
                self._drop_stream(rid, stream)
            self._fail(rid, f"cannot stage KV payload: {exc}")
            return
        lease_deadline = time.time() + self.lease_s if self.leases_region else 0.0
        meta = with_header(meta, transport=self.kind, lease_deadline=lease_deadline)
        try:
            sock = self._socket(address)
            tracker = sock.send_multipart(self._sealed(meta, frames), flags=zmq.NOBLOCK, copy=False, track=True)
        except (zmq.ZMQError, TransportError) as exc:  # zmq.Again: the queue to that peer is full
            self._unstage(hold)
            if stream is not None:
                self._drop_stream(rid, stream)
            self._fail(rid, f"cannot queue KV for {address}: {exc}")
            return
        assert tracker is not None  # track=True always returns one
        self._inflight[rid] = _InFlight(address, time.monotonic() + self.lease_s, tracker, [hold, *held])
        self._loop.counters["sent"] += 1
        self._loop.counters["bytes_sent"] += meta.tensor.nbytes

    def _sealed(self, meta: KVTransfer | KVPart, frames: list) -> list:
        """`[auth frame, header, *payload]`: the MAC covers the header, which carries the payload's
        checksum; the payload frames ride the connection's CURVE boxes (docs/security.md)."""
        return [*self.auth.seal(KV_TO_DECODE, [encode(meta)]), *frames]

    def _send_part_now(self, address: str, part: KVPart, payload: torch.Tensor, ready: object) -> None:
        with self._queued_lock:
            self._queued -= 1
        rid = part.request_id
        stream = self._streams.get(rid)
        if stream is None or part.seq == 0:
            if stream is not None:  # a new stream of the request: the old one will never end
                self._drop_stream(rid, stream)
            stream = self._streams[rid] = _Stream(address, part)
        if stream.broken:
            return
        if part.seq != stream.sent or address != stream.address:
            self._break(rid, stream, f"part {part.seq} for {address} after {stream.sent} parts for {stream.address}")
            return
        try:
            if ready is not None:
                ready.synchronize()  # type: ignore[attr-defined]
            part, frames, hold = self._stage(with_header(part, transport=self.kind), payload)
        except Exception as exc:
            expected = isinstance(exc, TransportError | TensorFrameError)
            log.warning("request %s: cannot stage KV part %d: %s", rid, part.seq, exc, exc_info=not expected)
            self._break(rid, stream, f"cannot stage part {part.seq}: {exc}")
            return
        stream.holds.append(hold)
        try:
            self._socket(address).send_multipart(self._sealed(part, frames), flags=zmq.NOBLOCK, copy=False)
        except (zmq.ZMQError, TransportError) as exc:
            self._break(rid, stream, f"cannot queue part {part.seq} for {address}: {exc}")
            return
        stream.sent += 1
        self._loop.counters["parts_sent"] += 1
        self._loop.counters["bytes_sent"] += part.tensor.nbytes

    def _break(self, rid: str, stream: _Stream, why: str) -> None:
        """A part could not go: tell the receiver to drop the stream; the transfer ending it fails."""
        log.warning("request %s: KV stream broken: %s", rid, why)
        self._loop.counters["streams_broken"] += 1
        stream.broken = why
        self._send_cancel(rid, stream)
        self._cooling.append((time.monotonic() + self.lease_s, stream.holds))
        stream.holds = []

    def _cancel_now(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._loop.counters["streams_cancelled"] += 1
            self._drop_stream(rid, stream)

    def _drop_stream(self, rid: str, stream: _Stream) -> None:
        """The receiver may still be reading a part: keep the parts for a lease, then free them."""
        if not stream.broken:
            self._send_cancel(rid, stream)
        self._cooling.append((time.monotonic() + self.lease_s, stream.holds))
        stream.holds = []

    def _send_cancel(self, rid: str, stream: _Stream) -> None:
        first = stream.part
        cancel = KVPart(request_id=rid, prefill_worker_id=first.prefill_worker_id, receiver_id=first.receiver_id,
                        seq=stream.sent, first_block=0, total_blocks=0, fingerprint=first.fingerprint,
                        tensor=TensorHeader("uint8", (0,), 0, ""), transport=self.kind, cancel=True)
        with contextlib.suppress(zmq.ZMQError, TransportError):  # a receiver that is gone drops it anyway
            self._socket(stream.address).send_multipart(self._sealed(cancel, []), flags=zmq.NOBLOCK)

    def _socket(self, address: str) -> zmq.Socket:
        self._last_used[address] = time.monotonic()
        sock = self._sockets.get(address)
        if sock is not None:
            self._sockets.move_to_end(address)
            return sock
        if len(self._sockets) >= MAX_PEER_SOCKETS:
            busy = self._busy_addresses()
            idle = next((a for a in self._sockets if a not in busy), None)
            if idle is None:
                raise TransportError(f"{len(self._sockets)} decode peers busy (cap {MAX_PEER_SOCKETS})")
            self._close_socket(idle)
            self._loop.counters["sockets_evicted"] += 1
        sock = self._loop.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self.auth)
        sock.connect(address)
        self._sockets[address] = sock
        self._last_used[address] = time.monotonic()
        self._loop.add_socket(sock, functools.partial(self._on_acks, address))
        return sock

    def _busy_addresses(self) -> set[str]:
        return ({f.address for f in self._inflight.values()} | {f.address for f in self._draining}
                | {s.address for s in self._streams.values()})

    def _close_socket(self, address: str) -> None:
        self._last_used.pop(address, None)
        sock = self._sockets.pop(address, None)
        if sock is not None:
            self._loop.remove_socket(sock)

    def _evict_idle(self, now: float) -> float | None:
        """Close sockets idle for IDLE_SOCKET_S; seconds until the next may go idle (None: none)."""
        busy = self._busy_addresses()
        for address in [a for a in self._sockets if a not in busy]:
            if now - self._last_used.get(address, now) >= IDLE_SOCKET_S:
                self._close_socket(address)
                self._loop.counters["sockets_idle_closed"] += 1
        if not self._sockets:
            return None
        return max(0.05, min(IDLE_SOCKET_S - (now - self._last_used.get(a, now)) for a in self._sockets))

    def _on_acks(self, address: str, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_used[address] = time.monotonic()
            try:
                msg = open_message(self.auth, KV_TO_PREFILL, [p.buffer for p in parts])
            except AuthError as exc:
                self._loop.counters["auth_rejected"] += 1
                self._loop.counters[f"auth_{exc.reason}"] += 1
                _log_bad("KV sender: refused a message from %s: %s", address, exc, key=f"auth-{exc.reason}")
                continue
            except ProtocolError as exc:
                self._drop_reply(address, str(exc))
                continue
            if not isinstance(msg, KVAck):
                self._drop_reply(address, f"unexpected {type(msg).__name__} on the KV channel")
                continue
            f = self._inflight.get(msg.request_id)
            if f is None or f.address != address:
                self._loop.counters["unexpected_acks"] += 1
                _log_bad("request %s: ack from %s matches no transfer in flight (late?)",
                         msg.request_id, address, key="unexpected-ack")
                continue
            del self._inflight[msg.request_id]
            self._done(f)
            self._loop.counters["acked" if msg.ok else "nacked"] += 1
            self._acks.put(msg)

    def _tick(self, now: float) -> float | None:
        for rid, f in list(self._inflight.items()):
            if f.deadline <= now:
                del self._inflight[rid]
                if not f.tracker.done:  # never left this process: drop the peer's queue
                    self._reset_socket(f.address)
                self._done(f)
                self._loop.counters["lease_expired"] += 1
                self._fail(rid, f"no KV ack from {f.address} within {self.lease_s}s")
        still = []
        for f in self._draining:
            if f.tracker.done:
                self._unstage_all(f.holds)
            else:
                still.append(f)
        self._draining = still
        cooled = [c for c in self._cooling if c[0] <= now]
        self._cooling = [c for c in self._cooling if c[0] > now]
        for _, holds in cooled:
            self._unstage_all(holds)
        waits = [f.deadline - now for f in self._inflight.values()] + [c[0] - now for c in self._cooling]
        if self._draining:
            waits.append(0.01)
        idle_wait = self._evict_idle(now)
        if idle_wait is not None:
            waits.append(idle_wait)
        return min(waits) if waits else None

    def _drop_reply(self, address: str, why: str) -> None:
        self._loop.counters["dropped"] += 1
        _log_bad("KV sender: dropped a message from %s: %s", address, why, key="bad-ack")

    def _done(self, f: _InFlight) -> None:
        if f.tracker.done:
            self._unstage_all(f.holds)
        else:
            self._draining.append(f)

    def _unstage_all(self, holds: list) -> None:
        for hold in holds:
            self._unstage(hold)

    def _reset_socket(self, address: str) -> None:
        self._close_socket(address)

    def _fail(self, rid: str, reason: str) -> None:
        self._loop.counters["failed"] += 1
        log.warning("request %s: KV transfer failed: %s", rid, reason)
        self._acks.put(KVAck(request_id=rid, ok=False, reason=reason))

    def _finalize(self) -> None:
        for holds in [*(f.holds for f in [*self._inflight.values(), *self._draining]),
                      *(s.holds for s in self._streams.values()), *(c[1] for c in self._cooling)]:
            self._unstage_all(holds)
        self._inflight.clear()
        self._draining.clear()
        self._streams.clear()
        self._cooling.clear()
        for sock in self._sockets.values():
            self._loop.remove_socket(sock)
        self._sockets.clear()
        self._last_used.clear()
        self._close_resources()


class ZmqKVReceiver(KVReceiver):
    """Binds `address`; verifies each transfer in its I/O thread before `poll` hands it out.

    Undecodable messages (not msgpack, pickle, wrong version or tag, not a KVTransfer) are
    dropped and counted. A KVTransfer whose payload does not check out (frames, shape,
    fingerprint, checksum) is handed out with ok=False so the engine can NACK it at once.
    """

    kind = "tcp"

    def __init__(
        self,
        address: str,
        *,
        fingerprint: ModelFingerprint | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        name: str = "kv-receiver",
        auth: FrameAuth | None = None,
        receiver_id: str = "",
        max_stream_bytes: int = 4 << 30,
        on_ready: Callable[[], None] | None = None,
        report_parts: bool = False,
    ) -> None:
        check_address(address)
        # Called (I/O thread) once a transfer or a part event is queued: the engine's loop waits
        # on it when idle, instead of finding the transfer at its next poll.
        self._on_ready = on_ready or (lambda: None)
        # Part events (poll_parts) only for an engine that polls them: each holds its part's view,
        # so unpolled events would hold memory. Bounded in count and in the bytes they hold.
        self._report_parts = report_parts
        self._event_bytes = 0
        self._event_lock = threading.Lock()
        self.fingerprint = fingerprint
        self.receiver_id = receiver_id  # its worker's id: a transfer naming another is dropped
        self.auth = auth if auth is not None else FrameAuth(None)
        self._max_frame_bytes = max_frame_bytes
        self._ready: queue.Queue[ReceivedKV] = queue.Queue(MAX_READY)
        self._peers: OrderedDict[str, bytes] = OrderedDict()  # I/O thread only
        self._held: dict[str, ReceivedKV] = {}
        self._held_lock = threading.Lock()
        self._unknown_acks = 0  # engine thread only
        self._zap: ZapHandler | None = None
        # Streams being assembled (I/O thread): bounded in count, bytes and idle time.
        self._assemblies: dict[str, _Assembly] = {}
        self._max_stream_bytes = max_stream_bytes
        self._stream_bytes = 0
        self._streams_opened = 0
        self._part_events: queue.Queue[PartArrived | StreamEnded] = queue.Queue(MAX_PART_EVENTS)
        self._loop = IOLoop(name, tick=self._tick)
        try:
            self.address: str = self._loop.call(lambda: self._bind(address))  # type: ignore[assignment]
        except BaseException:
            self._loop.stop()
            raise

    # --- engine thread -------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> list[ReceivedKV]:
        return drain(self._ready, timeout)

    def poll_parts(self) -> list[PartArrived | StreamEnded]:
        events = drain(self._part_events, 0.0)
        held = sum(e.view.nbytes for e in events if isinstance(e, PartArrived))
        if held:
            with self._event_lock:
                self._event_bytes -= held
        return events

    def ack(self, request_id: str, ok: bool, reason: str = "") -> None:
        with self._held_lock:
            rkv = self._held.pop(request_id, None)
        if rkv is None:  # never delivered, or acked twice: nobody to answer
            self._unknown_acks += 1
            log.warning("request %s: ack for a KV transfer this receiver does not hold", request_id)
            return
        rkv.release()
        self._loop.call_soon(
            lambda: self._send_ack(KVAck(request_id=request_id, ok=ok, reason=reason))
        )

    def drop_stream(self, request_id: str) -> None:
        self._loop.call_soon(lambda: self._drop_assembly(request_id))

    def stats(self) -> dict[str, int]:
        stats = dict(self._loop.counters)
        stats["streams_open"] = len(self._assemblies)  # a read of another thread's dict's size: atomic
        if self._unknown_acks:
            stats["unknown_acks"] = self._unknown_acks
        return stats

    def close(self) -> None:
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        for rkv in held:
            rkv.release()
        self._loop.stop(finalize=self._finalize)

    # --- transport hooks (I/O thread) ---------------------------------------------------

    def _open(self, meta: KVTransfer, frames: list) -> tuple[torch.Tensor, object]:
        """A view of the payload and a release callback (or None); raise on a mismatch."""
        expected = max(1, -(-meta.tensor.nbytes // PAYLOAD_FRAME_BYTES))
        if len(frames) != expected:
            raise TransportError(f"a tcp KV transfer of {meta.tensor.nbytes} bytes carries {expected} payload "
                                 f"frames, got {len(frames)}")
        if expected == 1:
            return tensor_from_buffer(meta.tensor, frames[0].buffer), None
        joined = bytearray(sum(len(f.buffer) for f in frames))
        at = 0
        for f in frames:
            joined[at : at + len(f.buffer)] = f.buffer
            at += len(f.buffer)
        return tensor_from_buffer(meta.tensor, memoryview(joined)), None

    def _close_resources(self) -> None:
        """Free transport resources at close."""

    def _finalize(self) -> None:
        for rid in list(self._assemblies):
            self._drop_assembly(rid)
        self._close_resources()

    # --- I/O thread ---------------------------------------------------------------------

    def _bind(self, address: str) -> str:
        sock = self._loop.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an ack to a vanished sender raises, not hangs
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
        if self.auth.secure:  # no message of a peer before it proved the secret (handshake.py)
            self._zap = ZapHandler(self._loop.ctx, self.auth)
            self._loop.add_socket(self._zap.socket, self._zap.answer)
            secure_server(sock, self.auth)
            self._loop.add_socket(self._zap.watch(sock), self._on_handshake_failed)
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"  # zmq's spelling of "any free port"
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot bind the KV receiver to {address}: {exc}") from None
        self._sock = sock
        self._loop.add_socket(sock, self._on_messages)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _on_handshake_failed(self, monitor: zmq.Socket) -> None:
        n = ZapHandler.failed(monitor)
        self._loop.counters["auth_rejected"] += n  # refused before any frame: reason "handshake"
        self._loop.counters[f"auth_{HANDSHAKE_FAILED}"] += n
        _log_bad("KV receiver %s refused %d connections: no proof of the deployment secret", self.address, n,
                 key="auth-handshake")

    def _on_messages(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._loop._guarded(self._handle, parts)

    def _drop(self, reason: str) -> None:
        self._loop.counters["dropped"] += 1
        _log_bad("KV receiver %s dropped a message: %s", self.address, reason, key="dropped")

    def _handle(self, parts: list) -> None:
        arrived_at = time.time()
        identity, body = parts[0].bytes, parts[1:]
        signed = bool(body) and is_auth_frame(body[0].buffer)
        try:  # nothing of an unauthenticated sender is decoded, nor answered
            self.auth.open(KV_TO_DECODE, [p.buffer for p in body[: 2 if signed else 1]])
        except AuthError as exc:
            self._loop.counters["auth_rejected"] += 1
            self._loop.counters[f"auth_{exc.reason}"] += 1
            _log_bad("KV receiver %s refused a message: %s", self.address, exc, key=f"auth-{exc.reason}")
            return
        body = body[1:] if signed else body
        if not body:
            return self._drop("empty message")
        try:
            msg = decode(body[0].buffer)
        except ProtocolError as exc:
            return self._drop(f"undecodable header: {exc}")
        if not isinstance(msg, KVTransfer | KVPart):
            return self._drop(f"unexpected {type(msg).__name__} on the KV channel")
        if msg.receiver_id and self.receiver_id and msg.receiver_id != self.receiver_id:
            # Captured on its way to another decode worker and replayed here: not ours to answer.
            self._loop.counters["wrong_receiver"] += 1
            return self._drop(f"request {msg.request_id}: the transfer is for {msg.receiver_id!r}")
        if isinstance(msg, KVPart):
            return self._on_part(msg, body[1:])
        rid = msg.request_id
        if rid in self._peers:
            return self._drop(f"request {rid}: a second transfer before the first was acked")
        self._peers[rid] = identity
        if len(self._peers) > _MAX_PENDING_PEERS:
            stale, _ = self._peers.popitem(last=False)
            log.warning("request %s: never acked; forgetting its sender", stale)

        asm = self._assemblies.pop(rid, None)
        if asm is not None:
            self._stream_bytes -= asm.nbytes
            if msg.parts == 0:  # sent whole: a stream of the request left half-way is void
                asm.release()
                self._event(StreamEnded(rid, asm.stream))
                asm = None
        payload, release, reason = None, None, None
        try:
            reason = self._check(msg) or self._stream_mismatch(msg, asm)
            if reason is None:
                payload, release = self._open(msg, body[1:])
                with on_kv_stream(payload.device):  # a device checksum runs on the KV stream
                    reason = verify_reason(msg.tensor, payload)
        except (TensorFrameError, TransportError, msgspec.MsgspecError) as exc:
            reason = str(exc)
        except Exception as exc:  # anything else still ends in a prompt NACK, not a lease wait
            self._loop.counters["receive_errors"] += 1
            log.exception("request %s: KV receive failed", rid)
            if callable(release):
                with contextlib.suppress(Exception):
                    release()
            if asm is not None:
                asm.release()
                self._event(StreamEnded(rid, asm.stream))
            self._send_ack(KVAck(request_id=rid, ok=False, reason=f"receive failed: {type(exc).__name__}: {exc}"))
            return
        streamed: list[tuple[int, torch.Tensor]] = []
        stream = 0
        if asm is not None:
            if reason is None:
                streamed, stream = list(asm.parts), asm.stream
                release = self._releasing(asm, release)
            else:
                asm.release()
                self._event(StreamEnded(rid, asm.stream))
        ok = reason is None
        if ok:
            self._loop.counters["received"] += 1
            self._loop.counters["bytes_received"] += msg.tensor.nbytes
        else:
            self._loop.counters["rejected"] += 1
            log.warning("request %s: KV refused: %s", rid, reason)
        rkv = ReceivedKV(msg, payload if ok else None, ok, reason or "", release,  # type: ignore[arg-type]
                         streamed, arrived_at, time.time(), stream)
        if not ok:
            rkv.release()
        with self._held_lock:
            self._held[rid] = rkv
        try:
            self._ready.put_nowait(rkv)
            self._on_ready()
        except queue.Full:  # the engine is not polling: refuse now rather than let the lease run out
            with self._held_lock:
                self._held.pop(rid, None)
            rkv.release()
            self._loop.counters["ready_full"] += 1
            self._send_ack(KVAck(request_id=rid, ok=False, reason="decode worker KV queue full"))

    @staticmethod
    def _releasing(asm: _Assembly, release: object) -> object:
        """One release for a transfer's own payload and its stream's parts."""

        def both() -> None:
            asm.release()
            if callable(release):
                release()

        return both

    @staticmethod
    def _stream_mismatch(msg: KVTransfer, asm: _Assembly | None) -> str | None:
        """None when the parts that came before `msg` are exactly the blocks it says came."""
        if msg.parts == 0:
            return None
        if asm is None:
            return f"its {msg.parts} streamed parts did not arrive (or were dropped)"
        if asm.failed:
            return asm.failed
        if asm.sender != msg.prefill_worker_id or asm.next_seq != msg.parts or asm.next_block != msg.first_block:
            return (f"the stream has {asm.next_seq} parts, blocks 0..{asm.next_block} from {asm.sender!r}; the "
                    f"transfer says {msg.parts}, 0..{msg.first_block} from {msg.prefill_worker_id!r}")
        if asm.total_blocks != msg.tensor.shape[2] + msg.first_block:
            return f"the stream was for {asm.total_blocks} blocks, the transfer ends at {msg.tensor.shape[2] + msg.first_block}"
        return None

    def _on_part(self, part: KVPart, frames: list) -> None:
        """Verify one streamed part now and keep it for the transfer that will end its stream."""
        rid = part.request_id
        asm = self._assemblies.get(rid)
        if part.cancel:
            if asm is not None and asm.sender == part.prefill_worker_id:
                self._loop.counters["streams_cancelled"] += 1
                self._drop_assembly(rid)
            return
        if asm is not None and (asm.sender != part.prefill_worker_id or part.seq == 0):
            self._drop_assembly(rid)  # the request was sent again: its old stream will never end
            asm = None
        if asm is None:
            if len(self._assemblies) >= MAX_STREAMS:
                self._loop.counters["streams_refused"] += 1
                return self._drop(f"request {rid}: {MAX_STREAMS} KV streams already open")
            self._streams_opened += 1
            asm = self._assemblies[rid] = _Assembly(part.prefill_worker_id, part.total_blocks, time.monotonic(),
                                                    self._streams_opened)
        asm.last_at = time.monotonic()
        if asm.failed:
            return
        block_bytes = part.tensor.nbytes // max(1, part.tensor.shape[2] if len(part.tensor.shape) == 6 else 1)
        reason = (
            self._check_fingerprint(part.fingerprint) or part_shape_mismatch(part)
            or (f"part {part.seq} after {asm.next_seq}, at block {part.first_block} after {asm.next_block}"
                if part.seq != asm.next_seq or part.first_block != asm.next_block else None)
            or (f"part for {part.total_blocks} blocks in a stream of {asm.total_blocks}"
                if part.total_blocks != asm.total_blocks else None)
            or (f"{self._stream_bytes + part.tensor.nbytes} streamed KV bytes would pass the bound of "
                f"{self._max_stream_bytes}" if self._stream_bytes + part.tensor.nbytes > self._max_stream_bytes
                or asm.total_blocks * block_bytes > self._max_stream_bytes else None)
        )
        view, release = None, None
        try:
            if reason is None:
                view, release = self._open(part, frames)  # type: ignore[arg-type]
                reason = verify_reason(part.tensor, view)
        except (TensorFrameError, TransportError, msgspec.MsgspecError) as exc:
            reason = str(exc)
        if reason is not None:
            if callable(release):
                release()
            self._loop.counters["parts_rejected"] += 1
            log.warning("request %s: KV part %d refused: %s", rid, part.seq, reason)
            self._fail_assembly(rid, asm, f"streamed part {part.seq} refused: {reason}")
            return
        assert view is not None
        asm.parts.append((part.first_block, view))
        if release is not None:
            asm.releases.append(release)
        asm.next_seq += 1
        asm.next_block += view.shape[2]
        asm.nbytes += part.tensor.nbytes
        self._stream_bytes += part.tensor.nbytes
        self._loop.counters["parts_received"] += 1
        self._loop.counters["bytes_received"] += part.tensor.nbytes
        self._event(PartArrived(rid, asm.stream, part.first_block, asm.total_blocks, view))

    def _fail_assembly(self, rid: str, asm: _Assembly, why: str) -> None:
        """Keep the stream's failure (its transfer is NACKed with it), not its parts."""
        asm.failed = why
        self._stream_bytes -= asm.nbytes
        asm.nbytes = 0
        asm.release()
        self._event(StreamEnded(rid, asm.stream))

    def _drop_assembly(self, rid: str) -> None:
        asm = self._assemblies.pop(rid, None)
        if asm is not None:
            self._stream_bytes -= asm.nbytes
            asm.release()
            self._event(StreamEnded(rid, asm.stream))

    def _event(self, event: PartArrived | StreamEnded) -> None:
        """Tell the engine, if it asked (advisory: an event past the bounds is lost; the parts
        then load at admission, and the engine's sweep frees what a lost StreamEnded would have)."""
        if not self._report_parts:
            return
        nbytes = event.view.nbytes if isinstance(event, PartArrived) else 0
        with self._event_lock:
            if self._event_bytes + nbytes > self._max_stream_bytes:
                self._loop.counters["part_events_dropped"] += 1
                return
            self._event_bytes += nbytes
        try:
            self._part_events.put_nowait(event)
        except queue.Full:
            with self._event_lock:
                self._event_bytes -= nbytes
            self._loop.counters["part_events_dropped"] += 1
            return
        self._on_ready()

    def _tick(self, now: float) -> float | None:
        for rid, asm in list(self._assemblies.items()):
            if now - asm.last_at >= STREAM_IDLE_S:  # its sender is gone, or never ended it
                self._loop.counters["streams_expired"] += 1
                log.warning("request %s: KV stream idle for %.0f s; dropped", rid, now - asm.last_at)
                self._drop_assembly(rid)
        if not self._assemblies:
            return None
        return max(0.5, min(STREAM_IDLE_S - (now - a.last_at) for a in self._assemblies.values()))

    def _check_fingerprint(self, fingerprint: ModelFingerprint) -> str | None:
        return None if self.fingerprint is None else fingerprint_mismatch(self.fingerprint, fingerprint)

    def _check(self, msg: KVTransfer) -> str | None:
        # Every receiver also takes inline (tcp) transfers: the fallback between hosts.
        if msg.transport not in (self.kind, "tcp"):
            return f"transfer uses transport {msg.transport!r}, this receiver is {self.kind!r}"
        if self.fingerprint is not None and (
            why := fingerprint_mismatch(self.fingerprint, msg.fingerprint)
        ):
            return why
        return payload_shape_mismatch(msg)

    def _send_ack(self, ack: KVAck) -> None:
        identity = self._peers.pop(ack.request_id, None)
        if identity is None:  # forgotten by the _MAX_PENDING_PEERS bound
            self._loop.counters["ack_failures"] += 1
            log.warning(
                "request %s: the sender of this transfer is no longer known", ack.request_id
            )
            return
        try:
            self._sock.send_multipart(
                [identity, *self.auth.seal(KV_TO_PREFILL, [encode(ack)])], flags=zmq.NOBLOCK
            )
            self._loop.counters["acks_sent"] += 1
        except zmq.ZMQError as exc:  # the sender is gone (ROUTER_MANDATORY) or not reading
            self._loop.counters["ack_failures"] += 1
            log.warning("request %s: cannot send ack: %s", ack.request_id, exc)


TcpKVSender = ZmqKVSender
TcpKVReceiver = ZmqKVReceiver
