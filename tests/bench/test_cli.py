"""`bench run | sweep | compare` end to end against mock servers, and the CLI's option rules."""

import json
import shlex
import sys

import httpx
import pytest

from pdserve.bench.cli import build_parser, main, plan_from_args
from pdserve.bench.mock_server import launch
from tests.helpers.paths import REPO

ROOT = REPO
MOCK = f"{shlex.quote(sys.executable)} -m pdserve.bench.mock_server --port {{port}}"
FAST = ["--num-requests", "6", "--input-len", "8", "--output-len", "4", "--range-ratio", "0",
        "--warmup", "1", "--no-progress"]


def test_run_writes_summary_requests_and_plots(tmp_path, capsys):
    with launch("--ttft-ms", "20", "--tbt-ms", "5") as url:
        code = main(["run", "--base-url", url, "--request-rate", "50", "--slo", "ttft=500ms,tbt_p99=100ms",
                     "--output-dir", str(tmp_path), "--endpoint", "completions", *FAST])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0 and summary["num_warmup"] == 1
    assert summary["model"] == "mock-model" and summary["endpoint"] == "/v1/completions"
    assert summary["slo_attainment"] == 1.0
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 7 and "chunk_times" in json.loads(lines[0])
    for png in ("ttft_cdf.png", "tbt_cdf.png", "tbt_timeline.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_sweep_reports_the_highest_rate_meeting_the_slo(tmp_path):
    # One request at a time, ~35 ms each: 5 req/s keeps up, 200 req/s queues far past the SLO.
    with launch("--ttft-ms", "20", "--tbt-ms", "5", "--max-concurrency", "1") as url:
        code = main(["sweep", "--base-url", url, "--rates", "5,200", "--slo", "ttft=100ms",
                     "--arrival", "constant", "--output-dir", str(tmp_path), "--no-plots", *FAST])
    assert code == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    attainment = {p["request_rate"]: p["slo_attainment"] for p in result["points"]}
    assert attainment[5.0] == 1.0 and attainment[200.0] < 0.9
    assert result["max_rate_meeting_slo"] == 5.0
    best = max(result["points"], key=lambda p: p["goodput"])
    assert (result["peak_goodput"], result["peak_goodput_rate"]) == (best["goodput"], best["request_rate"])
    assert (tmp_path / "rate_5" / "summary.json").exists()


def test_peak_goodput_can_lie_above_the_slo_capacity_and_both_reach_the_tables():
    """Past its SLO capacity a server can still deliver more requests per second within the SLO
    (goodput) while fewer than 90% of them meet it: the sweep reports both, and compare's table
    gains both columns once a deployment was swept."""
    from pdserve.bench import compare, sweep

    def point(rate, attainment, goodput):
        return {"request_rate": rate, "slo_attainment": attainment, "goodput": goodput, "request_throughput": rate,
                "p99_ttft_ms": 1.0, "p99_tbt_ms": 1.0, "failed": 0}

    points = [point(1.0, 1.0, 1.0), point(2.0, 0.95, 1.9), point(3.0, 0.8, 2.4), point(4.0, 0.5, 2.0)]
    assert sweep.max_rate_meeting([(p["request_rate"], p["slo_attainment"]) for p in points], 0.9) == 2.0
    assert sweep.peak_goodput(points) == (2.4, 3.0)
    assert sweep.peak_goodput([]) is None
    result = {"attainment_target": 0.9, "max_rate_meeting_slo": 2.0, "peak_goodput": 2.4, "peak_goodput_rate": 3.0,
              "points": points}
    assert "peak goodput: 2.40 req/s meeting the SLO, at 3 req/s offered" in sweep.sweep_table(result)
    summary = {"completed": 6, "failed": 0, "request_throughput": 1.0, "output_throughput": 1.0, "p50_ttft_ms": 1.0,
               "p99_ttft_ms": 1.0, "p50_tbt_ms": 1.0, "p99_tbt_ms": 1.0, "slo_attainment": 1.0, "goodput": 1.0,
               "startup_s": 1.0}
    plain = compare.compare_table({"a": summary})
    assert "peak goodput" not in plain
    swept = compare.compare_table({"a": summary | {"max_rate_meeting_slo": 2.0, "peak_goodput": 2.4,
                                                   "peak_goodput_rate": 3.0},
                                   "b": summary | {"max_rate_meeting_slo": None, "peak_goodput": 0.0,
                                                   "peak_goodput_rate": 1.0},
                                   "c": {"error": "exited with code 3"}})
    header, _, a, b, c = ([cell.strip() for cell in line.split("|")[1:-1]] for line in swept.splitlines())
    assert header[-3:] == ["SLO capacity req/s", "peak goodput", "at req/s"]
    assert a[-3:] == ["2.00", "2.40", "3.00"] and b[-3:] == ["none", "0.00", "1.00"]
    assert c[-1] == "error: exited with code 3" and len(c) == len(header)


def test_each_sweep_point_sends_fresh_prompts_so_no_prefix_cache_carries_over(tmp_path, monkeypatch):
    """Repeated prompts would hit the server's prefix cache: later points would skip prefill."""
    from pdserve.bench import sweep

    plan = plan_from_args(build_parser().parse_args(
        ["sweep", "--rates", "1,2,3", "--slo", "ttft=1s", "--workload", "random", "--num-requests", "5",
         "--input-len", "16", "--output-len", "2", "--seed", "7"]))
    prompts: dict[float, list] = {}

    def fake_point(point_plan, out_dir, rate=None, label=""):
        prompts[rate] = [spec.prompt for spec in sweep.specs_for(point_plan, rate)]
        return {"request_rate": rate, "slo_attainment": 1.0, "goodput": 1.0, "request_throughput": rate,
                "output_throughput": 1.0, "completed": 5, "failed": 0, "p50_ttft_ms": 1.0, "p99_ttft_ms": 1.0,
                "p50_tbt_ms": 1.0, "p99_tbt_ms": 1.0}

    monkeypatch.setattr(sweep, "run_point", fake_point)
    sweep.run_sweep(plan, [1.0, 2.0, 3.0], tmp_path, 0.9)
    own = {str(s.prompt) for s in sweep.specs_for(plan)}
    seen = [{str(p) for p in prompts[r]} for r in (1.0, 2.0, 3.0)]
    assert all(len(s) == 5 for s in seen)
    assert not (own & seen[0]) and not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (own & seen[2])


def test_compare_runs_each_deployment_and_writes_table_json_and_plots(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the deployments run `python -m pdserve.bench.mock_server`
    code = main(["compare", "--deployment", f"fast={MOCK} --ttft-ms 20 --tbt-ms 5",
                 "--deployment", f"slow={MOCK} --ttft-ms 120 --tbt-ms 15", "--ready-timeout", "20",
                 "--stop-timeout", "5", "--slo", "ttft=80ms", "--request-rate", "40",
                 "--output-dir", str(tmp_path), *FAST])
    assert code == 0
    results = json.loads((tmp_path / "compare.json").read_text())["deployments"]
    fast, slow = results["fast"], results["slow"]
    assert fast["completed"] == slow["completed"] == 6
    assert slow["p50_ttft_ms"] > fast["p50_ttft_ms"] + 60
    assert slow["p50_tbt_ms"] > fast["p50_tbt_ms"] + 5
    assert fast["slo_attainment"] == 1.0 and slow["slo_attainment"] == 0.0
    table = (tmp_path / "compare.md").read_text()
    assert "fast" in table and "slow" in table and "TTFT p99" in table
    for png in ("compare_throughput.png", "compare_ttft.png", "compare_tbt.png", "compare_goodput.png",
                "compare_ttft_cdf.png", "compare_tbt_cdf.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG", png
    for s in (fast, slow):  # each deployment was stopped after its run
        with pytest.raises(httpx.ConnectError):
            httpx.get(s["base_url"] + "/ready", timeout=2)


def test_compare_records_a_deployment_that_never_gets_ready_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = main(["compare", "--deployment", f"broken={shlex.quote(sys.executable)} -c 'raise SystemExit(3)' {{port}}",
                 "--deployment", f"fine={MOCK} --ttft-ms 10 --tbt-ms 2", "--ready-timeout", "20",
                 "--output-dir", str(tmp_path), "--no-plots", *FAST])
    assert code == 1
    results = json.loads((tmp_path / "compare.json").read_text())["deployments"]
    assert "exited with code 3" in results["broken"]["error"]
    assert results["fine"]["completed"] == 6


def test_compare_waits_on_health_for_a_server_without_ready_and_records_start_up(tmp_path, monkeypatch):
    """vLLM and llama-server have no /ready (404); their /health answers 503 until the model loads."""
    monkeypatch.chdir(ROOT)
    code = main(["compare", "--deployment", f"peer={MOCK} --no-ready-route --ready-delay-ms 1500 --ttft-ms 10 --tbt-ms 2",
                 "--deployment", f"ours={MOCK} --ready-delay-ms 300 --ttft-ms 10 --tbt-ms 2",
                 "--ready-timeout", "20", "--output-dir", str(tmp_path), "--no-plots", *FAST])
    assert code == 0
    results = json.loads((tmp_path / "compare.json").read_text())["deployments"]
    assert results["peer"]["completed"] == results["ours"]["completed"] == 6
    assert results["peer"]["failed"] == 0
    assert results["peer"]["startup_s"] >= 1.5 > results["ours"]["startup_s"] >= 0.3
    assert "start-up s" in (tmp_path / "compare.md").read_text()


def test_compare_waits_until_pdserve_says_its_kv_caches_are_warm(tmp_path, monkeypatch):
    """pdserve's /ready?warm=1 answers 503 while its workers' KV caches fault in: the run starts
    after that, and start-up counts it (vLLM zeroes its cache before it answers ready)."""
    monkeypatch.chdir(ROOT)
    code = main(["compare", "--deployment", f"ours={MOCK} --ready-delay-ms 200 --warm-delay-ms 1200 --ttft-ms 10 --tbt-ms 2",
                 "--ready-timeout", "20", "--output-dir", str(tmp_path), "--no-plots", *FAST])
    assert code == 0
    results = json.loads((tmp_path / "compare.json").read_text())["deployments"]
    assert results["ours"]["completed"] == 6 and results["ours"]["startup_s"] >= 1.2


def test_options_take_defaults_from_pdserve_env_vars(monkeypatch):
    monkeypatch.setenv("PDSERVE_REQUEST_RATE", "7")
    monkeypatch.setenv("PDSERVE_SLO", "ttft=250ms")
    monkeypatch.setenv("PDSERVE_NO_PLOTS", "true")
    plan = plan_from_args(build_parser().parse_args(["run", "--seed", "3"]))
    assert plan.workload.request_rate == 7.0 and plan.workload.seed == 3
    assert plan.slo.ttft_s == pytest.approx(0.25) and not plan.plots


def test_run_options_work_before_or_after_the_subcommand():
    parser = build_parser()
    before = plan_from_args(parser.parse_args(["--input-len", "33", "sweep", "--output-len", "5"]))
    after = plan_from_args(parser.parse_args(["sweep", "--input-len", "33", "--output-len", "5"]))
    bare = plan_from_args(parser.parse_args(["--input-len", "33", "--output-len", "5"]))
    assert before.workload == after.workload == bare.workload
    assert before.workload.input_len == 33


def test_concurrency_selects_a_closed_loop():
    plan = plan_from_args(build_parser().parse_args(["--concurrency", "4"]))
    assert plan.load.mode.value == "closed" and plan.load.concurrency == 4


@pytest.mark.parametrize("command", ["run", "sweep", "compare"])
def test_each_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--slo" in capsys.readouterr().out


def test_bad_option_values_give_an_error_not_a_traceback(capsys):
    assert main(["--workload", "nonsense", "--no-progress"]) == 2
    assert "--workload" in capsys.readouterr().err
