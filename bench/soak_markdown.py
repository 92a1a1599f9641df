"""bench/results/soak.md from the soak's record (bench/soak.py): settings, capacity, verdicts, slopes, plots."""

from __future__ import annotations

from typing import Any

from soak_report import FLOORS, LATENCY_BOUND, REL_BOUND


def _n(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _ok(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def markdown(r: dict[str, Any]) -> str:
    s, v, cal = r["settings"], r["verdict"], r["calibration"]
    kind = "the quick form, `--quick`" if r["quick"] else "the full run"
    lines = [
        f"# Soak run: {kind} ({r['timestamp']})",
        "",
        f"- command: `{r['command']}`",
        f"- machine: {r['machine']['nproc']} cores, {r['machine']['cpu_model']}",
        f"- soak {s['duration_s']:.0f} s, a sample every {s['sample_s']:.0f} s, warm-up {s['warmup_s']:.0f} s left out "
        f"of the slopes, latency windows of {s['window_s']:.0f} s; answers of {s['max_tokens']} tokens; mix "
        + ", ".join(f"{k} {w:.0%}" for k, w in s["mix"].items()),
        f"- capacity {r['capacity_per_s']:.2f} arrivals/s (calibration: {len(cal['steps'])} steps of "
        f"{s['calib_step_s']:.0f} s, first overload at {_n(cal.get('first_overload_per_s'), 2)}/s); soak rate "
        f"**{r['rate_per_s']:.2f}/s** ({s['load']:.0%}); {r['arrivals']} arrivals",
        "",
        "## Verdicts",
        "",
        f"- every series flat after the warm-up: {_ok(v['flat'])} (|slope| x window <= max({REL_BOUND:.0%} of the "
        "mean, the floor of its kind, 2 standard errors of the slope x window); floors: "
        + ", ".join(f"{k} {f:g}" for k, f in FLOORS.items())
        + ")",
        f"- idle once the traffic stopped (every gauge 0): {_ok(v['idle'])}",
        f"- latency of the last window at most {LATENCY_BOUND:.0%} over the first (after the warm-up): "
        f"{_ok(v['latency'])}",
        f"- no errors, no process restarted: {_ok(v['no_errors'])}"
        + (f" — errors {r['errors']}" if r["errors"] else "")
        + (f" — restarts {r['restarts']}" if r["restarts"] else ""),
        "",
        "## Calibration",
        "",
        "| rate /s | arrivals | served /s | TTFT P50 / P90 ms | drain s | overload |",
        "|---|---|---|---|---|---|",
    ]
    for st in cal["steps"]:
        lines.append(
            f"| {st['rate']:.2f} | {st['arrivals']} | {st['served_per_s']:.2f} | {_n(st['ttft_p50_ms'])} / "
            f"{_n(st['ttft_p90_ms'])} | {st['drain_s']:.0f} | {st['overload'] or ''} |"
        )
    lat = r["latency"]
    lines += [
        "",
        f"## Latency, text answers (first window {lat['windows_s']['start']}, last {lat['windows_s']['end']} s)",
        "",
        f"Answers in the windows: {lat['start']['answers']} and {lat['end']['answers']}.",
        "",
        "| figure | start ms | end ms | end / start | within |",
        "|---|---|---|---|---|",
    ]
    for c in lat["checks"]:
        lines.append(
            f"| {c['figure']} | {_n(c['start'], 1)} | {_n(c['end'], 1)} | {_n(c['ratio'], 2)} | {_ok(c['ok'])} |"
        )
    vs, ve = lat["voice"]["start"], lat["voice"]["end"]
    lines += [
        "",
        f"Spoken turns (end of speech -> first token, not judged): TTFT P50 {_n(vs['ttft_p50_ms'])} ms at the start "
        f"({vs['answers']} turns), {_n(ve['ttft_p50_ms'])} ms at the end ({ve['answers']}).",
        "",
        "By kind over the whole soak:",
        "",
        "| kind | arrivals | answered | TTFT P50 / P90 / P99 ms | ITL P50 / P90 ms |",
        "|---|---|---|---|---|",
    ]
    for k, f in r["by_kind"].items():
        lines.append(
            f"| {k} | {f['arrivals']} | {f['answers']} | {_n(f['ttft_p50_ms'])} / {_n(f['ttft_p90_ms'])} / "
            f"{_n(f['ttft_p99_ms'])} | {_n(f['itl_p50_ms'], 1)} / {_n(f['itl_p90_ms'], 1)} |"
        )
    lines += [
        "",
        "## Slopes",
        "",
        "| family | series | samples | first | last | mean | slope /h | change over window | bound | flat |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["slopes"]:
        lines.append(
            f"| {row['family']} | {row['series']} | {row['samples']} | {_n(row['first'], 1)} | {_n(row['last'], 1)} | "
            f"{_n(row['mean'], 1)} | {_n(row['slope_per_h'], 2)} | {_n(row['change_over_window'], 2)} | "
            f"{_n(row['bound'], 2)} | {_ok(row['flat'])} |"
        )
    lines += ["", "## Idle at the end", "", "| gauge | value | 0 |", "|---|---|---|"]
    lines += [f"| {c['gauge']} | {c['value']} | {_ok(c['ok'])} |" for c in r["idle"]]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.rsplit('/', 1)[-1]}]({p.rsplit('/', 1)[-1]})" for p in r["plots"]]
    return "\n".join(lines) + "\n"
