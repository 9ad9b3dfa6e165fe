"""The results page: docs/results.md keeps one current section per machine kind, rendered from
`pdserve bench compare` runs.

    python -m pdserve.bench.results_page --kind amx --run-dir bench/results/amx [--stages saturation]

`bench/results.sh` runs each stage into `RUN_DIR/<stage>/` (raw data, ignored by git) with a
`run.json` beside it (CPU, commit, date, command), then calls this. Each stage of the run, or each
one named, is rendered into its own block of the kind's section (between
`<!-- results:<kind>:<stage>:begin -->` and `...:end -->`), and only the one picture the block
shows is copied into `docs/results/<kind>/<stage>/`: the table is the page's record of the run, the
raw data stays in git history or in the run folder. A run of one stage leaves the kind's other
blocks as they are; a kind without markers gets its section appended. Figures are written as
bench/results_cells.py writes them (ratios against the peer of the row's dtype); the shapes
stage's tables are bench/results_shapes.py's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pdserve.bench import results_shapes
from pdserve.bench.results_cells import (
    PEER_NAMES,
    PEERS,
    error_row,
    limit,
    ms,
    peak,
    peer_of,
    ratio,
    sweep_cells,
    sweep_head,
    sweep_rates,
    table,
)

KINDS = {
    "amx": "AMX: AVX-512, AVX512-BF16 and AMX-BF16",
    "avx512-bf16": "AVX-512 and AVX512-BF16, no AMX",
    "avx512": "AVX-512 without native bfloat16",
    "avx2": "AVX2, no AVX-512",
}


class Stage(NamedTuple):
    """A stage of bench/results.sh: its folder, its heading, the picture shown (None: none), the
    compared field of its table, and for a stage whose folder is not one compare run, what renders
    its block below the command line and the file a finished run leaves in its folder."""

    name: str
    title: str
    picture: str | None
    compared: str  # "request_throughput" or "goodput": what the ratio to a peer is of
    body: Callable[[Path], str] | None = None  # None: one compare run's table and picture
    marker: str = "compare.json"  # a glob in the stage's folder


STAGES = (
    Stage("saturation", "W1 saturation: 64 prompts of 256 tokens, 64 output tokens, all sent at once",
          "compare_throughput.png", "request_throughput"),
    Stage("rate1", "W1's requests at 1 request/s", "compare_tbt_cdf.png", "goodput"),
    Stage("interference", "Interference: 96-token chats at 0.8 req/s, a 768-token prompt every 6 s; "
          "then the same mix swept over rates", "attainment_vs_rate.png", "goodput"),
    Stage("concurrency32", "32 concurrent streaming chats (closed loop)", "compare_tbt_cdf.png",
          "request_throughput"),
    Stage("shapes", "Models larger than the cache: real models' shapes, W1 burst, one stream, decode roofline",
          None, "request_throughput", body=results_shapes.render, marker=results_shapes.MARKER),
)

Summary = dict[str, Any]


def _markers(kind: str, stage: str | None = None) -> tuple[str, str]:
    name = kind if stage is None else f"{kind}:{stage}"
    return f"<!-- results:{name}:begin -->", f"<!-- results:{name}:end -->"


def _between(text: str, begin: str, end: str) -> str | None:
    """What `text` holds from `begin` to `end`, both included; None where it has no such block."""
    start = text.find(begin)
    stop = text.find(end, start)
    return None if start < 0 or stop < 0 else text[start:stop + len(end)]


def _table(stage: Stage, results: dict[str, Summary], sweeps: dict[str, dict]) -> str:
    peers = [(label, f32, bf16) for label, f32, bf16 in PEERS if f32 in results or bf16 in results]
    compared = "req/s" if stage.compared == "request_throughput" else "goodput"
    head = ["deployment", "req/s", "goodput req/s", "SLO met", "TTFT p50 ms", "TTFT p99 ms", "TBT p50 ms",
            "TBT p99 ms", "start-up s"]
    at = head.index("req/s" if compared == "req/s" else "goodput req/s") + 1
    head[at:at] = [f"{compared} vs {label}" for label, _, _ in peers]
    rates = sweep_rates(sweeps)
    if sweeps:
        head += sweep_head(rates) + [f"peak vs {label}" for label, _, _ in peers]
    rows = []
    for name, s in results.items():
        if "error" in s:
            rows.append(error_row(name, s["error"], len(head)))
            continue
        row = [name, f"{s['request_throughput']:.2f}", f"{s['goodput']:.2f}", f"{100 * s['slo_attainment']:.0f}%",
               ms(s["p50_ttft_ms"]), ms(s["p99_ttft_ms"]), ms(s["p50_tbt_ms"]), ms(s["p99_tbt_ms"]),
               f"{s['startup_s']:.1f}" if "startup_s" in s else "-"]
        ratios, peak_ratios = [], []
        for _, f32, bf16 in peers:
            peer = peer_of(name, f32, bf16) or ""
            base = results.get(peer, {})
            if name in PEER_NAMES or "error" in base:
                ratios.append("")
                peak_ratios.append("")
                continue
            ratios.append(ratio(s.get(stage.compared), base.get(stage.compared), 2))
            peak_ratios.append(ratio(peak(sweeps.get(name)), peak(sweeps.get(peer)), 1))
        row[at:at] = ratios
        if sweeps:
            row += sweep_cells(sweeps.get(name), rates) + peak_ratios
        rows.append(row)
    return table(head, rows)


def render_stage(stage: Stage, src: Path, kind: str, link: str) -> str:
    """One stage's block, markers included, from its run folder (compare's output, or what the
    stage's `body` reads, and run.json); `link` is the folder of its picture as the page sees it."""
    run = json.loads((src / "run.json").read_text())
    line = f"`{run['command']}` at `{run['commit']}`, {run['date']}, on {run['cpu']} ({run['cores']} cores)."
    begin, end = _markers(kind, stage.name)
    if stage.body is not None:
        return "\n".join([begin, f"### {stage.title}", "", line, "", stage.body(src), end])
    results = json.loads((src / "compare.json").read_text())["deployments"]
    sweeps = {n: json.loads(p.read_text()) for n in results if (p := src / n / "sweep" / "sweep.json").exists()}
    slo: dict[str, float] = next((s["slo"] for s in results.values() if s.get("slo")), {})
    text = [begin, f"### {stage.title}", "",
            line + (" SLO per request: " + ", ".join(limit(k, v) for k, v in slo.items()) + "." if slo else ""),
            "", _table(stage, results, sweeps)]
    if stage.picture and (src / stage.picture).exists():
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
    if stage.picture and (src / stage.picture).exists():
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
              if any((run_dir / s.name).glob(s.marker)) and (stages is None or s.name in stages)]
    if not picked:
        raise ValueError(f"{run_dir} holds no finished stage ({', '.join(f'{s.name}/{s.marker}' for s in STAGES)})")
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
