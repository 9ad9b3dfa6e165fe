"""Two routers, one pool of workers: a decode worker takes the KV of either router's epoch and
streams each request to its own router; one router's fence or death costs only its requests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.config.worker import WorkerOptions
from pdserve.decode_node.worker import DecodeWorker
from pdserve.kvtransfer.tensors import describe
from pdserve.kvtransfer.transport.tcp import TcpKVSender
from pdserve.protocol.messages import Heartbeat, KVTransfer, TokenEvents
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.service_harness import Cluster
from tests.worker.test_router_links import ScriptedRouter

pytestmark = pytest.mark.timeout(120)

STREAM_TOKENS = 1500


# --- a decode worker between two scripted routers --------------------------------------------


def _transfer(fp, request_id: str, epoch: str, max_tokens: int) -> tuple[KVTransfer, torch.Tensor]:
    """A prefilled request (20 prompt tokens, its first token generated) of router epoch `epoch`."""
    payload = torch.randn(fp.num_layers, 2, 2, fp.block_size, fp.num_kv_heads, fp.head_dim)
    meta = KVTransfer(request_id=request_id, prefill_worker_id="p-test", prompt_token_ids=tuple(range(1, 21)),
                      output_token_ids=(5,), fingerprint=fp, num_computed_tokens=20,
                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                      tensor=describe(payload, with_checksum=False), transport="tcp", epoch=epoch)
    return meta, payload


def _events_of(router: ScriptedRouter, rid: str) -> list:
    with router._cond:
        return [e for m in router.received if isinstance(m, TokenEvents) for e in m.events if e.request_id == rid]


def _finished(router: ScriptedRouter, rid: str) -> bool:
    return any(e.finish_reason for e in _events_of(router, rid))


@pytest.fixture
def decode_between_two_routers(tiny):
    a, b = ScriptedRouter(epoch="EA"), ScriptedRouter(epoch="EB")
    worker = DecodeWorker.create(
        WorkerOptions(router_address=f"{a.address},{b.address}", worker_id="decode-2r", kv_port=0,
                      heartbeat_interval=0.1),
        EngineConfig(dtype="float32", model="tiny", num_kv_blocks=64), loaded=tiny).start()
    loop = threading.Thread(target=worker.run, name="decode-loop", daemon=True)
    loop.start()
    try:
        assert a.wait_for(lambda got: any(isinstance(m, Heartbeat) for m in got))
        assert b.wait_for(lambda got: any(isinstance(m, Heartbeat) for m in got))
        info = worker.health.address + "/info"
        deadline = time.monotonic() + 5  # the engine loop has taken both routers' first epochs
        while {r["epoch"] for r in httpx.get(info, timeout=5).json()["routers"]} != {"EA", "EB"}:
            assert time.monotonic() < deadline, httpx.get(info, timeout=5).json()["routers"]
            time.sleep(0.02)
        with TcpKVSender(lease_s=5.0) as sender:
            yield worker, a, b, sender
    finally:
        worker.stop()
        loop.join(10)
        a.close()
        b.close()


def _acks(sender: TcpKVSender, n: int, timeout: float = 10.0) -> dict:
    acks: dict = {}
    deadline = time.monotonic() + timeout
    while len(acks) < n and time.monotonic() < deadline:
        acks.update({ack.request_id: ack for ack in sender.poll_acks(timeout=0.02)})
    return acks


def test_decode_accepts_kv_of_any_registered_routers_epoch_and_streams_each_to_its_router(decode_between_two_routers):
    worker, a, b, sender = decode_between_two_routers
    for rid, epoch in (("via-a", "EA"), ("via-b", "EB"), ("stale", "E-gone")):
        sender.send(worker.receiver.address, *_transfer(worker.fingerprint, rid, epoch, max_tokens=12))
    acks = _acks(sender, 3)
    assert (acks["via-a"].ok, acks["via-b"].ok, acks["stale"].ok) == (True, True, False)
    assert "epoch" in acks["stale"].reason
    assert a.wait_for(lambda got: _finished(a, "via-a")) and b.wait_for(lambda got: _finished(b, "via-b"))
    for router, mine, other in ((a, "via-a", "via-b"), (b, "via-b", "via-a")):
        assert sum(len(e.token_ids) for e in _events_of(router, mine)) == 11  # 12 less the prefill's
        assert _events_of(router, other) == [] and _events_of(router, "stale") == []


def test_a_fence_of_one_router_drops_its_decodes_and_the_other_routers_run_to_the_end(decode_between_two_routers):
    worker, a, b, sender = decode_between_two_routers
    for rid, epoch in (("via-a", "EA"), ("via-b", "EB")):
        sender.send(worker.receiver.address, *_transfer(worker.fingerprint, rid, epoch, max_tokens=300))
    assert a.wait_for(lambda got: _events_of(a, "via-a")) and b.wait_for(lambda got: _events_of(b, "via-b"))
    a.epoch = "EA-restarted"  # router a restarted: its next HeartbeatAck says so
    assert b.wait_for(lambda got: _finished(b, "via-b"), timeout=60)
    events = _events_of(b, "via-b")
    assert (events[-1].finish_reason, sum(len(e.token_ids) for e in events)) == ("length", 299)
    assert not _finished(a, "via-a")  # dropped, not finished
    info = httpx.get(worker.health.address + "/info", timeout=5).json()
    assert info["running"] == 0 and info["used_blocks"] == 0
    assert {r["router"]: r["fences"] for r in info["routers"]} == {a.address: 1, b.address: 0}


# --- end to end: two real routers, one prefill and one decode worker --------------------------


def _stream(base_url: str, model: str, max_tokens: int) -> dict:
    """One streamed completion: its finish reason, usage and any error (an exception: the
    connection broke)."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out: dict = {"finish_reason": None, "usage": None, "error": None}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            out["error"] = out["error"] or chunk.get("error")
            out["usage"] = chunk.get("usage") or out["usage"]
            for choice in chunk.get("choices", []):
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    return out


