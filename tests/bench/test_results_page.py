"""The results page: a bench/results.sh run rewrites its machine kind's section of docs/results.md
and stores the small summary beside it; every other kind's section stays as it was."""

import json

import pytest

from pdserve.bench.report import write_json
from pdserve.bench.results_page import main, publish

PAGE = """# Results

Text above the sections.

<!-- results:amx:begin -->
## AMX
A table from an older run: 1.01x.
<!-- results:amx:end -->

<!-- results:avx2:begin -->
## AVX2
| deployment | req/s |
|---|---|
| mixed | 1.25 |
<!-- results:avx2:end -->

Text below the sections.
"""
PNG = b"\x89PNG\r\n\x1a\nfake"


def summary(req_s: float, goodput: float, attainment: float, **extra) -> dict:
    """The fields of a `pdserve bench compare` summary that the page reads."""
    return {"completed": 64, "failed": 0, "request_throughput": req_s, "output_throughput": 64 * req_s,
            "goodput": goodput, "slo_attainment": attainment, "p50_ttft_ms": 2021.7, "p99_ttft_ms": 2684.2,
            "p50_tbt_ms": 60.3, "p99_tbt_ms": 119.4, "startup_s": 10.69, "request_rate": "inf",
            "slo": {"ttft_ms": 5000.0, "tbt_p99_ms": 200.0}, **extra}


def sweep(label: str, attainments: list[float], goodputs: list[float]) -> dict:
    points = [{"request_rate": r, "slo_attainment": a, "goodput": g, "request_throughput": r,
               "p99_tbt_ms": 40.0 + 10 * i} for i, (r, a, g) in enumerate(zip([0.8, 1.6], attainments, goodputs, strict=True))]
    return {"label": label, "attainment_target": 0.9, "points": points}


def write_stage(run, stage: str, deployments: dict, sweeps: dict | None = None, commit: str = "6afc135") -> None:
    """One stage folder as bench/results.sh leaves it: compare's output plus run.json."""
    d = run / stage
    write_json(d / "compare.json", {"deployments": deployments})
    (d / "compare_throughput.png").write_bytes(PNG)
    (d / "attainment_vs_rate.png").write_bytes(PNG)
    for name, s in (sweeps or {}).items():
        write_json(d / name / "sweep" / "sweep.json", s)
    (d / "run.json").write_text(json.dumps({"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "commit": commit,
                                            "date": "2026-12-04", "command": f"STAGES={stage} bash bench/results.sh"}))


@pytest.fixture
def page(tmp_path):
    path = tmp_path / "docs" / "results.md"
    path.parent.mkdir()
    path.write_text(PAGE)
    return path


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "bench" / "results" / "amx"
    write_stage(run, "saturation", {"vllm-bf16": summary(6.0257, 0.0, 0.0), "mixed-bf16": summary(9.8060, 4.903, 0.5)})
    return run


def test_the_kinds_section_shows_the_runs_numbers_and_ratio(page, run):
    assert publish("amx", run, page) == ["saturation"]
    text = page.read_text()
    amx = text[text.index("<!-- results:amx:begin -->"):text.index("<!-- results:amx:end -->")]
    assert "1.01x" not in amx
    assert "| mixed-bf16 | 9.81 | 1.63x | 4.90 | 50% | 2,022 | 2,684 | 60 | 119 | 10.7 |" in amx
    assert "`STAGES=saturation bash bench/results.sh` at `6afc135`, 2026-12-04" in amx
    assert "TTFT ≤ 5 s, TBT p99 ≤ 200 ms" in amx
    assert "![saturation](results/amx/saturation/compare_throughput.png)" in amx


def test_other_kinds_sections_and_the_text_around_them_are_untouched(page, run):
    publish("amx", run, page)
    text = page.read_text()
    avx2 = PAGE[PAGE.index("<!-- results:avx2:begin -->"):]
    assert text.startswith("# Results\n\nText above the sections.\n\n<!-- results:amx:begin -->")
    assert text.endswith(avx2)


def test_only_the_picture_shown_is_stored_beside_the_page(page, run):
    publish("amx", run, page)
    stored = page.parent / "results" / "amx" / "saturation"
    assert sorted(p.name for p in (page.parent / "results").rglob("*") if p.is_file()) == ["compare_throughput.png"]
    assert (stored / "compare_throughput.png").read_bytes() == PNG


def test_a_run_of_one_stage_keeps_the_other_stages_tables(page, run, tmp_path):
    publish("amx", run, page)
    later = tmp_path / "later"
    write_stage(later, "interference",
                {"vllm-bf16": summary(0.93, 0.71, 0.76), "mixed-bf16": summary(0.96, 0.96, 1.0)},
                {"vllm-bf16": sweep("vllm-bf16", [0.68, 0.36], [0.68, 0.61]),
                 "mixed-bf16": sweep("mixed-bf16", [1.0, 1.0], [0.95, 1.55])}, commit="1fd9683")
    assert publish("amx", later, page) == ["interference"]
    text = page.read_text()
    assert "| mixed-bf16 | 9.81 | 1.63x |" in text  # the saturation block, kept from the page
    assert "| mixed-bf16 | 0.96 | 0.96 | 1.35x | 100% |" in text
    assert "| 100 / 100 % | 40-50 | ≥ 1.6 | 1.55 at 1.6 | 2.3x |" in text
    assert text.index("<!-- results:amx:saturation:end -->") < text.index("<!-- results:amx:interference:begin -->")


