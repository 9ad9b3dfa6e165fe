"""The results page: docs/results.md keeps one current section per machine kind, rendered from
`pdserve bench compare` runs.

    python -m pdserve.bench.results_page --kind amx --run-dir bench/results/amx [--stages saturation]

`bench/results.sh` runs each stage into `RUN_DIR/<stage>/` (raw data, ignored by git) with a
`run.json` beside it (CPU, commit, date, command), then calls this. Each stage of the run, or each
one named, is rendered into its own block of the kind's section (between
`<!-- results:<kind>:<stage>:begin -->` and `...:end -->`), and only the one picture the block
shows is copied into `docs/results/<kind>/<stage>/`: the table is the page's record of the run, the
raw data stays in git history or in the run folder. A run of one stage leaves the kind's other
blocks as they are; a kind without markers gets its section appended.

Ratios against a peer are of the rounded figures the table shows, so a reader can check them;
a row is compared with the peer of its dtype (rows named `*-bf16` run bfloat16).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pdserve.bench.sweep import max_rate_meeting, peak_goodput

KINDS = {
    "amx": "AMX: AVX-512, AVX512-BF16 and AMX-BF16",
    "avx512-bf16": "AVX-512 and AVX512-BF16, no AMX",
    "avx512": "AVX-512 without native bfloat16",
    "avx2": "AVX2, no AVX-512",
}


class Stage(NamedTuple):
    """A stage of bench/results.sh: its folder, its heading, the picture shown, the compared field."""

    name: str
    title: str
    picture: str
    compared: str  # "request_throughput" or "goodput": what the ratio to a peer is of


STAGES = (
    Stage("saturation", "W1 saturation: 64 prompts of 256 tokens, 64 output tokens, all sent at once",
          "compare_throughput.png", "request_throughput"),
    Stage("rate1", "W1's requests at 1 request/s", "compare_tbt_cdf.png", "goodput"),
    Stage("interference", "Interference: 96-token chats at 0.8 req/s, a 768-token prompt every 6 s; "
          "then the same mix swept over rates", "attainment_vs_rate.png", "goodput"),
    Stage("concurrency32", "32 concurrent streaming chats (closed loop)", "compare_tbt_cdf.png",
          "request_throughput"),
)
# A pdserve row is compared with the peer of its dtype: rows named *-bf16 run bfloat16.
PEERS = (("vLLM-CPU", "vllm", "vllm-bf16"), ("llama.cpp", "llama-f32", None))
PEER_NAMES = {n for _, f32, bf16 in PEERS for n in (f32, bf16) if n}
# No ratio over a peer's figure below this: at two decimals its rounding alone moves the ratio 5%+.
MIN_BASE = 0.1

Summary = dict[str, Any]


def _markers(kind: str, stage: str | None = None) -> tuple[str, str]:
    name = kind if stage is None else f"{kind}:{stage}"
    return f"<!-- results:{name}:begin -->", f"<!-- results:{name}:end -->"


def _between(text: str, begin: str, end: str) -> str | None:
    """What `text` holds from `begin` to `end`, both included; None where it has no such block."""
    start = text.find(begin)
    stop = text.find(end, start)
    return None if start < 0 or stop < 0 else text[start:stop + len(end)]


def _ms(v: float) -> str:
    return f"{v:.2f}" if v < 1 else f"{v:.1f}" if v < 10 else f"{v:,.0f}"


def _limit(key: str, ms: float) -> str:
    name = key.removesuffix("_ms").replace("_", " ").upper().replace(" P", " p").replace(" MAX", " max")
    return f"{name} ≤ {ms / 1e3:g} s" if ms >= 1000 else f"{name} ≤ {ms:g} ms"


def _rate(r: float) -> str:
    return f"{r:.1f}" if r == int(r) else f"{r:g}"


def _ratio(a: float | None, b: float | None, digits: int) -> str:
    if a is None or b is None or round(b, 2) < MIN_BASE:
        return "-"
    return f"{round(a, 2) / round(b, 2):.{digits}f}x"


def _peer(name: str, f32: str, bf16: str | None) -> str | None:
    return bf16 if name.endswith("-bf16") else f32


def _peak(sweep: dict | None) -> float | None:
    best = peak_goodput(sweep["points"]) if sweep else None
    return best[0] if best else None


def _sweep_cells(sweep: dict | None, rates: list[float]) -> list[str]:
    if sweep is None:
        return ["-"] * 4
    points = sweep["points"]
    met = " / ".join(f"{100 * p['slo_attainment']:.0f}" for p in points) + " %"
    tbt = [p["p99_tbt_ms"] for p in points]
    capacity = max_rate_meeting([(p["request_rate"], p["slo_attainment"]) for p in points],
                                sweep.get("attainment_target", 0.9))
    cap = (f"below {_rate(min(rates))}" if capacity is None
           else f"≥ {_rate(capacity)}" if capacity >= max(rates) else _rate(capacity))
    best = peak_goodput(points)
    return [met, f"{_ms(min(tbt))}-{_ms(max(tbt))}", cap, "-" if best is None else f"{best[0]:.2f} at {_rate(best[1])}"]


def _table(stage: Stage, results: dict[str, Summary], sweeps: dict[str, dict]) -> str:
    peers = [(label, f32, bf16) for label, f32, bf16 in PEERS if f32 in results or bf16 in results]
    compared = "req/s" if stage.compared == "request_throughput" else "goodput"
    head = ["deployment", "req/s", "goodput req/s", "SLO met", "TTFT p50 ms", "TTFT p99 ms", "TBT p50 ms",
            "TBT p99 ms", "start-up s"]
    at = head.index("req/s" if compared == "req/s" else "goodput req/s") + 1
    head[at:at] = [f"{compared} vs {label}" for label, _, _ in peers]
    rates = [p["request_rate"] for p in next(iter(sweeps.values()))["points"]] if sweeps else []
    if sweeps:
        head += [f"SLO met at {' / '.join(_rate(r) for r in rates)} req/s", "TBT p99 ms across the sweep",
                 "SLO capacity req/s", "peak goodput (at req/s)"]
        head += [f"peak vs {label}" for label, _, _ in peers]
    rows = []
    for name, s in results.items():
        if "error" in s:
            rows.append([name, f"error: {s['error'].splitlines()[0][:60]}"] + [""] * (len(head) - 2))
            continue
        row = [name, f"{s['request_throughput']:.2f}", f"{s['goodput']:.2f}", f"{100 * s['slo_attainment']:.0f}%",
               _ms(s["p50_ttft_ms"]), _ms(s["p99_ttft_ms"]), _ms(s["p50_tbt_ms"]), _ms(s["p99_tbt_ms"]),
               f"{s['startup_s']:.1f}" if "startup_s" in s else "-"]
        ratios, peak_ratios = [], []
        for _, f32, bf16 in peers:
            peer = _peer(name, f32, bf16) or ""
            base = results.get(peer, {})
            if name in PEER_NAMES or "error" in base:
                ratios.append("")
                peak_ratios.append("")
                continue
            ratios.append(_ratio(s.get(stage.compared), base.get(stage.compared), 2))
            peak_ratios.append(_ratio(_peak(sweeps.get(name)), _peak(sweeps.get(peer)), 1))
        row[at:at] = ratios
        if sweeps:
            row += _sweep_cells(sweeps.get(name), rates) + peak_ratios
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def render_stage(stage: Stage, src: Path, kind: str, link: str) -> str:
    """One stage's block, markers included, from its run folder (compare's output and run.json);
    `link` is the folder of its picture as the page sees it."""
    results = json.loads((src / "compare.json").read_text())["deployments"]
    sweeps = {n: json.loads(p.read_text()) for n in results if (p := src / n / "sweep" / "sweep.json").exists()}
    run = json.loads((src / "run.json").read_text())
    slo: dict[str, float] = next((s["slo"] for s in results.values() if s.get("slo")), {})
    begin, end = _markers(kind, stage.name)
    text = [begin, f"### {stage.title}", "",
            f"`{run['command']}` at `{run['commit']}`, {run['date']}, on {run['cpu']} ({run['cores']} cores)."
            + (" SLO per request: " + ", ".join(_limit(k, v) for k, v in slo.items()) + "." if slo else ""),
            "", _table(stage, results, sweeps)]
    if (src / stage.picture).exists():
        text += ["", f"![{stage.name}]({link}/{stage.picture})"]
    return "\n".join([*text, end])


def replace_section(page: str, kind: str, blocks: dict[str, str]) -> str:
    """`page` with the kind's section holding `blocks` (stage -> block) in place of those stages'
    blocks, every other stage's block kept, in the order of STAGES; appended where it has none."""
    begin, end = _markers(kind)
    old = _between(page, begin, end) or ""
    kept = {s.name: block for s in STAGES if (block := _between(old, *_markers(kind, s.name)))}
    merged = {**kept, **blocks}
    section = "\n\n".join([begin, f"## {KINDS[kind]}", *(merged[s.name] for s in STAGES if s.name in merged), end])
    if not old:
        return page.rstrip("\n") + "\n\n" + section + "\n"
    return page.replace(old, section)


