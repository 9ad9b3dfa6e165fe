"""The KV connector seam in one process: a prefill engine and a decode engine joined by the
PrefillConnector, a real transport and the DecodeConnector, checked against the colocated engine."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdserve.config.engine import EngineConfig
from pdserve.config.names import DECODE_ONLY
from pdserve.engine.engine import Engine
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.llm import LLM
from pdserve.kvtransfer.connector import (
    DecodeConnector,
    HandoffTarget,
    first_token_only,
)
from pdserve.kvtransfer.payload import with_header
from pdserve.kvtransfer.transport import ReceivedKV
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.kv_pair import Pair

CFG = EngineConfig(dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1 + (7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(6)]
@pytest.fixture
def pair(tiny, request):
    p = Pair(tiny, CFG, getattr(request, "param", "tcp"))
    yield p
    p.close()


@pytest.fixture(scope="module")
def colocated(tiny):
    llm = LLM(dtype="float32", loaded=tiny, config=CFG)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("pair", ["tcp", "shm"], indirect=True)
def test_handoff_through_the_connectors_equals_the_colocated_engine(pair, colocated):
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, GREEDY)
    pair.run()
    assert [pair.tokens[f"r{i}"] for i in range(len(PROMPTS))] == colocated
    assert set(pair.finish.values()) == {"length"}
    assert not pair.nacks


def test_prefill_engine_holds_the_kv_and_reports_no_finish_for_a_request_that_goes_on(pair):
    pair.submit("r0", PROMPTS[3], GREEDY)
    pair.run()
    first = [o for o in pair.prefill_outputs if o.request_id == "r0"]
    assert len(first) == 1 and first[0].kv_held and first[0].finish_reason is None
    assert len(first[0].new_token_ids) == 1


def test_decode_engine_never_computes_a_prompt_token(pair):
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, GREEDY)
    pair.run()
    assert pair.decode.counters.prefill_tokens == 0
    assert pair.decode.counters.decode_tokens == sum(GREEDY.max_tokens - 1 for _ in PROMPTS)


def test_every_block_is_free_on_both_sides_once_the_handoffs_are_acked(pair):
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, GREEDY)
    pair.run()
    for engine in (pair.prefill, pair.decode):
        engine.pool.check_integrity()
        assert engine.cache_stats()["used_blocks"] == 0


def test_a_request_that_ends_at_its_first_token_is_not_handed_off(pair):
    pair.submit("one", PROMPTS[0], replace_sampling(max_tokens=1))
    pair.run()
    assert pair.finish == {"one": "length"} and len(pair.tokens["one"]) == 1
    assert not pair.out_conn.handoffs and not pair.in_conn.arrived
    assert pair.prefill.cache_stats()["used_blocks"] == 0


def test_aborting_a_held_request_frees_its_prefill_blocks_at_once(pair):
    pair.submit("r0", PROMPTS[4], GREEDY)
    pair.prefill.step()
    pair.prefill.save_kv()
    assert pair.prefill.cache_stats()["used_blocks"] > 0 and "r0" in pair.out_conn.in_flight
    pair.prefill.abort(["r0"])
    pair.out_conn.forget("r0")
    assert pair.prefill.cache_stats()["used_blocks"] == 0
    pair.prefill.abort(["r0"])  # idempotent


def test_a_payload_that_does_not_fit_fails_only_its_own_request(pair, colocated):
    def admit_with_one_bad(rkv: ReceivedKV) -> None:
        if rkv.meta.request_id == "bad":
            rkv.payload = rkv.payload[:, :, :1]  # one block short of its header
        pair.admit(rkv)

    pair.submit("bad", PROMPTS[5], GREEDY)
    pair.submit("good", PROMPTS[2], GREEDY)
    pair.run(admit_with_one_bad)
    assert pair.finish == {"bad": "error", "good": "length"}
    assert pair.tokens["good"] == colocated[2]
    bad = [o for o in pair.decode_outputs if o.request_id == "bad"]
    assert bad[-1].error and "KV" in bad[-1].error
    assert pair.decode.cache_stats()["used_blocks"] == 0


def test_kv_whose_lease_ran_out_is_never_decoded(pair):
    def admit_expired(rkv: ReceivedKV) -> None:
        rkv.meta = with_header(rkv.meta, lease_deadline=time.time() - 1.0)
        pair.admit(rkv)

    pair.submit("late", PROMPTS[1], GREEDY)
    pair.run(admit_expired)
    assert pair.finish == {"late": "error"}
    assert len(pair.tokens["late"]) == 1  # only the prefill worker's first token
    assert pair.decode.counters.decode_tokens == 0


def test_a_decode_engine_short_of_blocks_offloads_instead_of_recomputing_prompts(tiny, colocated):
    pair = Pair(tiny, CFG, decode_blocks=24)  # six requests need 5-8 blocks each: some must wait
    try:
        for i, prompt in enumerate(PROMPTS):
            pair.submit(f"r{i}", prompt, GREEDY)
        pair.run()
        assert pair.decode.counters.preemptions > 0 and pair.in_conn.num_offloads > 0
        assert pair.decode.counters.prefill_tokens == 0
        assert [pair.tokens[f"r{i}"] for i in range(len(PROMPTS))] == colocated
        assert pair.decode.cache_stats()["used_blocks"] == 0 and not pair.in_conn.offloaded
    finally:
        pair.close()


def replace_sampling(**changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(GREEDY, **changes)


def test_a_duplicate_transfer_is_refused_and_allocates_nothing(pair):
    seen = []

    def admit_twice(rkv: ReceivedKV) -> None:
        pair.admit(rkv)
        with pytest.raises(ValueError, match="already in use"):
            pair.decode.add_request(rkv.meta.request_id, list(rkv.meta.prompt_token_ids), rkv.meta.sampling,
                                    output_token_ids=list(rkv.meta.output_token_ids))
        seen.append(pair.decode.cache_stats()["used_blocks"])

    pair.submit("r0", PROMPTS[2], GREEDY)
    pair.run(admit_twice)
    assert seen == [0]  # nothing allocated before admission, so nothing could leak
    assert pair.finish == {"r0": "length"} and pair.decode.cache_stats()["used_blocks"] == 0


def test_a_decode_address_the_transport_cannot_use_fails_only_its_own_request(pair, colocated):
    pair.submit("good", PROMPTS[1], GREEDY)
    pair.prefill.add_request("lost", PROMPTS[4], first_token_only(GREEDY))
    pair.out_conn.expect("lost", HandoffTarget("not-a-zmq-address", "tcp", GREEDY))
    pair.tokens["lost"] = []
    pair.finish["lost"] = "error"  # what the prefill worker reports on the failed hand-off
    pair.run()
    assert [r.request_id for r in pair.nacks] == ["lost"] and "cannot send" in pair.nacks[0].reason
    assert pair.tokens["good"] == colocated[1]
    assert pair.prefill.cache_stats()["used_blocks"] == 0


def test_a_transfer_longer_than_the_decode_context_is_refused_before_any_block(tiny):
    from pdserve.engine.engine import RequestRejected

    decode = Engine(replace(CFG, policy=DECODE_ONLY, max_model_len=32), tiny, KVConnector(DecodeConnector(), DecodeConnector()))
    with pytest.raises(RequestRejected, match="context"):
        decode.add_request("long", list(range(1, 32)), GREEDY, output_token_ids=[5])
    assert decode.cache_stats()["used_blocks"] == 0 and not decode.has_unfinished()


def test_an_error_during_admission_rolls_its_blocks_back_and_fails_only_that_request(pair, colocated):
    real = pair.in_conn.on_allocated

    def flaky(req, block_ids, n, meta):
        if req.request_id == "bad":
            raise RuntimeError("connector bug")
        return real(req, block_ids, n, meta)

    pair.in_conn.on_allocated = flaky  # type: ignore[method-assign]
    pair.submit("bad", PROMPTS[3], GREEDY)
    pair.submit("good", PROMPTS[0], GREEDY)
    pair.run()
    assert pair.finish == {"bad": "error", "good": "length"}
    assert pair.tokens["good"] == colocated[0]
    pair.decode.pool.check_integrity()
    assert pair.decode.cache_stats()["used_blocks"] == 0


def test_seeded_sampling_across_the_handoff_equals_one_engine(tiny):
    """The prefill worker draws position 0, the decode worker the rest: the draws depend only on
    (seed, position), so the tokens are what the colocated engine draws."""
    seeded = [replace_sampling(temperature=1.0, top_p=0.9, seed=11 + i) for i in range(len(PROMPTS))]
    llm = LLM(dtype="float32", loaded=tiny, config=CFG)
    expected = [o.token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
    pair = Pair(tiny, CFG)
    try:
        for i, prompt in enumerate(PROMPTS):
            pair.submit(f"r{i}", prompt, seeded[i])
        pair.run()
        assert [pair.tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
    finally:
        pair.close()
