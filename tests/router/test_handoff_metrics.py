"""The router's hand-off metrics: the gap between a disaggregated request's first token (from its
prefill worker) and its second (its decode worker's first), and the phases the decode worker
measured, observed where worker events come in."""

from __future__ import annotations

import httpx
import pytest

from pdserve.protocol.messages import HandoffTiming, TokenEvent
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Route
from pdserve.router.requests import Choice, RequestState, RequestTracker
from tests.helpers.fake_worker import FakeDetokenizer, FakeTokenizer, RouterHarness

pytestmark = pytest.mark.timeout(60)

DISAGG = Route("disaggregated", "prefill-0", "decode-0", "tcp://127.0.0.1:1")
TIMING = HandoffTiming(wait=0.002, send=0.03, verify=0.001, load=0.004, nbytes=3 << 20, parts=4)


def tracked(route: Route = DISAGG) -> tuple[RequestTracker, RequestState, RouterMetrics]:
    metrics = RouterMetrics()
    choice = Choice(0, "r-0", route, FakeDetokenizer(FakeTokenizer()), ())
    state = RequestState("r", [choice], prompt_tokens=3, want_logprobs=False, timeout=10.0, metrics=metrics,
                         send_abort=lambda workers, ids: None, on_close=lambda s: None, arrival=0.0)
    tracker = RequestTracker()
    tracker.add(state)
    return tracker, state, metrics


def token(position: int, handoff: HandoffTiming | None = None, request_id: str = "r-0") -> TokenEvent:
    return TokenEvent(request_id=request_id, token_ids=(7,), position=position, handoff=handoff)


def value(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_the_gap_is_the_router_receipt_of_the_decode_token_less_that_of_the_prefill_token():
    tracker, _, m = tracked()
    tracker.deliver("prefill-0", token(0), received=10.0)
    tracker.deliver("decode-0", token(1, TIMING), received=10.25)
    tracker.deliver("decode-0", token(2), received=10.3)  # later tokens are no hand-off
    assert value(m, "pdserve_handoff_gap_seconds_count") == 1
    assert value(m, "pdserve_handoff_gap_seconds_sum") == pytest.approx(0.25)
    assert value(m, "pdserve_handoff_gap_seconds_bucket", le="0.2") == 0
    assert value(m, "pdserve_handoff_gap_seconds_bucket", le="0.5") == 1


def test_the_phases_bytes_and_parts_are_the_decode_workers_timing():
    tracker, _, m = tracked()
    tracker.deliver("prefill-0", token(0), received=1.0)
    tracker.deliver("decode-0", token(1, TIMING), received=1.05)
    for phase, seconds in (("wait", 0.002), ("send", 0.03), ("verify", 0.001), ("load", 0.004)):
        assert value(m, "pdserve_handoff_phase_seconds_count", phase=phase) == 1
        assert value(m, "pdserve_handoff_phase_seconds_sum", phase=phase) == pytest.approx(seconds)
    assert value(m, "pdserve_handoff_bytes_sum") == 3 << 20
    assert value(m, "pdserve_kv_stream_parts_sum") == 4
    assert value(m, "pdserve_kv_stream_parts_bucket", le="2.0") == 0
    assert value(m, "pdserve_kv_stream_parts_bucket", le="4.0") == 1


def test_a_colocated_request_has_no_hand_off():
    tracker, _, m = tracked(Route("colocated", "colo-0"))
    tracker.deliver("colo-0", token(0), received=1.0)
    tracker.deliver("colo-0", token(1), received=1.5)
    assert value(m, "pdserve_handoff_gap_seconds_count") == 0
    assert value(m, "pdserve_handoff_phase_seconds_count", phase="wait") == 0


def test_a_decode_token_that_overtook_the_prefill_token_gives_phases_but_no_gap():
    tracker, _, m = tracked()
    tracker.deliver("decode-0", token(1, TIMING), received=2.0)
    tracker.deliver("prefill-0", token(0), received=2.001)
    assert value(m, "pdserve_handoff_gap_seconds_count") == 0
    assert value(m, "pdserve_handoff_phase_seconds_count", phase="send") == 1


def test_a_redispatched_choice_times_its_new_hand_off_from_its_new_prefill_token():
    tracker, state, m = tracked()
    choice = state.choices[0]
    tracker.deliver("prefill-0", token(0), received=5.0)
    old_id, _ = choice.redispatch(Route("disaggregated", "prefill-1", "decode-1", "tcp://127.0.0.1:2"))
    tracker.rekey(old_id, choice.request_id)
    tracker.deliver("decode-1", token(1, TIMING, choice.request_id), received=9.0)  # overtook prefill-1's
    assert value(m, "pdserve_handoff_gap_seconds_count") == 0  # not 4 s from the old dispatch's token
    assert value(m, "pdserve_handoff_phase_seconds_count", phase="load") == 1


def test_a_disaggregated_request_through_the_router_observes_its_gap_on_metrics():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker("prefill-0", "prefill")
        h.worker("decode-0", "decode", delay=0.2)  # its first token 0.2 s after the KV arrives
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        page = c.get("/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in page.splitlines()
                   if line.startswith("pdserve_handoff_gap_seconds_"))
    assert float(samples["pdserve_handoff_gap_seconds_count"]) == 1
    assert 0.1 < float(samples["pdserve_handoff_gap_seconds_sum"]) < 5
