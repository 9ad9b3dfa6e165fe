"""A worker serving several routers: --router-address forms, dns:// re-resolution, and per-router
ownership of work (events, aborts, fences), against scripted routers on raw ROUTER sockets."""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from pdserve.config.engine import ConfigError
from pdserve.config.ports import free_port
from pdserve.config.router_address import RouterAddress, parse_router_addresses
from pdserve.config.worker import WorkerOptions, add_worker_arguments, worker_argv, worker_options
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Goodbye,
    Heartbeat,
    HeartbeatAck,
    Register,
    RegisterAck,
    TokenEvent,
    TokenEvents,
)
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker import router_links
from pdserve.worker.router_link import Fence
from pdserve.worker.router_links import RouterLinks
from tests.worker.test_router_link import heartbeat, register

pytestmark = pytest.mark.timeout(30)


class ScriptedRouter:
    """A router on a raw ROUTER socket: acks every Register and Heartbeat with `epoch`, records
    every message, and sends what the test queues. Its socket lives on its own thread."""

    def __init__(self, address: str = "tcp://127.0.0.1:*", epoch: str = "EA") -> None:
        self.epoch = epoch
        self.answer_heartbeats = True
        self.received: list = []
        self._cond = threading.Condition()
        self._out: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ident: bytes | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(10):
                ident, frame = self._sock.recv_multipart()
                self._ident, msg = ident, decode(frame)
                if isinstance(msg, Register):
                    self._send(RegisterAck(worker_id=msg.worker_id, accepted=True, epoch=self.epoch))
                elif isinstance(msg, Heartbeat) and self.answer_heartbeats:
                    self._send(HeartbeatAck(worker_id=msg.worker_id, epoch=self.epoch))
                with self._cond:
                    self.received.append(msg)
                    self._cond.notify_all()
            while self._ident is not None and not self._out.empty():
                self._send(self._out.get())
        self._sock.close()

    def _send(self, msg) -> None:
        self._sock.send_multipart([self._ident, encode(msg)])

    def send(self, msg) -> None:
        self._out.put(msg)

    def wait_for(self, predicate: Callable[[list], bool], timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.received), timeout)

    def event_ids(self) -> list[str]:
        with self._cond:
            return [e.request_id for m in self.received if isinstance(m, TokenEvents) for e in m.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


@pytest.fixture
def two_routers():
    a, b = ScriptedRouter(epoch="EA"), ScriptedRouter(epoch="EB")
    yield a, b
    a.close()
    b.close()


def _has(kind) -> Callable[[list], bool]:
    return lambda got: any(isinstance(m, kind) for m in got)


def _poll_until(links: RouterLinks, predicate: Callable[[list], bool], timeout: float = 5.0) -> list:
    items: list = []
    deadline = time.monotonic() + timeout
    while not predicate(items) and time.monotonic() < deadline:
        items += links.poll()
        time.sleep(0.005)
    return items


def _work(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, token_ids=(1, 2), sampling=SamplingParams())


def _events(*rids: str) -> TokenEvents:
    return TokenEvents(worker_id="w0", events=tuple(TokenEvent(request_id=r, token_ids=(7,)) for r in rids))


def _fences(items: list) -> list[Fence]:
    return [i for i in items if isinstance(i, Fence)]


def _started(routers, **kw) -> RouterLinks:
    addresses = parse_router_addresses(",".join(r.address for r in routers))
    kw.setdefault("heartbeat_interval", 0.1)
    links = RouterLinks(addresses, heartbeat, **kw).start(register())
    # Each router's first epoch comes through poll() as a Fence that holds no request.
    first = _poll_until(links, lambda items: len(_fences(items)) == len(routers))
    assert sorted(f.epoch for f in _fences(first)) == sorted(r.epoch for r in routers)
    return links


# --- --router-address ------------------------------------------------------------------------


def test_router_address_takes_a_comma_separated_list_and_dns_names_without_repeats():
    assert parse_router_addresses("tcp://10.0.0.1:5550, dns://routers.pdserve:5550,tcp://[::1]:7,tcp://10.0.0.1:5550") == (
        RouterAddress("tcp", "10.0.0.1", 5550), RouterAddress("dns", "routers.pdserve", 5550),
        RouterAddress("tcp", "::1", 7))
    assert str(RouterAddress("tcp", "::1", 7)) == "tcp://[::1]:7"


@pytest.mark.parametrize("text", ["", "10.0.0.1:5550", "tcp://host", "udp://host:1", "tcp://host:0",
                                  "tcp://host:70000", "dns://[::1]:5550", "tcp://[host]:1", "tcp://*:5550"])
def test_router_address_refuses_what_is_no_router_with_a_message_naming_the_forms(text):
    with pytest.raises(ConfigError, match="--router-address"):
        parse_router_addresses(text)


def test_router_address_and_resolve_interval_come_from_the_environment_and_travel_in_argv(monkeypatch):
    monkeypatch.setenv("PDSERVE_ROUTER_ADDRESS", "dns://pdserve-router-headless:5550")
    monkeypatch.setenv("PDSERVE_ROUTER_RESOLVE_INTERVAL", "2.5")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, kv_port=0, health_port=0, transports="tcp")
    options = worker_options(parser.parse_args(["--insecure"]))
    assert (options.router_address, options.router_resolve_interval) == ("dns://pdserve-router-headless:5550", 2.5)
    monkeypatch.delenv("PDSERVE_ROUTER_ADDRESS")
    monkeypatch.delenv("PDSERVE_ROUTER_RESOLVE_INTERVAL")
    again = worker_options(parser.parse_args(worker_argv(options)))
    assert (again.router_address, again.router_resolve_interval) == (options.router_address, 2.5)
    with pytest.raises(ConfigError, match="--router-address"):
        WorkerOptions(router_address="tcp://a:1,router-b:1")


