"""The shapes stage's block of docs/results.md: pdserve and vLLM-CPU on real models' shapes,
larger than the CPU's cache, beside the decode step's roofline on this machine.

It reads the stage's folder as `STAGES=shapes bash bench/results.sh` leaves it:

    shapes/run.json                    CPU, commit, date, command (bench/results_page.py reads it)
    shapes/SHAPE/shape.json            the shape (python -m pdserve.bench.shapes)
    shapes/SHAPE/roofline-DTYPE.json   python -m pdserve.bench.engine_overhead --json, per dtype run
    shapes/SHAPE/burst/                python -m pdserve.bench.multi_compare runs: compare.json,
    shapes/SHAPE/stream/                 plan.json, DEPLOYMENT/summary.json ...
    shapes/SHAPE/interference/         (swept shapes only) DEPLOYMENT/sweep/sweep.json

Per shape: one table of the deployments (W1 burst and one stream, ratios against the peer of
the row's dtype), one of the roofline per dtype and step, and where the shape was swept, the
interference mix's SLO capacity. The text around the tables is written from plan.json, so it
states the workload that ran.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.results_cells import (
    PEER_NAMES,
    PEERS,
    dtype_of,
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

MARKER = "*/shape.json"  # a shape's folder: the stage's folder holds one per shape measured
DTYPES = ("float32", "bfloat16")


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _results(folder: Path) -> dict[str, dict]:
    return (_read(folder / "compare.json") or {}).get("deployments", {})


def _rooflines(folder: Path) -> dict[str, dict]:
    """dtype -> engine_overhead's record, for the dtypes measured."""
    return {d: r for d in DTYPES if (r := _read(folder / f"roofline-{d}.json"))}


def _case(roofline: dict | None, kind: str, tokens: int) -> dict | None:
    return next((c for c in (roofline or {}).get("cases", ()) if c["kind"] == kind and c["tokens"] == tokens), None)


def _roof_ms(roofline: dict | None, batch: int) -> str:
    c = _case(roofline, "decode", batch)
    return "-" if c is None else ms(1e3 * c["roofline_s"])


def _peers(names) -> list[tuple[str, str, str | None]]:
    """The peers with a row among `names`; vLLM-CPU where none has (its columns then read "-")."""
    return [p for p in PEERS if {p[1], p[2]} & set(names)] or [PEERS[0]]


def _cell(summary: dict, key: str, fmt: str | None = None) -> str:
    """A summary's figure, in milliseconds' style unless `fmt`; "-" where the run has none."""
    v = summary.get(key)
    return "-" if v is None else fmt.format(v) if fmt else ms(v)


def _workload(plan: dict | None) -> str:
    """A random workload's requests as a sentence's object: "32 prompts of 256 tokens, 64 output tokens"."""
    if plan is None:
        return "the workload in its plan.json"
    w, load = plan["workload"], plan["load"]
    n = w["num_requests"] - load["num_warmup"]
    how = ("one at a time" if load["mode"] == "closed" and load["concurrency"] == 1
           else f"{load['concurrency']} at a time" if load["mode"] == "closed"
           else "all sent at once" if w["request_rate"] == "inf" else f"at {w['request_rate']} requests/s")
    return f"{n} prompts of {_about(w)}{w['input_len']} tokens, {w['output_len']} output tokens, {how}"


def _about(workload: dict) -> str:
    """The word "about" before a mean length that each request's is drawn around (--range-ratio)."""
    return "about " if workload.get("range_ratio") else ""


