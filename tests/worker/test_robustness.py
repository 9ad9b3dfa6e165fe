"""A worker survives bad input: each failure costs the request it belongs to, never the worker."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from pdserve.config.engine import EngineConfig
from pdserve.config.worker import WorkerOptions
from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.block_pool import BlockPool, PoolCorrupted
from pdserve.kvtransfer.tensors import describe
from pdserve.kvtransfer.transport import ReceivedKV
from pdserve.protocol.messages import GenerateRequest, KVTransfer
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.colocated import ColocatedWorker
from pdserve.worker.loop import (
    IDLE_EMPTY_AFTER_S,
    IDLE_EMPTY_SLEEP_S,
    IDLE_SLEEP_S,
    idle_sleep,
    model_fingerprint,
)

CFG = EngineConfig(dtype="float32", num_kv_blocks=64, block_size=4)
OPTIONS = WorkerOptions(host="127.0.0.1", kv_port=0, health_port=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
ROUTER = "tcp://127.0.0.1:5550"


def run_loop_for(worker, seconds: float) -> float:
    """Run the worker's engine loop on a thread for `seconds`, then stop it and check that it
    returned. Returns the monotonic time at which the loop was started."""
    worker.start()
    loop = threading.Thread(target=worker.run)
    started = time.monotonic()
    loop.start()
    time.sleep(seconds)
    worker.stop()
    loop.join(timeout=10)
    assert not loop.is_alive()
    return started


@pytest.fixture
def colocated(tiny):
    w = ColocatedWorker.create(OPTIONS, CFG, loaded=tiny)
    yield w
    w.health.close()


@pytest.fixture
def decode(tiny):
    w = DecodeWorker.create(OPTIONS, CFG, loaded=tiny)
    w.links.routes.fence(ROUTER, "E1")  # as the first Fence of the router at ROUTER records it
    acks = []
    w.receiver.ack = lambda rid, ok, reason="": acks.append((rid, ok, reason))  # type: ignore[method-assign]
    w.acks = acks
    yield w
    w.receiver.close()
    w.health.close()


def errors_of(worker) -> dict[str, str]:
    return {e.request_id: e.error for e in worker._pending_events if e.finish_reason == "error"}


def test_an_unexpected_error_accepting_one_request_fails_only_that_request(colocated, monkeypatch):
    def broken(work):
        if work.request_id == "bad":
            raise RuntimeError("bug")
        return ColocatedWorker.accept(colocated, work)

    monkeypatch.setattr(colocated, "accept", broken)
    colocated._accept_safely(GenerateRequest(request_id="bad", token_ids=(1, 2, 3), sampling=GREEDY))
    colocated._accept_safely(GenerateRequest(request_id="good", token_ids=(1, 2, 3), sampling=GREEDY))
    assert list(errors_of(colocated)) == ["bad"]
    assert colocated.engine.request_ids() == ["good"]


def test_a_failing_io_hook_is_logged_and_the_loop_goes_on(colocated):
    def hook():
        raise OSError("socket gone")

    colocated._guarded("transport poll", hook)  # does not raise
    colocated._guarded("transport poll", hook)


def transfer(rid: str, prompt: list[int], output: list[int], computed: int, fp) -> ReceivedKV:
    import torch

    payload = torch.zeros(fp.num_layers, 2, -(-max(computed, 1) // fp.block_size), fp.block_size,
                          fp.num_kv_heads, fp.head_dim)
    meta = KVTransfer(request_id=rid, prefill_worker_id="p", prompt_token_ids=tuple(prompt),
                      output_token_ids=tuple(output), sampling=GREEDY, num_computed_tokens=computed,
                      fingerprint=fp, tensor=describe(payload, with_checksum=False), transport="tcp",
                      epoch="E1")
    return ReceivedKV(meta, payload, ok=True)


def test_a_transfer_claiming_all_its_tokens_computed_is_refused(decode, tiny):
    fp = model_fingerprint(CFG, tiny)
    decode._arrived(transfer("all", [1, 2, 3, 4], [5], computed=5, fp=fp))
    assert decode.acks == [("all", False, "num_computed_tokens 5 must be in [1, 5)")]
    assert "all" in errors_of(decode) and not decode.engine.has_unfinished()
    assert decode.engine.cache_stats()["used_blocks"] == 0


def test_an_unexpected_error_on_one_arrival_refuses_only_that_transfer(decode, tiny, monkeypatch):
    fp = model_fingerprint(CFG, tiny)
    real = decode.engine.add_request

    def flaky(rid, *args, **kw):
        if rid == "bad":
            raise TypeError("bug")
        return real(rid, *args, **kw)

    monkeypatch.setattr(decode.engine, "add_request", flaky)
    monkeypatch.setattr(decode.receiver, "poll", lambda: [transfer("bad", [1, 2, 3], [4], 3, fp),
                                                          transfer("good", [1, 2, 3], [4], 3, fp)])
    decode.poll_io()
    assert [a[:2] for a in decode.acks] == [("bad", False)]
    assert decode.engine.request_ids() == ["good"] and list(decode.kv_in.arrived) == ["good"]


def test_a_pool_invariant_holds_under_python_O():
    """A double free raises even with asserts compiled out (it was an `assert`)."""
    code = ("from pdserve.engine.block_pool import BlockPool, PoolCorrupted\n"
            "p = BlockPool(4, 4); b = p.allocate(1); p.free(b)\n"
            "try:\n    p.free(b)\nexcept PoolCorrupted as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("refused: block"), out.stderr


def test_check_integrity_reports_a_lost_block():
    pool = BlockPool(4, 4)
    pool.allocate(1)
    pool.ref_count[0] = 0  # forget the holder without freeing
    with pytest.raises(PoolCorrupted):
        pool.check_integrity()


def test_a_loop_whose_requests_cannot_run_yet_sleeps_instead_of_spinning(colocated, monkeypatch):
    """Requests waiting on something outside the loop (KV still arriving, KV held for a transfer)
    leave nothing to run: the loop must not spin on the core the other worker computes on."""
    steps = []

    def idle_step():
        steps.append(time.monotonic())
        colocated.engine.last_step_ran = False
        return []

    monkeypatch.setattr(colocated.engine, "has_unfinished", lambda: True)
    monkeypatch.setattr(colocated.engine, "step", idle_step)
    window = 0.5
    run_loop_for(colocated, window)  # the measurement window itself: steps are counted over it
    assert 10 < len(steps) <= window / IDLE_SLEEP_S  # one step per idle sleep at most; spinning makes 10^5


def test_idle_sleep_lengthens_only_for_a_loop_with_no_request():
    assert IDLE_EMPTY_SLEEP_S > IDLE_SLEEP_S
    assert idle_sleep(None) == IDLE_SLEEP_S  # requests waiting on KV: poll often
    assert idle_sleep(0.0) == IDLE_SLEEP_S  # just emptied: a next request is likely near
    assert idle_sleep(IDLE_EMPTY_AFTER_S / 2) == IDLE_SLEEP_S
    assert idle_sleep(IDLE_EMPTY_AFTER_S) == IDLE_EMPTY_SLEEP_S
    assert idle_sleep(3600.0) == IDLE_EMPTY_SLEEP_S


def test_an_empty_loop_polls_at_the_long_idle_sleep(colocated, monkeypatch):
    """A worker with no request wakes a few hundred times a second, not thousands: it costs
    its node's CPU nothing worth counting, and still picks up new work within milliseconds."""
    polls = []
    reclaim = colocated.engine.reclaim

    def counted_reclaim():
        polls.append(time.monotonic())
        reclaim()

    monkeypatch.setattr(colocated.engine, "reclaim", counted_reclaim)
    settle, window = IDLE_EMPTY_AFTER_S * 2, 0.5
    start = run_loop_for(colocated, settle + window) + settle  # polls counted after the loop has settled
    in_window = [t for t in polls if start <= t < start + window]
    assert 10 < len(in_window) <= window / IDLE_EMPTY_SLEEP_S + 5  # at 0.5 ms sleeps it would be ~1,000
    assert len(in_window) < window / IDLE_SLEEP_S / 4


