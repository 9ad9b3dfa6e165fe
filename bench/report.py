"""Result files and console tables: the summary JSON, per-request JSONL, text tables."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from pdserve.bench.metrics import RequestRecord

_record_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(RequestRecord)


def _finite(obj):
    """JSON has no inf/nan: write them as strings so every reader can load the file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(obj), indent=2, sort_keys=False) + "\n")
    return path


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> Path:
    """One JSON object per request: every timestamp (s from the run's start) and the outcome."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for rec in records:
            f.write(_record_encoder.encode(rec) + b"\n")
    return path


def read_records(path: str | Path) -> list[RequestRecord]:
    with open(path, "rb") as f:
        return [_record_decoder.decode(line) for line in f if line.strip()]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_summary(s: dict, title: str = "Serving Benchmark Result") -> str:
    """The console table of one run, laid out like `vllm bench serve` with our SLO lines added."""
    rows: list[tuple[str, object] | str] = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Warm-up requests (excluded)", s["num_warmup"]),
        ("Benchmark duration (s)", s["duration"]),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    if s.get("slo"):
        slo = ", ".join(f"{k}<={v:g}" for k, v in s["slo"].items())
        rows += ["SLO (" + slo + f", from {s['slo_from']} send)",
                 ("SLO attainment (%)", 100.0 * s["slo_attainment"]),
                 ("Goodput (req/s)", s["goodput"])]
    sections = [("Time to First Token", "ttft", "TTFT"),
                ("TTFT from intended send time", "ttft_intended", "TTFT*"),
                ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                ("Time Between Tokens (chunks split)", "tbt", "TBT"),
                ("Inter-token Latency (per chunk)", "itl", "ITL"),
                ("End-to-end Latency", "e2el", "E2EL"),
                ("Send lag (intended -> actual)", "send_lag", "Lag")]
    if "mean_first_to_second_ms" in s:  # summaries written before it have none
        sections.insert(4, ("First -> second token (the hand-off if disaggregated)", "first_to_second", "1st->2nd"))
    if "mean_server_queue_ms" in s:
        sections.append(("Server-reported queueing", "server_queue", "Queue"))
    for header, key, short in sections:
        rows.append(header)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99"), ("max", "Max")):
            rows.append((f"{label} {short} (ms)", s[f"{stat}_{key}_ms"]))
    lines = [f"{' ' + title + ' ':=^60}"]
    for row in rows:
        if isinstance(row, str):
            lines.append(f"{' ' + row + ' ':-^60}")
        else:
            lines.append(f"{row[0] + ':':<44}{_fmt(row[1]):>16}")
    if s.get("bubble_fraction"):
        lines.append(f"{' Pipeline bubbles (idle / wall per stage) ':-^60}")
        lines += [f"{worker + ':':<44}{' / '.join(f'{f:.2f}' for f in fr):>16}" for worker, fr in s["bubble_fraction"].items()]
    if s.get("handoff_split"):
        lines += _handoff_lines(s["handoff_split"])
    if s.get("errors"):
        lines.append(f"{' Errors ':-^60}")
        lines += [f"{n:>5} x {msg[:52]}" for msg, n in s["errors"].items()]
    lines.append("=" * 60)
    return "\n".join(lines)


_HANDOFF_ROWS = (("mean_gap_ms", "Gap, first -> second token (ms)"), ("mean_wait_ms", "  wait for the prefill (ms)"),
                 ("mean_send_ms", "  send (ms)"), ("mean_verify_ms", "  verify (ms)"), ("mean_load_ms", "  load (ms)"))


def _handoff_lines(split: dict) -> list[str]:
    """The router's hand-off split: means, which add up (bench/handoff_scrape.py)."""
    counts = f"{split['handoffs']} / {split['timed_handoffs']}"
    lines = [f"{' Hand-offs at the router (means) ':-^60}", f"{'Hand-offs (with a gap / with phases):':<44}{counts:>16}"]
    lines += [f"{label + ':':<44}{_fmt(split[key]):>16}" for key, label in _HANDOFF_ROWS if key in split]
    if "mean_kv_bytes" in split:
        lines.append(f"{'KV per hand-off (MiB):':<44}{_fmt(split['mean_kv_bytes'] / 2**20):>16}")
    if "mean_parts" in split:
        lines.append(f"{'KV parts per hand-off:':<44}{_fmt(split['mean_parts']):>16}")
    return lines


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (also valid Markdown)."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells[1:]])
