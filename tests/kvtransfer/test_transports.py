"""KV transports (tcp, shm; cuda_ipc on a GPU): delivery, acks, verification, hostile input."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch
import zmq

from pdserve.engine.kv_cache import gather_blocks
from pdserve.kvtransfer.payload import with_header
from pdserve.kvtransfer.tensors import as_bytes, describe
from pdserve.kvtransfer.transport import (
    TransportError,
    TransportUnavailable,
    make_receiver,
    make_sender,
)
from pdserve.kvtransfer.transport.shm import SEGMENT_PREFIX, ShmKVSender, ShmLocation, ShmPool
from pdserve.protocol import codec, messages
from pdserve.protocol.messages import KVTransfer, ModelFingerprint
from pdserve.protocol.sampling import SamplingParams

CPU_KINDS = ["tcp", "shm"]
ADDR = "tcp://127.0.0.1:0"
WAIT = 10.0  # seconds: an upper bound, never a sleep
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A realistic payload: 30 layers, 16 blocks of 16 tokens, 3 KV heads of 64 (~11.8 MB of float32).
BIG = ModelFingerprint(
    "smollm2", "llama", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16
)
SMALL = ModelFingerprint(
    "tiny", "llama", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4
)


def make_payload(
    fp: ModelFingerprint, num_blocks: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.randn(
        fp.num_layers, 2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_dim
    ).to(dtype)


def make_meta(payload: torch.Tensor, fp: ModelFingerprint, request_id: str = "req-1") -> KVTransfer:
    num_tokens = payload.shape[2] * fp.block_size - 1
    return KVTransfer(
        request_id=request_id,
        prefill_worker_id="prefill-0",
        prompt_token_ids=tuple(range(num_tokens)),
        output_token_ids=(7,),
        sampling=SamplingParams(temperature=0.0),
        num_computed_tokens=num_tokens,
        fingerprint=fp,
        tensor=describe(payload, with_checksum=False),
        transport="",
    )


@pytest.fixture(params=CPU_KINDS)
def pair(request):
    kind = request.param
    receiver = make_receiver(kind, ADDR, fingerprint=SMALL)
    sender = make_sender(kind, lease_s=5.0)
    yield kind, sender, receiver
    sender.close()
    receiver.close()


def receive_one(receiver):
    got = receiver.poll(timeout=WAIT)
    assert len(got) == 1, f"expected one transfer, got {got}"
    return got[0]


def shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)}


# --- delivery -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_realistic_payload_arrives_bit_identical_and_the_ack_reaches_the_sender(kind):
    with make_receiver(kind, ADDR, fingerprint=BIG) as receiver, make_sender(kind) as sender:
        payload = make_payload(BIG, 16)
        sender.send(receiver.address, make_meta(payload, BIG), payload)
        got = receive_one(receiver)
        assert got.ok, got.reason
        assert torch.equal(got.payload, payload)
        assert got.meta.tensor.nbytes == payload.numel() * 4
        receiver.ack("req-1", True)
        acks = sender.poll_acks(timeout=WAIT)
        assert [(a.request_id, a.ok) for a in acks] == [("req-1", True)]


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_the_receiver_wakes_its_engine_loop_when_a_transfer_is_queued(kind):
    """The decode worker's idle loop waits on `on_ready` rather than sleeping: it must be set
    once the transfer can be polled, not before."""
    import threading

    woken = threading.Event()
    with make_receiver(kind, ADDR, fingerprint=SMALL, on_ready=woken.set) as receiver, make_sender(kind) as sender:
        payload = make_payload(SMALL, 3)
        assert not woken.is_set()
        sender.send(receiver.address, make_meta(payload, SMALL), payload)
        assert woken.wait(WAIT)
        got = receiver.poll()  # no waiting: it was queued before the wake
        assert len(got) == 1 and got[0].ok, got
        receiver.ack("req-1", True)


def test_bfloat16_payload_round_trips(pair):
    _, sender, receiver = pair
    fp = msgspec.structs.replace(SMALL, dtype="bfloat16")
    receiver.fingerprint = fp
    payload = make_payload(fp, 3, torch.bfloat16)
    sender.send(receiver.address, make_meta(payload, fp), payload)
    got = receive_one(receiver)
    assert got.ok, got.reason
    assert got.payload.dtype == torch.bfloat16 and torch.equal(got.payload, payload)


def test_one_sender_serves_two_decode_workers(pair):
    kind, sender, receiver = pair
    with make_receiver(kind, ADDR) as other:
        a, b = make_payload(SMALL, 2), make_payload(SMALL, 3)
        sender.send(receiver.address, make_meta(a, SMALL, "to-a"), a)
        sender.send(other.address, make_meta(b, SMALL, "to-b"), b)
        got_a, got_b = receive_one(receiver), receive_one(other)
        assert torch.equal(got_a.payload, a) and torch.equal(got_b.payload, b)
        receiver.ack("to-a", True)
        other.ack("to-b", False, "no free blocks")
        acks = {a.request_id: a for a in sender.poll_acks(timeout=WAIT)}
        if len(acks) < 2:
            acks |= {a.request_id: a for a in sender.poll_acks(timeout=WAIT)}
        assert acks["to-a"].ok and (acks["to-b"].ok, acks["to-b"].reason) == (
            False,
            "no free blocks",
        )


def test_payload_gathered_from_a_cache_is_received_as_those_blocks(pair):
    _, sender, receiver = pair
    cache = make_payload(SMALL, 10)
    payload = gather_blocks(cache, [9, 0, 4])
    sender.send(receiver.address, make_meta(payload, SMALL), payload)
    got = receive_one(receiver)
    assert torch.equal(got.payload[:, :, 1], cache[:, :, 0])


# --- refusals -----------------------------------------------------------------------------


def test_fingerprint_mismatch_is_refused_before_the_engine_sees_the_payload(pair):
    _, sender, receiver = pair
    other = msgspec.structs.replace(SMALL, model="another-model")
    payload = make_payload(other, 2)
    sender.send(receiver.address, make_meta(payload, other), payload)
    got = receive_one(receiver)
    assert not got.ok and got.payload is None and "model" in got.reason
    receiver.ack("req-1", False, got.reason)
    (ack,) = sender.poll_acks(timeout=WAIT)
    assert not ack.ok and "fingerprint" in ack.reason


def test_payload_shape_that_contradicts_the_token_count_is_refused(pair):
    _, sender, receiver = pair
    payload = make_payload(SMALL, 2)
    sender.send(
        receiver.address, with_header(make_meta(payload, SMALL), num_computed_tokens=20), payload
    )
    got = receive_one(receiver)
    assert not got.ok and "does not match" in got.reason


def test_tcp_flipped_byte_in_flight_is_detected():
    with make_receiver("tcp", ADDR, fingerprint=SMALL) as receiver, zmq.Context() as ctx:
        raw = ctx.socket(zmq.DEALER)
        raw.connect(receiver.address)
        payload = make_payload(SMALL, 2)
        meta = with_header(make_meta(payload, SMALL), tensor=describe(payload), transport="tcp")
        doctored = bytearray(as_bytes(payload).numpy().tobytes())
        doctored[1000] ^= 0x10
        raw.send_multipart([codec.encode(meta), bytes(doctored)])
        got = receive_one(receiver)
        assert not got.ok and "checksum mismatch" in got.reason
        receiver.ack("req-1", False, got.reason)
        assert raw.poll(int(WAIT * 1000))
        ack = codec.decode(raw.recv())
        assert not ack.ok and "checksum" in ack.reason
        raw.close(linger=0)


def test_shm_flipped_byte_in_the_segment_is_detected():
    class CorruptingSender(ShmKVSender):
        def _stage(self, meta, payload):
            meta, frames, seg = super()._stage(meta, payload)
            seg.shm.buf[100] ^= 0x01  # after the checksum was taken
            return meta, frames, seg

    with make_receiver("shm", ADDR) as receiver, CorruptingSender() as sender:
        payload = make_payload(SMALL, 2)
        sender.send(receiver.address, make_meta(payload, SMALL), payload)
        got = receive_one(receiver)
        assert not got.ok and "checksum mismatch" in got.reason


def test_shm_receiver_refuses_a_segment_name_that_is_not_pdserves():
    with make_receiver("shm", ADDR) as receiver, zmq.Context() as ctx:
        raw = ctx.socket(zmq.DEALER)
        raw.connect(receiver.address)
        payload = make_payload(SMALL, 1)
        location = msgspec.msgpack.encode(ShmLocation("../../etc/passwd", 0, payload.numel() * 4))
        meta = with_header(
            make_meta(payload, SMALL), tensor=describe(payload), transport="shm", location=location
        )
        raw.send_multipart([codec.encode(meta)])
        got = receive_one(receiver)
        assert not got.ok and "not one of pdserve's" in got.reason
        raw.close(linger=0)


def test_receiver_fed_garbage_keeps_serving_the_next_valid_transfer(pair, tmp_path):
    kind, sender, receiver = pair
    host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:  # not even ZMTP
        s.sendall(os.urandom(4096))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = make_payload(SMALL, 2)
    good = with_header(
        make_meta(payload, SMALL, "garbage"), tensor=describe(payload), transport=kind
    )
    encoded = codec.encode(good)
    unknown_tag = msgspec.to_builtins(good, builtin_types=(bytes,)) | {"type": "shell"}
    garbage = [
        [pickle.dumps(Exploit())],
        [os.urandom(1000)],
        [encoded[: len(encoded) // 3]],
        [codec.encode(with_header(good, version=99))],
        [msgspec.msgpack.encode(unknown_tag)],
        [codec.encode(messages.KVAck(request_id="x", ok=True))],
        [b""],
    ]
    with zmq.Context() as ctx:
        raw = ctx.socket(zmq.DEALER)
        raw.connect(receiver.address)
        for frames in garbage:
            raw.send_multipart(frames)
        # A KVTransfer whose frames disagree with its transport: refused, and handed out as such.
        raw.send_multipart([codec.encode(with_header(good, request_id="frames"))])
        raw.send_multipart([codec.encode(with_header(good, request_id="extra")), b"1", b"2"])
        refused = {r.meta.request_id: r for r in receiver.poll(timeout=WAIT)}
        while "extra" not in refused:  # one connection keeps order: all garbage was read by now
            batch = receiver.poll(timeout=WAIT)
            assert batch, f"the refusals never arrived; stats {receiver.stats()}"
            refused |= {r.meta.request_id: r for r in batch}
        raw.close(linger=0)
    # The raw bytes above may also count: libzmq reads a non-ZMTP/2 peer as ZMTP/1.0 frames.
    assert receiver.stats()["dropped"] >= len(garbage)
    assert not refused["frames"].ok and not refused["extra"].ok
    assert "payload frame" in refused["extra"].reason
    assert not marker.exists()

    payload = make_payload(SMALL, 2)
    sender.send(receiver.address, make_meta(payload, SMALL, "valid"), payload)
    valid = receive_one(receiver)
    assert valid.meta.request_id == "valid" and valid.ok and torch.equal(valid.payload, payload)


# --- acks and leases ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_send_to_a_silent_address_ends_in_a_failed_ack_after_the_lease(kind):
    with make_sender(kind, lease_s=0.2) as sender:
        payload = make_payload(SMALL, 1)
        sender.send("tcp://127.0.0.1:9", make_meta(payload, SMALL), payload)
        (ack,) = sender.poll_acks(timeout=WAIT)
        assert not ack.ok and "within 0.2s" in ack.reason
        assert sender.stats()["lease_expired"] == 1 and sender.stats()["in_flight"] == 0


def test_ack_after_the_lease_expired_is_ignored_so_each_send_gets_one_ack(pair):
    kind, _, receiver = pair
    with make_sender(kind, lease_s=0.3) as sender:
        payload = make_payload(SMALL, 1)
        sender.send(receiver.address, make_meta(payload, SMALL), payload)
        assert receive_one(receiver).ok
        (expired,) = sender.poll_acks(timeout=WAIT)
        assert not expired.ok and "within 0.3s" in expired.reason
        receiver.ack("req-1", True)
        for _ in range(200):  # bounded: the late ack must be seen and counted, not delivered
            assert sender.poll_acks(timeout=0.05) == []
            if sender.stats().get("unexpected_acks") == 1:
                break
        assert sender.stats()["unexpected_acks"] == 1


def test_shm_transfer_carries_a_lease_the_receiver_can_check():
    with make_receiver("shm", ADDR) as receiver, make_sender("shm", lease_s=5.0) as sender:
        payload = make_payload(SMALL, 1)
        sender.send(receiver.address, make_meta(payload, SMALL), payload)
        got = receive_one(receiver)
        assert got.within_lease()
        assert not got.within_lease(now=got.meta.lease_deadline + 0.001)


def test_ack_for_an_unknown_request_is_counted_not_sent(pair):
    _, _, receiver = pair
    receiver.ack("never-seen", True)
    assert receiver.stats()["unknown_acks"] == 1
    assert "acks_sent" not in receiver.stats()


def test_ack_releases_the_payload_view(pair):
    _, sender, receiver = pair
    payload = make_payload(SMALL, 1)
    sender.send(receiver.address, make_meta(payload, SMALL), payload)
    got = receive_one(receiver)
    receiver.ack("req-1", True)
    assert got.payload is None
    sender.poll_acks(timeout=WAIT)


def test_receiver_cannot_bind_an_address_in_use():
    with make_receiver("tcp", ADDR) as first, pytest.raises(TransportError, match="cannot bind"):
        make_receiver("tcp", first.address)


def test_sender_refuses_an_address_without_a_zmq_scheme():
    with make_sender("tcp") as sender, pytest.raises(ValueError, match="tcp://"):
        sender.send(
            "127.0.0.1:5555", make_meta(make_payload(SMALL, 1), SMALL), make_payload(SMALL, 1)
        )


# --- shared memory hygiene ----------------------------------------------------------------


def test_shm_segments_are_reused_and_all_unlinked_at_close():
    before = shm_segments()
    with make_receiver("shm", ADDR) as receiver:
        sender = make_sender("shm")
        for i in range(3):
            payload = make_payload(SMALL, 2)
            sender.send(receiver.address, make_meta(payload, SMALL, f"r{i}"), payload)
            got = receive_one(receiver)
            assert got.ok and torch.equal(got.payload, payload)
            receiver.ack(f"r{i}", True)
            assert sender.poll_acks(timeout=WAIT)[0].ok
        assert len(shm_segments() - before) == 1  # one segment, reused
        payload = make_payload(SMALL, 2)
        sender.send(receiver.address, make_meta(payload, SMALL, "unacked"), payload)
        assert receive_one(receiver).ok
        sender.close()
    assert shm_segments() == before


def test_shm_pool_limit_fails_the_transfer_with_a_reason():
    with (
        make_receiver("shm", ADDR) as receiver,
        make_sender("shm", max_pool_bytes=1 << 20) as sender,
    ):
        payload = make_payload(BIG, 16)  # ~11.8 MB > 1 MiB
        sender.send(receiver.address, make_meta(payload, BIG), payload)
        (ack,) = sender.poll_acks(timeout=WAIT)
        assert not ack.ok and "shm pool full" in ack.reason


# --- CUDA IPC -----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_ipc_without_a_gpu_says_what_to_use_instead():
    with pytest.raises(TransportUnavailable, match="'shm'"):
        make_sender("cuda_ipc")
    with pytest.raises(TransportUnavailable, match="CUDA GPU"):
        make_receiver("cuda_ipc", ADDR)


@pytest.mark.gpu
@gpu
def test_cuda_ipc_payload_arrives_bit_identical_in_another_process():
    fp = msgspec.structs.replace(BIG, dtype="bfloat16")
    payload = make_payload(fp, 16, torch.bfloat16).cuda()
    child = textwrap.dedent(
        """
        import sys, torch
        from pdserve.kvtransfer.transport import make_receiver
        with make_receiver("cuda_ipc", "tcp://127.0.0.1:0") as rx:
            print(rx.address, flush=True)
            (got,) = rx.poll(timeout=30)
            assert got.ok, got.reason
            assert got.payload.is_cuda
            print(float(got.payload.float().sum()), flush=True)
            rx.ack(got.meta.request_id, True)
            sys.stdin.readline()  # stay up until the parent has its ack
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        address = proc.stdout.readline().strip()
        with make_sender("cuda_ipc") as sender:
            sender.send(address, make_meta(payload, fp), payload)
            total = float(proc.stdout.readline())
            (ack,) = sender.poll_acks(timeout=30)
        assert ack.ok and total == float(payload.float().sum())
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.mark.gpu
@gpu
def test_cuda_ipc_in_one_process_verifies_on_the_device():
    fp = msgspec.structs.replace(SMALL, dtype="bfloat16")
    payload = make_payload(fp, 3, torch.bfloat16).cuda()
    with (
        make_receiver("cuda_ipc", ADDR, fingerprint=fp) as receiver,
        make_sender("cuda_ipc") as sender,
    ):
        sender.send(receiver.address, make_meta(payload, fp), payload)
        got = receive_one(receiver)
        assert got.ok and got.meta.tensor.checksum.startswith("wsum64:")
        assert torch.equal(got.payload, payload)
        receiver.ack("req-1", True)
        assert sender.poll_acks(timeout=WAIT)[0].ok


