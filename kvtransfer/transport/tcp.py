"""KV over ZeroMQ: the channel every transport shares, and the TCP transport itself.

    prefill  DEALER (one per decode address) ──[KVTransfer msgpack][payload frames?]─► ROUTER  decode
             DEALER ◄────────────────────────────[KVAck msgpack]───────────────────── ROUTER

TCP sends the payload as raw frames of at most `PAYLOAD_FRAME_BYTES` after the header (zero-copy
on send: `copy=False, track=True` over slices of the tensor; on receipt a view over the one zmq
Frame of a small payload, a joined copy of a larger one's). Frames that size let the receiver's
`MAXMSGSIZE` be small: it is what a peer that has not finished its handshake can make it buffer
(handshake.py). The shm and CUDA IPC transports subclass these classes and send no payload frame:
`location` names the bytes.

Every connection first proves the deployment secret (CURVE, handshake.py). Every message is then
`[auth frame, header, *payload]` (pdserve.protocol.auth): the MAC covers the header and the payload
frames, so a receiver never decodes a frame of an unauthenticated sender (it drops it, counted in
`stats()`); a header naming another receiver (`receiver_id`) is dropped too. Acks are authenticated the same way. A transfer that fails
on the receiver for any reason is NACKed at once. Sender sockets (one per decode address) are
closed when idle for `IDLE_SOCKET_S` and capped at `MAX_PEER_SOCKETS`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import torch
import zmq

from pdserve.config.log_limits import RateLimitedLog
from pdserve.engine.device import on_kv_stream
from pdserve.kvtransfer.payload import fingerprint_mismatch, payload_shape_mismatch, with_header
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
    ReceivedKV,
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
)
from pdserve.protocol.codec import ProtocolError, decode, encode, open_message
from pdserve.protocol.messages import KVAck, KVTransfer, ModelFingerprint

log = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://")
_BATCH = 64  # messages read per wake-up before other sockets get a turn
_MAX_PENDING_PEERS = 65536  # unacked request ids remembered for their ack's return address
MAX_QUEUED_SENDS = 4096  # sends handed to the I/O thread and not yet done: more fail at once
MAX_READY = 4096  # received transfers the engine has not polled: more are NACKed at once
IDLE_SOCKET_S = 60.0  # a sender's DEALER to a decode address with no traffic that long is closed
MAX_PEER_SOCKETS = 256  # DEALERs one sender keeps open (the least recently used idle one goes)
PAYLOAD_FRAME_BYTES = 16 << 20  # a tcp payload travels in frames of at most this
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
    hold: object  # kept alive until the ack / lease expiry: tensor, shm segment, CUDA staging


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
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self._last_used: dict[str, float] = {}
        self._queued = 0  # sends not yet taken by the I/O thread (engine thread +, I/O thread -)
        self._queued_lock = threading.Lock()
        self._loop = IOLoop(name, tick=self._tick)

    # --- engine thread -------------------------------------------------------------------

    def send(self, address: str, meta: KVTransfer, payload: torch.Tensor) -> None:
        check_address(address)
        with self._queued_lock:
            full = self._queued >= MAX_QUEUED_SENDS
            if not full:
                self._queued += 1
        if full:
            self._loop.counters["queue_full"] += 1
            self._acks.put(KVAck(request_id=meta.request_id, ok=False, reason="KV send queue full"))
            return
        ready = None
        if payload.is_cuda:  # the I/O thread must not read it before the engine's stream wrote it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(payload.device))
        self._loop.call_soon(lambda: self._send_now(address, meta, payload, ready))

    def poll_acks(self, timeout: float = 0.0) -> list[KVAck]:
        return drain(self._acks, timeout)

    def stats(self) -> dict[str, int]:
        return {**self._loop.counters, "in_flight": len(self._inflight)}

    def close(self) -> None:
        self._loop.stop(finalize=self._finalize)

    # --- transport hooks (I/O thread) ---------------------------------------------------

    def _stage(self, meta: KVTransfer, payload: torch.Tensor) -> tuple[KVTransfer, list, object]:
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
        if rid in self._inflight:
            self._fail(rid, "a KV transfer of this request is already in flight")
            return
        try:
            if ready is not None:
                ready.synchronize()  # type: ignore[attr-defined]
            meta, frames, hold = self._stage(meta, payload)
        except Exception as exc:  # any failure must still end in exactly one ack
            expected = isinstance(exc, TransportError | TensorFrameError)
            log.warning("request %s: cannot stage KV payload: %s", rid, exc, exc_info=not expected)
            self._fail(rid, f"cannot stage KV payload: {exc}")
            return
        lease_deadline = time.time() + self.lease_s if self.leases_region else 0.0
        meta = with_header(meta, transport=self.kind, lease_deadline=lease_deadline)
        try:
            sock = self._socket(address)
            tracker = sock.send_multipart(
                self.auth.seal(KV_TO_DECODE, [encode(meta), *frames]), flags=zmq.NOBLOCK, copy=False, track=True
            )
        except (zmq.ZMQError, TransportError) as exc:  # zmq.Again: the queue to that peer is full
            self._unstage(hold)
            self._fail(rid, f"cannot queue KV for {address}: {exc}")
            return
        assert tracker is not None  # track=True always returns one
        self._inflight[rid] = _InFlight(address, time.monotonic() + self.lease_s, tracker, hold)
        self._loop.counters["sent"] += 1
        self._loop.counters["bytes_sent"] += meta.tensor.nbytes

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
        return {f.address for f in self._inflight.values()} | {f.address for f in self._draining}

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
                self._unstage(f.hold)
            else:
                still.append(f)
        self._draining = still
        waits = [f.deadline - now for f in self._inflight.values()]
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
            self._unstage(f.hold)
        else:
            self._draining.append(f)

    def _reset_socket(self, address: str) -> None:
        self._close_socket(address)

    def _fail(self, rid: str, reason: str) -> None:
        self._loop.counters["failed"] += 1
        log.warning("request %s: KV transfer failed: %s", rid, reason)
        self._acks.put(KVAck(request_id=rid, ok=False, reason=reason))

    def _finalize(self) -> None:
        for f in [*self._inflight.values(), *self._draining]:
            self._unstage(f.hold)
        self._inflight.clear()
        self._draining.clear()
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
    ) -> None:
        check_address(address)
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
        self._loop = IOLoop(name)
        try:
            self.address: str = self._loop.call(lambda: self._bind(address))  # type: ignore[assignment]
        except BaseException:
            self._loop.stop()
            raise

    # --- engine thread -------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> list[ReceivedKV]:
        return drain(self._ready, timeout)

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

    def stats(self) -> dict[str, int]:
        stats = dict(self._loop.counters)
        if self._unknown_acks:
            stats["unknown_acks"] = self._unknown_acks
        return stats

    def close(self) -> None:
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        for rkv in held:
            rkv.release()
        self._loop.stop(finalize=self._close_resources)

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
        identity, body = parts[0].bytes, parts[1:]
        try:  # nothing of an unauthenticated sender is decoded, nor answered
            n = len(self.auth.open(KV_TO_DECODE, [p.buffer for p in body]))
        except AuthError as exc:
            self._loop.counters["auth_rejected"] += 1
            self._loop.counters[f"auth_{exc.reason}"] += 1
            _log_bad("KV receiver %s refused a message: %s", self.address, exc, key=f"auth-{exc.reason}")
            return
        body = body[len(body) - n:]
        if not body:
            return self._drop("empty message")
        try:
            msg = decode(body[0].buffer)
        except ProtocolError as exc:
            return self._drop(f"undecodable header: {exc}")
        if not isinstance(msg, KVTransfer):
            return self._drop(f"unexpected {type(msg).__name__} on the KV channel")
        if msg.receiver_id and self.receiver_id and msg.receiver_id != self.receiver_id:
            # Captured on its way to another decode worker and replayed here: not ours to answer.
            self._loop.counters["wrong_receiver"] += 1
            return self._drop(f"request {msg.request_id}: the transfer is for {msg.receiver_id!r}")
        rid = msg.request_id
        if rid in self._peers:
            return self._drop(f"request {rid}: a second transfer before the first was acked")
        self._peers[rid] = identity
        if len(self._peers) > _MAX_PENDING_PEERS:
            stale, _ = self._peers.popitem(last=False)
            log.warning("request %s: never acked; forgetting its sender", stale)

        payload, release, reason = None, None, None
        try:
            reason = self._check(msg)
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
            self._send_ack(KVAck(request_id=rid, ok=False, reason=f"receive failed: {type(exc).__name__}: {exc}"))
            return
        ok = reason is None
        if ok:
            self._loop.counters["received"] += 1
            self._loop.counters["bytes_received"] += msg.tensor.nbytes
        else:
            self._loop.counters["rejected"] += 1
            log.warning("request %s: KV refused: %s", rid, reason)
        rkv = ReceivedKV(msg, payload if ok else None, ok, reason or "", release)  # type: ignore[arg-type]
        if not ok:
            rkv.release()
        with self._held_lock:
            self._held[rid] = rkv
        try:
            self._ready.put_nowait(rkv)
        except queue.Full:  # the engine is not polling: refuse now rather than let the lease run out
            with self._held_lock:
                self._held.pop(rid, None)
            rkv.release()
            self._loop.counters["ready_full"] += 1
            self._send_ack(KVAck(request_id=rid, ok=False, reason="decode worker KV queue full"))

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
