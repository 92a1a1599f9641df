"""Summary, goal checks, markdown and plots for the streaming-input benchmark suite's raw results (suite.py).

Conventions (also stated in the markdown):
- TTFT runs from the moment the last input chunk is available to the first output token, in ms; failed
  queries (None) are left out of every percentile and counted as errors.
- Percentiles interpolate linearly between the closest ranks (numpy's default "linear" method, which the
  paper's `compute_scheduler_improvements.py` uses through numpy).
- `speedup_vs_X` = X's percentile / this system's percentile at the same QPS: > 1 means faster than X,
  1.0 is parity. Headline figures are taken at the workload's `headline_qps`.
- `completion_time_ratio_vs_peer` = peer's trace completion time / streaming's at the append headline QPS:
  higher is better, and >= 0.98 means streaming finishes the trace within 2% of peer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import plots
from workloads import percentile

PERCENTILES = (50, 95, 99)
BASELINES = ("peer", "on_end_only")  # what "streaming" is compared with on append and update
POLICIES = ("fcfs", "lcas", "mcps")  # always present in summary["pressure"], None when not run
ORDER = ["streaming", "on_end_only", "peer", "fcfs", "lcas", "mcps", "nonstreaming"]
DESCRIPTIONS = {
    "streaming": "this app, default policy, prefill while chunks arrive",
    "on_end_only": "this app, prefill only after the last chunk",
    "peer": "Ray Serve LLM P/D app, given the whole prompt when the last chunk is available",
    "fcfs": "this app streaming, FCFS prefill scheduling, small KV cache",
    "lcas": "this app streaming, LCAS prefill scheduling, small KV cache",
    "mcps": "this app streaming, MCPS prefill scheduling, small KV cache",
    "nonstreaming": "this app, on_end_only, same small KV cache",
}


# --- numbers -------------------------------------------------------------------------------------------


def pct(values: list[float | None], q: float) -> float | None:
    """q-th percentile (0-100) of the non-None values, linear between closest ranks; None if there are none."""
    xs = [v for v in values if v is not None]
    return percentile(xs, q) if xs else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _order(systems: list[str]) -> list[str]:
    known = [s for s in ORDER if s in systems]
    return known + [s for s in dict.fromkeys(systems) if s not in ORDER]


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def summarise(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run: workload, qps, system, n, ok, errors, p50/p95/p99/mean ms, completion_s."""
    rows = []
    for run in raw.get("runs", []):
        ttft = run.get("ttft_ms") or []
        ok = [v for v in ttft if v is not None]
        row: dict[str, Any] = {"workload": run["workload"], "qps": run["qps"], "system": run["system"]}
        row |= {"n": run.get("queries", len(ttft)), "ok": len(ok), "errors": run.get("errors", len(ttft) - len(ok))}
        row |= {f"p{q}": pct(ok, q) for q in PERCENTILES}
        row |= {"mean": sum(ok) / len(ok) if ok else None, "completion_s": run.get("completion_s")}
        row["error_kinds"] = run.get("error_kinds") or {}
        row["work_ratio"] = (run.get("work") or {}).get("work_ratio")  # prefill computed / prompt tokens
        rows.append(row)
    return rows


def _find(rows: list[dict[str, Any]], workload: str, qps: float | None, system: str) -> dict[str, Any] | None:
    if qps is None:
        return None
    return next((r for r in rows if r["workload"] == workload and r["system"] == system and _same(r["qps"], qps)), None)


def headline_qps(raw: dict[str, Any], workload: str) -> float | None:
    """The workload's `headline_qps`; failing that its only (or, as in the paper's headline, its highest) QPS."""
    given = (raw.get("workloads", {}).get(workload) or {}).get("headline_qps")
    if given is not None:
        return float(given)
    qps = [r["qps"] for r in raw.get("runs", []) if r["workload"] == workload]
    return max(qps) if qps else None


