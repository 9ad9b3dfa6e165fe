"""The scheduler and its policies, with a fake model: budgets, leaks, liveness, each policy's shape."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config.names import COLOCATED_POLICIES, DECODE_ONLY
from pdserve.engine.request import RequestStatus
from tests.helpers.scheduler_harness import Sim

FINAL = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}

workload = st.lists(
    st.tuples(
        st.integers(0, 6),  # arrival step
        st.integers(1, 40),  # prompt length
        st.integers(1, 12),  # output length
        st.one_of(st.none(), st.integers(0, 30)),  # abort at step
        st.integers(0, 3),  # prompt family (shared prefixes)
    ),
    min_size=1,
    max_size=14,
)


@pytest.mark.parametrize("policy", COLOCATED_POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload, num_blocks=st.integers(12, 48), prefix_caching=st.booleans())
def test_random_workloads_respect_budgets_leak_nothing_and_finish(policy, reqs, num_blocks, prefix_caching):
    sim = Sim(policy, num_blocks=num_blocks, prefix_caching=prefix_caching)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    aborts = {}
    step = 0
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, plen, olen, abort_at, fam) = pending.pop(0)
            prompt = [100 + fam] * min(plen, 16) + [200 + i] * max(0, plen - 16)
            sim.add(f"r{i}", prompt, olen)
            if abort_at is not None:
                aborts.setdefault(step + abort_at, []).append(f"r{i}")
        for rid in aborts.pop(step, []):
            sim.abort(rid)
        if sim.sched.has_unfinished():
            sim.step()
        step += 1
        assert step < 5000, "no progress"
    assert sim.statuses() <= FINAL
    assert len(sim.finished) == len(reqs)
    assert sim.pool.num_used == 0
    assert sim.pool.num_free + sim.pool.num_cached == sim.pool.num_blocks


def test_static_batch_admits_no_late_arrival():
    sim = Sim("static")
    sim.add("a", [1] * 5, 8)
    sim.add("b", [2] * 5, 3)
    sim.step()  # the batch {a, b} starts
    sim.add("late", [3] * 5, 2)
    while "a" not in sim.finished:
        out = sim.step()
        assert "late" not in {r.request_id for r, _ in out.scheduled}, "a late arrival joined a running batch"
    assert "b" in sim.finished  # b finished (and was delivered) before the batch drained
    sim.run()
    assert sim.all["late"].status is RequestStatus.FINISHED_LENGTH


def test_static_finished_request_is_delivered_before_batch_ends():
    sim = Sim("static")
    sim.add("long", [1] * 5, 10)
    sim.add("short", [2] * 5, 2)
    while "short" not in sim.finished:
        sim.step()
    assert sim.all["long"].status is RequestStatus.RUNNING


def test_prefill_first_never_mixes_prefill_and_decode():
    sim = Sim("prefill-first")
    sim.add("a", [1] * 9, 6)
    sim.step()
    sim.step()
    sim.add("b", [2] * 9, 6)
    saw_prefill_after_decode = False
    while sim.sched.has_unfinished():
        out = sim.step()
        assert not (out.num_prefill_tokens and out.num_decode_tokens)
        saw_prefill_after_decode |= out.num_prefill_tokens > 0 and sim.all["a"].num_output_tokens > 1
    assert saw_prefill_after_decode, "a waiting prompt should pre-empt decoding"


def test_mixed_step_can_hold_prefill_and_decode():
    sim = Sim("mixed")
    sim.add("a", [1] * 9, 6)
    sim.step()
    sim.add("b", [2] * 9, 6)
    out = sim.step()
    assert out.num_prefill_tokens == 9 and out.num_decode_tokens == 1


def test_chunked_keeps_budget_and_never_skips_a_running_decode():
    sim = Sim("chunked", max_num_batched_tokens=8, max_model_len=200, num_blocks=128)
    sim.add("a", [1] * 3, 20)
    sim.step()
    sim.add("long", [2] * 50, 4)
    chunks = []
    while sim.sched.has_unfinished():
        out = sim.step()
        assert out.num_tokens <= 8
        scheduled = {r.request_id for r, _ in out.scheduled}
        for r in sim.last_decoding_before:
            assert r.request_id in scheduled or r.status is RequestStatus.PREEMPTED, "a running decode was skipped"
        if any(r.request_id == "long" and n > 1 for r, n in out.scheduled):
            chunks.append(out.num_prefill_tokens)
    assert len(chunks) >= 6 and max(chunks) <= 7  # 50 tokens in chunks beside a running decode


def test_waiting_served_ratio_holds_prompts_until_enough_wait():
    sim = Sim("prefill-first", ratio=2.0)
    sim.add("a", [1] * 4, 10)
    sim.add("b", [2] * 4, 10)
    sim.step()  # nothing running yet: both admitted
    sim.add("c", [3] * 4, 3)
    out = sim.step()
    assert out.num_prefill_tokens == 0  # 1 waiting < 2.0 * 2 running: keep decoding
    for i in range(3):
        sim.add(f"d{i}", [4] * 4, 3)
    out = sim.step()
    assert out.num_prefill_tokens > 0  # 4 waiting >= 2.0 * 2 running


def test_preemption_recomputes_and_never_deadlocks():
    # 6 blocks of 4 slots: two requests growing to 20 tokens cannot both stay resident.
    sim = Sim("chunked", num_blocks=6, max_model_len=64, prefix_caching=False)
    sim.add("a", [1] * 6, 14)
    sim.add("b", [2] * 6, 14)
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert all(sim.all[r].status is RequestStatus.FINISHED_LENGTH for r in ("a", "b"))
    assert all(sim.all[r].num_output_tokens == 14 for r in ("a", "b"))


def test_request_larger_than_cache_ends_with_length_not_a_hang():
    sim = Sim("chunked", num_blocks=3, prefix_caching=False)
    sim.add("big", [1] * 8, 30)
    sim.run()
    assert sim.all["big"].status is RequestStatus.FINISHED_LENGTH


def test_shared_prefix_computes_only_the_suffix():
    sim = Sim("chunked", block_size=4)
    prefix = list(range(10, 22))  # 3 full blocks
    sim.add("first", prefix + [1, 2], 2)
    sim.run()
    second = sim.add("second", prefix + [7, 8, 9], 2)
    out = sim.step()
    (scheduled,) = [n for r, n in out.scheduled if r is second]
    assert second.num_cached_tokens == 12
    assert scheduled == 3
    assert sim.pool.cache_hits == 3


def test_abort_is_idempotent_in_every_state():
    sim = Sim("chunked", max_num_batched_tokens=4)
    sim.add("w", [1] * 30, 4)  # mid-prefill after one step
    sim.add("q", [2] * 5, 4)  # still waiting
    sim.step()
    sim.abort("w")
    sim.abort("w")
    sim.abort("q")
    sim.abort("unknown")
    assert sim.all["w"].status is RequestStatus.FINISHED_ABORTED
    assert sim.all["q"].status is RequestStatus.FINISHED_ABORTED
    assert sim.pool.num_used == 0


def test_decode_only_finishes_whole_prompts_longer_than_its_step_budget():
    """A decode worker serving whole prompts (no prefill worker left) or recomputing pre-empted
    ones runs them in chunks: a chunk cut by the step budget goes on in the next step."""
    sim = Sim(DECODE_ONLY, max_num_batched_tokens=16)
    for i in range(4):
        sim.add(f"r{i}", [10 + i] * 23, 3)  # 23 prompt tokens each, budget 16 a step
    steps = 0
    while sim.sched.has_unfinished():
        sim.step()
        steps += 1
        assert steps < 100, f"no progress: {[(r.request_id, r.num_computed_tokens) for r in sim.sched.running]}"
    assert sorted(sim.finished) == [f"r{i}" for i in range(4)]
    assert sim.pool.num_used == 0
