"""The cost part of the token-path results (cost.py): tables per process, serving totals, and issue 42's goals."""

from __future__ import annotations

from typing import Any

# What serves a token and a request, by system kind; the plain server's API server does it all in one process.
SERVING_TOKEN = {"app": ["router", "proxy", "decode_replica"], "plain": ["frontend"]}
SERVING_REQUEST = {"app": ["router", "proxy", "prefill_replica", "decode_replica"], "plain": ["frontend"]}
NOT_OWN = {"ray"}  # Ray's own processes: reported beside a system's own, not in them


def _kind(name: str) -> str:
    return "plain" if name.startswith("plain") else "app"


def _sum(values: dict[str, Any], roles: list[str]) -> float | None:
    found = [values[r] for r in roles if values.get(r) is not None]
    return sum(found) if found else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def serving(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """Serving CPU of one system: us per output token at each chat level, ms per 1-token request, fitted us per
    token, idle % of a core (its own processes, and Ray's)."""
    kind = _kind(name)
    out: dict[str, Any] = {"token_us": {}}
    for c, level in (result.get("chat") or {}).items():
        roles = {r: v.get("ms_per_1k_tokens") for r, v in (level.get("cpu") or {}).get("roles", {}).items()}
        out["token_us"][c] = _sum(roles, SERVING_TOKEN[kind])  # (ms per 1k tokens = us per token)
    spent = result.get("cost")
    if spent:
        out["request_ms"] = _sum(spent["per_request_1tok_ms"], SERVING_REQUEST[kind])
        fitted = {r: v["per_token_us"] for r, v in spent["fit"].items()}
        out["fit_token_us"] = _sum(fitted, SERVING_TOKEN[kind])
        idle = spent["idle_pct_core"]
        out["idle_own_pct"] = sum(v for r, v in idle.items() if r not in NOT_OWN and v is not None)
        out["idle_ray_pct"] = idle.get("ray")
        one = next((lv for lv in spent["levels"] if lv["max_tokens"] == 1), None)
        out["req_s"] = one["req_s"] if one else None
    return out


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 42's: serving CPU per token <= 1.5x plain's API server at 32 and 128 streams, per request <= 2x, the
    app idle under 5% of a core; tok/s >= 0.8x plain at every level, TTFT P90 at 128 within 2x, 1-token req/s
    >= 0.5x plain, tok/s >= 2.5x Ray Serve LLM at 128."""
    if "app" not in results or "plain" not in results:
        return []
    app, plain = serving("app", results["app"]), serving("plain", results["plain"])
    out: list[dict[str, Any]] = []
    for c in ("32", "128"):
        value = _ratio(app["token_us"].get(c), plain["token_us"].get(c))
        if value is not None:
            out.append({"goal": f"serving CPU/token <= 1.5x plain at c={c}", "value": value, "met": value <= 1.5})
    if (value := _ratio(app.get("request_ms"), plain.get("request_ms"))) is not None:
        out.append({"goal": "serving CPU/request (1-token) <= 2x plain", "value": value, "met": value <= 2})
    if (value := app.get("idle_own_pct")) is not None:
        out.append({"goal": "idle: the app's own processes < 5% of a core", "value": value, "met": value < 5})
    chat_app, chat_plain = results["app"].get("chat", {}), results["plain"].get("chat", {})
    for c, mine in chat_app.items():
        if (theirs := chat_plain.get(c)) is not None:
            value = _ratio(mine.get("output_tok_s"), theirs.get("output_tok_s"))
            out.append({"goal": f"tok/s >= 0.8x plain at c={c}", "value": value, "met": (value or 0) >= 0.8})
    if (theirs := chat_plain.get("128")) is not None and "128" in chat_app:
        value = _ratio(chat_app["128"].get("ttft_p90_ms"), theirs.get("ttft_p90_ms"))
        out.append({"goal": "TTFT P90 at c=128 <= 2x plain", "value": value, "met": value is not None and value <= 2})
    if (value := _ratio(app.get("req_s"), plain.get("req_s"))) is not None:
        out.append({"goal": "1-token requests/s >= 0.5x plain", "value": value, "met": value >= 0.5})
    rayllm = results.get("rayllm", {}).get("chat", {}).get("128")
    if rayllm is not None and "128" in chat_app:
        value = _ratio(chat_app["128"].get("output_tok_s"), rayllm.get("output_tok_s"))
        out.append({"goal": "tok/s >= 2.5x Ray Serve LLM at c=128", "value": value, "met": (value or 0) >= 2.5})
    return out


def section(results: dict[str, Any]) -> str:
    """Markdown: per system, each process's CPU per 1-token request, fitted per request and per token, idle share;
    then the serving totals side by side."""
    parts = []
    for name, result in results.items():
        spent = result.get("cost")
        if not spent:
            continue
        lines = [
            f"### {name}",
            "",
            "| process | ms per 1-token request | fit: ms per request | fit: us per output token | idle % of a core |",
            "|---|---|---|---|---|",
        ]
        for role, fitted in spent["fit"].items():
            cells = [role, _fmt(spent["per_request_1tok_ms"].get(role)), _fmt(fitted["per_request_ms"])]
            cells += [_fmt(fitted["per_token_us"], 1), _fmt(spent["idle_pct_core"].get(role), 1)]
            lines.append("| " + " | ".join(cells) + " |")
        levels = ", ".join(
            f"{lv['max_tokens']} tok: {lv['requests']} req, {_fmt(lv['req_s'], 0)} req/s" for lv in spent["levels"]
        )
        parts.append("\n".join(lines) + f"\n\nLevels (32 streams): {levels}.\n")
    if not parts:
        return ""
    head = "| system | serving us/token at each c | fit: us/token | ms per 1-token request | req/s "
    head += "| idle own % | idle Ray % |"
    rows = [head, "|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        if not result.get("cost"):
            continue
        s = serving(name, result)
        per_c = " / ".join(f"{c}: {_fmt(v, 0)}" for c, v in s["token_us"].items())
        cells = [name, per_c, _fmt(s.get("fit_token_us"), 0), _fmt(s.get("request_ms")), _fmt(s.get("req_s"), 0)]
        cells += [_fmt(s.get("idle_own_pct"), 1), _fmt(s.get("idle_ray_pct"), 1)]
        rows.append("| " + " | ".join(cells) + " |")
    serving_roles = "; ".join(f"{k}: {' + '.join(v)}" for k, v in SERVING_TOKEN.items())
    return (
        "\n## Where the CPU goes (bench/cost.py)\n\n"
        f"Serving per token = {serving_roles}; per request adds the prefill replica. Idle: after the levels, a "
        "stretch with no requests.\n\n" + "\n".join(rows) + "\n\n" + "\n".join(parts)
    )
