"""Tracing (docs/tracing.md): off by default at no cost; on, spans go to a JSON-lines file with
their parents, trace context crosses processes as a validated W3C traceparent, and a worker's
span map never outlives its requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdserve.config.engine import ConfigError
from pdserve.config.tracing import TracingOptions, child_trace_file, tracing_argv
from pdserve.telemetry import tracing
from tests.helpers.fake_worker import RouterHarness, toks

pytestmark = pytest.mark.timeout(60)

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def trace_file(tmp_path):
    """Tracing on in this process, to a file; off again (and flushed) after the test."""
    path = tmp_path / "spans.jsonl"
    tracing.setup("pdserve-test", "test-0", trace_file=str(path))
    yield path
    tracing.shutdown()


# --- off by default ---------------------------------------------------------------------------


def test_without_flags_no_sdk_is_loaded_and_no_span_object_exists():
    code = """
import sys
from pdserve.cli import build_parser
from pdserve.config.tracing import tracing_options
from pdserve.telemetry import tracing
from pdserve.router.tracing import NO_TRACE, request_trace
from pdserve.worker.tracing import NO_SPANS, worker_spans
from opentelemetry import trace
args = build_parser().parse_args(["router"])
opts = tracing_options(args)
assert not opts.enabled, opts
assert tracing.setup("pdserve-router", "r", otlp_endpoint=opts.traces_url, trace_file=opts.trace_file) is None
assert tracing.tracer() is None
assert request_trace("cmpl-1", "/v1/completions") is NO_TRACE
assert worker_spans("decode-0") is NO_SPANS
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
print(sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk") or m.startswith("opentelemetry.exporter")))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PDSERVE_OTLP_ENDPOINT", "PDSERVE_TRACE_FILE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- options ----------------------------------------------------------------------------------


def test_the_environment_turns_tracing_on_for_every_process_kind(monkeypatch, tmp_path):
    from pdserve.cli import build_parser
    from pdserve.config.tracing import tracing_options

    monkeypatch.setenv("PDSERVE_TRACE_FILE", str(tmp_path / "t.jsonl"))
    monkeypatch.setenv("PDSERVE_OTLP_ENDPOINT", "http://collector:4318")
    for argv in (["router"], ["prefill"], ["decode"], ["decode", "--mode", "colocated"], ["up"]):
        opts = tracing_options(build_parser().parse_args(argv))
        assert opts == TracingOptions("http://collector:4318", str(tmp_path / "t.jsonl")), argv


@pytest.mark.parametrize("endpoint, url", [
    ("http://localhost:4318", "http://localhost:4318/v1/traces"),
    ("http://localhost:4318/", "http://localhost:4318/v1/traces"),
    ("https://otel.example:443/custom/traces", "https://otel.example:443/custom/traces"),
])
def test_an_endpoint_without_a_path_gets_the_otlp_traces_path(endpoint, url):
    assert TracingOptions(otlp_endpoint=endpoint).traces_url == url


@pytest.mark.parametrize("endpoint", ["localhost:4318", "grpc://localhost:4317", "http://"])
def test_an_endpoint_that_is_not_an_http_url_is_refused_naming_the_flag(endpoint):
    with pytest.raises(ConfigError, match="--otlp-endpoint"):
        TracingOptions(otlp_endpoint=endpoint)


def test_pdserve_up_gives_each_child_its_own_trace_file():
    opts = TracingOptions(otlp_endpoint="http://c:4318", trace_file="/tmp/run/traces.jsonl")
    assert child_trace_file("/tmp/run/traces.jsonl", "prefill-0") == "/tmp/run/traces.prefill-0.jsonl"
    assert child_trace_file("traces", "router") == "traces.router"
    assert tracing_argv(opts, "decode-1") == ["--otlp-endpoint", "http://c:4318",
                                              "--trace-file", "/tmp/run/traces.decode-1.jsonl"]
    assert tracing_argv(TracingOptions(), "router") == []


# --- the file exporter and the context ------------------------------------------------------


def test_the_trace_file_has_one_line_per_finished_span_with_ids_parents_and_attributes(trace_file):
    t = tracing.tracer()
    root = t.start_span("request", attributes={"request_id": "cmpl-1"})
    child = t.start_span("dispatch", context=tracing.child_of(root),
                         attributes={"request_id": "cmpl-1-0", "worker_id": "prefill-0", "workers": ("a", "b")})
    child.add_event("first_token")
    tracing.error(child, "worker lost")
    child.end()
    root.end()
    t.start_span("never-ended")  # not finished: not written
    tracing.shutdown()

    spans = {s["name"]: s for s in read_spans(trace_file)}
    assert set(spans) == {"request", "dispatch"}
    r, d = spans["request"], spans["dispatch"]
    assert r["parent_span_id"] is None and d["parent_span_id"] == r["span_id"]
    assert d["trace_id"] == r["trace_id"] and len(r["trace_id"]) == 32 and len(d["span_id"]) == 16
    assert d["attributes"] == {"request_id": "cmpl-1-0", "worker_id": "prefill-0", "workers": ["a", "b"]}
    assert d["status"] == "ERROR" and d["status_message"] == "worker lost"
    assert [e["name"] for e in d["events"]] == ["first_token"]
    assert r["start_ns"] <= d["start_ns"] <= d["end_ns"] <= r["end_ns"]
    assert (r["service"], r["instance"]) == ("pdserve-test", "test-0")


def test_a_traceparent_names_the_span_it_came_from(trace_file):
    span = tracing.tracer().start_span("kv_send")
    ctx = tracing.parent_context(tracing.traceparent(span))
    child = tracing.tracer().start_span("kv_admit", context=ctx)
    assert child.parent.span_id == span.get_span_context().span_id
    assert child.get_span_context().trace_id == span.get_span_context().trace_id


@pytest.mark.parametrize("bad", [
    "", "garbage", VALID[:-1], VALID + "x", VALID.upper(), VALID.replace("-", "_"),
    "ff" + VALID[2:],                                     # version ff is forbidden
    "00-" + "0" * 32 + VALID[35:],                        # all-zero trace id
    VALID[:36] + "0" * 16 + "-01",                        # all-zero span id
    VALID + "-" + "x" * 600,                              # longer than the spec allows
])
def test_a_malformed_traceparent_is_no_parent_never_an_error(bad):
    assert tracing.parent_context(bad) is None


# --- the router's spans (in process, scripted workers) -----------------------------------------


def test_the_router_sends_each_dispatch_span_as_the_works_trace_context(trace_file):
    with RouterHarness() as h:
        p = h.worker("prefill-0", "prefill", script=toks("Hello world"))
        h.worker("decode-0", "decode", script=toks("Hello world"))
        r = httpx.post(h.base_url + "/v1/completions", timeout=10,
                       json={"model": "fake-model", "prompt": "hi", "max_tokens": 20})
        assert r.status_code == 200
        refused = httpx.post(h.base_url + "/v1/completions", timeout=10,
                             json={"model": "no-such-model", "prompt": "hi"})
        assert refused.status_code == 404
        (work,) = p.requests()
    tracing.shutdown()

    spans = read_spans(trace_file)
    roots = [s for s in spans if s["name"] == "request"]
    ok = next(s for s in roots if s["attributes"]["outcome"] == "finished")
    bad = next(s for s in roots if s["attributes"]["outcome"] == "error")
    assert bad["status"] == "ERROR" and bad["attributes"]["http.response.status_code"] == 404
    mine = {s["name"]: s for s in spans if s["trace_id"] == ok["trace_id"]}
    assert set(mine) == {"request", "tokenize", "route", "dispatch"}
    assert all(mine[n]["parent_span_id"] == ok["span_id"] for n in ("tokenize", "route", "dispatch"))
    d = mine["dispatch"]
    assert work.trace_context.startswith(f"00-{d['trace_id']}-{d['span_id']}-")
    assert d["attributes"]["request_id"] == work.request_id
    assert (d["attributes"]["worker_id"], d["attributes"]["decode_worker_id"]) == ("prefill-0", "decode-0")
    assert [e["name"] for e in d["events"]] == ["first_token"]
    assert d["attributes"]["outcome"] == "finished" and ok["attributes"]["completion_tokens"] > 0
    assert ok["attributes"]["request_id"] == r.json()["id"] and ok["attributes"]["prompt_tokens"] == 2


def test_otlp_endpoint_receives_the_spans_as_otlp_protobuf_over_http():
    """A stand-in OTLP/HTTP receiver (what Jaeger or a Collector listens with on :4318)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    posts: list[tuple[str, str, bytes]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            posts.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        opts = TracingOptions(otlp_endpoint=f"http://127.0.0.1:{server.server_port}")
        tracing.setup("pdserve-decode", "decode-0", otlp_endpoint=opts.traces_url)
        tracing.tracer().start_span("decode", attributes={"request_id": "cmpl-9-0"}).end()
        tracing.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        server.server_close()

    ((path, content_type, body),) = posts
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    (resource_spans,) = ExportTraceServiceRequest.FromString(body).resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "pdserve-decode" and service["service.instance.id"] == "decode-0"
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == "decode" and span.attributes[0].value.string_value == "cmpl-9-0"