def _fenced(cluster: Cluster, worker: str, router: str) -> bool:
    return any(r["router"] == router and r["fences"] for r in cluster.info(worker)["routers"])


def _stream_broken(base_url: str, model: str, max_tokens: int) -> None:
    with contextlib.suppress(httpx.HTTPError):  # its router died under it: expected
        _stream(base_url, model, max_tokens)


def test_two_routers_serve_one_pool_and_killing_one_leaves_the_others_streams_whole(tiny_dir, tmp_path):
    cluster = Cluster(tmp_path, str(tiny_dir), transport="tcp", num_routers=2).start()
    try:
        url_a, url_b = cluster.base_urls
        model = httpx.get(url_a + "/v1/models").json()["data"][0]["id"]
        for url in (url_a, url_b):
            r = httpx.post(url + "/v1/completions", timeout=30, json={"model": model, "prompt": "Hi", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"], url
        pool = ThreadPoolExecutor(4)
        # Long enough to outlast the fence (about 1.5 s after the kill) on a fast CPU: 300 tokens
        # of the tiny model once finished before it on a Sapphire Rapids.
        survivors = [pool.submit(_stream, url_b, model, STREAM_TOKENS) for _ in range(2)]
        for _ in range(2):
            pool.submit(_stream_broken, url_a, model, STREAM_TOKENS)
        deadline = time.monotonic() + 30
        while cluster.info("decode-0")["running"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cluster.info("decode-0")["running"] == 4, "not every stream reached the decode worker"

        os.killpg(cluster.proc("router").popen.pid, signal.SIGKILL)
        killed = time.monotonic()
        r = httpx.post(url_b + "/v1/completions", timeout=5, json={"model": model, "prompt": "Hello", "max_tokens": 4})
        answered = time.monotonic() - killed
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert answered < 1.0, f"the surviving router answered {answered:.2f} s after the kill"

        # The workers fence the dead router once it has been silent for 3 heartbeats (1.5 s),
        # while the survivor's streams are still running.
        deadline = time.monotonic() + 10
        while not _fenced(cluster, "decode-0", cluster.controls[0]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _fenced(cluster, "decode-0", cluster.controls[0])
        assert not all(f.done() for f in survivors), "the survivor's streams ended before the fence"
        for f in survivors:
            out = f.result(timeout=60)
            assert out["error"] is None and out["finish_reason"] == "length", out
            assert out["usage"]["completion_tokens"] == STREAM_TOKENS, out
        pool.shutdown(wait=True)
        infos = cluster.wait_idle(timeout=5)
        assert all(i["running"] == 0 and i["used_blocks"] == 0 for i in infos.values()), infos
        decode_log = cluster.proc("decode-0").log.read_text()
        # The dead router's two decodes were dropped at its fence; the survivor was never fenced.
        assert re.search(rf"fence of router {cluster.controls[0]} \(lost the router.*aborting its 2 requests",
                         decode_log)
        assert not _fenced(cluster, "decode-0", cluster.controls[1])
    finally:
        cluster.stop()