def _speedup(
    rows: list[dict[str, Any]], workload: str, qps: float | None, system: str, base: str, q: int
) -> float | None:
    mine, theirs = _find(rows, workload, qps, system), _find(rows, workload, qps, base)
    return _ratio(theirs and theirs[f"p{q}"], mine and mine[f"p{q}"])


def _level(ts: dict[str, Any], system: str, c: str) -> dict[str, Any]:
    # A token_path results JSON keeps its systems under "systems"; accept the bare systems dict too.
    systems = ts.get("systems", ts)
    return (systems.get(system) or {}).get("chat", {}).get(c) or {}


def token_streaming_summary(ts: dict[str, Any] | None) -> dict[str, Any]:
    """Ratios from a token_path results JSON: app tok/s over plain's and rayllm's at 128 chats, plain's ITL
    P50 over the app's at 32 (all higher-is-better), and the same per concurrency level under "by_concurrency"."""
    out: dict[str, Any] = {
        "tokps_ratio_vs_vllm_at_128": None,
        "tokps_ratio_vs_rayllm_at_128": None,
        "itl_p50_ratio_vs_vllm_at_32": None,
    }
    if not ts:
        return out
    app = _level(ts, "app", "128")
    out["tokps_ratio_vs_vllm_at_128"] = _ratio(app.get("output_tok_s"), _level(ts, "plain", "128").get("output_tok_s"))
    out["tokps_ratio_vs_rayllm_at_128"] = _ratio(
        app.get("output_tok_s"), _level(ts, "rayllm", "128").get("output_tok_s")
    )
    out["itl_p50_ratio_vs_vllm_at_32"] = _ratio(
        _level(ts, "plain", "32").get("itl_p50_ms"), _level(ts, "app", "32").get("itl_p50_ms")
    )
    levels = ts.get("systems", ts).get("app", {}).get("chat", {})
    by_c: dict[str, Any] = {}
    for c in sorted(levels, key=lambda x: int(x) if str(x).isdigit() else 0):
        mine = levels[c]
        row: dict[str, Any] = {}
        for other, name in (("plain", "vllm"), ("rayllm", "rayllm")):
            theirs = _level(ts, other, c)
            row[f"tokps_ratio_vs_{name}"] = _ratio(mine.get("output_tok_s"), theirs.get("output_tok_s"))
            row[f"ttft_p50_ratio_vs_{name}"] = _ratio(theirs.get("ttft_p50_ms"), mine.get("ttft_p50_ms"))
            row[f"itl_p50_ratio_vs_{name}"] = _ratio(theirs.get("itl_p50_ms"), mine.get("itl_p50_ms"))
        by_c[str(c)] = row
    out["by_concurrency"] = by_c
    out["source"] = {k: ts.get(k) for k in ("timestamp", "command", "model") if k in ts}
    return out


def preemptive_summary(record: dict[str, Any] | None) -> dict[str, Any]:
    """Per (end-of-turn lag, users): end of turn -> first token with preemptive answers against without, the
    share of turns answered preemptively and the tokens discarded per turn."""
    out: dict[str, Any] = {}
    for key, run in ((record or {}).get("runs") or {}).items():
        s = run["summary"]
        on, off = s["preemptive"], s["off"]
        out[key] = {
            "eot_lag_ms": run["eot_lag_ms"],
            "concurrency": run["concurrency"],
            **{f"p{q}_ms": on[f"p{q}_ms"] for q in PERCENTILES},
            **{f"p{q}_ms_off": off[f"p{q}_ms"] for q in PERCENTILES},
            **{f"p{q}_speedup": s["speedup"].get(f"p{q}") for q in PERCENTILES},
            "delivered_share": on["delivered_share"],
            "discarded_tokens_per_turn": on["discarded_tokens_per_turn"],
            "work_ratio": on["work_ratio"],
            "work_ratio_off": off["work_ratio"],
            "decode_step_ms": off.get("decode_step_ms"),
            "goal_ms": s.get("goal_ms"),
        }
    return out


