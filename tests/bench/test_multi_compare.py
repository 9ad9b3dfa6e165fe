"""bench/multi_compare.py against mock servers: each deployment starts once and serves every run
meant for it; each run's folder reads like one `pdserve bench compare` of that workload."""

import contextlib
import json
import shlex
import sys

import pytest

from pdserve.bench import compare
from pdserve.bench.multi_compare import main
from tests.helpers.paths import REPO

MOCK = f"{shlex.quote(sys.executable)} -m pdserve.bench.mock_server --port {{port}}"
FAST = "--input-len 8 --output-len 4 --range-ratio 0"
COMMON = ["--warmup", "1", "--no-progress", "--no-plots", "--ready-timeout", "20", "--stop-timeout", "5"]


@pytest.fixture
def starts(monkeypatch):
    """The deployments started, in order (the mock servers run as `python -m`, from the repo)."""
    monkeypatch.chdir(REPO)
    started = []
    real = compare.running

    @contextlib.contextmanager
    def counted(dep, *args, **kwargs):
        started.append(dep.name)
        with real(dep, *args, **kwargs) as s:
            yield s

    monkeypatch.setattr(compare, "running", counted)
    return started


def deployments(tmp_path, *runs: str) -> dict:
    return {r: json.loads((tmp_path / r / "compare.json").read_text())["deployments"] for r in runs}


def test_each_deployment_starts_once_for_every_run(tmp_path, starts):
    code = main(["--output-dir", str(tmp_path), "--deployment", f"fast={MOCK} --ttft-ms 10 --tbt-ms 2",
                 "--deployment", f"slow={MOCK} --ttft-ms 60 --tbt-ms 10",
                 "--run", f"burst=--num-requests 6 --request-rate inf {FAST}",
                 "--run", f"stream=--num-requests 3 --concurrency 1 --warmup 0 {FAST}", *COMMON])
    assert code == 0
    assert starts == ["fast", "slow"]
    results = deployments(tmp_path, "burst", "stream")
    assert {r: sorted(d) for r, d in results.items()} == {"burst": ["fast", "slow"], "stream": ["fast", "slow"]}
    assert results["burst"]["fast"]["completed"] == 6 and results["stream"]["fast"]["completed"] == 3
    assert results["stream"]["fast"]["max_concurrency"] == 1 and results["stream"]["fast"]["num_warmup"] == 0
    assert results["stream"]["slow"]["p50_tpot_ms"] > results["stream"]["fast"]["p50_tpot_ms"] + 5
    assert results["burst"]["slow"]["startup_s"] == results["stream"]["slow"]["startup_s"]  # the same start
    assert (tmp_path / "stream" / "fast" / "requests.jsonl").is_file()
    assert (tmp_path / "servers" / "slow" / "server.log").is_file()


def test_a_runs_own_options_win_and_its_plan_is_recorded(tmp_path, starts):
    main(["--output-dir", str(tmp_path), "--deployment", f"mock={MOCK} --ttft-ms 5 --tbt-ms 1",
          "--run", f"stream=--num-requests 2 --concurrency 1 --warmup 0 {FAST}", "--num-requests", "9", *COMMON])
    plan = json.loads((tmp_path / "stream" / "plan.json").read_text())
    assert plan["workload"]["num_requests"] == 2 and plan["workload"]["input_len"] == 8
    assert plan["load"] == {"mode": "closed", "concurrency": 1, "num_warmup": 0}


def test_only_keeps_a_run_to_its_deployments_and_a_swept_run_is_the_sweep(tmp_path, starts):
    code = main(["--output-dir", str(tmp_path), "--deployment", f"a={MOCK} --ttft-ms 10 --tbt-ms 2",
                 "--deployment", f"b={MOCK} --ttft-ms 10 --tbt-ms 2",
                 "--run", f"point=--num-requests 3 {FAST}",
                 "--run", f"swept=--num-requests 3 --slo ttft=500ms --rates 20,40 {FAST}", "--only", "swept=b",
                 *COMMON])
    assert code == 0 and starts == ["a", "b"]
    results = deployments(tmp_path, "point", "swept")
    assert sorted(results["point"]) == ["a", "b"] and list(results["swept"]) == ["b"]
    swept = results["swept"]["b"]
    assert swept["max_rate_meeting_slo"] == 40 and swept["rates"] == [20, 40] and "completed" not in swept
    sweep = json.loads((tmp_path / "swept" / "b" / "sweep" / "sweep.json").read_text())
    assert [p["request_rate"] for p in sweep["points"]] == [20, 40]
    assert not (tmp_path / "swept" / "b" / "summary.json").exists()  # no point run besides the sweep


def test_a_deployment_that_never_gets_ready_fills_its_runs_with_the_error(tmp_path, starts):
    broken = f"broken={shlex.quote(sys.executable)} -c 'raise SystemExit(3)' {{port}}"
    code = main(["--output-dir", str(tmp_path), "--deployment", broken,
                 "--deployment", f"fine={MOCK} --ttft-ms 5 --tbt-ms 1",
                 "--run", f"one=--num-requests 2 {FAST}", "--run", f"two=--num-requests 2 {FAST}", *COMMON])
    assert code == 1
    for run in deployments(tmp_path, "one", "two").values():
        assert "exited with code 3" in run["broken"]["error"] and run["fine"]["completed"] == 2


def test_only_naming_an_unknown_deployment_is_an_error_before_anything_starts(tmp_path, starts, capsys):
    code = main(["--output-dir", str(tmp_path), "--deployment", f"a={MOCK}", "--run", f"one={FAST}",
                 "--only", "one=vllm-bf16", *COMMON])
    assert code == 2 and starts == []
    assert "no deployment named vllm-bf16" in capsys.readouterr().err
