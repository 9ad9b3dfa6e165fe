"""Frame authentication for the internal planes: HMAC-SHA256 with a per-sender replay guard.

Every authenticated message is sent as `[auth frame, *message frames]`. The auth frame is

    MAGIC(4) | session(8) | counter(8, big-endian) | time_ms(8, big-endian) | mac(32)   = 60 bytes

session: random per sender (a process's `FrameAuth`), counter: strictly increasing per session,
time_ms: the sender's wall clock. mac = HMAC-SHA256(key, label | the first 28 bytes | for each
message frame: its length (8 bytes) and its bytes). `label` names the channel and direction
("control>router", "kv>decode", ...), so a frame is never valid on another channel or reflected
back. The receiver keeps, per channel label and session (bounded, LRU), the highest counter seen and
which of the `REPLAY_WINDOW` counters below it arrived (the sliding window of IPsec's anti-replay,
RFC 4303 3.4.3), so frames one sender's threads sealed in one order and sent in another still
pass. It refuses a counter seen before or older than the window (replay), a time outside
+-`window_s` (an old capture), and a MAC that does not verify. Without a key (`--insecure`) nothing is signed and an auth frame is only stripped.

No zmq and no torch here: frames are bytes-like (bytes, memoryview, zmq.Frame.buffer).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

MAGIC = b"PDA1"
_PREFIX = struct.Struct(">4s8sQQ")  # magic, session, counter, time_ms
AUTH_FRAME_BYTES = _PREFIX.size + 32
MAX_SESSIONS = 4096  # (label, sender) pairs remembered for replay protection (LRU beyond)
REPLAY_WINDOW = 1024  # counters below the highest seen that may still arrive late, once each
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1

# Reasons a frame is refused (the `reason` label of the rejection counters).
NO_MAC, MALFORMED, BAD_MAC, REPLAY, STALE = "no_mac", "malformed", "bad_mac", "replay", "stale"

Buffer = bytes | memoryview


class AuthError(ValueError):
    """A frame that does not authenticate; `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def derive_key(secret: bytes) -> bytes:
    """The MAC key from the deployment secret (domain-separated, so the secret is not the key)."""
    if len(secret) < 16:
        raise ValueError("the deployment secret must be at least 16 bytes")
    return hmac.new(secret, b"pdserve internal planes v1", hashlib.sha256).digest()


def new_secret() -> str:
    """A fresh random deployment secret (what `pdserve up` hands its children)."""
    return secrets.token_urlsafe(32)


def is_auth_frame(frame: Buffer) -> bool:
    return len(frame) == AUTH_FRAME_BYTES and bytes(frame[:4]) == MAGIC


class FrameAuth:
    """One process's signer and verifier. Thread-safe; `key=None` means insecure (no MACs)."""

    def __init__(self, key: bytes | None, *, window_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.window_s = window_s
        self.session = secrets.token_bytes(8)
        self._clock = clock
        self._counter = 0
        # (label, session) -> (highest counter seen, bit i set: counter highest - i arrived)
        self._seen: OrderedDict[tuple[bytes, bytes], tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_secret(cls, secret: bytes | None, **kw) -> FrameAuth:
        return cls(derive_key(secret) if secret else None, **kw)

    @property
    def secure(self) -> bool:
        return self.key is not None

    def seal(self, label: bytes, frames: Sequence[Buffer]) -> list[Buffer]:
        """`[auth frame, *frames]` ready to send (just `frames` when insecure)."""
        if self.key is None:
            return list(frames)
        with self._lock:
            self._counter += 1
            prefix = _PREFIX.pack(MAGIC, self.session, self._counter, int(self._clock() * 1000))
        return [prefix + self._mac(label, prefix, frames), *frames]

    def open(self, label: bytes, frames: Sequence[Buffer]) -> Sequence[Buffer]:
        """The message frames of a received `[auth frame, *frames]`; raise AuthError if it fails."""
        if self.key is None:  # insecure: accept signed and unsigned peers alike
            return frames[1:] if frames and is_auth_frame(frames[0]) else frames
        if not frames or len(frames[0]) != AUTH_FRAME_BYTES or bytes(frames[0][:4]) != MAGIC:
            raise AuthError(NO_MAC, "the message carries no authentication frame")
        head, body = bytes(frames[0]), frames[1:]
        if not body:
            raise AuthError(MALFORMED, "an authentication frame without a message")
        prefix, mac = head[: _PREFIX.size], head[_PREFIX.size:]
        _, session, counter, time_ms = _PREFIX.unpack(prefix)
        if not hmac.compare_digest(mac, self._mac(label, prefix, body)):
            raise AuthError(BAD_MAC, "the MAC does not verify (wrong secret or altered frame)")
        skew = abs(self._clock() - time_ms / 1000)
        if skew > self.window_s:
            raise AuthError(STALE, f"timestamp {skew:.0f} s away from now (window {self.window_s:.0f} s)")
        with self._lock:
            self._accept_once(label, session, counter)
        return body

    def _accept_once(self, label: bytes, session: bytes, counter: int) -> None:
        """Record `counter` of (label, session), refusing one seen before or below the window."""
        key = (label, session)
        highest, arrived = self._seen.get(key, (0, 0))
        ahead = counter - highest
        if ahead > 0:
            arrived = ((arrived << ahead) | 1) & _WINDOW_MASK if ahead < REPLAY_WINDOW else 1
            highest = counter
        elif -ahead >= REPLAY_WINDOW:
            raise AuthError(REPLAY, f"counter {counter} of session {session.hex()} is {-ahead} behind "
                                    f"its newest, outside the window of {REPLAY_WINDOW}")
        elif arrived >> -ahead & 1:
            raise AuthError(REPLAY, f"counter {counter} of session {session.hex()} already seen")
        else:
            arrived |= 1 << -ahead
        self._seen[key] = (highest, arrived)
        self._seen.move_to_end(key)
        if len(self._seen) > MAX_SESSIONS:
            self._seen.popitem(last=False)

    def _mac(self, label: bytes, prefix: bytes, frames: Sequence[Buffer]) -> bytes:
        assert self.key is not None
        h = hmac.new(self.key, label, hashlib.sha256)
        h.update(b"\0")
        h.update(prefix)
        for f in frames:
            h.update(len(f).to_bytes(8, "big"))
            h.update(f)
        return h.digest()


# --- the connection handshake (CURVE keys and the ZAP answer; the zmq side is the sockets') ---

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
HANDSHAKE_FAILED = "handshake"  # the rejection reason of a connection that did not prove the secret


class CurveSecrets(NamedTuple):
    """The deployment's two CURVE secret keys (32 raw bytes each), derived from the MAC key: every
    server (router control, KV receiver) holds `server`, every client (worker link, KV sender)
    `client`. Whoever completes a handshake with either knows the deployment secret."""

    server: bytes
    client: bytes


def curve_secrets(key: bytes) -> CurveSecrets:
    return CurveSecrets(hmac.new(key, b"curve server", hashlib.sha256).digest(),
                        hmac.new(key, b"curve client", hashlib.sha256).digest())


def zap_reply(request: Sequence[bytes], client_public: bytes) -> list[bytes]:
    """libzmq's ZAP request (RFC 27: version, id, domain, address, identity, mechanism, key) to
    its reply: 200 for a CURVE client whose long-term public key is the deployment's, else 400."""
    if len(request) < 6 or request[0] != b"1.0":
        return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
    ok = request[5] == b"CURVE" and len(request) == 7 and hmac.compare_digest(request[6], client_public)
    if ok:
        return [b"1.0", request[1], b"200", b"OK", b"pdserve", b""]
    return [b"1.0", request[1], b"400", b"not a key of this deployment", b"", b""]


# The channels' labels, one per direction.
CONTROL_TO_ROUTER = b"control>router"
CONTROL_TO_WORKER = b"control>worker"
KV_TO_DECODE = b"kv>decode"
KV_TO_PREFILL = b"kv>prefill"