def test_a_restarted_shm_sender_unlinks_the_segments_its_killed_predecessor_left(tmp_path):
    """kill -9 of a process group takes Python's resource tracker with it: nothing unlinks the
    dead sender's segments, so the next sender of the same owner does."""
    code = textwrap.dedent(
        """
        import os, torch
        from pdserve.kvtransfer.transport.shm import ShmPool
        pool = ShmPool(1 << 30, owner="prefill-7")
        seg = pool.acquire(3 << 20)
        print(seg.shm.name, flush=True)
        os.killpg(os.getpgid(0), 9)  # the resource tracker dies too
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         start_new_session=True)
    (name,) = out.stdout.split()
    assert name.startswith(f"{SEGMENT_PREFIX}prefill_7-") and os.path.exists(f"/dev/shm/{name}")
    other = ShmPool(1 << 30, owner="prefill-8")  # another worker's pool leaves it alone
    assert other.reaped == 0 and os.path.exists(f"/dev/shm/{name}")
    successor = ShmPool(1 << 30, owner="prefill-7")
    assert successor.reaped >= 1 and not os.path.exists(f"/dev/shm/{name}")
    mine = successor.acquire(1 << 20)
    assert ShmPool(1 << 30, owner="prefill-7").reaped == 0  # a live pool's segments stay
    assert os.path.exists(f"/dev/shm/{mine.shm.name}")
    successor.close()
    other.close()


# --- failures on the receiver, idle and capped sender sockets ------------------------------------


def test_an_unexpected_receive_error_is_nacked_at_once_and_its_sender_forgotten(pair):
    kind, sender, receiver = pair

    def broken_open(meta, frames):
        raise KeyError("injected bug in the receive path")

    receiver._open = broken_open
    payload = make_payload(SMALL, 2)
    sender.send(receiver.address, make_meta(payload, SMALL), payload)
    acks = sender.poll_acks(timeout=2.0)  # well before the 5 s lease
    assert [(a.request_id, a.ok) for a in acks] == [("req-1", False)]
    assert "receive failed" in acks[0].reason
    assert receiver.poll() == [] and receiver.stats()["receive_errors"] == 1
    assert receiver._loop.call(lambda: len(receiver._peers)) == 0


def test_an_idle_sender_socket_is_closed(monkeypatch):
    from pdserve.kvtransfer.transport import tcp

    monkeypatch.setattr(tcp, "IDLE_SOCKET_S", 0.2)
    with make_receiver("tcp", ADDR, fingerprint=SMALL) as receiver, make_sender("tcp") as sender:
        payload = make_payload(SMALL, 2)
        sender.send(receiver.address, make_meta(payload, SMALL), payload)
        receive_one(receiver)
        receiver.ack("req-1", True)
        assert [a.ok for a in sender.poll_acks(timeout=WAIT)] == [True]
        deadline = time.monotonic() + 3
        while sender.stats().get("sockets_idle_closed", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.stats()["sockets_idle_closed"] == 1
        assert sender._loop.call(lambda: len(sender._sockets)) == 0


def test_sender_sockets_are_capped_by_evicting_an_idle_one(monkeypatch):
    from pdserve.kvtransfer.transport import tcp

    monkeypatch.setattr(tcp, "MAX_PEER_SOCKETS", 1)
    with make_receiver("tcp", ADDR, fingerprint=SMALL) as a, make_receiver("tcp", ADDR, fingerprint=SMALL) as b, \
            make_sender("tcp") as sender:
        for receiver, rid in ((a, "to-a"), (b, "to-b")):
            payload = make_payload(SMALL, 2)
            sender.send(receiver.address, make_meta(payload, SMALL, rid), payload)
            receive_one(receiver)
            receiver.ack(rid, True)
            assert [x.ok for x in sender.poll_acks(timeout=WAIT)] == [True]
        assert sender.stats()["sockets_evicted"] == 1
        assert sender._loop.call(lambda: list(sender._sockets)) == [b.address]