def test_a_stage_run_again_replaces_its_own_block_only(page, run, tmp_path):
    publish("amx", run, page)
    again = tmp_path / "again"
    write_stage(again, "saturation", {"vllm-bf16": summary(6.0, 0.0, 0.0), "mixed-bf16": summary(12.0, 6.0, 0.5)},
                commit="abc1234")
    publish("amx", again, page)
    text = page.read_text()
    assert "| mixed-bf16 | 12.00 | 2.00x |" in text and "| mixed-bf16 | 9.81 |" not in text
    assert text.count("<!-- results:amx:saturation:begin -->") == 1


def test_a_kind_without_markers_is_appended(page, tmp_path):
    run = tmp_path / "run"
    write_stage(run, "saturation", {"vllm": summary(2.0, 0.0, 0.0), "mixed": summary(2.38, 0.0, 0.0)})
    main(["--kind", "avx512", "--run-dir", str(run), "--page", str(page)])
    text = page.read_text()
    assert text.startswith(PAGE.rstrip("\n"))
    assert text.rstrip().endswith("<!-- results:avx512:end -->")
    assert "| mixed | 2.38 | 1.19x |" in text


def test_a_stage_without_run_json_is_refused(page, run):
    (run / "saturation" / "run.json").unlink()
    with pytest.raises(ValueError, match="run.json"):
        publish("amx", run, page)
    assert page.read_text() == PAGE


# The shapes stage: one folder per shape, each with the multi_compare runs and the rooflines.
def plan(num_requests: int, warmup: int, mode: str = "open", concurrency: int | None = None, **workload) -> dict:
    return {"workload": {"kind": "random", "num_requests": num_requests + warmup, "input_len": 256, "output_len": 64,
                         "request_rate": "inf", **workload},
            "load": {"mode": mode, "concurrency": concurrency, "num_warmup": warmup},
            "slo": {"ttft_ms": 3000.0, "tbt_p99_ms": 200.0}, "rates": None, "attainment_target": 0.9}


def served(req_s: float, tpot_ms: float, ttft_ms: float = 900.0) -> dict:
    return {"completed": 32, "failed": 0, "request_throughput": req_s, "output_throughput": 64 * req_s,
            "p50_ttft_ms": ttft_ms, "p50_tpot_ms": tpot_ms, "startup_s": 21.04}


def roofline(dtype: str, bytes_per_weight: int) -> dict:
    def case(name: str, kind: str, tokens: int, engine_s: float) -> dict:
        weights = 1.0e9 * bytes_per_weight
        return {"case": name, "kind": kind, "tokens": tokens, "context": 256 if kind == "decode" else 0,
                "engine_s": engine_s, "matmuls_s": engine_s / 2, "flops": 2e9 * tokens, "bytes": weights,
                "gemm_flops_s": 4e11, "read_bytes_s": 2e10, "one_thread_read_bytes_s": 1.5e10,
                "roofline_s": max(weights / 2e10, 2e9 * tokens / 4e11)}

    return {"dtype": dtype, "threads": 2, "cases": [case("decode batch 1", "decode", 1, 0.2),
                                                    case("decode batch 32", "decode", 32, 0.4),
                                                    case("prefill 256 tokens", "prefill", 256, 2.0)]}


def write_shape_run(run, swept: bool = True) -> None:
    stage = run / "shapes"
    shape = stage / "llama-3.2-1b"
    write_json(shape / "shape.json", {"name": "llama-3.2-1b", "num_parameters": 1_235_814_400,
                                      "description": "LlamaForCausalLM, 1.24 B parameters: 16 layers"})
    write_json(shape / "roofline-float32.json", roofline("float32", 4))
    write_json(shape / "roofline-bfloat16.json", roofline("bfloat16", 2))
    write_json(shape / "burst" / "plan.json", plan(32, 2))
    write_json(shape / "burst" / "compare.json", {"deployments": {
        "vllm-bf16": served(0.50, 180.0), "mixed-bf16": served(0.75, 150.0),
        "disaggregated-bf16": {"error": "exited with code 1 before ready; log tail:\nMemoryError"}}})
    write_json(shape / "stream" / "plan.json", plan(8, 1, mode="closed", concurrency=1))
    write_json(shape / "stream" / "compare.json", {"deployments": {
        "vllm-bf16": served(0.1, 120.0, 1500.0), "mixed-bf16": served(0.1, 100.0, 1200.0)}})
    if swept:
        write_json(shape / "interference" / "plan.json",
                   plan(24, 2, kind="interference", input_len=96, long_input_len=768, long_output_len=8,
                        long_interval_s=30.0) | {"rates": [0.8, 1.6]})
        write_json(shape / "interference" / "compare.json", {"deployments": {
            "vllm-bf16": {"startup_s": 95.0, "max_rate_meeting_slo": None},
            "disaggregated-bf16": {"startup_s": 30.0, "max_rate_meeting_slo": 1.6}}})
        for name, s in {"vllm-bf16": sweep("vllm-bf16", [0.5, 0.2], [0.4, 0.3]),
                        "disaggregated-bf16": sweep("disaggregated-bf16", [1.0, 0.95], [0.8, 1.5])}.items():
            write_json(shape / "interference" / name / "sweep" / "sweep.json", s)
    # A smaller shape, without a vLLM row: it comes first, and its rows have no ratio.
    small = stage / "qwen2.5-0.5b"
    write_json(small / "shape.json", {"name": "qwen2.5-0.5b", "num_parameters": 494_032_768,
                                      "description": "Qwen2ForCausalLM, 0.49 B parameters"})
    write_json(small / "burst" / "compare.json", {"deployments": {"chunked": served(1.2, 90.0)}})
    (stage / "run.json").write_text(json.dumps({"cpu": "AMD EPYC", "cores": 2, "commit": "abc1234",
                                                "date": "2026-12-08", "command": "STAGES=shapes bash bench/results.sh"}))


