"""WorkerLink, the worker's side of the control channel, against a raw socket and the real router."""

from __future__ import annotations

import pickle
import time

import httpx
import pytest
import zmq

from pdserve.config.ports import free_port
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Goodbye,
    Heartbeat,
    Register,
    RegisterAck,
    TokenEvent,
    TokenEvents,
)
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.router_link import WorkerLink
from tests.helpers.fake_worker import FINGERPRINT, FakeWorker, RouterHarness, toks

pytestmark = pytest.mark.timeout(60)


def register(worker_id: str = "w0") -> Register:
    return Register(
        worker_id=worker_id,
        role="colocated",
        kv_address="tcp://x",
        fingerprint=FINGERPRINT,
        num_blocks=10,
        max_model_len=100,
    )


def heartbeat() -> Heartbeat:
    return Heartbeat(
        worker_id="w0",
        free_blocks=10,
        total_blocks=10,
        queued_prefill_tokens=0,
        running=0,
        waiting=0,
    )


@pytest.fixture
def raw_router():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close()


def recv_until(sock, kind, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ident, frame = sock.recv_multipart()
        msg = decode(frame)
        if isinstance(msg, kind):
            return ident, msg
    raise AssertionError(f"no {kind.__name__} received")


def test_link_registers_heartbeats_and_ships_events(raw_router):
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.05).start()
    try:
        ident, reg = recv_until(sock, Register)
        assert ident == b"w0" and reg.incarnation  # the link stamps its incarnation
        assert not link.registered
        sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=True))])
        assert link.wait_registered(3)
        recv_until(sock, Heartbeat)
        link.send_events(
            TokenEvents(worker_id="w0", events=(TokenEvent(request_id="r", token_ids=(1,)),))
        )
        _, events = recv_until(sock, TokenEvents)
        assert events.events[0].request_id == "r"
    finally:
        link.close()
    recv_until(sock, Goodbye)


def test_link_drops_malformed_frames_and_keeps_working(raw_router):
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.05).start()
    try:
        ident, _ = recv_until(sock, Register)
        for junk in (
            b"\xc1junk",
            pickle.dumps(["x"]),
            encode(heartbeat()),
        ):  # heartbeat: wrong direction
            sock.send_multipart([ident, junk])
        sock.send_multipart([ident, b"a", b"b"])
        work = GenerateRequest(request_id="r1", token_ids=(1, 2), sampling=SamplingParams())
        sock.send_multipart([ident, encode(work)])
        sock.send_multipart([ident, encode(Abort(request_ids=("r1",)))])
        deadline, got = time.monotonic() + 3, []
        while len(got) < 2 and time.monotonic() < deadline:
            got += link.poll()
            time.sleep(0.005)
        assert got == [work, Abort(request_ids=("r1",))]
        assert link.bad_messages == 4
    finally:
        link.close()


def test_link_stops_retrying_when_refused(raw_router):
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.05).start()
    try:
        ident, _ = recv_until(sock, Register)
        sock.send_multipart(
            [ident, encode(RegisterAck(worker_id="w0", accepted=False, reason="bad model"))]
        )
        assert not link.wait_registered(0.3)
        assert link.refused_reason == "bad model"
    finally:
        link.close()


def test_worker_registers_again_after_the_router_restarts():
    address = f"tcp://127.0.0.1:{free_port()}"
    with RouterHarness(control_address=address) as first:
        w = FakeWorker(first.control_address, "colo-0", script=toks("Hello")).start()
    try:
        with RouterHarness(control_address=address) as second:  # knows nothing of colo-0
            assert second.wait_until(lambda: "colo-0" in second.service.registry.workers, timeout=5)
            r = httpx.post(
                second.base_url + "/v1/completions",
                json={"model": "fake-model", "prompt": "x"},
                timeout=10,
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello"
    finally:
        w.stop()


def test_shm_is_chosen_for_workers_on_the_same_host():
    with RouterHarness() as h:
        p = h.worker("prefill-0", "prefill", host_id="node-a", kv_transports=("tcp", "shm"))
        h.worker("decode-0", "decode", host_id="node-a", kv_transports=("tcp", "shm"))
        r = httpx.post(
            h.base_url + "/v1/completions", json={"model": "fake-model", "prompt": "x"}, timeout=10
        )
        assert r.status_code == 200
        assert p.requests()[-1].kv_transport == "shm"


def test_a_full_inbox_refuses_new_work_with_an_error_event_and_keeps_aborts(raw_router, monkeypatch):
    from pdserve.worker import router_link

    monkeypatch.setattr(router_link, "MAX_INBOX", 2)
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.05).start()
    try:
        ident, _ = recv_until(sock, Register)
        works = [GenerateRequest(request_id=f"r{i}", token_ids=(1, 2), sampling=SamplingParams()) for i in range(3)]
        for msg in (*works, Abort(request_ids=("r0",))):
            sock.send_multipart([ident, encode(msg)])
        _, refused = recv_until(sock, TokenEvents)  # the third one, answered at once
        assert [(e.request_id, e.finish_reason) for e in refused.events] == [("r2", "error")]
        deadline, got = time.monotonic() + 3, []
        while len(got) < 3 and time.monotonic() < deadline:
            got += link.poll()
            time.sleep(0.005)
        assert got == [works[0], works[1], Abort(request_ids=("r0",))] and link.inbox_dropped == 1
    finally:
        link.close()


def test_a_full_outbox_drops_token_batches_and_counts_them(raw_router, monkeypatch):
    from pdserve.worker import router_link

    monkeypatch.setattr(router_link, "MAX_OUTBOX", 0)
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.05)  # not started: nothing drains
    batch = TokenEvents(worker_id="w0", events=(TokenEvent(request_id="r", token_ids=(1,)),))
    try:
        assert link.send_events(batch) is False and link.outbox_dropped == 1
    finally:
        link.close()


def test_a_burst_of_unknown_worker_answers_makes_one_registration_not_a_storm(raw_router):
    """A restarted router answers every queued token batch with 'unknown worker'."""
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=1.0).start()
    try:
        ident, _ = recv_until(sock, Register)
        sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=True))])
        assert link.wait_registered(3)
        for _ in range(50):
            sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=False, reason="unknown worker"))])
        registers, deadline = 0, time.monotonic() + 0.5  # half a heartbeat interval
        sock.setsockopt(zmq.RCVTIMEO, 100)
        while time.monotonic() < deadline:
            try:
                _, frame = sock.recv_multipart()
            except zmq.Again:
                continue
            registers += isinstance(decode(frame), Register)
        assert registers == 1
    finally:
        link.close()


def test_link_calls_on_ready_for_each_thing_it_queues_after_queuing_it(raw_router):
    sock, address = raw_router
    seen: list[list] = []
    link: WorkerLink | None = None

    def on_ready() -> None:  # on the I/O thread: what it queued is already there to poll
        assert link is not None
        seen.append(link.poll())

    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.05, on_ready=on_ready)
    link.start()
    try:
        ident, _ = recv_until(sock, Register)
        sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=True, epoch="E1"))])
        work = GenerateRequest(request_id="r1", token_ids=(1, 2), sampling=SamplingParams())
        sock.send_multipart([ident, encode(work)])
        sock.send_multipart([ident, encode(Abort(request_ids=("r1",)))])
        deadline = time.monotonic() + 3
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [[type(x).__name__ for x in batch] for batch in seen] == [["Fence"], ["GenerateRequest"], ["Abort"]]
    finally:
        link.close()
