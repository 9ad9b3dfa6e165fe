"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.bench.metrics import RequestRecord, tbt_gaps  # noqa: E402


def ttfts_ms(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft_s * 1e3 for r in records if r.success and not r.warmup and r.ttft_s is not None]


def tbts_ms(records: Sequence[RequestRecord]) -> list[float]:
    return [g * 1e3 for r in records if r.success and not r.warmup for g in tbt_gaps(r.chunk_times, r.chunk_tokens)]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cdf_plot(series: Mapping[str, Sequence[float]], xlabel: str, title: str, path: Path,
             slo_ms: float | None = None) -> Path:
    """Empirical CDFs of one metric, one line per series (one per strategy when comparing)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    lows, highs = [], []
    for name, values in series.items():
        if len(values):
            xs = np.sort(np.asarray(values))
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
            lows.append(float(np.percentile(xs[xs > 0], 0.5)) if (xs > 0).any() else 1.0)
            highs.append(xs.max())
    if lows and max(highs) > 20 * min(lows):
        ax.set_xscale("log")  # tails (the stalls) span decades: a linear axis hides them
        ax.set_xlim(left=min(lows) / 1.5)
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set(xlabel=xlabel, ylabel="fraction of samples", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def tbt_timeline(records: Sequence[RequestRecord], path: Path, long_tag: str = "long") -> Path:
    """Every TBT gap at the time it ended, with request arrivals marked (long prompts in red):
    shows decode stalls when prefills arrive."""
    fig, ax = plt.subplots(figsize=(8, 4))
    xs, ys = [], []
    for r in records:
        if r.warmup or not r.success:
            continue
        gaps = tbt_gaps(r.chunk_times, r.chunk_tokens)
        ends = [t for i, t in enumerate(r.chunk_times[1:], 1) for _ in range(max(r.chunk_tokens[i], 1))]
        xs += ends
        ys += [g * 1e3 for g in gaps]
    ax.scatter(xs, ys, s=4, alpha=0.6, label="TBT gap")
    arrivals = [r for r in records if not r.warmup]
    for r in arrivals:
        long = r.tag == long_tag
        ax.axvline(r.intended_s, color="red" if long else "grey", alpha=0.8 if long else 0.15,
                   linewidth=1.2 if long else 0.5)
    ax.plot([], [], color="grey", label="arrival")
    if any(r.tag == long_tag for r in arrivals):
        ax.plot([], [], color="red", label="long prompt arrival")
    ax.set(xlabel="time since start (s)", ylabel="TBT (ms)", title="TBT over time")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def run_plots(records: Sequence[RequestRecord], out_dir: Path, slo_ttft_ms: float | None = None,
              slo_tbt_ms: float | None = None) -> list[Path]:
    """The plots of one run: TTFT CDF, TBT CDF, TBT over time."""
    return [
        cdf_plot({"TTFT": ttfts_ms(records)}, "TTFT (ms)", "TTFT CDF", out_dir / "ttft_cdf.png", slo_ttft_ms),
        cdf_plot({"TBT": tbts_ms(records)}, "TBT (ms)", "TBT CDF", out_dir / "tbt_cdf.png", slo_tbt_ms),
        tbt_timeline(records, out_dir / "tbt_timeline.png"),
    ]


def attainment_vs_rate(curves: Mapping[str, Sequence[tuple[float, float]]], path: Path,
                       target: float | None = None) -> Path:
    """SLO attainment (%) against request rate, one curve per deployment."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        rates, att = zip(*sorted(points), strict=True) if points else ((), ())
        ax.plot(rates, [100 * a for a in att], marker="o", label=name)
    if target is not None:
        ax.axhline(100 * target, color="red", linestyle="--", label=f"target {100 * target:g}%")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title="SLO attainment vs rate", ylim=(0, 105))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def compare_bars(names: Sequence[str], groups: Mapping[str, Sequence[float]], ylabel: str, title: str,
                 path: Path) -> Path:
    """Grouped bars: one group per strategy, one bar per statistic (e.g. p50 and p99)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) + 2), 4))
    width = 0.8 / max(len(groups), 1)
    x = np.arange(len(names))
    for i, (label, values) in enumerate(groups.items()):
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=label)
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize="small")
    return _save(fig, path)

