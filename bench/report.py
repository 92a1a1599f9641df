"""Tables, ratios and goal checks for the token-path benchmark's results (token_path.py)."""

from __future__ import annotations

from typing import Any

import cost_report

KINDS = {"chat": "chat", "session": "REST session", "realtime": "realtime WS"}
LATENCY = ["ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms"]
CPU_ROLES = ["router", "proxy", "frontend", "prefill_replica", "decode_replica", "engines"]


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def _role(level: dict[str, Any], role: str, key: str) -> float | None:
    return (level.get("cpu", {}).get("roles", {}).get(role) or {}).get(key)


def front_cpu(level: dict[str, Any]) -> tuple[float | None, float | None]:
    """(% of one core, CPU ms per 1,000 output tokens) of the router and the proxy together; for the plain
    server, of its API server process (the engine core excluded)."""
    roles = [r for r in ("router", "proxy", "frontend") if _role(level, r, "cpu_s") is not None]
    if not roles:
        return None, None
    pct = sum(_role(level, r, "pct_core") or 0.0 for r in roles)
    per_k = [_role(level, r, "ms_per_1k_tokens") for r in roles]
    return pct, None if None in per_k else sum(per_k)  # type: ignore[arg-type]


def progress_line(kind: str, level: dict[str, Any]) -> str:
    pct, per_k = front_cpu(level)
    return (
        f"{kind} c={level['concurrency']}: {level['requests']} answers, {level['errors']} errors, "
        f"{level['wall_s']:.1f}s, {_fmt(level['output_tok_s'])} tok/s, TTFT p50 {_fmt(level['ttft_p50_ms'])} ms, "
        f"ITL p50/p99 {_fmt(level['itl_p50_ms'], 2)}/{_fmt(level['itl_p99_ms'], 2)} ms, "
        f"{_fmt(level.get('tokens_per_frame'), 2)} tok/frame, "
        f"router+proxy {_fmt(pct)}% core, {_fmt(per_k)} ms/1k tok"
        + (f" {level['error_examples'][:1]}" if level["errors"] else "")
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios app/plain and app/rayllm per chat level, and the goals."""
    ratios: dict[str, Any] = {}
    for name in ("app", "app_serve_proxy"):  # behind HAProxy (the default), behind Serve's own proxy
        app = results.get(name, {}).get("chat", {})
        for peer in ("plain", "plain_decode", "rayllm", "app"):
            other = results.get(peer, {}).get("chat", {})
            for c, mine in app.items():
                theirs = other.get(c)
                if theirs is None or peer == name:
                    continue
                row = {k: _ratio(mine.get(k), theirs.get(k)) for k in [*LATENCY, "output_tok_s"]}
                row["ttft_p50_diff_ms"] = (
                    mine["ttft_p50_ms"] - theirs["ttft_p50_ms"]
                    if mine.get("ttft_p50_ms") is not None and theirs.get("ttft_p50_ms") is not None
                    else None
                )
                row["front_ms_per_1k_tokens"] = _ratio(front_cpu(mine)[1], front_cpu(theirs)[1])
                ratios.setdefault(f"{name}/{peer}", {})[c] = row
    return {"ratios": ratios, "goals": goals(ratios) + overload_goals(results) + cost_report.goals(results)}


def goals(ratios: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    plain, rayllm = ratios.get("app/plain", {}), ratios.get("app/rayllm", {})
    for c in ("32", "128"):
        if c in plain:
            value = plain[c]["output_tok_s"]
            out.append({"goal": f"tok/s >= 0.95x plain at c={c}", "value": value, "met": (value or 0) >= 0.95})
    if "1" in plain:
        value = plain["1"]["ttft_p50_diff_ms"]
        met = value is not None and value <= 20
        out.append({"goal": "TTFT P50 at c=1 within 20 ms of plain", "value": value, "met": met})
    for c, row in rayllm.items():
        tok, ttft = row["output_tok_s"], row["ttft_p50_ms"]
        met = tok is not None and ttft is not None and tok > 1 and ttft < 1
        out.append({"goal": f"ahead of Ray Serve LLM at c={c} (tok/s, TTFT P50)", "value": [tok, ttft], "met": met})
    return out


def overload_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 31's: past 32 streams, no refusal where plain vLLM serves every request, no collapse (tok/s no lower
    than the app's own at 32) and TTFT P90 within 2x of plain's; the session APIs past 32 without refusals."""
    out: list[dict[str, Any]] = []
    app, plain = results.get("app", {}), results.get("plain", {}).get("chat", {})
    chat = app.get("chat", {})
    base = (chat.get("32") or {}).get("output_tok_s")
    for c, mine in chat.items():
        if int(c) <= 32:
            continue
        theirs = plain.get(c)
        if theirs is not None and not theirs["errors"]:
            out.append(
                {"goal": f"no refusals at c={c} (plain: none)", "value": mine["errors"], "met": not mine["errors"]}
            )
            p90 = _ratio(mine.get("ttft_p90_ms"), theirs.get("ttft_p90_ms"))
            out.append({"goal": f"TTFT P90 <= 2x plain at c={c}", "value": p90, "met": p90 is not None and p90 <= 2})
        if base:
            value = _ratio(mine.get("output_tok_s"), base)
            out.append({"goal": f"tok/s at c={c} >= the app's at c=32", "value": value, "met": (value or 0) >= 1})
    for kind in ("session", "realtime"):
        for c, mine in app.get(kind, {}).items():
            if int(c) > 32:
                value = mine["errors"]
                out.append({"goal": f"no refusals: {KINDS[kind]} at c={c}", "value": value, "met": not value})
    return out


def main_table(results: dict[str, Any]) -> str:
    head = "| system | API | c | answers | errors | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | ITL p99 | out tok/s "
    head += "| tok/frame | router %core | proxy %core | router+proxy CPU ms / 1k tok |"
    lines = [head, "|" + "---|" * 15]
    for name, result in results.items():
        for kind, label in KINDS.items():
            for c, lv in result.get(kind, {}).items():
                router = _role(lv, "frontend" if name.startswith("plain") else "router", "pct_core")
                cells = [name, label, c, lv["requests"], lv["errors"], *(_fmt(lv[k], 2) for k in LATENCY)]
                cells += [_fmt(lv["output_tok_s"]), _fmt(lv.get("tokens_per_frame"), 2)]
                cells += [_fmt(router), _fmt(_role(lv, "proxy", "pct_core"))]
                cells += [_fmt(front_cpu(lv)[1])]
                lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def cpu_table(results: dict[str, Any]) -> str:
    head = "| system | API | c | " + " | ".join(CPU_ROLES) + " | bench client | outside this run | busy per core |"
    lines = [head, "|" + "---|" * 12]
    for name, result in results.items():
        for kind, label in KINDS.items():
            for c, lv in result.get(kind, {}).items():
                cells = [name, label, c, *(_fmt(_role(lv, r, "pct_core")) for r in CPU_ROLES)]
                cells += [_fmt(lv.get("cpu", {}).get(k)) for k in ("client_pct_core", "outside_pct_core")]
                cells.append(" / ".join(_fmt(x, 0) for x in lv.get("cpu", {}).get("core_busy_pct", [])))
                lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def ratio_table(ratios: dict[str, Any]) -> str:
    head = "| ratio | c | out tok/s | TTFT p50 (diff ms) | TTFT p90 | ITL p50 | ITL p90 | ITL p99 "
    lines = [head + "| router+proxy CPU / 1k tok |", "|" + "---|" * 9]
    for name, by_c in ratios.items():
        for c, r in by_c.items():
            ttft = f"{_fmt(r['ttft_p50_ms'], 2)} ({_fmt(r['ttft_p50_diff_ms'])})"
            cells = [name, c, _fmt(r["output_tok_s"], 2), ttft]
            cells += [_fmt(r[k], 2) for k in LATENCY[1:]] + [_fmt(r["front_ms_per_1k_tokens"], 2)]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


BENCH_SERVE = [
    ("ok", "Successful requests"),
    ("failed", "Failed requests"),
    ("s", "Benchmark duration (s)"),
    ("out tok/s", "Output token throughput (tok/s)"),
    ("TTFT p50", "Median TTFT (ms)"),
    ("TTFT p99", "P99 TTFT (ms)"),
    ("TPOT p50", "Median TPOT (ms)"),
    ("ITL p50", "Median ITL (ms)"),
    ("ITL p99", "P99 ITL (ms)"),
]


def bench_serve_section(results: dict[str, Any]) -> str:
    runs = {name: r["vllm_bench_serve"] for name, r in results.items() if "vllm_bench_serve" in r}
    if not runs:
        return ""
    lines = ["| system | " + " | ".join(label for label, _ in BENCH_SERVE) + " |", "|" + "---|" * 10]
    for name, run in runs.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(run["figures"].get(key)) for _, key in BENCH_SERVE) + " |")
    commands = "\n".join(f"    {run['command']}" for run in runs.values())
    return f"\n## vllm bench serve (vLLM's own client, random prompts)\n\n{commands}\n\n" + "\n".join(lines) + "\n"


