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