def _intro(burst: dict | None, stream: dict | None, one_thread: float | None) -> str:
    thread = f", and one thread read at most {one_thread / 1e9:.0f} GB/s in the same run" if one_thread else ""
    return (
        "Each shape is a real model's architecture with random weights (`python -m pdserve.bench.shapes`: "
        "its layers, widths and vocabulary, SmolLM2's tokenizer) and does not fit the CPU's cache, so every "
        "decode step reads the weights from memory. The deployments are those above, serving the shape's "
        f"directory. **W1 burst**: {_workload(burst)}. **One stream**: {_workload(stream)}. "
        "TPOT = (E2E - TTFT) / (output tokens - 1), the median over requests; \"1/TPOT vs vLLM-CPU\" is "
        "vLLM's stream TPOT over the row's. **Roofline** of a decode step with a 256-token context per "
        "sequence: the bytes it reads (every weight once, plus the KV) over the memory read bandwidth "
        "measured around it, or its FLOPs over the GEMM rate where that takes longer "
        "(`python -m pdserve.bench.engine_overhead --model DIR --threads 2`, the threads of a colocated "
        f"worker; a disaggregated decode worker has one core{thread}). \"roofline b32\" and \"b1\" stand "
        "beside the TPOT they bound; \"of roofline\" is the bound over the engine's measured step."
        + _same_prompts_note(burst, stream))


def _same_prompts_note(burst: dict | None, stream: dict | None) -> str:
    """What the stream's TTFT measures where its prompts were the burst's (one seed for both, as
    runs before the stream got its own seed had): a cached prompt, on every server."""
    seeds = [(p or {}).get("workload", {}).get("seed") for p in (burst, stream)]
    if None in seeds or seeds[0] != seeds[1]:
        return ""
    return (" In this run the stream's prompts were the burst's first ones (one seed for both), so its TTFT is "
            "a prefix-cache hit on every server (vLLM-CPU caches prefixes too), not a prefill: read the W1 "
            "TTFT and the roofline table's prefill for that; the stream's TPOT is unaffected.")


def _all_failed(summary: dict) -> str:
    """"every request failed" for a run none of whose requests completed (its workers never served:
    the server log says why), else ""."""
    if summary.get("completed") == 0 and summary.get("failed"):
        return f"all {summary['failed']} requests failed (see the server log)"
    return ""


def _serving_table(burst: dict[str, dict], stream: dict[str, dict], rooflines: dict[str, dict]) -> str:
    names = list(dict.fromkeys([*burst, *stream]))
    peers = _peers(names)
    head = ["deployment", "W1 req/s", *(f"W1 req/s vs {p[0]}" for p in peers), "W1 out tok/s", "W1 TTFT p50 ms",
            "W1 TPOT p50 ms", "roofline b32 ms", "stream TTFT p50 ms", "stream TPOT p50 ms", "roofline b1 ms",
            *(f"stream 1/TPOT vs {p[0]}" for p in peers), "start-up s"]
    rows = []
    for name in names:
        b, s = burst.get(name, {}), stream.get(name, {})
        if error := b.get("error") or s.get("error") or _all_failed(b) or _all_failed(s):
            rows.append(error_row(name, error, len(head)))
            continue
        roof = rooflines.get(dtype_of(name))
        faster, tpot = [], []
        for _, f32, bf16 in peers:
            peer = peer_of(name, f32, bf16) or ""
            mine = name in PEER_NAMES
            faster.append("" if mine else ratio(b.get("request_throughput"), burst.get(peer, {}).get("request_throughput"), 2))
            tpot.append("" if mine else ratio(stream.get(peer, {}).get("p50_tpot_ms"), s.get("p50_tpot_ms"), 2))
        startup = b.get("startup_s", s.get("startup_s"))
        rows.append([name, _cell(b, "request_throughput", "{:.2f}"), *faster, _cell(b, "output_throughput", "{:,.0f}"),
                     _cell(b, "p50_ttft_ms"), _cell(b, "p50_tpot_ms"), _roof_ms(roof, 32), _cell(s, "p50_ttft_ms"),
                     _cell(s, "p50_tpot_ms"), _roof_ms(roof, 1), *tpot, "-" if startup is None else f"{startup:.1f}"])
    return table(head, rows)