def test_an_out_of_vocabulary_output_token_fails_only_its_request_on_a_colocated_worker(colocated, tiny):
    vocab = tiny.config.vocab_size
    colocated._handle(GenerateRequest(request_id="good", token_ids=(1, 2, 3), sampling=GREEDY))
    colocated._handle(GenerateRequest(request_id="oov", token_ids=(1, 2, 3), sampling=GREEDY,
                                      output_token_ids=(4, vocab + 7)))
    assert errors_of(colocated) == {"oov": f"output_token_ids: token ids must be in [0, {vocab})"}
    colocated._pending_events.clear()
    while colocated.engine.has_unfinished():
        colocated._publish(colocated.engine.step())
    assert not errors_of(colocated)
    assert sum(len(e.token_ids) for e in colocated._pending_events if e.request_id == "good") == GREEDY.max_tokens


def test_an_out_of_vocabulary_output_token_in_a_transfer_is_refused_and_the_others_decode(decode, tiny):
    fp = model_fingerprint(CFG, tiny)
    decode._arrived(transfer("oov", [1, 2, 3], [-1], 3, fp))
    decode._arrived(transfer("good", [1, 2, 3], [4], 3, fp))
    assert decode.acks == [("oov", False, f"token ids must be in [0, {tiny.config.vocab_size})")]
    assert "oov" in errors_of(decode) and decode.engine.request_ids() == ["good"]
    decode._pending_events.clear()
    while decode.engine.has_unfinished():
        decode._publish(decode.engine.step())
    assert not errors_of(decode)


