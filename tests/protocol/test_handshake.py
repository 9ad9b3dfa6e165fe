"""The connection handshake of the planes: a peer without the secret is refused before any message
of it is accepted, cannot hold a worker's identity, and a worker never talks to an impostor."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from pdserve.kvtransfer.transport.tcp import TcpKVReceiver, TcpKVSender
from pdserve.protocol.auth import FrameAuth, curve_secrets, zap_reply
from pdserve.protocol.codec import encode
from pdserve.protocol.messages import Register
from tests.helpers.fake_worker import FINGERPRINT, FakeWorker, RouterHarness, toks
from tests.kvtransfer.test_transports import SMALL, make_meta, make_payload

pytestmark = pytest.mark.timeout(60)

SECRET = b"s3cret-of-this-deployment-0123456789"
OTHER = b"another-deployment-secret-9876543210"
PATIENT = 10.0


def plain_dealer(address: str, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_zap_admits_only_the_deployments_client_key():
    key = FrameAuth.from_secret(SECRET).key
    assert curve_secrets(key) != curve_secrets(FrameAuth.from_secret(OTHER).key)
    good = b"k" * 32
    assert zap_reply([b"1.0", b"7", b"", b"127.0.0.1", b"", b"CURVE", good], good)[2] == b"200"
    assert zap_reply([b"1.0", b"7", b"", b"127.0.0.1", b"", b"CURVE", b"x" * 32], good)[2] == b"400"
    assert zap_reply([b"1.0", b"7", b"", b"127.0.0.1", b"", b"NULL"], good)[2] == b"400"
    assert zap_reply([b"9.9"], good)[2] == b"500"


def test_a_control_peer_without_the_secret_is_refused_at_the_handshake_and_counted():
    with RouterHarness(auth=FrameAuth.from_secret(SECRET), heartbeat_timeout=PATIENT) as h:
        rogue = plain_dealer(h.control_address, b"rogue-0")
        reg = Register(worker_id="rogue-0", role="colocated", kv_address="", fingerprint=FINGERPRINT,
                       num_blocks=10, max_model_len=100)
        rogue.send_multipart(FrameAuth.from_secret(SECRET).seal(b"control>router", [encode(reg)]))
        assert h.wait_until(lambda: h.service.control.rejected.labels("handshake")._value.get() >= 1)
        assert "rogue-0" not in h.service.registry.workers
        assert not rogue.poll(300), "the router answered a peer that did not prove the secret"
        rogue.close()


def test_a_squatter_without_the_secret_cannot_hold_a_workers_identity():
    with RouterHarness(auth=FrameAuth.from_secret(SECRET), heartbeat_timeout=PATIENT) as h:
        squatter = plain_dealer(h.control_address, b"colo-0")  # connects first, under the worker's id
        assert h.wait_until(lambda: h.service.control.rejected.labels("handshake")._value.get() >= 1)
        w = h.worker("colo-0", script=toks("Hello"))
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        r = httpx.post(h.base_url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"
        assert len(w.requests()) == 1
        squatter.close()


def test_a_later_authenticated_claim_of_an_identity_wins():
    with RouterHarness(auth=FrameAuth.from_secret(SECRET), heartbeat_timeout=PATIENT) as h:
        first = h.worker("colo-0", script=toks("Hello"))
        first.stop(goodbye=False)  # silent, its connection still up: a stale holder of the identity
        second = FakeWorker(h.control_address, "colo-0", script=toks("Hi"), auth=FrameAuth.from_secret(SECRET))
        second.start(timeout=PATIENT)
        try:
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            assert h.wait_until(lambda: httpx.post(h.base_url + "/v1/chat/completions", json=body,
                                                   timeout=10).status_code == 200, timeout=PATIENT)
            assert len(second.requests()) >= 1
        finally:
            second.stop()
            first.link.close()


def test_a_worker_does_not_register_with_an_impostor_on_the_routers_address():
    with RouterHarness(auth=FrameAuth.from_secret(OTHER)) as impostor:
        w = FakeWorker(impostor.control_address, "colo-0", auth=FrameAuth.from_secret(SECRET))
        w.link.start()
        assert not w.link.wait_registered(1.0)
        assert "colo-0" not in impostor.service.registry.workers
        assert impostor.service.control.rejected.labels("handshake")._value.get() >= 1
        w.link.close()


@pytest.mark.parametrize("rogue_auth", [FrameAuth(None), FrameAuth.from_secret(OTHER)], ids=["no-secret", "other-secret"])
def test_a_kv_sender_without_the_secret_is_refused_at_the_handshake(rogue_auth):
    with TcpKVReceiver("tcp://127.0.0.1:0", auth=FrameAuth.from_secret(SECRET)) as receiver, \
            TcpKVSender(lease_s=0.5, auth=rogue_auth) as rogue, \
            TcpKVSender(lease_s=5.0, auth=FrameAuth.from_secret(SECRET)) as good:
        payload = make_payload(SMALL, 2)
        rogue.send(receiver.address, make_meta(payload, SMALL, "rogue"), payload)
        assert [(a.request_id, a.ok) for a in rogue.poll_acks(timeout=3.0)] == [("rogue", False)]
        stats = receiver.stats()
        assert receiver.poll() == [] and stats.get("auth_handshake", 0) >= 1
        assert stats["auth_rejected"] == stats["auth_handshake"]  # refused before the frame layer
        good.send(receiver.address, make_meta(payload, SMALL, "good"), payload)
        [rkv] = receiver.poll(timeout=3.0)
        assert rkv.ok and rkv.meta.request_id == "good"


def test_before_its_handshake_a_peer_cannot_send_a_frame_over_the_kv_frame_cap():
    import socket

    from pdserve.kvtransfer.transport.tcp import MAX_FRAME_BYTES

    with TcpKVReceiver("tcp://127.0.0.1:0", auth=FrameAuth.from_secret(SECRET)) as receiver:
        port = int(receiver.address.rsplit(":", 1)[1])
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" * 32
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(greeting + b"\x06" + (MAX_FRAME_BYTES + 1).to_bytes(8, "big"))
            conn.settimeout(3)  # under the 5 s handshake deadline, which would close it anyway
            started = time.monotonic()
            try:  # the server's greeting, then the end: closed at the size, before a byte is held
                while conn.recv(4096):
                    pass
                closed = True
            except ConnectionResetError:
                closed = True
            except TimeoutError:  # still waiting for the frame's bytes: it would hold them
                closed = False
            assert closed and time.monotonic() - started < 3


def test_a_tcp_payload_larger_than_a_frame_travels_in_frames_and_arrives_whole(monkeypatch):
    from pdserve.kvtransfer.transport import tcp

    monkeypatch.setattr(tcp, "PAYLOAD_FRAME_BYTES", 1000)
    auth = FrameAuth.from_secret(SECRET)
    with TcpKVReceiver("tcp://127.0.0.1:0", auth=auth, fingerprint=SMALL) as receiver, \
            TcpKVSender(auth=auth) as sender:
        payload = make_payload(SMALL, 3)  # 3,072 bytes: 4 frames
        sender.send(receiver.address, make_meta(payload, SMALL, "big"), payload)
        [rkv] = receiver.poll(timeout=5.0)
        assert rkv.ok and bytes(rkv.payload.numpy().tobytes()) == payload.numpy().tobytes()
        receiver.ack("big", True)
        assert [a.ok for a in sender.poll_acks(timeout=5.0)] == [True]