def test_a_dns_name_resolves_to_every_ipv4_and_ipv6_address(monkeypatch):
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.7", 5550)),
               (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 5550, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.7", 5550))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: answers)
    assert router_links.resolve("routers", 5550) == {"tcp://10.1.0.7:5550", "tcp://[fd00::7]:5550"}


# --- dns:// re-resolution ----------------------------------------------------------------------


def test_links_follow_the_dns_answer_and_close_a_router_gone_long_enough(monkeypatch):
    port = free_port()
    a = ScriptedRouter(f"tcp://127.0.0.1:{port}", epoch="EA")
    b = ScriptedRouter(f"tcp://127.0.0.2:{port}", epoch="EB")
    answer: list[str] | OSError = ["127.0.0.1"]
    failures = threading.Semaphore(0)

    def getaddrinfo(host, p, *args, **kw):
        assert (host, p) == ("routers.test", port)
        if isinstance(answer, OSError):
            failures.release()
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, p)) for ip in answer]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    links = RouterLinks(parse_router_addresses(f"dns://routers.test:{port}"), heartbeat, heartbeat_interval=0.1,
                        resolve_interval=0.02, forget_after=0.3).start(register())
    try:
        assert a.wait_for(_has(Register)) and links.wait_registered(5)
        _poll_until(links, lambda items: len(_fences(items)) == 1)
        answer = ["127.0.0.1", "127.0.0.2"]  # a second router pod appears
        assert b.wait_for(_has(Register))
        _poll_until(links, lambda items: len(_fences(items)) == 1)
        a.send(_work("from-a"))
        assert _poll_until(links, lambda items: bool(items)) == [_work("from-a")]

        answer = ["127.0.0.2"]  # the first one goes: its link closes after forget_after
        assert a.wait_for(_has(Goodbye), timeout=3)
        [gone] = _poll_until(links, lambda items: bool(items))
        assert isinstance(gone, Fence) and gone.router == a.address and gone.request_ids == ("from-a",)
        assert list(links.links()) == [b.address]

        answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")  # a DNS outage
        for _ in range(25):  # 25 failed lookups, 0.02 s apart: well past forget_after
            assert failures.acquire(timeout=2)
        assert list(links.links()) == [b.address] and links.registered and links.alive
    finally:
        links.close()
        a.close()
        b.close()


# --- per-router ownership --------------------------------------------------------------------


