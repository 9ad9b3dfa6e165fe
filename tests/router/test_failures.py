"""Failures have bounded answers: disconnects abort the workers, dead workers fail their requests,
bad control frames are dropped, and the router keeps serving through all of it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from pdserve.protocol.codec import encode
from pdserve.protocol.messages import Heartbeat
from tests.helpers.fake_worker import RouterHarness, toks
from tests.helpers.paths import REPO

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
SLOW = toks("Hello world") * 5
LONG = toks("Hello world") * 100


def sse_events(lines) -> list:
    return [
        json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
        for x in lines
        if x.startswith("data: ")
    ]


@pytest.fixture
def pair():
    with RouterHarness() as h:
        p = h.worker("prefill-0", "prefill", script=SLOW, delay=0.05)
        d = h.worker("decode-0", "decode", script=SLOW, delay=0.05)
        yield h, p, d


@pytest.fixture
def long_pair():
    """Workers whose stream lasts ~20 s: it cannot end on its own before the client leaves."""
    with RouterHarness() as h:
        p = h.worker("prefill-0", "prefill", script=LONG, delay=0.05)
        d = h.worker("decode-0", "decode", script=LONG, delay=0.05)
        yield h, p, d


def test_stream_disconnect_aborts_prefill_and_decode_within_2s(long_pair):
    h, p, d = long_pair
    with (
        httpx.Client(base_url=h.base_url, timeout=10) as c,
        c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 400, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        while "Hel" not in next(lines):  # the first token has arrived
            pass
        assert d.wait_for(lambda: len(d.received) > 0, timeout=2)  # decode is generating
        left_at = time.monotonic()
    rid = p.requests()[0].request_id
    assert p.wait_for(lambda: rid in p.aborted, timeout=2) and d.wait_for(
        lambda: rid in d.aborted, timeout=2
    )
    assert time.monotonic() - left_at < 2
    assert h.wait_until(lambda: h.service.inflight == 0 and len(h.service.tracker) == 0)
    m = h.service.metrics
    assert m.queue_depth._value.get() == 0 and m.running._value.get() == 0


def test_non_streaming_disconnect_while_waiting_aborts_both(pair):
    h, p, d = pair
    p.first_delay = 30  # the request waits for its first token
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=h.base_url, timeout=0.5) as c:
        c.post("/v1/chat/completions", json=CHAT)
    left_at = time.monotonic()
    rid = p.requests()[0].request_id
    assert p.wait_for(lambda: rid in p.aborted, timeout=2) and d.wait_for(
        lambda: rid in d.aborted, timeout=2
    )
    assert time.monotonic() - left_at < 2


def test_worker_that_stops_heartbeating_fails_streams_and_flips_ready(pair):
    h, p, d = pair
    with httpx.Client(base_url=h.base_url, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.iter_lines()
            while "Hel" not in next(lines):
                pass
            d.hang()
            started = time.monotonic()
            events = sse_events(lines)
        assert time.monotonic() - started < 4  # heartbeat timeout (1 s) + slack, never a hang
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_lost"
        assert c.get("/ready").status_code == 503
        envelope = c.post("/v1/chat/completions", json=CHAT)
        assert (
            envelope.status_code == 503
            and envelope.json()["error"]["type"] == "service_unavailable"
        )
        # A decode worker joining later is used.
        h.worker("decode-1", "decode", script=toks("Hello world"))
        assert c.get("/ready").status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT)
        assert (
            r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
        )
        assert p.requests()[-1].decode_worker_id == "decode-1"


def test_dead_worker_fails_non_streaming_request_with_502():
    with RouterHarness(prefill_fallback=False) as h:
        p = h.worker("prefill-0", "prefill", script=SLOW, delay=0.05, first_delay=30)
        h.worker("decode-0", "decode", script=SLOW, delay=0.05)
        with httpx.Client(base_url=h.base_url, timeout=10) as c:
            p.hang()
            r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_lost"


def test_with_the_only_prefill_worker_dead_the_decode_worker_serves_the_request_whole(pair):
    h, p, d = pair
    p.first_delay = 30
    with httpx.Client(base_url=h.base_url, timeout=10) as c:
        p.hang()
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world" * 5
        assert type(d.requests()[-1]).__name__ == "GenerateRequest"  # the whole request, prompt included
        r = c.post("/v1/chat/completions", json=CHAT)  # new requests too, while no prefill is back
        assert r.status_code == 200 and type(d.requests()[-1]).__name__ == "GenerateRequest"
    assert 'cause="prefill_lost_before_first_token"' in h.service.metrics.render().decode()


def test_worker_goodbye_takes_it_out_of_rotation():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url) as c:
        w = h.worker("colo-0")
        assert c.get("/ready").status_code == 200
        h.workers.remove(w)
        w.stop(goodbye=True)
        assert h.wait_until(lambda: "colo-0" not in h.service.registry.workers, timeout=2)
        assert c.get("/ready").status_code == 503


def test_request_without_tokens_times_out_with_504():
    with (
        RouterHarness(request_timeout=0.5) as h,
        httpx.Client(base_url=h.base_url, timeout=10) as c,
    ):
        w = h.worker("colo-0", first_delay=30)
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        rid = w.requests()[0].request_id
        assert w.wait_for(lambda: rid in w.aborted, timeout=2)


def test_worker_error_event_ends_request_with_error_chunk():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        w = h.worker("colo-0", script=toks("Hello"))
        w._plan = lambda prompt, sampling: (toks("Hello"), "error")  # the worker fails at the end
        with c.stream(
            "POST", "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True}
        ) as r:
            events = sse_events(r.iter_lines())
        assert events[-2]["error"]["code"] == "worker_error" and events[-1] == "[DONE]"


def test_garbage_control_frames_are_dropped_and_router_keeps_serving():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker("colo-0", script=toks("Hello world"))
        ctx = zmq.Context.instance()
        evil = ctx.socket(zmq.DEALER)
        evil.setsockopt(zmq.IDENTITY, b"intruder")
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(h.control_address)
        hb = Heartbeat(
            worker_id="colo-0",
            free_blocks=1,
            total_blocks=1,
            queued_prefill_tokens=0,
            running=0,
            waiting=0,
        )
        frames = [
            [b"\x00garbage\xff"],
            [pickle.dumps({"type": "heartbeat"})],
            [msgspec.msgpack.encode({"type": "heartbeat", "version": 99, "worker_id": "colo-0"})],
            [msgspec.msgpack.encode({"type": "nope", "version": 1})],
            [encode(hb), b"extra frame"],
            [encode(hb)],  # a live worker's id from another connection: spoofing
            [
                encode(
                    Heartbeat(
                        worker_id="someone-else",
                        free_blocks=1,
                        total_blocks=1,
                        queued_prefill_tokens=0,
                        running=0,
                        waiting=0,
                    )
                )
            ],
        ]
        for f in frames:
            evil.send_multipart(f)
        bad = h.service.metrics.bad_messages
        assert h.wait_until(lambda: bad._value.get() >= len(frames), timeout=3)
        evil.close()
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT)
        assert (
            r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
        )
        assert f"pdserve_router_bad_messages_total {len(frames)}.0" in c.get("/metrics").text


def test_heartbeat_kv_counters_become_prometheus_counters():
    from pdserve.protocol.messages import Register
    from tests.helpers.fake_worker import FINGERPRINT

    with RouterHarness() as h, httpx.Client(base_url=h.base_url) as c:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"p9")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(h.control_address)
        reg = Register(
            worker_id="p9",
            role="prefill",
            kv_address="",
            fingerprint=FINGERPRINT,
            num_blocks=10,
            max_model_len=100,
        )
        dealer.send(encode(reg))
        for sent in (100, 250):
            dealer.send(
                encode(
                    Heartbeat(
                        worker_id="p9",
                        free_blocks=4,
                        total_blocks=10,
                        queued_prefill_tokens=0,
                        running=0,
                        waiting=0,
                        kv_bytes_sent=sent,
                        kv_transfer_seconds=sent / 100,
                    )
                )
            )
        want = 'pdserve_kv_transfer_bytes_total{direction="sent",role="prefill",worker="p9"} 250.0'
        assert h.wait_until(lambda: want in c.get("/metrics").text, timeout=3)
        text = c.get("/metrics").text
        assert 'pdserve_kv_blocks_used{role="prefill",worker="p9"} 6.0' in text
        assert 'pdserve_kv_transfer_seconds_total{role="prefill",worker="p9"} 2.5' in text
        dealer.close()


KILLABLE = """
import sys, time
from tests.helpers.fake_worker import FakeWorker, toks
FakeWorker(sys.argv[1], "colo-doomed", script=toks("Hello world") * 20, delay=0.02, heartbeat_interval=1.0).start()
time.sleep(120)
"""


def test_a_killed_worker_is_lost_when_its_connection_closes_not_a_heartbeat_timeout_later():
    root = str(REPO)
    with RouterHarness(heartbeat_timeout=30) as h, httpx.Client(base_url=h.base_url, timeout=30) as c:
        doomed = subprocess.Popen([sys.executable, "-c", KILLABLE, h.control_address], cwd=root)
        try:
            assert h.wait_until(lambda: "colo-doomed" in h.service.registry.workers, timeout=30)
            with c.stream("POST", "/v1/chat/completions",
                          json={**CHAT, "max_tokens": 40, "stream": True}) as r:
                lines = r.iter_lines()
                seen = [next(lines)]
                while "Hel" not in seen[-1]:  # streaming from the doomed worker
                    seen.append(next(lines))
                h.worker("colo-1", script=toks("Hello world") * 20)
                doomed.kill()
                killed = time.monotonic()
                assert h.wait_until(lambda: "colo-doomed" not in h.service.registry.workers, timeout=5)
                lost_after = time.monotonic() - killed
                events = sse_events([*seen, *lines])
        finally:
            doomed.kill()
            doomed.wait()
    assert lost_after < 1.0  # the heartbeat timeout is 30 s
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices"))
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert text == ("Hello world" * 20)[: len(text)] and len(text) >= 40  # 40 tokens, none twice
    assert h.service.control.disconnects == 1


def test_a_worker_the_router_forgot_drops_that_routers_work_and_registers_again():
    with RouterHarness(heartbeat_timeout=0.5, migration_limit=0) as h, \
            httpx.Client(base_url=h.base_url, timeout=10) as c:
        w = h.worker("colo-0", script=SLOW, delay=0.05)
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.iter_lines()
            while "Hel" not in next(lines):
                pass
            w.hang()  # silent: the router times it out and fails the stream (no migration allowed)
            assert h.wait_until(lambda: "colo-0" not in h.service.registry.workers, timeout=5)
            w.hung = False  # back: its next heartbeat meets a router that no longer knows it
            events = sse_events(lines)
        assert events[-2]["error"]["code"] == "worker_lost"
        assert w.wait_for(lambda: any(f.reason == "the router forgot us" for f in w.fences), timeout=5)
        assert h.wait_until(lambda: "colo-0" in h.service.registry.workers, timeout=5)
        assert not w._active  # the forgotten request is not computed on for nobody
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world" * 5