def shapes_block(page) -> str:
    text = page.read_text()
    return text[text.index("<!-- results:amx:shapes:begin -->"):text.index("<!-- results:amx:shapes:end -->")]


def test_the_shapes_stage_shows_each_shapes_deployments_beside_the_decode_roofline(page, tmp_path):
    write_shape_run(tmp_path)
    assert publish("amx", tmp_path, page) == ["shapes"]
    block = shapes_block(page)
    assert "`STAGES=shapes bash bench/results.sh` at `abc1234`, 2026-12-08, on AMD EPYC (2 cores)." in block
    # W1 req/s, vs vLLM, out tok/s, TTFT, TPOT, roofline b32 (32 GFLOP... 2 GB / 20 GB/s = 100 ms), the
    # stream's TTFT and TPOT, roofline b1, vLLM's TPOT over this one, start-up.
    assert "| mixed-bf16 | 0.75 | 1.50x | 48 | 900 | 150 | 160 | 1,200 | 100 | 100 | 1.20x | 21.0 |" in block
    assert "| vllm-bf16 | 0.50 |  | 32 | 900 | 180 | 160 | 1,500 | 120 | 100 |  | 21.0 |" in block
    assert "| disaggregated-bf16 | error: exited with code 1 before ready; log tail: |" in block
    # The roofline table: bytes over bandwidth, or FLOPs over the GEMM rate where that is longer.
    assert "| float32 | decode batch 1 | 4.00 | 2.0 | 20.0 | 15.0 | 400 | 200 | memory | 200 | 1.00 |" in block
    assert "| bfloat16 | prefill 256 tokens | 2.00 | 512.0 | 20.0 | 15.0 | 400 | 1,280 | compute | 2,000 | 0.64 |" in block
    assert "**W1 burst**: 32 prompts of 256 tokens, 64 output tokens, all sent at once." in block
    assert "**One stream**: 8 prompts of 256 tokens, 64 output tokens, one at a time." in block


def test_the_swept_shape_shows_its_slo_capacity_against_vllm(page, tmp_path):
    write_shape_run(tmp_path)
    publish("amx", tmp_path, page)
    block = shapes_block(page)
    assert ("Interference, swept: 24 chats per rate of 96 prompt tokens and 64 output tokens, with a 768-token "
            "prompt (8 output tokens) every 30 s") in block
    assert "TTFT ≤ 3 s, TBT p99 ≤ 200 ms" in block
    assert "| disaggregated-bf16 | 100 / 95 % | 40-50 | ≥ 1.6 | 1.50 at 1.6 | 3.8x | 30.0 |" in block
    assert "| vllm-bf16 | 50 / 20 % | 40-50 | below 0.8 | 0.40 at 0.8 |  | 95.0 |" in block


def test_shapes_come_smallest_first_and_a_shape_without_a_peer_has_no_ratio(page, tmp_path):
    write_shape_run(tmp_path, swept=False)
    publish("amx", tmp_path, page)
    block = shapes_block(page)
    assert block.index("#### qwen2.5-0.5b") < block.index("#### llama-3.2-1b")
    assert "Interference, swept" not in block
    assert "| chunked | 1.20 | - | 77 | 900 | 90 | - | - | - | - | - | 21.0 |" in block


def test_the_shapes_block_goes_after_the_other_stages_and_keeps_them(page, run, tmp_path):
    publish("amx", run, page)
    write_shape_run(tmp_path / "later")
    assert publish("amx", tmp_path / "later", page, ["shapes"]) == ["shapes"]
    text = page.read_text()
    assert "| mixed-bf16 | 9.81 | 1.63x |" in text
    assert text.index("<!-- results:amx:saturation:end -->") < text.index("<!-- results:amx:shapes:begin -->")
    assert not (page.parent / "results" / "amx" / "shapes").exists()  # the block shows no picture
