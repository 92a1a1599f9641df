"""PNG plots for the streaming-input benchmark suite (suite_report.py): TTFT CCDFs, P95 TTFT against QPS and
grouped percentile bars, in the style of the Stream2LLM paper's figures (log axes, one line per system).

Every function takes plain data (ms), draws nothing for a system without data, and writes one PNG.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the bench machines; must precede the pyplot import

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

DPI = 120
# One colour per system across every plot, so a system reads the same in each figure.
COLORS = {
    "streaming": "tab:blue",
    "on_end_only": "tab:orange",
    "peer": "tab:red",
    "fcfs": "tab:blue",
    "lcas": "tab:green",
    "mcps": "tab:purple",
    "nonstreaming": "tab:gray",
}


def _color(system: str, index: int) -> str:
    return COLORS.get(system, f"C{index % 10}")


def _save(fig: Figure, ax: Axes, path: Path, title: str, drew: bool) -> Path:
    ax.set_title(title)
    if drew:
        ax.legend(fontsize="small")
    else:
        # An empty log axis warns and draws junk ticks; say plainly that nothing was measured.
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def ttft_ccdf(series: dict[str, list[float]], path: Path, title: str) -> Path:
    """Empirical CCDF of TTFT per system: x = TTFT ms (log), y = share of queries with TTFT >= x (log).

    The curve is exact for "> x" between samples; at the slowest query it shows 1/n rather than 0, which a log
    axis cannot draw. Failed queries must be left out by the caller.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drew = False
    for i, (system, values) in enumerate(series.items()):
        xs = sorted(v for v in values if v is not None and v > 0)
        if not xs:
            continue
        n = len(xs)
        ys = [(n - k) / n for k in range(n)]
        ax.plot(xs, ys, drawstyle="steps-pre", color=_color(system, i), label=f"{system} (n={n})")
        drew = True
    if drew:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of queries with TTFT > x")
    return _save(fig, ax, path, title, drew)


def p95_vs_qps(series: dict[str, list[tuple[float, float]]], path: Path, title: str) -> Path:
    """P95 TTFT (ms, log y) against offered QPS, one marked line per system; points with no P95 are skipped."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drew = False
    for i, (system, points) in enumerate(series.items()):
        pts = sorted((q, p) for q, p in points if p is not None and p > 0)
        if not pts:
            continue
        ax.plot([q for q, _ in pts], [p for _, p in pts], marker="o", color=_color(system, i), label=system)
        drew = True
    if drew:
        ax.set_yscale("log")
    ax.set_xlabel("QPS (Poisson arrivals)")
    ax.set_ylabel("P95 TTFT (ms)")
    return _save(fig, ax, path, title, drew)


def percentile_bars(series: dict[str, dict[str, float | None]], path: Path, title: str) -> Path:
    """Grouped bars (log y): one group per percentile key ("p50", "p95", "p99"), one bar per system."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    keys = ["p50", "p95", "p99"]
    systems = list(series)
    width = 0.8 / max(len(systems), 1)
    drew = False
    for i, system in enumerate(systems):
        xs, hs = [], []
        for j, key in enumerate(keys):
            value = series[system].get(key)
            if value is not None and value > 0:
                xs.append(j - 0.4 + width * (i + 0.5))
                hs.append(value)
        if hs:
            ax.bar(xs, hs, width=width, color=_color(system, i), label=system)
            drew = True
    if drew:
        ax.set_yscale("log")
    ax.set_xticks(range(len(keys)), [k.upper() for k in keys])
    ax.set_ylabel("TTFT (ms)")
    return _save(fig, ax, path, title, drew)