def voice_summary(record: dict[str, Any] | None) -> dict[str, Any]:
    """Per number of voices: end of speech -> first token of each system (bench/voice.py), the silence window
    and decode step they are judged against."""
    out: dict[str, Any] = {}
    for run in (record or {}).get("runs") or []:
        out[str(run["voices"])] = {
            "voices": run["voices"],
            "silence_ms": int((record or {}).get("args", {}).get("silence_ms", 500)),
            "decode_step_ms": (record or {}).get("decode_step_ms"),
            **{
                system: {k: row.get(k) for k in ("p50_ms", "p95_ms", "p99_ms", "preemptive_delivered")}
                for system, row in run["summary"].items()
            },
        }
    return out


def summary_json(raw: dict[str, Any]) -> dict[str, Any]:
    """The headline ratios (higher is better, 1.0 parity, None where not measured), the QPS they were taken at,
    the percentiles behind them, provenance and the goals."""
    rows = summarise(raw)
    out: dict[str, Any] = {"headline_qps": {}, "ttft_ms": {}}
    for workload in ("append", "update", "pressure"):
        qps = headline_qps(raw, workload)
        out["headline_qps"][workload] = qps
        out["ttft_ms"][workload] = {
            r["system"]: {k: r[k] for k in ("p50", "p95", "p99", "mean", "ok", "errors", "completion_s", "work_ratio")}
            for r in rows
            if r["workload"] == workload and qps is not None and _same(r["qps"], qps)
        }
    for workload in ("append", "update"):
        qps = out["headline_qps"][workload]
        out[workload] = {
            f"p{q}_speedup_vs_{base}": _speedup(rows, workload, qps, "streaming", base, q)
            for base in BASELINES
            for q in PERCENTILES
        }
    qps = out["headline_qps"]["pressure"]
    run = [r["system"] for r in rows if r["workload"] == "pressure" and r["system"] != "nonstreaming"]
    out["pressure"] = {}
    for policy in dict.fromkeys([*POLICIES, *run]):
        out["pressure"][policy] = {
            f"p{q}_speedup_vs_nonstreaming": _speedup(rows, "pressure", qps, policy, "nonstreaming", q)
            for q in PERCENTILES
        }
    # Work: prefill tokens computed per prompt token, per workload and system at the headline QPS (1.0 = each
    # prompt token once, what not streaming costs; None for the peer, whose engine is not ours to count).
    out["work_ratio"] = {w: {s: v["work_ratio"] for s, v in out["ttft_ms"][w].items()} for w in out["ttft_ms"]}
    qps = out["headline_qps"]["append"]
    mine, peer = _find(rows, "append", qps, "streaming"), _find(rows, "append", qps, "peer")
    out["completion_time_ratio_vs_peer"] = _ratio(peer and peer["completion_s"], mine and mine["completion_s"])
    out["token_streaming"] = token_streaming_summary(raw.get("token_streaming"))
    out["preemptive"] = preemptive_summary(raw.get("preemptive"))
    out["voice"] = voice_summary(raw.get("voice"))
    prov = raw.get("provenance", {})
    out["provenance"] = {k: prov.get(k) for k in ("command", "commit", "machine", "date")} | {
        "quick": prov.get("quick")
    }
    out["goals"] = goals(out)
    return out


