"""KV streamed while the prompt is prefilled (--kv-streaming layer): each landed prompt chunk's
blocks leave as a KVPart, the transfer at the end carries the rest. Checked in one process through
the real connectors and transports against the whole transfer and the colocated engine, and under
faults: a part corrupted on its way, a sender that vanishes half-way, a lease that runs out, an
abort mid-stream. Every fault must end in a NACK (a retry), never a partial decode, and leave no
block, part or shm segment held on either side."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.config.names import CHUNKED
from pdserve.engine.engine import Engine
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.llm import LLM
from pdserve.kvtransfer.connector import PrefillConnector
from pdserve.kvtransfer.payload import with_header
from pdserve.kvtransfer.transport import ReceivedKV
from pdserve.kvtransfer.transport import tcp as tcp_mod
from pdserve.kvtransfer.transport.shm import ShmKVSender
from pdserve.protocol.messages import KVPart
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.kv_pair import Pair

pytestmark = pytest.mark.timeout(120)

# Chunks of 16 tokens over blocks of 4: a 70-token prompt lands in 5 chunks, 4 of them streamed.
CFG = EngineConfig(dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1 + (11 * i + 3 * j) % 300 for j in range(45 + 13 * i)] for i in range(3)]


def make_pair(tiny, kind: str, streaming: bool = True, lease_s: float = 10.0) -> Pair:
    pair = Pair(tiny, CFG, kind)
    pair.out_conn.streaming = streaming
    pair.out_conn.lease_s = lease_s
    return pair


@pytest.fixture(scope="module")
def colocated(tiny):
    llm = LLM(dtype="float32", loaded=tiny, config=replace(CFG, max_num_batched_tokens=64))
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def loaded_kv(pair: Pair) -> dict[str, torch.Tensor]:
    """What each request's load wrote into the decode cache, read back right after the load."""
    seen: dict[str, torch.Tensor] = {}
    load = pair.in_conn.load

    def load_and_read(loads, runner):
        failures = load(loads, runner)
        for ld in loads:
            if ld.request_id not in failures:
                seen[ld.request_id] = runner.read_blocks(ld.block_ids).clone()
        return failures

    pair.in_conn.load = load_and_read  # type: ignore[method-assign]
    return seen


def assert_nothing_held(pair: Pair) -> None:
    """No block on either engine, no part, stream or staged region in either transport."""
    pair.turn()
    pair.prefill.reclaim()
    assert pair.prefill.cache_stats()["used_blocks"] == 0
    assert pair.decode.cache_stats()["used_blocks"] == 0
    assert not pair.out_conn.in_flight and not pair.out_conn.targets
    assert pair.receiver._assemblies == {} and pair.receiver._stream_bytes == 0  # type: ignore[attr-defined]
    for sender in pair.out_conn._senders.values():
        assert sender.stats()["in_flight"] == 0 and sender.stats()["streams"] == 0
        if isinstance(sender, ShmKVSender):
            assert not any(seg.busy for seg in sender._pool._segments)


def run_until(pair: Pair, done, limit: float = 30.0, admit=None) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, "stuck"
        pair.turn(admit)


# (streaming, blocks per message): streamed in parts of 3 blocks at most; sent at the end in parts
# of 3 (what --kv-streaming request does with more than PART_BYTES); sent whole.
WAYS = {"streamed": (True, 3), "at the end in parts": (False, 3), "whole": (False, 10**6)}


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_streamed_handoff_loads_the_same_bits_as_a_whole_one_and_decodes_like_one_engine(tiny, colocated, kind):
    caches = {}
    for way, (streaming, per_part) in WAYS.items():
        pair = make_pair(tiny, kind, streaming)
        pair.out_conn._blocks_per_part = per_part
        seen = loaded_kv(pair)
        try:
            for i, prompt in enumerate(PROMPTS):
                pair.submit(f"r{i}", prompt, GREEDY)
            pair.run()
            assert [pair.tokens[f"r{i}"] for i in range(len(PROMPTS))] == colocated, way
            assert not pair.nacks
            parts = pair.receiver.stats().get("parts_received", 0)
            # 45, 58 and 71 tokens: 12 to 18 blocks each, in chunks of 16 tokens shared by three prompts.
            assert (parts >= 3 * len(PROMPTS)) if per_part == 3 else parts == 0, (way, parts)
            # Streamed parts were copied into blocks set aside as they arrived, and the load at
            # admission skipped exactly those; at the end in parts they arrive with the transfer.
            early = pair.in_conn.early
            assert early["adopted"] == early["parts"] and (early["parts"] >= len(PROMPTS) if streaming else True), early
            assert not pair.in_conn.set_aside
            caches[way] = seen
            assert_nothing_held(pair)
        finally:
            pair.close()
    for way in WAYS:
        assert caches[way].keys() == {f"r{i}" for i in range(len(PROMPTS))}
        for rid, kv in caches[way].items():
            assert torch.equal(kv, caches["whole"][rid]), (way, rid)