def test_an_idle_loop_takes_router_work_as_it_lands_not_at_its_next_poll(tiny, monkeypatch):
    """The router link wakes the engine loop: with the empty loop's sleep stretched to 60 s, a
    request sent to a worker that has idled into that sleep still streams its tokens at once."""
    import zmq

    from pdserve.protocol.codec import decode, encode
    from pdserve.protocol.messages import Register, RegisterAck, TokenEvents
    from pdserve.worker import loop as worker_loop

    monkeypatch.setattr(worker_loop, "IDLE_EMPTY_SLEEP_S", 60.0)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    router.bind("tcp://127.0.0.1:*")
    options = WorkerOptions(host="127.0.0.1", kv_port=0, health_port=0, worker_id="w-wake",
                            router_address=router.getsockopt_string(zmq.LAST_ENDPOINT), heartbeat_interval=120.0)
    worker = ColocatedWorker.create(options, CFG, loaded=tiny)
    worker.start()
    loop = threading.Thread(target=worker.run)
    try:
        while not isinstance(decode((frames := router.recv_multipart())[1]), Register):
            pass
        router.send_multipart([frames[0], encode(RegisterAck(worker_id="w-wake", accepted=True))])
        assert worker.links.wait_registered(10)
        loop.start()
        time.sleep(IDLE_EMPTY_AFTER_S * 4)  # empty long enough: the loop is in its 60 s sleep now
        sent = time.monotonic()
        router.send_multipart([frames[0], encode(GenerateRequest(request_id="r", token_ids=(1, 2, 3), sampling=GREEDY))])
        tokens = 0
        while tokens < GREEDY.max_tokens:
            msg = decode(router.recv_multipart()[1])  # RCVTIMEO: 10 s, far below the 60 s sleep
            if isinstance(msg, TokenEvents):
                tokens += sum(len(e.token_ids) for e in msg.events if e.request_id == "r")
        assert time.monotonic() - sent < 10
    finally:
        worker.stop()
        if loop.is_alive():
            loop.join(timeout=70)
        worker.close()
        router.close()