def _goal(goal: str, target: str, measured: float | None, threshold: float, **extra: Any) -> dict[str, Any]:
    met = None if measured is None else measured >= threshold
    return {"goal": goal, "target": target, "measured": measured, "met": met, **extra}


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, each {goal, target, measured, met}; met is None when the figure was not measured."""
    append, update = summary.get("append", {}), summary.get("update", {})
    out = [
        _goal("append: median TTFT speedup vs peer", ">= 11x", append.get("p50_speedup_vs_peer"), 11.0),
        _goal("append: P99 TTFT speedup vs peer", ">= 3x", append.get("p99_speedup_vs_peer"), 3.0),
        _goal("update: median TTFT speedup vs peer", ">= 2.5x", update.get("p50_speedup_vs_peer"), 2.5),
    ]
    for policy in ("fcfs", "lcas"):
        ratios = summary.get("pressure", {}).get(policy) or {}
        detail = {f"p{q}": ratios.get(f"p{q}_speedup_vs_nonstreaming") for q in PERCENTILES}
        values = [v for v in detail.values() if v is not None]
        worst = min(values) if len(values) == len(detail) else None  # a missing percentile leaves it unknown
        goal = f"pressure: {policy} P50, P95 and P99 TTFT no worse than nonstreaming (worst shown)"
        out.append(_goal(goal, ">= 1.0x each", worst, 1.0, detail=detail))
    goal = "trace completion time within 2% of peer (peer / streaming, append headline QPS)"
    out.append(_goal(goal, ">= 0.98", summary.get("completion_time_ratio_vs_peer"), 0.98))
    runs = summary.get("preemptive") or {}
    if runs:
        top = max(r["concurrency"] for r in runs.values())
        saturated = [r for r in runs.values() if r["concurrency"] == top]
        worst = min((r[f"p{q}_speedup"] or 0.0) for r in saturated for q in PERCENTILES)
        goal = "preemptive answers at saturating load: no percentile worse than without (worst shown)"
        out.append(_goal(goal, ">= 1.0x each", worst, 1.0))
        low = [r for r in runs.values() if r["concurrency"] == 1 and r.get("goal_ms") is not None]
        if low:  # (lower is better: the margin below the limit, as a ratio limit / P50, must be >= 1)
            worst_low = min(r["goal_ms"] / r["p50_ms"] for r in low if r["p50_ms"])
            goal = "preemptive answers at 1 user: end of turn -> first token P50 <= one decode step + 10 ms (limit/P50)"
            out.append(_goal(goal, ">= 1.0", worst_low, 1.0))
    out += voice_goals(summary.get("voice") or {})
    return out


def voice_goals(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """bench/voice.py's goals (lower is better: each as a ratio that must be >= 1)."""
    out: list[dict[str, Any]] = []
    one = runs.get("1")
    if one and one.get("voice+preemptive", {}).get("p50_ms") and one.get("decode_step_ms") is not None:
        limit = one["silence_ms"] + one["decode_step_ms"] + 10
        goal = (
            "voice, 1 voice: end of speech -> first token P50 <= silence window + one decode step + 10 ms (limit/P50)"
        )
        out.append(_goal(goal, ">= 1.0", limit / one["voice+preemptive"]["p50_ms"], 1.0))
        cascade = one.get("cascade", {}).get("p95_ms")
        if cascade:
            goal = "voice, 1 voice: P95 at most half the cascade's (cascade P95 / 2 / voice P95)"
            out.append(_goal(goal, ">= 1.0", cascade / 2 / one["voice+preemptive"]["p95_ms"], 1.0))
    many = [r for k, r in runs.items() if k != "1"]
    if many:
        ratios = [
            r["cascade"][f"p{q}_ms"] / r["voice+preemptive"][f"p{q}_ms"]
            for r in many
            for q in PERCENTILES
            if r.get("cascade", {}).get(f"p{q}_ms") and r.get("voice+preemptive", {}).get(f"p{q}_ms")
        ]
        goal = "voice, many voices: no percentile worse than the cascade (worst cascade/voice shown)"
        out.append(_goal(goal, ">= 1.0x each", min(ratios) if ratios else None, 1.0))
    return out


# --- markdown ------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _x(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value == 0 or abs(value) >= 0.1 else f"{value:.2g}x"  # keep tiny ratios readable


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out |= _flat(v, key) if isinstance(v, dict) else {key: v}
    return out


def _cell(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v, 2) for v in value)
    return _fmt(value, 2)


