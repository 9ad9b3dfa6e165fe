"""shm staging: a payload gathered straight into a pooled segment travels without a copy, and its
segment goes back to the pool exactly once whatever becomes of the transfer."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from pdserve.engine.kv_cache import gather_blocks
from pdserve.kvtransfer.tensors import TensorFrameError, describe
from pdserve.kvtransfer.transport import TransportError, make_receiver
from pdserve.kvtransfer.transport.shm import ShmKVSender, ShmLocation
from pdserve.protocol.messages import KVPart, KVTransfer, ModelFingerprint
from tests.kvtransfer import test_transports as transports

ADDR = "tcp://127.0.0.1:0"
WAIT = 10.0  # seconds: an upper bound, never a sleep
FP = ModelFingerprint(
    "tiny", "llama", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4
)


def kv_cache(num_blocks: int = 8) -> torch.Tensor:
    return torch.randn(FP.num_layers, 2, num_blocks, FP.block_size, FP.num_kv_heads, FP.head_dim)


def payload_shape(num_blocks: int) -> tuple[int, ...]:
    return (FP.num_layers, 2, num_blocks, FP.block_size, FP.num_kv_heads, FP.head_dim)


def make_meta(payload: torch.Tensor, request_id: str = "req-1") -> KVTransfer:
    return transports.make_meta(payload, FP, request_id)


def busy(sender: ShmKVSender) -> int:
    return sender.stats()["shm_segments_busy"]


def wait_idle(sender: ShmKVSender) -> None:
    """Until every segment is back (a transfer zmq still reads from is released when it is done)."""
    deadline = time.monotonic() + WAIT
    while busy(sender) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert busy(sender) == 0


def staged(sender: ShmKVSender, cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return gather_blocks(cache, ids, out=sender.staging(payload_shape(len(ids)), cache.dtype))


@pytest.fixture
def sender():
    with ShmKVSender(lease_s=5.0) as s:
        yield s


@pytest.fixture
def receiver():
    with make_receiver("shm", ADDR, fingerprint=FP) as r:
        yield r


def test_a_staged_payload_is_sent_from_its_own_segment_and_freed_by_the_ack(sender, receiver):
    cache = kv_cache()
    payload = staged(sender, cache, [5, 1, 2])
    segments = {s.shm.name: s for s in sender._pool._segments}
    (name,) = segments
    assert busy(sender) == 1 and payload.data_ptr() == segments[name].view(1).data_ptr()
    sender.send(receiver.address, make_meta(payload), payload)
    del payload
    (got,) = receiver.poll(timeout=WAIT)
    assert got.ok, got.reason
    assert msgspec.msgpack.decode(got.meta.location, type=ShmLocation).name == name  # no copy
    assert torch.equal(got.payload, gather_blocks(cache, [5, 1, 2]))
    assert got.meta.tensor.checksum.startswith("xxh3:")
    assert busy(sender) == 1  # the decode worker still reads it
    receiver.ack("req-1", True)
    assert [a.ok for a in sender.poll_acks(timeout=WAIT)] == [True]
    wait_idle(sender)


def test_a_staged_payload_whose_lease_expires_is_freed():
    with ShmKVSender(lease_s=0.2) as sender:
        payload = staged(sender, kv_cache(), [0, 1])
        sender.send("tcp://127.0.0.1:9", make_meta(payload), payload)  # nobody listens
        (ack,) = sender.poll_acks(timeout=WAIT)
        assert not ack.ok and "within 0.2s" in ack.reason
        wait_idle(sender)


def test_release_staging_frees_an_unsent_staging_tensor_once(sender):
    payload = staged(sender, kv_cache(), [3])
    assert busy(sender) == 1
    sender.release_staging(payload)
    assert busy(sender) == 0
    with pytest.raises(ValueError, match="not a staging tensor"):
        sender.release_staging(payload)


def test_a_sent_staging_tensor_cannot_be_released_by_the_caller(sender, receiver):
    payload = staged(sender, kv_cache(), [3])
    sender.send(receiver.address, make_meta(payload), payload)
    with pytest.raises(ValueError, match="not a staging tensor"):
        sender.release_staging(payload)
    (got,) = receiver.poll(timeout=WAIT)
    receiver.ack(got.meta.request_id, True)
    assert [a.ok for a in sender.poll_acks(timeout=WAIT)] == [True]
    wait_idle(sender)


def test_a_staged_send_refused_by_a_full_queue_is_freed(sender, monkeypatch):
    from pdserve.kvtransfer.transport import tcp

    monkeypatch.setattr(tcp, "MAX_QUEUED_SENDS", 0)
    payload = staged(sender, kv_cache(), [0])
    sender.send("tcp://127.0.0.1:9", make_meta(payload), payload)
    (ack,) = sender.poll_acks(timeout=WAIT)
    assert not ack.ok and "queue full" in ack.reason
    assert busy(sender) == 0


def test_a_staged_send_refused_before_staging_is_freed(sender, receiver):
    first = staged(sender, kv_cache(), [0])
    sender.send(receiver.address, make_meta(first), first)
    second = staged(sender, kv_cache(), [1])  # same request id while the first is in flight
    sender.send(receiver.address, make_meta(second), second)
    (refused,) = sender.poll_acks(timeout=WAIT)
    assert not refused.ok and "already in flight" in refused.reason
    assert busy(sender) == 1  # only the first transfer's
    receiver.ack(receiver.poll(timeout=WAIT)[0].meta.request_id, True)
    assert [a.ok for a in sender.poll_acks(timeout=WAIT)] == [True]
    wait_idle(sender)


def test_a_staged_send_that_cannot_be_staged_fails_and_is_freed(sender, receiver):
    payload = staged(sender, kv_cache(), [0, 1])
    shuffled = payload.transpose(3, 4)  # the same memory, not contiguous
    sender.send(receiver.address, make_meta(shuffled), shuffled)
    (ack,) = sender.poll_acks(timeout=WAIT)
    assert not ack.ok and "contiguous" in ack.reason
    assert busy(sender) == 0


def test_staging_refuses_what_cannot_travel(sender):
    with pytest.raises(TensorFrameError, match="cannot be sent"):
        sender.staging((4,), torch.complex64)
    with pytest.raises(ValueError, match="at least one byte"):
        sender.staging((0, 4), torch.float32)
    assert busy(sender) == 0


def test_the_pool_stays_bounded_by_max_pool_bytes():
    with ShmKVSender(max_pool_bytes=2 << 20) as sender:
        held = [sender.staging((1 << 18,), torch.float32) for _ in range(2)]  # 1 MiB each
        with pytest.raises(TransportError, match="shm pool full"):
            sender.staging((1 << 18,), torch.float32)
        sender.release_staging(held.pop())
        held.append(sender.staging((1 << 18,), torch.float32))  # the freed segment, reused
        assert sender.stats()["shm_pool_bytes"] == 2 << 20


def test_staged_sends_reuse_one_segment(sender, receiver):
    cache = kv_cache()
    for i in range(5):
        payload = staged(sender, cache, [i, i + 1])
        sender.send(receiver.address, make_meta(payload, f"r{i}"), payload)
        del payload
        (got,) = receiver.poll(timeout=WAIT)
        assert got.ok and torch.equal(got.payload, gather_blocks(cache, [i, i + 1]))
        receiver.ack(f"r{i}", True)
        assert [a.ok for a in sender.poll_acks(timeout=WAIT)] == [True]
        wait_idle(sender)
    assert len(sender._pool._segments) == 1


def test_engine_threads_stage_while_the_io_thread_copies(sender, receiver):
    """Staging (engine threads) and plain sends (copied on the I/O thread) share the pool."""
    cache = kv_cache()
    errors: list[BaseException] = []

    def engine(prefix: str, use_staging: bool) -> None:
        try:
            for i in range(10):
                ids = [i % 8]
                payload = staged(sender, cache, ids) if use_staging else gather_blocks(cache, ids)
                sender.send(receiver.address, make_meta(payload, f"{prefix}{i}"), payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(p, s)) for p, s in (("s", True), ("c", False))]
    for t in threads:
        t.start()
    got: list = []
    while len(got) < 20:
        batch = receiver.poll(timeout=WAIT)
        assert batch, f"only {len(got)} of 20 transfers arrived"
        got += batch
    for t in threads:
        t.join()
    assert not errors and all(g.ok for g in got)
    for g in got:
        receiver.ack(g.meta.request_id, True)
    acks: list = []
    while len(acks) < 20:
        batch = sender.poll_acks(timeout=WAIT)
        assert batch
        acks += batch
    assert all(a.ok for a in acks)
    wait_idle(sender)


def make_part(payload: torch.Tensor, seq: int, first_block: int, total_blocks: int) -> KVPart:
    return KVPart(request_id="req-1", prefill_worker_id="prefill-0", receiver_id="", seq=seq,
                  first_block=first_block, total_blocks=total_blocks, fingerprint=FP,
                  tensor=describe(payload, with_checksum=False), transport="shm")


def test_a_staged_part_of_a_cancelled_stream_is_freed_after_its_lease(receiver):
    with ShmKVSender(lease_s=0.2) as sender:
        payload = staged(sender, kv_cache(), [0, 1])
        sender.send_part(receiver.address, make_part(payload, 0, 0, 4), payload)
        sender.cancel_stream("req-1")
        wait_idle(sender)
        assert sender.stats()["parts_sent"] == 1


def test_a_staged_part_out_of_order_is_freed_without_being_sent(sender, receiver):
    payload = staged(sender, kv_cache(), [0, 1])
    sender.send_part(receiver.address, make_part(payload, 1, 2, 4), payload)  # no part 0 before it
    wait_idle(sender)
    assert sender.stats()["streams_broken"] == 1 and "parts_sent" not in sender.stats()