def store_picture(src: Path, dest: Path, stage: Stage) -> None:
    """The one picture the stage's block shows, in `dest`, in place of what was there."""
    shutil.rmtree(dest, ignore_errors=True)
    if (src / stage.picture).exists():
        dest.mkdir(parents=True)
        shutil.copy2(src / stage.picture, dest / stage.picture)


def publish(kind: str, run_dir: Path, page: Path, stages: Sequence[str] | None = None) -> list[str]:
    """Render the run's stages into the kind's section of `page`, their pictures beside it; return the stages."""
    if kind not in KINDS:
        raise ValueError(f"unknown machine kind {kind!r}: expected one of {', '.join(KINDS)}")
    known = {s.name: s for s in STAGES}
    if stages is not None and (unknown := set(stages) - known.keys()):
        raise ValueError(f"unknown stages {sorted(unknown)}: expected some of {', '.join(known)}")
    picked = [s for s in STAGES
              if (run_dir / s.name / "compare.json").exists() and (stages is None or s.name in stages)]
    if not picked:
        raise ValueError(f"{run_dir} holds no stage folder with a compare.json ({', '.join(known)})")
    if missing := [s.name for s in picked if not (run_dir / s.name / "run.json").exists()]:
        raise ValueError(f"{run_dir}: {', '.join(missing)} without run.json (CPU, commit, date, command): "
                         "run the stages through bench/results.sh")
    link = f"results/{kind}"
    store = page.parent / link
    if run_dir.resolve() == store.resolve():
        raise ValueError(f"{run_dir} is where the page keeps its copies: run into another folder (bench/results/{kind})")
    blocks = {}
    for stage in picked:
        store_picture(run_dir / stage.name, store / stage.name, stage)
        blocks[stage.name] = render_stage(stage, run_dir / stage.name, kind, f"{link}/{stage.name}")
    page.write_text(replace_section(page.read_text(), kind, blocks))
    return [s.name for s in picked]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.results_page",
                                description="Rewrite a machine kind's section of docs/results.md from a run.")
    p.add_argument("--kind", required=True, choices=sorted(KINDS), help="the machine kind (bench/results.sh derives it)")
    p.add_argument("--run-dir", required=True, type=Path, help="the folder bench/results.sh wrote the stages into")
    p.add_argument("--page", type=Path, default=Path("docs/results.md"), help="the page; its data goes beside it")
    p.add_argument("--stages", nargs="+", help="store only these stages of the run (default: every one in it)")
    args = p.parse_args(argv)
    stored = publish(args.kind, args.run_dir, args.page, args.stages)
    print(f"{args.page}: the {args.kind} section, from {', '.join(stored)} in {args.run_dir}")


if __name__ == "__main__":
    main()