def _provenance(raw: dict[str, Any]) -> str:
    prov = raw.get("provenance", {})
    machine = prov.get("machine")
    lines = [f"- command: `{prov.get('command')}`", f"- commit: `{prov.get('commit')}`"]
    lines += [f"- machine: {json.dumps(machine) if isinstance(machine, dict) else machine}"]
    lines += [f"- date: {prov.get('date')}", f"- quick run: {prov.get('quick')}"]
    if raw.get("model"):
        lines.append(f"- model: `{json.dumps(raw['model'], default=str)}`")
    return "\n".join(lines)


def _workloads(raw: dict[str, Any]) -> str:
    parts = []
    for name, w in raw.get("workloads", {}).items():
        # stats: one trace's, or {qps: stats} (bench/suite.py: a trace per QPS level): a column each
        stats = w.get("stats") or {}
        per_level = stats if stats and all(isinstance(v, dict) for v in stats.values()) else {"": stats}
        levels = {f"ours{f' @ {q} QPS' if q else ''}": _flat(v) for q, v in per_level.items()}
        paper = _flat(w.get("paper") or {})
        files = w.get("files") or ([w["file"]] if w.get("file") else [])
        qps = headline_qps(raw, name)
        extra = {k: w[k] for k in ("delay_multiplier", "kv_sessions", "prefill_kv_blocks") if k in w}
        head = f"### {name}\n\nheadline QPS {qps}, QPS {w.get('qps')}" + "".join(f", {k} {v}" for k, v in extra.items())
        head += "".join(f"; `{f}`" for f in files) + "\n\n"
        keys = dict.fromkeys([*(k for v in levels.values() for k in v), *paper])
        rows = [[k, *(_cell(v.get(k)) for v in levels.values()), _cell(paper.get(k))] for k in keys]
        parts.append(head + (_table(["stat", *levels, "paper"], rows) if rows else "(no stats)"))
    return "\n\n".join(parts) or "(no workloads)"


def _ratios_cell(rows: list[dict[str, Any]], r: dict[str, Any], base: str) -> str:
    theirs = _find(rows, r["workload"], r["qps"], base)
    if theirs is None or r["system"] == base:
        return "-"
    return " / ".join(_x(_ratio(theirs[f"p{q}"], r[f"p{q}"])) for q in PERCENTILES)


def _runs_table(rows: list[dict[str, Any]], workload: str, baselines: tuple[str, ...]) -> str:
    mine = [r for r in rows if r["workload"] == workload]
    if not mine:
        return "(not run)"
    bases = [b for b in baselines if any(r["system"] == b for r in mine)]
    head = ["QPS", "system", "queries", "ok", "errors", "P50 ms", "P95 ms", "P99 ms", "mean ms", "work ratio"]
    head += ["completion s"]
    head += [f"speedup vs {b} (P50 / P95 / P99)" for b in bases]
    has_peer = "peer" in bases
    if has_peer:
        head.append("completion ratio (peer / this)")
    order = {s: i for i, s in enumerate(_order([r["system"] for r in mine]))}
    out = []
    for r in sorted(mine, key=lambda r: (r["qps"], order[r["system"]])):
        cells = [r["qps"], r["system"], r["n"], r["ok"], r["errors"], *(_fmt(r[f"p{q}"]) for q in PERCENTILES)]
        cells += [_fmt(r["mean"]), _fmt(r.get("work_ratio"), 3), _fmt(r["completion_s"], 2)]
        cells += [_ratios_cell(rows, r, b) for b in bases]
        if has_peer:
            peer = _find(rows, workload, r["qps"], "peer")
            cells.append(_x(_ratio(peer and peer["completion_s"], r["completion_s"])) if r["system"] != "peer" else "-")
        out.append(cells)
    errors = [
        f"- QPS {r['qps']} {r['system']}: " + ", ".join(f"{k} x{v}" for k, v in r["error_kinds"].items())
        for r in mine
        if r["error_kinds"]
    ]
    return _table(head, out) + ("\n\nErrors by kind:\n\n" + "\n".join(errors) if errors else "")


