"""Fencing: a worker drops the work of a router that is gone, before any work of the next one;
and the router's liveness judgement, which must not blame workers for its own stalls."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pdserve.protocol.codec import decode, encode
from pdserve.protocol.messages import GenerateRequest, HeartbeatAck, Register, RegisterAck
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.router_link import ROUTER_LOST_HEARTBEATS, Fence, WorkerLink
from tests.helpers.fake_worker import RouterHarness
from tests.helpers.service_harness import Cluster
from tests.worker.test_router_link import heartbeat, raw_router, register  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(120)


def _wait_poll(link: WorkerLink, n: int, timeout: float = 3.0) -> list:
    items: list = []
    deadline = time.monotonic() + timeout
    while len(items) < n and time.monotonic() < deadline:
        items += link.poll()
        time.sleep(0.01)
    return items


def _registered(sock) -> tuple[bytes, Register]:
    while True:
        ident, frame = sock.recv_multipart()
        msg = decode(frame)
        if isinstance(msg, Register):
            return ident, msg


def test_a_new_router_epoch_fences_before_the_new_routers_work(raw_router):  # noqa: F811
    sock, address = raw_router
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=0.1).start()
    try:
        ident, first = _registered(sock)
        sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=True, epoch="A"))])
        assert [f.epoch for f in _wait_poll(link, 1)] == ["A"]
        work = GenerateRequest(request_id="new-1", token_ids=(1, 2), sampling=SamplingParams(), epoch="B")
        sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=True, epoch="B"))])
        sock.send_multipart([ident, encode(work)])
        items = _wait_poll(link, 2)
        assert isinstance(items[0], Fence) and items[0].epoch == "B" and "restarted" in items[0].reason
        assert items[1] == work
        assert link.fences == 1
        _, again = _registered(sock)  # a fenced worker registers as a new incarnation
        assert again.incarnation != first.incarnation
    finally:
        link.close()


def test_a_router_silent_for_3_heartbeats_fences_the_worker(raw_router):  # noqa: F811
    sock, address = raw_router
    interval = 0.1
    link = WorkerLink(address, register(), heartbeat, heartbeat_interval=interval).start()
    try:
        ident, _ = _registered(sock)
        sock.send_multipart([ident, encode(RegisterAck(worker_id="w0", accepted=True, epoch="A"))])
        sock.send_multipart([ident, encode(HeartbeatAck(worker_id="w0", epoch="A"))])
        assert [f.epoch for f in _wait_poll(link, 1)] == ["A"]
        started = time.monotonic()
        [fence] = _wait_poll(link, 1, timeout=3.0)
        assert isinstance(fence, Fence) and fence.epoch == "" and "lost the router" in fence.reason
        assert time.monotonic() - started < (ROUTER_LOST_HEARTBEATS + 2) * interval + 0.3
        assert not link.registered
    finally:
        link.close()


def test_a_blocked_router_loop_does_not_expire_workers_whose_heartbeats_arrived():
    with RouterHarness(heartbeat_timeout=0.5) as h:
        h.worker("colo-0")
        loop = h.service.control._loop
        blocked = threading.Event()

        def block() -> None:
            blocked.set()
            time.sleep(1.5)  # three heartbeat timeouts with the event loop stuck

        loop.call_soon_threadsafe(block)
        assert blocked.wait(2)
        time.sleep(1.8)  # past the block, and a few reaper periods after it
        assert "colo-0" in h.service.registry.workers
        assert h.service.metrics.worker_failures._value.get() == 0


def test_link_thread_death_makes_ready_fail(tiny):
    from pdserve.config.engine import EngineConfig
    from pdserve.config.worker import WorkerOptions
    from pdserve.worker.colocated import ColocatedWorker

    with RouterHarness() as h:
        worker = ColocatedWorker.create(
            WorkerOptions(router_address=h.control_address, worker_id="colo-ready", heartbeat_interval=0.1),
            EngineConfig(dtype="float32", model="tiny", num_kv_blocks=64, device="cpu"), loaded=tiny,
        ).start()
        try:
            assert worker.links.wait_registered(5)
            ready = worker.health.address + "/ready"
            assert httpx.get(ready, timeout=5).status_code == 200

            def broken(sock) -> None:
                raise RuntimeError("injected: the link's socket broke")

            [link] = worker.links.links().values()
            link._flush = broken  # the I/O thread's next turn dies
            link._wake()
            assert h.wait_until(lambda: not worker.links.alive, timeout=5)
            assert httpx.get(ready, timeout=5).status_code == 503
        finally:
            worker.close()


# --- the acceptance test: kill -9 the router of a running deployment ---------------------------


def _stream(base_url: str, model: str) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the router died under it: expected


def test_router_killed_mid_stream_workers_drop_its_work_and_the_restarted_router_serves(tiny_dir, tmp_path):
    cluster = Cluster(tmp_path, str(tiny_dir), transport="tcp").start()
    try:
        model = httpx.get(cluster.base_url + "/v1/models").json()["data"][0]["id"]
        pool = ThreadPoolExecutor(4)
        for _ in range(4):
            pool.submit(_stream, cluster.base_url, model)
        deadline = time.time() + 30
        while time.time() < deadline and cluster.info("decode-0")["running"] == 0:
            time.sleep(0.05)
        assert cluster.info("decode-0")["running"] > 0, "no stream reached the decode worker"
        router = cluster.proc("router")
        os.killpg(router.popen.pid, signal.SIGKILL)
        router.popen.wait(10)
        killed = time.time()
        # 3 heartbeats of 0.5 s, plus 2 s of slack for the loop turn, the probe and a loaded CI
        # host (1 s of slack failed there twice, the decode worker fencing at 1.8-2.6 s).
        infos = cluster.wait_idle(timeout=3 * 0.5 + 2.0)
        assert time.time() - killed < 3 * 0.5 + 2.5
        for name, info in infos.items():
            assert info["used_blocks"] == 0 and info["running"] == 0, (name, info)
        assert "lost the router" in cluster.proc("decode-0").log.read_text()  # fenced, not finished
        pool.shutdown(wait=True)
        cluster.start_router()
        cluster.wait_ready(60)
        r = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                       json={"model": model, "prompt": "Hello", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        cluster.stop()


# --- the decode side: KV carries the epoch ----------------------------------------------------


def _kv_meta(fp, request_id: str, epoch: str):
    from pdserve.kvtransfer.tensors import describe
    from pdserve.protocol.messages import KVTransfer

    payload = torch.randn(fp.num_layers, 2, 2, fp.block_size, fp.num_kv_heads, fp.head_dim)
    meta = KVTransfer(request_id=request_id, prefill_worker_id="p-test", prompt_token_ids=tuple(range(1, 21)),
                      output_token_ids=(5,), sampling=SamplingParams(temperature=0.0, max_tokens=50),
                      num_computed_tokens=20, fingerprint=fp, tensor=describe(payload, with_checksum=False),
                      transport="tcp", epoch=epoch)
    return meta, payload


def _pump_until_ack(worker, sender, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.poll_io()
        acks = sender.poll_acks(timeout=0.02)
        if acks:
            return acks
    return []


def test_decode_worker_nacks_kv_of_another_epoch_and_its_routers_fence_drops_what_it_holds(tiny):
    from pdserve.config.engine import EngineConfig
    from pdserve.config.worker import WorkerOptions
    from pdserve.decode_node.worker import DecodeWorker
    from pdserve.kvtransfer.transport.tcp import TcpKVSender

    worker = DecodeWorker.create(WorkerOptions(worker_id="decode-fence", kv_port=0),
                                 EngineConfig(dtype="float32", model="tiny", num_kv_blocks=64), loaded=tiny)
    router = "tcp://127.0.0.1:5550"
    worker.links.routes.fence(router, "E1")  # as RouterLinks.poll records the link's first Fence
    try:
        with TcpKVSender(lease_s=5.0) as sender:
            meta, payload = _kv_meta(worker.fingerprint, "stale-1", epoch="E0")
            sender.send(worker.receiver.address, meta, payload)
            [ack] = _pump_until_ack(worker, sender)
            assert not ack.ok and "epoch" in ack.reason
            assert worker.engine.request_ids() == []

            meta, payload = _kv_meta(worker.fingerprint, "current-1", epoch="E1")
            sender.send(worker.receiver.address, meta, payload)
            deadline = time.monotonic() + 5
            while "current-1" not in worker.engine.request_ids() and time.monotonic() < deadline:
                worker.poll_io()
                time.sleep(0.01)
            assert worker.engine.request_ids() == ["current-1"]
            held = worker.links.routes.fence(router, "E2")  # what RouterLinks.poll puts in the Fence
            worker.fence(Fence("the router restarted (test)", "E2", router=router, request_ids=held))
            [ack] = _pump_until_ack(worker, sender)
            assert (ack.request_id, ack.ok) == ("current-1", False)
            assert worker.engine.request_ids() == [] and worker.engine.cache_stats()["used_blocks"] == 0
    finally:
        worker.close_io()  # the worker was never started: no link, no health server to stop