def test_each_requests_events_go_only_to_the_router_that_sent_it(two_routers):
    a, b = two_routers
    links = _started(two_routers)
    try:
        a.send(_work("ra"))
        b.send(_work("rb"))
        assert len(_poll_until(links, lambda items: len(items) == 2)) == 2
        assert links.send_events(_events("ra", "rb", "nobodys")) is False  # one had no router
        assert a.wait_for(lambda got: "ra" in a.event_ids()) and b.wait_for(lambda got: "rb" in b.event_ids())
        assert (a.event_ids(), b.event_ids(), links.routes.unrouted) == (["ra"], ["rb"], 1)
    finally:
        links.close()


def test_heartbeats_go_to_every_router_and_one_registration_makes_the_worker_registered(two_routers):
    a, b = two_routers
    b.close()  # never answers: the worker stays registered with a alone
    links = RouterLinks(parse_router_addresses(f"{a.address},{b.address}"), heartbeat,
                        heartbeat_interval=0.05).start(register())
    try:
        assert links.wait_registered(5) and links.registered
        assert a.wait_for(lambda got: sum(isinstance(m, Heartbeat) for m in got) >= 2)
        assert not links.links()[b.address].registered
    finally:
        links.close()
    both = [ScriptedRouter(epoch="E1"), ScriptedRouter(epoch="E2")]
    links = _started(both, heartbeat_interval=0.05)
    try:
        assert all(r.wait_for(lambda got: sum(isinstance(m, Heartbeat) for m in got) >= 2) for r in both)
    finally:
        links.close()
        for r in both:
            r.close()


def test_an_abort_from_one_router_aborts_only_its_own_requests(two_routers):
    a, b = two_routers
    links = _started(two_routers)
    try:
        a.send(_work("ra"))
        b.send(_work("rb"))
        _poll_until(links, lambda items: len(items) == 2)
        b.send(Abort(request_ids=("ra",)))  # nothing of b's: no Abort at all
        b.send(_work("rb-2"))  # polled after b's Abort: b's link keeps its order
        a.send(Abort(request_ids=("ra", "rb", "not-yet-arrived")))
        items = _poll_until(links, lambda items: len(items) == 2)
        assert sorted(items, key=repr) == [Abort(request_ids=("ra", "not-yet-arrived")), _work("rb-2")]
    finally:
        links.close()


def test_a_new_epoch_of_one_router_fences_only_that_routers_requests(two_routers):
    a, b = two_routers
    links = _started(two_routers)
    try:
        a.send(_work("ra-1"))
        a.send(_work("ra-2"))
        b.send(_work("rb"))
        _poll_until(links, lambda items: len(items) == 3)
        a.epoch = "EA-restarted"  # its next HeartbeatAck names a new epoch
        [fence] = _fences(_poll_until(links, lambda items: bool(_fences(items))))
        assert (fence.router, fence.epoch, sorted(fence.request_ids)) == (a.address, "EA-restarted", ["ra-1", "ra-2"])
        assert links.routes.router_for_epoch("EA") is None and links.routes.router_for_epoch("EB") == b.address
        links.send_events(_events("ra-1", "rb"))  # ra-1 has no router any more
        assert b.wait_for(lambda got: "rb" in b.event_ids())
        assert "ra-1" not in a.event_ids() and links.routes.unrouted == 1
    finally:
        links.close()


def test_a_request_id_another_router_holds_is_refused_to_its_sender(two_routers):
    a, b = two_routers
    links = _started(two_routers)
    try:
        a.send(_work("same"))
        _poll_until(links, lambda items: bool(items))
        b.send(_work("same"))
        assert _poll_until(links, lambda items: "same" in b.event_ids()) == []  # answered, not delivered
        [refusal] = [e for m in b.received if isinstance(m, TokenEvents) for e in m.events]
        assert refusal.finish_reason == "error" and "in use" in refusal.error
        assert links.routes.owner("same") == a.address
    finally:
        links.close()


def test_routes_of_requests_the_worker_no_longer_holds_are_forgotten(two_routers):
    a, b = two_routers
    links = _started(two_routers)
    try:
        for rid in ("done", "running"):
            a.send(_work(rid))
        _poll_until(links, lambda items: len(items) == 2)
        links.retain({"running"})
        assert (links.routes.owner("done"), links.routes.owner("running")) == (None, a.address)
    finally:
        links.close()