def _token_streaming(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    ts = summary.get("token_streaming") or {}
    if raw.get("token_streaming") is None:
        return "Not run in this suite (no token_path results)."
    head = "App against a plain vLLM server (`vllm`) and Ray Serve LLM (`rayllm`), streaming chat completions "
    head += f"({json.dumps(ts.get('source', {}))}). Ratios are higher-is-better: tok/s app / other; "
    head += "TTFT and ITL P50 other / app. A server that sends several tokens per network read shows an ITL P50 "
    head += "near 0 (frames read together share a time), which makes its ITL ratio near 0 too.\n\n"
    rows = [
        ["out tok/s, app / vllm, 128 chats", _x(ts.get("tokps_ratio_vs_vllm_at_128"))],
        ["out tok/s, app / rayllm, 128 chats", _x(ts.get("tokps_ratio_vs_rayllm_at_128"))],
        ["ITL P50, vllm / app, 32 chats", _x(ts.get("itl_p50_ratio_vs_vllm_at_32"))],
    ]
    text = head + _table(["ratio", "value"], rows)
    by_c = ts.get("by_concurrency") or {}
    if by_c:
        cols = [f"{m}_ratio_vs_{o}" for o in ("vllm", "rayllm") for m in ("tokps", "ttft_p50", "itl_p50")]
        labels = [f"{m} vs {o}" for o in ("vllm", "rayllm") for m in ("tok/s", "TTFT P50", "ITL P50")]
        text += "\n\n" + _table(["chats", *labels], [[c, *(_x(r.get(k)) for k in cols)] for c, r in by_c.items()])
    return text


def _preemptive(summary: dict[str, Any]) -> str:
    head = ["EOT lag", "users", "P50/P95/P99 ms, preemptive", "off", "speedup", "delivered", "discarded tok/turn"]
    head.append("decode step ms")
    rows = [
        [
            f"{r['eot_lag_ms']:.0f} ms",
            r["concurrency"],
            "/".join(_fmt(r[f"p{q}_ms"], 0) for q in PERCENTILES),
            "/".join(_fmt(r[f"p{q}_ms_off"], 0) for q in PERCENTILES),
            " / ".join(_x(r[f"p{q}_speedup"]) for q in PERCENTILES),
            f"{r['delivered_share']:.0%}",
            _fmt(r["discarded_tokens_per_turn"]),
            _fmt(r.get("decode_step_ms")),
        ]
        for r in summary["preemptive"].values()
    ]
    return "End of turn (the client's `/finish`, after the end-of-turn detector's lag) -> first token.\n\n" + _table(
        head, rows
    )


def _goals(summary: dict[str, Any]) -> str:
    rows = []
    for g in summary.get("goals") or goals(summary):
        result = "not measured" if g["met"] is None else ("met" if g["met"] else "short")
        figure = _x(g["measured"])
        if g.get("detail"):
            figure += " (" + ", ".join(f"{k} {_x(v)}" for k, v in g["detail"].items()) + ")"
        rows.append([g["goal"], g["target"], figure, result])
    return _table(["goal", "target", "measured", "result"], rows)


def markdown(raw: dict[str, Any], summary: dict[str, Any], plots: dict[str, Path]) -> str:
    """The suite's report; plots are linked by file name, as they sit beside suite.md in bench/results/."""
    rows = summarise(raw)
    systems = _order([r["system"] for r in rows])
    defs = "\n".join(f"- `{s}`: {DESCRIPTIONS.get(s, '')}" for s in systems)
    workloads = [w for w in dict.fromkeys([*raw.get("workloads", {}), *(r["workload"] for r in rows)])]
    sections = [f"# Streaming-input benchmark suite ({raw.get('provenance', {}).get('date')})", _provenance(raw)]
    sections += [
        "TTFT: last input chunk available -> first output token, in ms; failed queries are errors and left out of "
        "the percentiles (linear interpolation). Speedup vs X = X's percentile / this system's, at the same QPS: "
        "higher is better, 1.00x is parity. Completion ratio = peer's trace completion time / this system's: "
        "higher is better, >= 0.98 is within 2% of peer.",
        f"Systems:\n\n{defs}" if defs else "",
        f"## Workloads\n\n{_workloads(raw)}",
    ]
    for w in workloads:
        if w != "pressure":
            sections.append(f"## {w}\n\n{_runs_table(rows, w, BASELINES)}")
    if "pressure" in workloads:
        sections.append(f"## pressure (small KV cache)\n\n{_runs_table(rows, 'pressure', ('nonstreaming',))}")
    ratio = summary.get("completion_time_ratio_vs_peer")
    sections.append(f"Trace completion ratio, peer / streaming at the append headline QPS: {_x(ratio)}")
    sections.append(f"## Token streaming\n\n{_token_streaming(raw, summary)}")
    if summary.get("preemptive"):
        sections.append(f"## Preemptive answers\n\n{_preemptive(summary)}")
    sections.append(f"## Goals\n\n{_goals(summary)}")
    if plots:
        figs = "\n\n".join(f"![{name.replace('_', ' ')}]({Path(p).name})" for name, p in plots.items())
        sections.append(f"## Plots\n\n{figs}")
    notes = raw.get("notes") or []
    if notes:
        sections.append("## Notes\n\n" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(s for s in sections if s) + "\n"


# --- files ---------------------------------------------------------------------------------------------


def _ok(run: dict[str, Any]) -> list[float]:
    return [v for v in run.get("ttft_ms") or [] if v is not None]


def _plots(raw: dict[str, Any], summary: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    runs = raw.get("runs", [])
    written: dict[str, Path] = {}
    for workload in ("append", "update", "pressure"):
        qps = summary["headline_qps"].get(workload)
        at = [r for r in runs if r["workload"] == workload and qps is not None and _same(r["qps"], qps)]
        by_system = {r["system"]: r for r in at}
        series = {s: _ok(by_system[s]) for s in _order(list(by_system))}
        if any(series.values()):
            name = f"ttft_ccdf_{workload}"
            title = f"TTFT CCDF, {workload} at {qps} QPS"
            written[name] = plots.ttft_ccdf(series, out_dir / f"{name}.png", title)
        if workload == "pressure":
            ms = summary["ttft_ms"].get("pressure", {})
            bars = {s: ms[s] for s in _order(list(ms)) if any(ms[s].get(k) for k in ("p50", "p95", "p99"))}
            if bars:
                title = f"TTFT percentiles under memory pressure, {qps} QPS"
                written["ttft_percentiles_pressure"] = plots.percentile_bars(
                    bars, out_dir / "ttft_percentiles_pressure.png", title
                )
            continue
        points: dict[str, list[tuple[float, float]]] = {}
        for r in summarise(raw):
            if r["workload"] == workload and r["p95"] is not None:
                points.setdefault(r["system"], []).append((r["qps"], r["p95"]))
        if points:
            name = f"p95_vs_qps_{workload}"
            points = {s: points[s] for s in _order(list(points))}
            written[name] = plots.p95_vs_qps(points, out_dir / f"{name}.png", f"P95 TTFT vs QPS, {workload}")
    return written


def write(raw: dict[str, Any], out_dir: Path, stamp: str) -> dict[str, Path]:
    """Write suite.json (raw; a new run replaces the last), the plots, summary.json and suite.md into out_dir;
    return what was written by name ("raw", "summary", "markdown", and each plot's file stem). A plot without
    data is skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {"raw": out_dir / "suite.json"}
    paths["raw"].write_text(json.dumps(raw, indent=2, default=str) + "\n")
    summary = summary_json(raw)
    figures = _plots(raw, summary, out_dir)
    paths["summary"] = out_dir / "summary.json"
    paths["summary"].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    paths["markdown"] = out_dir / "suite.md"
    paths["markdown"].write_text(markdown(raw, summary, figures))
    return paths | figures
