"""The soak's plots: one PNG per family of series (RSS, fds and threads by process; the app's state gauges;
latency and rates over time), minutes on x, the warm-up shaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on the bench machines; must precede the pyplot import

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

DPI = 110
TITLES = {
    "rss_mib": ("RSS by process", "MiB"),
    "fds": ("open file descriptors by process", "fds"),
    "threads": ("threads by process", "threads"),
    "state": ("sessions, KV blocks, journal records, work in flight", "count"),
}


def _finish(ax: Axes, path: Path, title: str, ylabel: str, warmup_s: float, outside: bool = True) -> Path:
    ax.axvspan(0, warmup_s / 60, color="0.9", label="warm-up")
    ax.set_title(title)
    ax.set_xlabel("minutes into the soak")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if outside:  # many series: beside the axes
        ax.legend(fontsize="x-small", ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    else:
        ax.legend(fontsize="x-small", ncol=3, loc="upper left")
    ax.figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    ax.figure.savefig(path, dpi=DPI)
    plt.close(ax.figure)
    return path


def family(named: dict[str, list[tuple[float, float]]], kind: str, path: Path, warmup_s: float, log: bool) -> Path:
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, (name, points) in enumerate(sorted(named.items())):
        ax.plot(
            [t / 60 for t, _ in points],
            [v for _, v in points],
            marker=".",
            color=f"C{i % 10}",
            label=name,
            linestyle="-" if i < 10 else "--",
        )
    if log:
        ax.set_yscale("log")
    title, unit = TITLES[kind]
    return _finish(ax, path, title, unit, warmup_s)


def latency(rows: list[dict[str, Any]], path: Path, warmup_s: float) -> Path:
    fig, ax = plt.subplots(figsize=(10, 5))
    ts = [r["t"] / 60 for r in rows]
    for key, style in (
        ("ttft_p50_ms", "-"),
        ("ttft_p90_ms", "-"),
        ("ttft_p99_ms", ":"),
        ("itl_p50_ms", "--"),
        ("itl_p90_ms", "--"),
    ):
        ax.plot(ts, [r[key] for r in rows], linestyle=style, marker=".", label=key.replace("_ms", " (ms)"))
    ax.set_yscale("log")
    rate = ax.twinx()
    rate.plot(ts, [r["arrivals_per_s"] for r in rows], color="0.5", linewidth=0.8, label="arrivals/s")
    rate.set_ylabel("arrivals/s (grey)")
    return _finish(
        ax, path, "text answers' latency per sample interval (by arrival)", "ms (log)", warmup_s, outside=False
    )


def all_plots(
    series: dict[str, dict[str, list[tuple[float, float]]]],
    rows: list[dict[str, Any]],
    out: Path,
    name: str,
    warmup_s: float,
) -> list[Path]:
    paths = [
        family(named, kind, out / f"{name}_{kind}.png", warmup_s, log=kind in ("rss_mib", "fds"))
        for kind, named in series.items()
    ]
    return [*paths, latency(rows, out / f"{name}_latency.png", warmup_s)]
