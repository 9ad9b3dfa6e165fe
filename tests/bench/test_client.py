"""The client and load generator against the scripted mock server (a subprocess on 127.0.0.1)."""

import statistics

import pytest

from pdserve.bench.client import Api, Endpoint
from pdserve.bench.loadgen import LoadConfig, LoadMode, run_load_sync
from pdserve.bench.metrics import SLO, RunInfo, summarize, tbt_gaps, tpot_s
from pdserve.bench.mock_server import launch
from pdserve.bench.sweep import Plan, resolve_model
from pdserve.bench.workloads import RequestSpec, WorkloadConfig

TOL_S = 0.015  # generous for a loaded 2-core CI machine, still far below the scripted delays
TTFT_MS, TBT_MS, N_OUT = 100, 20, 8


def specs(n, max_tokens=N_OUT, prompt="hello there", gap_s=0.0, tag="default"):
    return [RequestSpec(request_id=f"r{i}", prompt=f"{prompt} {i}", prompt_tokens=3, max_tokens=max_tokens,
                        arrival_s=i * gap_s, tag=tag) for i in range(n)]


def closed(n_warmup=1):
    return LoadConfig(mode=LoadMode.CLOSED, concurrency=1, num_warmup=n_warmup, progress=False,
                      request_timeout_s=20)


@pytest.fixture(scope="module")
def scripted():
    with launch("--ttft-ms", str(TTFT_MS), "--tbt-ms", str(TBT_MS)) as url:
        yield url


@pytest.fixture(scope="module")
def chunked():
    with launch("--ttft-ms", "50", "--tbt-ms", str(TBT_MS), "--tokens-per-chunk", "3") as url:
        yield url


@pytest.fixture(scope="module")
def stalling():
    # One request at a time, ~180 ms each: requests sent every 50 ms must queue.
    with launch("--ttft-ms", "150", "--tbt-ms", "10", "--max-concurrency", "1") as url:
        yield url


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
def test_measured_latencies_equal_the_scripted_ones(scripted, api):
    result = run_load_sync(specs(6), Endpoint(scripted, "mock-model", api), closed())
    measured = result.measured
    assert len(measured) == 5 and all(r.success and r.output_tokens == N_OUT for r in measured)
    # Medians over the requests: one request descheduled on a busy machine is not the client's error.
    median = lambda xs: statistics.median(xs)  # noqa: E731
    assert median([r.ttft_s for r in measured]) == pytest.approx(TTFT_MS / 1e3, abs=TOL_S)
    assert median([tpot_s(r) for r in measured]) == pytest.approx(TBT_MS / 1e3, abs=TOL_S)
    assert median([r.e2e_s for r in measured]) == pytest.approx((TTFT_MS + (N_OUT - 1) * TBT_MS) / 1e3, abs=TOL_S)
    gaps = [g for r in measured for g in tbt_gaps(r.chunk_times, r.chunk_tokens)]
    assert len(gaps) == 5 * (N_OUT - 1)
    assert median(gaps) == pytest.approx(TBT_MS / 1e3, abs=TOL_S)


def test_role_only_chat_chunk_is_not_counted_as_the_first_token(scripted):
    r = run_load_sync(specs(2), Endpoint(scripted, "mock-model", Api.CHAT), closed()).measured[0]
    assert sum(r.chunk_tokens) == N_OUT  # the mock sends a role-only delta first
    assert r.ttft_s >= TTFT_MS / 1e3 - TOL_S


def test_multi_token_chunks_are_split_into_per_token_gaps(chunked):
    r = run_load_sync(specs(2, max_tokens=10), Endpoint(chunked, "mock-model"), closed()).measured[0]
    assert r.chunk_tokens == [1, 3, 3, 3]
    gaps = tbt_gaps(r.chunk_times, r.chunk_tokens)
    assert len(gaps) == 9
    assert statistics.mean(gaps) == pytest.approx(TBT_MS / 1e3, abs=TOL_S / 3)
    assert tpot_s(r) == pytest.approx(TBT_MS / 1e3, abs=TOL_S / 3)


def test_without_per_chunk_usage_each_chunk_counts_one_token():
    with launch("--ttft-ms", "30", "--tbt-ms", "10", "--tokens-per-chunk", "3", "--no-chunk-usage") as url:
        r = run_load_sync(specs(2, max_tokens=7), Endpoint(url, "mock-model"), closed()).measured[0]
    assert r.chunk_tokens == [1, 1, 1]
    assert r.output_tokens == 7  # still known from the final usage


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
def test_http_500_and_cut_streams_are_failures_and_slo_misses(scripted, api):
    batch = (specs(1, prompt="warm") + specs(1, prompt="fine") + specs(1, prompt="MOCK_HTTP_500")
             + specs(1, prompt="MOCK_CUT_STREAM"))
    batch = [RequestSpec(request_id=f"q{i}", prompt=s.prompt, prompt_tokens=3, max_tokens=N_OUT) for i, s in enumerate(batch)]
    result = run_load_sync(batch, Endpoint(scripted, "mock-model", api), closed())
    by_id = {r.request_id: r for r in result.measured}
    assert by_id["q1"].success
    assert not by_id["q2"].success and "500" in by_id["q2"].error
    assert not by_id["q3"].success and by_id["q3"].chunk_times  # cut after some tokens
    s = summarize(result.records, RunInfo(duration_s=result.duration_s), SLO.parse("e2e=10s"))
    assert (s["completed"], s["failed"]) == (1, 2)
    assert s["slo_attainment"] == pytest.approx(1 / 3)


