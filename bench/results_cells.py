"""How the results page writes a figure: milliseconds, rates, SLO limits, ratios against the peer
of a row's dtype, and the cells of a rate sweep. Shared by every table of docs/results.md
(bench/results_page.py, bench/results_shapes.py).

Ratios against a peer are of the rounded figures the table shows, so a reader can check them;
a row is compared with the peer of its dtype (rows named `*-bf16` run bfloat16).
"""

from __future__ import annotations

from pdserve.bench.sweep import max_rate_meeting, peak_goodput

# (label, float32 row, bfloat16 row): the peer servers a pdserve row is compared with.
PEERS = (("vLLM-CPU", "vllm", "vllm-bf16"), ("llama.cpp", "llama-f32", None))
PEER_NAMES = {n for _, f32, bf16 in PEERS for n in (f32, bf16) if n}
# No ratio over a peer's figure below this: at two decimals its rounding alone moves the ratio 5%+.
MIN_BASE = 0.1


def ms(v: float) -> str:
    return f"{v:.2f}" if v < 1 else f"{v:.1f}" if v < 10 else f"{v:,.0f}"


def limit(key: str, value_ms: float) -> str:
    """An SLO term as a reader writes it: `tbt_p99_ms` 200 -> "TBT p99 ≤ 200 ms"."""
    name = key.removesuffix("_ms").replace("_", " ").upper().replace(" P", " p").replace(" MAX", " max")
    return f"{name} ≤ {value_ms / 1e3:g} s" if value_ms >= 1000 else f"{name} ≤ {value_ms:g} ms"


def rate(r: float) -> str:
    return f"{r:.1f}" if r == int(r) else f"{r:g}"


def ratio(a: float | None, b: float | None, digits: int) -> str:
    """a / b of the figures rounded to two decimals, "-" where either is missing or b is too small."""
    if a is None or b is None or round(b, 2) < MIN_BASE:
        return "-"
    return f"{round(a, 2) / round(b, 2):.{digits}f}x"


def peer_of(name: str, f32: str, bf16: str | None) -> str | None:
    """The peer row a pdserve row is compared with: the one of its dtype."""
    return bf16 if name.endswith("-bf16") else f32


def dtype_of(name: str) -> str:
    return "bfloat16" if name.endswith("-bf16") else "float32"


def peak(sweep: dict | None) -> float | None:
    best = peak_goodput(sweep["points"]) if sweep else None
    return best[0] if best else None


def sweep_rates(sweeps: dict[str, dict]) -> list[float]:
    return [p["request_rate"] for p in next(iter(sweeps.values()))["points"]] if sweeps else []


def sweep_head(rates: list[float]) -> list[str]:
    return [f"SLO met at {' / '.join(rate(r) for r in rates)} req/s", "TBT p99 ms across the sweep",
            "SLO capacity req/s", "peak goodput (at req/s)"]


def sweep_cells(sweep: dict | None, rates: list[float]) -> list[str]:
    """The cells of sweep_head for one deployment's sweep."""
    if sweep is None:
        return ["-"] * 4
    points = sweep["points"]
    met = " / ".join(f"{100 * p['slo_attainment']:.0f}" for p in points) + " %"
    tbt = [p["p99_tbt_ms"] for p in points]
    capacity = max_rate_meeting([(p["request_rate"], p["slo_attainment"]) for p in points],
                                sweep.get("attainment_target", 0.9))
    cap = (f"below {rate(min(rates))}" if capacity is None
           else f"≥ {rate(capacity)}" if capacity >= max(rates) else rate(capacity))
    best = peak_goodput(points)
    return [met, f"{ms(min(tbt))}-{ms(max(tbt))}", cap, "-" if best is None else f"{best[0]:.2f} at {rate(best[1])}"]


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def error_row(name: str, error: str, width: int) -> list[str]:
    return [name, f"error: {error.splitlines()[0][:60]}"] + [""] * (width - 2)