def _roofline_table(rooflines: dict[str, dict]) -> str:
    head = ["dtype", "step", "GB read", "GFLOP", "read GB/s", "1-thread read GB/s", "GEMM GFLOP/s",
            "roofline ms", "bound", "engine ms", "of roofline"]
    rows = []
    for dtype, r in rooflines.items():
        for c in r["cases"]:
            memory = c["bytes"] / c["read_bytes_s"] >= c["flops"] / c["gemm_flops_s"]
            rows.append([dtype, c["case"], f"{c['bytes'] / 1e9:.2f}", f"{c['flops'] / 1e9:,.1f}",
                         f"{c['read_bytes_s'] / 1e9:.1f}", f"{c['one_thread_read_bytes_s'] / 1e9:.1f}",
                         f"{c['gemm_flops_s'] / 1e9:,.0f}", ms(1e3 * c["roofline_s"]), "memory" if memory else "compute",
                         ms(1e3 * c["engine_s"]), f"{c['roofline_s'] / c['engine_s']:.2f}"])
    return table(head, rows)


def _sweep_section(folder: Path) -> str:
    results, plan = _results(folder), _read(folder / "plan.json")
    sweeps = {n: json.loads(p.read_text()) for n in results if (p := folder / n / "sweep" / "sweep.json").is_file()}
    rates = sweep_rates(sweeps)
    peers = _peers(results)
    head = ["deployment", *sweep_head(rates), *(f"peak vs {p[0]}" for p in peers), "start-up s"]
    rows = []
    for name, s in results.items():
        if "error" in s or name not in sweeps:
            rows.append(error_row(name, s.get("error", "no sweep.json"), len(head)))
            continue
        peaks = ["" if name in PEER_NAMES else ratio(peak(sweeps[name]), peak(sweeps.get(peer_of(name, f32, bf16) or "")), 1)
                 for _, f32, bf16 in peers]
        rows.append([name, *sweep_cells(sweeps[name], rates), *peaks, f"{s['startup_s']:.1f}"])
    text = "The interference mix swept over rates."
    if plan is not None:
        w = plan["workload"]
        text = (f"Interference, swept: {w['num_requests'] - plan['load']['num_warmup']} chats per rate of "
                f"{_about(w)}{w['input_len']} prompt tokens and {w['output_len']} output tokens, with a {w['long_input_len']}-token "
                f"prompt ({w['long_output_len']} output tokens) every {w['long_interval_s']:g} s; fresh prompts at "
                "each rate. SLO per request: " + ", ".join(limit(k, v) for k, v in plan["slo"].items())
                + f"; SLO capacity: the highest rate at which it and every lower rate reach "
                f"{100 * plan['attainment_target']:.0f}%.")
    return text + "\n\n" + table(head, rows)


def render_shape(folder: Path) -> str:
    """One shape's heading and tables from its folder."""
    shape = json.loads((folder / "shape.json").read_text())
    rooflines = _rooflines(folder)
    size = ", ".join(f"{shape['num_parameters'] * n / 1e9:.2f} GB in {d}" for d, n in (("bfloat16", 2), ("float32", 4)))
    parts = [f"#### {shape['name']}: {shape['description']}; weights {size}", "",
             _serving_table(_results(folder / "burst"), _results(folder / "stream"), rooflines)]
    if rooflines:
        parts += ["", _roofline_table(rooflines)]
    if (folder / "interference" / "compare.json").is_file():
        parts += ["", _sweep_section(folder / "interference")]
    return "\n".join(parts)


def render(src: Path) -> str:
    """The block's text below its command line: what was measured, then each shape, smallest first."""
    shapes = sorted((p.parent for p in src.glob(MARKER)),
                    key=lambda f: (json.loads((f / "shape.json").read_text())["num_parameters"], f.name))
    if not shapes:
        raise ValueError(f"{src}: no shape folder (SHAPE/shape.json)")
    plans = {run: next((p for f in shapes if (p := _read(f / run / "plan.json"))), None) for run in ("burst", "stream")}
    one_thread = max((c["one_thread_read_bytes_s"] for f in shapes for r in _rooflines(f).values()
                      for c in r["cases"]), default=None)
    intro = _intro(plans["burst"], plans["stream"], one_thread)
    return "\n\n".join([intro, *(render_shape(f) for f in shapes)])