def test_the_handoff_timing_rides_the_load_and_counts_every_part(tiny):
    pair = make_pair(tiny, "tcp")
    try:
        pair.submit("r0", PROMPTS[2], GREEDY)
        pair.run()
        [timing] = [t for rid, t in pair.in_conn.timings.items() if rid == "r0"]
        parts = pair.receiver.stats()["parts_received"]
        assert timing.parts == parts + 1 and parts >= 3
        fp = pair.out_conn.fingerprint
        blocks = -(-len(PROMPTS[2]) // fp.block_size)
        block_bytes = fp.num_layers * 2 * fp.block_size * fp.num_kv_heads * fp.head_dim * 4
        assert timing.nbytes == blocks * block_bytes
        assert min(timing.wait, timing.send, timing.verify, timing.load) >= 0.0
        assert timing.wait + timing.send + timing.verify + timing.load < 10.0
    finally:
        pair.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_part_corrupted_on_its_way_fails_the_handoff_and_frees_everything(tiny, kind, monkeypatch):
    cls = ShmKVSender if kind == "shm" else tcp_mod.ZmqKVSender
    stage = cls._stage

    def corrupt_part_one(self, meta, payload):
        meta, frames, hold = stage(self, meta, payload)  # the checksum is of the true bytes
        if isinstance(meta, KVPart) and meta.seq == 1:
            if frames:
                frames[0][7] ^= 0x40
            else:
                hold.shm.buf[7] ^= 0x40
        return meta, frames, hold

    monkeypatch.setattr(cls, "_stage", corrupt_part_one)
    pair = make_pair(tiny, kind)

    def admit_or_refuse(rkv: ReceivedKV) -> None:  # as the decode worker does
        if rkv.ok:
            pair.admit(rkv)
        else:
            pair.receiver.ack(rkv.meta.request_id, False, rkv.reason)

    try:
        pair.submit("r0", PROMPTS[1], GREEDY)
        run_until(pair, lambda: pair.nacks, admit=admit_or_refuse)
        assert pair.finish == {}  # the decode engine never saw it: only a NACK came back
        [nack] = pair.nacks
        assert nack.request_id == "r0" and "part 1" in nack.reason and "checksum" in nack.reason
        assert pair.decode.counters.decode_tokens == 0
        assert pair.receiver.stats()["parts_rejected"] == 1
        assert_nothing_held(pair)
    finally:
        pair.close()


def test_a_stream_whose_sender_vanished_is_dropped_and_a_retry_from_another_prefill_succeeds(tiny, colocated,
                                                                                             monkeypatch):
    monkeypatch.setattr(tcp_mod, "STREAM_IDLE_S", 0.5)
    pair = make_pair(tiny, "shm")
    try:
        pair.submit("r0", PROMPTS[2], GREEDY)
        run_until(pair, lambda: pair.receiver.stats().get("parts_received", 0) >= 2)
        # The prefill worker dies half-way: its engine and its sender (its segments with it) go.
        pair.out_conn.close()
        pair.prefill.close()
        fresh = PrefillConnector(pair.out_conn.fingerprint, "prefill-2", pair.out_conn.max_model_len, lease_s=10.0)
        pair.out_conn = fresh
        pair.prefill = Engine(replace(CFG, policy=CHUNKED), tiny, KVConnector(fresh, fresh))
        run_until(pair, lambda: pair.receiver.stats().get("streams_expired", 0) == 1)
        assert pair.receiver._assemblies == {} and pair.receiver._stream_bytes == 0  # type: ignore[attr-defined]
        # The router sends the request to another prefill worker: a stream of its own, from part 0.
        pair.submit("r0", PROMPTS[2], GREEDY)
        pair.run()
        assert pair.tokens["r0"] == colocated[2] and not pair.nacks
        assert_nothing_held(pair)
    finally:
        pair.close()


def test_a_streamed_transfer_whose_lease_ran_out_is_never_decoded(tiny):
    pair = make_pair(tiny, "shm")

    def admit_expired(rkv: ReceivedKV) -> None:
        assert rkv.parts, "the transfer should have come in parts"
        rkv.meta = with_header(rkv.meta, lease_deadline=time.time() - 1.0)
        pair.admit(rkv)

    try:
        pair.submit("late", PROMPTS[1], GREEDY)
        pair.run(admit_expired)
        assert pair.finish == {"late": "error"}
        assert pair.decode.counters.decode_tokens == 0
        assert_nothing_held(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_an_abort_mid_stream_frees_everything_on_both_sides(tiny, kind):
    pair = make_pair(tiny, kind, lease_s=0.3)
    try:
        pair.submit("r0", PROMPTS[2], GREEDY)
        run_until(pair, lambda: pair.receiver.stats().get("parts_received", 0) >= 2)
        pair.prefill.abort(["r0"])  # what the prefill worker's abort does
        pair.out_conn.forget("r0")
        run_until(pair, lambda: pair.receiver.stats().get("streams_cancelled", 0) == 1)
        time.sleep(0.4)  # the sender keeps cancelled parts one lease: the receiver may still read them
        assert_nothing_held(pair)
        assert pair.decode.counters.decode_tokens == 0
    finally:
        pair.close()


def test_parts_load_at_admission_when_the_cache_has_no_room_to_set_them_aside(tiny, colocated):
    """A decode cache of 24 blocks cannot set 12-18 aside (at most half of it): the parts wait
    for admission and load then, with the same tokens."""
    pair = Pair(tiny, CFG, "shm", decode_blocks=24)
    pair.out_conn._blocks_per_part = 3
    try:
        pair.submit("r2", PROMPTS[2], GREEDY)
        pair.run()
        assert pair.tokens["r2"] == colocated[2] and not pair.nacks
        assert pair.in_conn.early["no_room"] == 1 and pair.in_conn.early["parts"] == 0
        assert_nothing_held(pair)
    finally:
        pair.close()


def test_a_set_aside_goes_when_its_stream_ends_another_way(tiny):
    """Blocks set aside for stream 1 are freed by a transfer of another stream, by stream 1's
    end event, or by the sweep once that event is lost; never handed to the request."""
    from pdserve.kvtransfer.connector import SET_ASIDE_IDLE_S, DecodeConnector
    from pdserve.kvtransfer.transport import PartArrived, StreamEnded

    pair = Pair(tiny, CFG, "tcp")
    pool, runner = pair.decode.pool, pair.decode.runner
    part = runner.read_blocks([0, 1, 2]).clone()  # any bytes of the right shape
    try:
        conn = DecodeConnector()
        conn.on_part(PartArrived("r", 1, 0, 10, part), pool, runner)
        assert len(conn.set_aside["r"].block_ids) == 10 and pool.num_used == 10
        conn.on_part(PartArrived("r", 2, 0, 10, part), pool, runner)  # the request's KV comes again
        assert conn.set_aside["r"].stream == 2 and pool.num_used == 10
        conn.on_part(StreamEnded("r", 1), pool, runner)  # the old stream's end: not this one
        assert pool.num_used == 10
        conn.on_part(StreamEnded("r", 2), pool, runner)
        assert not conn.set_aside and pool.num_used == 0
        conn.on_part(PartArrived("r", 2, 3, 10, part), pool, runner)  # late: its stream has ended
        conn.on_part(PartArrived("s", 3, 3, 10, part), pool, runner)  # not from the first part
        assert not conn.set_aside and pool.num_used == 0
        conn.on_part(PartArrived("t", 4, 0, 10, part), pool, runner)
        assert conn.expire_set_asides(time.monotonic() + SET_ASIDE_IDLE_S - 5) == []
        assert conn.expire_set_asides(time.monotonic() + SET_ASIDE_IDLE_S + 5) == ["t"]
        assert not conn.set_aside and pool.num_used == 0
        conn.on_part(PartArrived("u", 5, 0, 10, part), pool, runner)
        conn.expect(ReceivedKV(SimpleNamespace(request_id="u"), None, True, stream=6))  # type: ignore[arg-type]
        assert not conn.set_aside and pool.num_used == 0  # the transfer ends another stream
        conn.on_part(PartArrived("u", 5, 3, 10, part), pool, runner)  # a part of the ended stream
        assert not conn.set_aside and pool.num_used == 0
        pool.check_integrity()
    finally:
        pair.close()


def test_a_receiver_not_asked_for_part_events_queues_none_and_parts_load_at_admission(tiny, colocated):
    """Each part event holds its part's view: a receiver whose engine does not poll them (a bench,
    another tool) must not queue any, or unpolled events would hold the parts' memory."""
    from pdserve.kvtransfer.transport import make_receiver

    pair = make_pair(tiny, "tcp")
    pair.receiver.close()
    pair.receiver = make_receiver("tcp", "tcp://127.0.0.1:0", fingerprint=pair.out_conn.fingerprint)
    try:
        pair.submit("r2", PROMPTS[2], GREEDY)
        pair.run()
        assert pair.tokens["r2"] == colocated[2] and not pair.nacks
        assert pair.receiver.stats()["parts_received"] >= 3
        assert pair.receiver.poll_parts() == [] and pair.in_conn.early["parts"] == 0
        assert_nothing_held(pair)
    finally:
        pair.close()
