"""The connection handshake of the internal planes: CURVE with keys derived from the secret.

libzmq holds what a peer sends before its handshake is done: a frame's "more" flag makes it
buffer frame after frame of a message that never ends, and `MAXMSGSIZE` bounds one frame, not a
message. So a socket that accepts connections (a KV receiver's ROUTER; the router's control
socket does the same in router/control.py) is a CURVE server whose ZAP handler admits only the
deployment's client key: a peer without the secret fails the handshake and is disconnected after
its first frame, before libzmq accepts any message of it. Clients (a KV sender's DEALERs, a
worker's control DEALER) authenticate the server too: an impostor on the address cannot finish the
handshake. Without a secret (`--insecure`) sockets are left as they are. docs/security.md has the
bounds and the cost.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import zmq
from zmq.utils import z85

from pdserve.protocol.auth import ZAP_ENDPOINT, FrameAuth, curve_secrets, zap_reply

HANDSHAKE_IVL_MS = 5000  # a connection that has not finished its handshake by then is dropped
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HandshakeKeys(NamedTuple):
    """Z85 keys as zmq's socket options take them, and the client key as ZAP reports it (raw)."""

    server_secret: bytes
    server_public: bytes
    client_secret: bytes
    client_public: bytes
    client_public_raw: bytes


@functools.lru_cache(maxsize=8)
def _keys(mac_key: bytes) -> HandshakeKeys:
    secrets = curve_secrets(mac_key)
    server, client = z85.encode(secrets.server), z85.encode(secrets.client)
    client_public = zmq.curve_public(client)
    return HandshakeKeys(server, zmq.curve_public(server), client, client_public, z85.decode(client_public))


def handshake_keys(auth: FrameAuth) -> HandshakeKeys | None:
    """The deployment's keys (None when insecure)."""
    return None if auth.key is None else _keys(auth.key)


def secure_client(sock: zmq.Socket, auth: FrameAuth) -> None:
    """Before `connect`: prove the secret to the server, and require the server to prove it."""
    keys = handshake_keys(auth)
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


def secure_server(sock: zmq.Socket, auth: FrameAuth) -> None:
    """Before `bind`: a CURVE server (its context must serve ZAP: `ZapHandler`)."""
    keys = handshake_keys(auth)
    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.handshake_ivl = HANDSHAKE_IVL_MS


class ZapHandler:
    """A context's ZAP endpoint, answered on the caller's I/O thread (`answer` when readable).
    Bind it before the server socket: libzmq admits every CURVE client of a context without one."""

    def __init__(self, ctx: zmq.Context, auth: FrameAuth) -> None:
        keys = handshake_keys(auth)
        assert keys is not None, "a ZAP handler is for a secure socket"
        self._client_public = keys.client_public_raw
        self.socket = ctx.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)

    @staticmethod
    def watch(server: zmq.Socket) -> zmq.Socket:
        """A monitor of `server`'s failed handshakes (wrong keys, another mechanism, ZAP refusal);
        `failed(monitor)` counts what it reported since."""
        return server.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)

    @staticmethod
    def failed(monitor: zmq.Socket) -> int:
        n = 0
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1

    def answer(self, _sock: zmq.Socket | None = None) -> None:
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(zap_reply(request, self._client_public))
