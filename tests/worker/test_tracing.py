"""A worker's request spans (worker/tracing.py): each phase a span under the remote parent, moved
on by what the engine did, and nothing left in the map once a request is over, however it ends."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.engine import RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.protocol.sampling import SamplingParams
from pdserve.telemetry import tracing
from pdserve.worker.tracing import KV_ADMIT, QUEUE, RequestSpans

pytestmark = pytest.mark.timeout(60)

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing.setup("pdserve-test", "w-0", trace_file=str(path))
    s = RequestSpans(tracing.tracer(), "w-0")

    def finished() -> list[dict]:
        tracing.shutdown()
        return [json.loads(line) for line in path.read_text().splitlines()]

    s.finished = finished  # type: ignore[attr-defined]
    yield s
    tracing.shutdown()


def request(rid: str, prompt: int = 4) -> Request:
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=8))


def scheduled(req: Request, tokens: int) -> None:
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, tokens


def test_a_prefill_runs_queue_prefill_kv_send_under_the_dispatch_span(spans):
    req = request("r-0")
    spans.started("r-0", PARENT, req, QUEUE)
    spans.stepped(1, [])  # not scheduled yet
    scheduled(req, 4)
    req.token_ids.append(7)
    req.status = RequestStatus.FINISHED_LENGTH
    spans.stepped(2, [RequestOutput("r-0", [7], None, position=0, kv_held=True)])
    kv = spans.kv_context("r-0")
    assert kv.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    spans.kv_acked("r-0", True, "")
    assert spans.live == {}

    got = {s["name"]: s for s in spans.finished()}
    assert list(got) == ["queue", "prefill", "kv_send"]
    assert {s["parent_span_id"] for s in got.values()} == {"00f067aa0ba902b7"}
    assert got["kv_send"]["span_id"] == kv.split("-")[2]
    assert got["queue"]["end_ns"] == got["prefill"]["start_ns"] == 2
    assert all(s["attributes"]["request_id"] == "r-0" and s["attributes"]["worker_id"] == "w-0"
               for s in got.values())
    assert got["kv_send"]["status"] == "UNSET"


def test_a_failed_kv_hand_off_ends_kv_send_with_its_reason(spans):
    req = request("r-1")
    spans.started("r-1", PARENT, req, QUEUE)
    scheduled(req, 4)
    spans.stepped(1, [RequestOutput("r-1", [7], None, kv_held=True)])
    spans.kv_acked("r-1", False, "checksum mismatch")
    (kv_send,) = [s for s in spans.finished() if s["name"] == "kv_send"]
    assert kv_send["status"] == "ERROR" and "checksum mismatch" in kv_send["status_message"]


def test_a_colocated_request_goes_queue_prefill_decode_and_ends_with_its_finish(spans):
    req = request("r-2")
    spans.started("r-2", PARENT, req, QUEUE)
    scheduled(req, 4)
    spans.stepped(1, [RequestOutput("r-2", [5], None)])
    spans.stepped(2, [RequestOutput("r-2", [6], None)])
    req.status = RequestStatus.FINISHED_STOPPED
    spans.stepped(3, [RequestOutput("r-2", [7], "stop")])
    assert spans.live == {}
    assert [s["name"] for s in spans.finished()] == ["queue", "prefill", "decode"]


def test_a_decode_worker_admits_the_kv_then_decodes_under_the_kv_send_span(spans):
    req = request("r-3")
    spans.started("r-3", PARENT, req, KV_ADMIT)
    scheduled(req, 4)
    spans.stepped(10, [RequestOutput("r-3", [5], None)])
    req.status = RequestStatus.FINISHED_LENGTH
    spans.stepped(11, [RequestOutput("r-3", [6], "length")])
    got = {s["name"]: s for s in spans.finished()}
    assert list(got) == ["kv_admit", "decode"]
    assert got["kv_admit"]["end_ns"] == got["decode"]["start_ns"] == 10
    assert got["decode"]["parent_span_id"] == "00f067aa0ba902b7" and got["decode"]["status"] == "UNSET"


def test_aborts_fences_and_engine_side_ends_leave_no_span_behind(spans):
    reqs = {rid: request(rid) for rid in ("a", "b", "c", "d")}
    for rid, req in reqs.items():
        spans.started(rid, PARENT, req, QUEUE)
    spans.aborted(["a"])
    reqs["b"].status = RequestStatus.FINISHED_ABORTED  # the engine dropped it (e.g. a failed step)
    spans.stepped(1, [])
    assert set(spans.live) == {"c", "d"}
    spans.clear("fenced: new router epoch")
    assert spans.live == {}
    got = spans.finished()
    assert len(got) == 4 and all(s["status"] == "ERROR" for s in got)
    assert {s["status_message"] for s in got} == {"aborted", "abort", "fenced: new router epoch"}


def test_the_span_map_is_bounded_and_evicts_the_oldest(spans):
    spans.limit = 2
    for rid in ("a", "b", "c"):
        spans.started(rid, PARENT, request(rid), QUEUE)
    assert list(spans.live) == ["b", "c"]
    (evicted,) = spans.finished()
    assert evicted["attributes"]["request_id"] == "a" and evicted["attributes"]["outcome"] == "evicted"


def test_a_malformed_trace_context_starts_a_trace_of_its_own(spans, caplog):
    spans.started("r-4", "00-not-a-traceparent", request("r-4"), QUEUE)
    spans.aborted(["r-4"])
    (span,) = spans.finished()
    assert span["parent_span_id"] is None
    assert "request r-4: malformed trace context" in caplog.text
