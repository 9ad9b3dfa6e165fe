"""The deployment secret on the control and KV planes: who is refused, and what is counted."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from pdserve.config.engine import ConfigError
from pdserve.config.worker import resolve_secret
from pdserve.kvtransfer.transport import tcp
from pdserve.kvtransfer.transport.handshake import secure_client
from pdserve.kvtransfer.transport.tcp import TcpKVReceiver, TcpKVSender
from pdserve.protocol.auth import (
    BAD_MAC,
    CONTROL_TO_ROUTER,
    CONTROL_TO_WORKER,
    REPLAY,
    REPLAY_WINDOW,
    STALE,
    AuthError,
    FrameAuth,
)
from pdserve.protocol.codec import encode
from pdserve.protocol.messages import Register
from tests.helpers.fake_worker import FINGERPRINT, FakeWorker, RouterHarness
from tests.kvtransfer.test_transports import SMALL, make_meta, make_payload

pytestmark = pytest.mark.timeout(60)

SECRET = b"s3cret-of-this-deployment-0123456789"
OTHER = b"another-deployment-secret-9876543210"


def rejected(h: RouterHarness, reason: str) -> float:
    return h.service.control.rejected.labels(reason)._value.get()


def chat(h: RouterHarness) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return httpx.post(h.base_url + "/v1/chat/completions", json=body, timeout=10)


# --- the MAC itself ----------------------------------------------------------------------------


def test_sealed_frames_open_once_and_a_replay_is_refused():
    sender, receiver = FrameAuth.from_secret(SECRET), FrameAuth.from_secret(SECRET)
    frames = sender.seal(CONTROL_TO_ROUTER, [b"hello"])
    assert list(receiver.open(CONTROL_TO_ROUTER, frames)) == [b"hello"]
    with pytest.raises(AuthError) as err:
        receiver.open(CONTROL_TO_ROUTER, frames)
    assert err.value.reason == REPLAY


def test_frames_sealed_in_one_order_and_sent_in_another_each_open_once():
    # Two threads of one sender can seal 1 and 2 and send 2 first: both must pass, neither twice.
    sender, receiver = FrameAuth.from_secret(SECRET), FrameAuth.from_secret(SECRET)
    sealed = [sender.seal(CONTROL_TO_ROUTER, [str(i).encode()]) for i in range(6)]
    for i in (1, 0, 4, 2, 5, 3):
        assert bytes(receiver.open(CONTROL_TO_ROUTER, sealed[i])[0]) == str(i).encode()
    for frames in sealed:
        with pytest.raises(AuthError) as err:
            receiver.open(CONTROL_TO_ROUTER, frames)
        assert err.value.reason == REPLAY


def test_a_frame_further_behind_than_the_window_is_refused():
    sender, receiver = FrameAuth.from_secret(SECRET), FrameAuth.from_secret(SECRET)
    late = sender.seal(CONTROL_TO_ROUTER, [b"late"])
    sealed = [sender.seal(CONTROL_TO_ROUTER, [b"x"]) for _ in range(REPLAY_WINDOW)]
    receiver.open(CONTROL_TO_ROUTER, sealed[-1])
    receiver.open(CONTROL_TO_ROUTER, sealed[0])  # REPLAY_WINDOW - 1 behind: still inside
    with pytest.raises(AuthError) as err:
        receiver.open(CONTROL_TO_ROUTER, late)
    assert err.value.reason == REPLAY and "outside the window" in str(err.value)


def test_one_process_at_both_ends_of_a_plane_keeps_each_direction_apart():
    # A router and a worker in one process (as in the test harness) share one FrameAuth: a frame
    # it opened in one direction must not make an earlier-sealed frame of the other look replayed.
    both = FrameAuth.from_secret(SECRET)
    to_worker = both.seal(CONTROL_TO_WORKER, [b"ack"])
    to_router = both.seal(CONTROL_TO_ROUTER, [b"heartbeat"])
    assert bytes(both.open(CONTROL_TO_ROUTER, to_router)[0]) == b"heartbeat"
    assert bytes(both.open(CONTROL_TO_WORKER, to_worker)[0]) == b"ack"


def test_a_frame_is_refused_under_another_secret_another_label_or_altered():
    frames = FrameAuth.from_secret(SECRET).seal(CONTROL_TO_ROUTER, [b"hello"])
    for secret, label, body in ((OTHER, CONTROL_TO_ROUTER, b"hello"), (SECRET, CONTROL_TO_WORKER, b"hello"),
                                (SECRET, CONTROL_TO_ROUTER, b"hellO")):
        with pytest.raises(AuthError) as err:
            FrameAuth.from_secret(secret).open(label, [frames[0], body])
        assert err.value.reason == BAD_MAC


def test_a_frame_older_than_the_window_is_refused():
    old = FrameAuth.from_secret(SECRET, clock=lambda: time.time() - 3600).seal(CONTROL_TO_ROUTER, [b"x"])
    with pytest.raises(AuthError) as err:
        FrameAuth.from_secret(SECRET).open(CONTROL_TO_ROUTER, old)
    assert err.value.reason == STALE


# --- the control plane -------------------------------------------------------------------------


# The chats below need the good worker in rotation the whole time: a loaded CI machine can delay
# a fake worker's heartbeat past the harness's 1 s default and fail them with a timeout.
PATIENT = 10.0


def holds_the_handshake_keys(sock: zmq.Socket) -> None:
    """The peers below get past the connection handshake, so the frame layer behind it is what
    refuses them (a peer without the secret never gets that far: tests/protocol/test_handshake.py)."""
    secure_client(sock, FrameAuth.from_secret(SECRET))


def test_registration_without_a_mac_is_refused_and_gets_no_work():
    with RouterHarness(auth=FrameAuth.from_secret(SECRET), heartbeat_timeout=PATIENT) as h:
        good = h.worker("good-0")
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.IDENTITY, b"rogue-0")
        rogue.setsockopt(zmq.LINGER, 0)
        holds_the_handshake_keys(rogue)
        rogue.connect(h.control_address)
        reg = Register(worker_id="rogue-0", role="colocated", kv_address="", fingerprint=FINGERPRINT,
                       num_blocks=10_000, max_model_len=4096)
        rogue.send(encode(reg))
        assert h.wait_until(lambda: rejected(h, "no_mac") >= 1)
        for _ in range(4):
            assert chat(h).status_code == 200
        assert "rogue-0" not in h.service.registry.workers
        assert not rogue.poll(300), "the router answered an unauthenticated peer"
        assert len(good.requests()) == 4
        rogue.close()


def test_registration_with_a_wrong_mac_is_refused_and_gets_no_work(monkeypatch):
    from pdserve.worker import router_link

    monkeypatch.setattr(router_link, "secure_client", lambda sock, auth: holds_the_handshake_keys(sock))
    with RouterHarness(auth=FrameAuth.from_secret(SECRET), heartbeat_timeout=PATIENT) as h:
        good = h.worker("good-0")
        rogue = FakeWorker(h.control_address, "rogue-1", auth=FrameAuth.from_secret(OTHER))
        rogue.link.start()
        assert not rogue.link.wait_registered(1.0)
        assert rejected(h, "bad_mac") >= 1
        assert chat(h).status_code == 200
        assert "rogue-1" not in h.service.registry.workers
        assert len(good.requests()) == 1 and rogue.requests() == []
        rogue.link.close()


def test_a_replayed_control_frame_is_refused():
    with RouterHarness(auth=FrameAuth.from_secret(SECRET)) as h:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"w-replay")
        sock.setsockopt(zmq.LINGER, 0)
        holds_the_handshake_keys(sock)
        sock.connect(h.control_address)
        reg = Register(worker_id="w-replay", role="colocated", kv_address="", fingerprint=FINGERPRINT,
                       num_blocks=10, max_model_len=100)
        frames = FrameAuth.from_secret(SECRET).seal(CONTROL_TO_ROUTER, [encode(reg)])
        sock.send_multipart(frames)
        assert h.wait_until(lambda: "w-replay" in h.service.registry.workers)
        sock.send_multipart(frames)
        assert h.wait_until(lambda: rejected(h, "replay") == 1)
        sock.close()


def test_a_worker_of_another_model_is_refused_with_the_reason():
    with RouterHarness(auth=FrameAuth.from_secret(SECRET), model_name="some-other-model") as h:
        w = FakeWorker(h.control_address, "wrong-model", auth=FrameAuth.from_secret(SECRET))
        w.link.start()
        assert h.wait_until(lambda: "model mismatch" in w.link.refused_reason)
        assert "wrong-model" not in h.service.registry.workers
        w.link.close()


# --- the KV channel ----------------------------------------------------------------------------


def test_kv_from_an_unauthenticated_sender_is_dropped_undecoded(monkeypatch):
    monkeypatch.setattr(tcp, "secure_client", lambda sock, auth: holds_the_handshake_keys(sock))
    with TcpKVReceiver("tcp://127.0.0.1:0", auth=FrameAuth.from_secret(SECRET)) as receiver, \
            TcpKVSender(lease_s=0.5, auth=FrameAuth(None)) as rogue, \
            TcpKVSender(lease_s=5.0, auth=FrameAuth.from_secret(SECRET)) as good:
        payload = make_payload(SMALL, 2)
        rogue.send(receiver.address, make_meta(payload, SMALL, "rogue"), payload)
        acks = rogue.poll_acks(timeout=3.0)
        assert [(a.request_id, a.ok) for a in acks] == [("rogue", False)]  # the lease ran out: no answer
        assert receiver.poll() == []
        assert receiver.stats()["auth_rejected"] == 1 and receiver.stats().get("received", 0) == 0
        good.send(receiver.address, make_meta(payload, SMALL, "good"), payload)
        [rkv] = receiver.poll(timeout=3.0)
        assert rkv.ok and rkv.meta.request_id == "good"
        receiver.ack("good", True)
        assert [a.ok for a in good.poll_acks(timeout=3.0)] == [True]


# --- configuration -----------------------------------------------------------------------------


def test_insecure_runs_without_a_secret_and_logs_a_warning(monkeypatch, caplog):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    with caplog.at_level(logging.WARNING):
        assert resolve_secret(None, insecure=True) is None
    assert "NOT authenticated" in caplog.text


def test_a_secret_file_is_read_and_a_short_one_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    (tmp_path / "s").write_bytes(SECRET + b"\n")
    assert resolve_secret(str(tmp_path / "s"), insecure=False) == SECRET
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ConfigError):
        resolve_secret(str(tmp_path / "short"), insecure=False)


@pytest.mark.parametrize("role", ["router", "prefill"])
def test_no_secret_and_no_insecure_exits_2_with_a_clear_message(role):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_SECRET") and k != "PDSERVE_INSECURE"}
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", role, "--model", "/nonexistent"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no deployment secret" in proc.stderr and "--insecure" in proc.stderr