def markdown(meta: dict[str, Any], results: dict[str, Any], summary: dict[str, Any]) -> str:
    m = meta["machine"]
    goal_lines = []
    for g in summary["goals"]:
        values = g["value"] if isinstance(g["value"], list) else [g["value"]]
        goal_lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']}: {', '.join(_fmt(v, 2) for v in values)}")
    return (
        f"# Token-path benchmark ({meta['timestamp']})\n\n"
        f"Command: `{meta['command']}` ({meta['total_s'] / 60:.1f} min)\n\n"
        f"Machine: {m['nproc']} CPUs, {m['cpu_model']}. Model: {meta['model']}, max_tokens {meta['max_tokens']}, "
        f"prompt {meta.get('prompt', 'long')}, ignore_eos, temperature 0. "
        "Latencies in ms; ITL is the gap between frames with text as the client reads them (a frame may carry "
        "several tokens: plain vLLM's when its loop lags, the app's under load, decode/pacing.py; tok/frame says "
        "how many); "
        "CPU in % of one core over the level's wall time; "
        "for `plain` the router column is its API server process.\n\n"
        f"{main_table(results)}\n\n## Ratios (app / other)\n\n{ratio_table(summary['ratios'])}\n\n"
        "## Goals\n\n"
        + "\n".join(goal_lines)
        + f"\n\n## CPU by process (% of one core)\n\n{cpu_table(results)}\n"
        + bench_serve_section(results)
        + cost_report.section(results)
    )
