"""The soak's verdicts: is each sampled series flat after the warm-up, is the app idle once the traffic stops, is
latency at the end what it was at the start, and which errors were seen.

Flat: the least-squares slope over the samples after the warm-up, times that window's length (the change the
trend explains), is within max(5 % of the series' mean, an absolute floor for its kind, twice the slope's standard
error times the window: noise that a straight line cannot tell from zero). Idle: once every answer has ended and a
settle time has passed, no session is open, no KV block held, no journal record kept, nothing in flight.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from clients import pct_ms
from soak_traffic import TEXT_KINDS, Answer, error_kind

REL_BOUND = 0.05
FLOORS = {  # absolute floor per kind of series, in its unit
    "rss_mib": 20.0,
    "fds": 2.0,
    "threads": 1.0,
    "sessions_open": 2.0,
    "kv_blocks_used": 16.0,  # 128-token blocks: a few sessions' worth
    "journal_records": 50.0,
    "journal_sessions": 5.0,
    "requests": 2.0,
    "in_flight": 2.0,
}
LATENCY_BOUND = 0.10  # end at most 10 % over the start (lower is no degradation)
PROCESS_KINDS = ("rss_mib", "fds", "threads")


def floor_for(series: str) -> float:
    return next((v for k, v in FLOORS.items() if series.endswith(k)), 1.0)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope (per second) and its standard error."""
    n = len(points)
    if n < 3:
        return 0.0, math.inf
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return 0.0, math.inf
    slope = sum((t - mt) * (v - mv) for t, v in points) / sxx
    resid = sum((v - mv - slope * (t - mt)) ** 2 for t, v in points)
    return slope, math.sqrt(resid / (n - 2) / sxx)


def series(samples: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """family -> name -> [(t, value)] over the loaded samples: one family per process figure, and `state`."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {k: {} for k in (*PROCESS_KINDS, "state")}
    for s in samples:
        if s["phase"] != "load":
            continue
        for name, fig in s["procs"].items():
            for kind in PROCESS_KINDS:
                out[kind].setdefault(name, []).append((s["t"], fig[kind]))
        for key, value in s["state"].items():
            out["state"].setdefault(key, []).append((s["t"], value))
    return out


def verdicts(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    rows = []
    for family, named in series(samples).items():
        for name, points in sorted(named.items()):
            kept = [(t, v) for t, v in points if t >= warmup_s]
            if len(kept) < 3:
                continue
            window = kept[-1][0] - kept[0][0]
            slope, se = fit(kept)
            mean = sum(v for _, v in kept) / len(kept)
            floor = FLOORS[family] if family in FLOORS else floor_for(name)
            bound = max(REL_BOUND * abs(mean), floor, 2 * se * window if math.isfinite(se) else 0.0)
            change = slope * window
            rows.append(
                {
                    "family": family,
                    "series": name,
                    "samples": len(kept),
                    "first": kept[0][1],
                    "last": kept[-1][1],
                    "mean": round(mean, 2),
                    "slope_per_h": round(slope * 3600, 3),
                    "change_over_window": round(change, 2),
                    "bound": round(bound, 2),
                    "flat": abs(change) <= bound,
                }
            )
    return rows


def idle_checks(idle: dict[str, Any] | None, settle_s: float) -> list[dict[str, Any]]:
    """Every state gauge must be 0 once the traffic has stopped and settled."""
    if idle is None:
        return [{"gauge": "idle sample", "value": None, "ok": False, "settle_s": settle_s}]
    return [{"gauge": k, "value": v, "ok": v == 0} for k, v in sorted(idle["state"].items())]


def latency(answers: list[Answer]) -> dict[str, Any]:
    ok = [a.sample for a in answers if a.sample.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    itls = [x for s in ok for x in s.itls]
    out: dict[str, Any] = {"answers": len(ok)}
    out |= {f"ttft_p{q}_ms": pct_ms(ttfts, q) for q in (50, 90, 99)}
    return out | {f"itl_p{q}_ms": pct_ms(itls, q) for q in (50, 90)}


def latency_windows(answers: list[Answer], start: float, end: float, window_s: float) -> dict[str, Any]:
    """The text kinds' latency in the first window after the warm-up against the last window; voice apart."""

    def within(lo: float, hi: float, kinds: tuple[str, ...]) -> list[Answer]:
        return [a for a in answers if lo <= a.arrived < hi and a.kind in kinds]

    first = latency(within(start, start + window_s, TEXT_KINDS))
    last = latency(within(end - window_s, end, TEXT_KINDS))
    checks = []
    for key in [k for k in first if k != "answers"]:
        a, b = first[key], last[key]
        ratio = b / a if a and b is not None else None
        checks.append(
            {
                "figure": key,
                "start": a,
                "end": b,
                "ratio": ratio,
                # (Lower at the end is no degradation: the start carries the warm-up's compile and cache misses.)
                "ok": ratio is not None and ratio <= 1 + LATENCY_BOUND,
            }
        )
    voice = {
        "start": latency(within(start, start + window_s, ("voice",))),
        "end": latency(within(end - window_s, end, ("voice",))),
    }
    windows = {"start": [start, start + window_s], "end": [end - window_s, end]}
    return {"windows_s": windows, "start": first, "end": last, "checks": checks, "voice": voice}


def errors(answers: list[Answer]) -> dict[str, int]:
    return dict(Counter(error_kind(a.kind, a.sample.error) for a in answers if a.sample.error).most_common())


def by_kind(answers: list[Answer]) -> dict[str, Any]:
    kinds = sorted({a.kind for a in answers})
    return {
        k: {"arrivals": sum(a.kind == k for a in answers), **latency([a for a in answers if a.kind == k])}
        for k in kinds
    }


def buckets(answers: list[Answer], edges: list[float]) -> list[dict[str, Any]]:
    """The text kinds' latency and the arrival and answer rates per interval between sample times."""
    out = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        if hi <= lo:
            continue
        inside = [a for a in answers if lo <= a.arrived < hi]
        text = [a for a in inside if a.kind in TEXT_KINDS]
        row = {"t": hi, "arrivals_per_s": len(inside) / (hi - lo), **latency(text)}
        row["errors"] = sum(a.sample.error is not None for a in inside)
        out.append(row)
    return out


def restarts(samples: list[dict[str, Any]]) -> list[str]:
    """Processes whose pid changed, or that came or went, between samples (a replica restarted)."""
    seen: dict[str, int] = {}
    changes = []
    names = [set(s["procs"]) for s in samples if s["phase"] == "load"]
    for s in samples:
        for name, fig in s["procs"].items():
            if seen.setdefault(name, fig["pid"]) != fig["pid"]:
                changes.append(f"{name}: pid {seen[name]} -> {fig['pid']} at {s['t']:.0f} s")
                seen[name] = fig["pid"]
    if names and (gone := set.union(*names) - set.intersection(*names)):
        changes.append(f"not in every sample: {sorted(gone)}")
    return changes