def test_client_side_queueing_is_measured_from_the_intended_send_time(stalling):
    # Open loop, one request every 50 ms, at most one in flight: each request goes out late.
    load = LoadConfig(mode=LoadMode.OPEN, concurrency=1, num_warmup=1, progress=False, request_timeout_s=20)
    result = run_load_sync(specs(5, max_tokens=4, gap_s=0.05), Endpoint(stalling, "mock-model"), load)
    lags = [r.send_lag_s for r in result.measured]
    assert lags == sorted(lags) and lags[-1] > 0.3  # the backlog grows: ~130 ms more per request
    for r in result.measured:
        from_intended = r.chunk_times[0] - r.intended_s
        assert from_intended == pytest.approx(r.ttft_s + r.send_lag_s, abs=1e-9)
    # TTFT from the actual send is ~150 ms each; from the schedule ~150, 280, 410, 540 ms.
    s = summarize(result.records, RunInfo(duration_s=result.duration_s), SLO.parse("ttft=220ms"))
    assert s["p99_ttft_intended_ms"] > s["p99_ttft_ms"] + 200
    assert s["mean_send_lag_ms"] > 100
    # From the actual send every request looks fine; from the schedule most miss the SLO.
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert SLO.parse("ttft=220ms", from_intended=False).met_by(result.measured[-1])


def test_server_side_queueing_is_reported_when_the_server_gives_it(stalling):
    load = LoadConfig(mode=LoadMode.OPEN, num_warmup=0, progress=False, request_timeout_s=20)
    result = run_load_sync(specs(3, max_tokens=4), Endpoint(stalling, "mock-model"), load)
    queues = sorted(r.server_queue_s for r in result.measured)
    assert queues[0] < 0.05 and queues[-1] > 0.3  # all arrive at once; the third waits for two
    s = summarize(result.records, RunInfo(duration_s=result.duration_s), SLO())
    assert s["max_server_queue_ms"] > 300


def test_model_defaults_to_the_first_listed_by_the_server(scripted):
    plan = Plan(workload=WorkloadConfig(), load=LoadConfig(progress=False), slo=SLO(), base_url=scripted)
    assert resolve_model(plan) == "mock-model"


def test_duration_limit_stops_a_closed_loop_that_cycles_the_workload(scripted):
    load = LoadConfig(mode=LoadMode.CLOSED, concurrency=2, num_warmup=0, duration_s=0.6, progress=False,
                      request_timeout_s=20)
    result = run_load_sync(specs(2, max_tokens=2), Endpoint(scripted, "mock-model"), load)
    ids = [r.request_id for r in result.measured]
    assert len(ids) > 2 and len(set(ids)) == len(ids)  # more requests than the workload holds
    assert result.duration_s < 0.6 + 0.5  # nothing new after the limit; in-flight ones finish


def test_open_loop_duration_limit_drops_requests_scheduled_after_it(scripted):
    load = LoadConfig(mode=LoadMode.OPEN, duration_s=0.25, progress=False, request_timeout_s=20)
    result = run_load_sync(specs(10, max_tokens=2, gap_s=0.1), Endpoint(scripted, "mock-model"), load)
    assert [r.request_id for r in result.measured] == ["r0", "r1", "r2"]


def test_api_key_is_sent_as_a_bearer_token():
    with launch("--ttft-ms", "5", "--tbt-ms", "1", "--api-key", "sekret") as url:
        good = run_load_sync(specs(1), Endpoint(url, "mock-model", api_key="sekret"), closed(0)).measured[0]
        bad = run_load_sync(specs(1), Endpoint(url, "mock-model"), closed(0)).measured[0]
    assert good.success
    assert not bad.success and "401" in bad.error


@pytest.fixture(scope="module")
def llama_style():
    with launch("--ttft-ms", "50", "--tbt-ms", str(TBT_MS), "--final-usage") as url:
        yield url


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
def test_total_usage_on_the_final_chunk_is_not_read_as_that_chunks_tokens(llama_style, api):
    """llama-server's way: usage only on the finishing chunk, and it is the request's total."""
    measured = run_load_sync(specs(3), Endpoint(llama_style, "mock-model", api), closed()).measured
    for r in measured:
        assert r.success and r.output_tokens == N_OUT
        assert r.chunk_tokens == [1] * N_OUT  # one token per content chunk, the last one too
        gaps = tbt_gaps(r.chunk_times, r.chunk_tokens)
        assert statistics.median(gaps) == pytest.approx(TBT_MS / 1e3, abs=TOL_S)
