"""Where a served token's and a request's CPU goes, per process: a fit over answer lengths, and an idle minute.

At one concurrency (32 streams), the system answers short chats (the app prefills them on decode, or hands them
off when decode is busy) of `max_tokens` 1, 32, 128 and 512, ignore_eos. For each process role, the CPU seconds of
each level are fitted as `a * requests + b * output tokens` (least squares): `a` is its CPU per request, `b` per
output token. The 1-token level is also reported on its own (`per_request_1tok_ms`): the cost of a request with
next to no tokens, the figure issue 42's goal names. Then the system sits idle for a minute (after its warm-up)
and each role's share of one core is read.

Roles are found as cpu.py finds them; `ray` is Ray's own processes (raylet, GCS, dashboard, Serve's controller and
proxy actor, agents: systems.RAY_OWN), counted beside the app's own.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

import clients
import cpu
import numpy as np

SHORT_PROMPT = "Say hello to the team in one sentence."
LENGTHS = (1, 32, 128, 512)
REQUESTS_PER_CLIENT = {1: 20, 32: 8, 128: 4, 512: 2}
QUICK_REQUESTS_PER_CLIENT = {1: 4, 32: 2}


def fit(levels: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """role -> {"per_request_ms", "per_token_us"}: CPU seconds = a * requests + b * tokens, least squares over the
    levels (at least two lengths)."""
    roles = sorted({role for level in levels for role in level["cpu_s"]})
    rows = np.array([[level["requests"], level["tokens"]] for level in levels], dtype=float)
    out: dict[str, dict[str, float | None]] = {}
    for role in roles:
        used = np.array([level["cpu_s"].get(role, 0.0) for level in levels], dtype=float)
        if len(levels) < 2:
            out[role] = {"per_request_ms": None, "per_token_us": None}
            continue
        (a, b), *_ = np.linalg.lstsq(rows, used, rcond=None)
        out[role] = {"per_request_ms": float(a) * 1e3, "per_token_us": float(b) * 1e6}
    return out


async def lengths(
    system: Any, roles: dict[str, list[Any]], concurrency: int = 32, quick: bool = False
) -> list[dict[str, Any]]:
    """One level per answer length: requests, output tokens, CPU seconds per role, requests/s, tokens/s."""
    per_client = QUICK_REQUESTS_PER_CLIENT if quick else REQUESTS_PER_CLIENT
    meter = cpu.CpuMeter(roles)
    out = []
    for max_tokens, n in per_client.items():
        one = partial(clients.chat, model=system.model, max_tokens=max_tokens, prompt=SHORT_PROMPT)
        await clients.run_level(one, min(8, concurrency), 1, system.base)  # (this length's warm-up)
        meter.start()
        level = await clients.run_level(one, concurrency, n, system.base)
        used = meter.stop(level["completion_tokens"])
        ok = level["requests"] - level["errors"]
        row = {
            "max_tokens": max_tokens,
            "concurrency": concurrency,
            "requests": ok,
            "errors": level["errors"],
            "tokens": level["completion_tokens"],
            "wall_s": level["wall_s"],
            "req_s": ok / level["wall_s"] if level["wall_s"] else None,
            "output_tok_s": level["output_tok_s"],
            "cpu_s": {role: figures["cpu_s"] for role, figures in used["roles"].items()},
        }
        out.append(row)
        print(
            f"  cost max_tokens={max_tokens}: {ok} answers ({level['errors']} errors), {row['req_s']:.0f} req/s, "
            + ", ".join(f"{role} {1e3 * s / max(ok, 1):.2f}" for role, s in row["cpu_s"].items())
            + " ms/request",
            flush=True,
        )
    return out


def idle(roles: dict[str, list[Any]], seconds: float) -> dict[str, float]:
    """role -> % of one core while nothing is asked of the system for `seconds`."""
    meter = cpu.CpuMeter(roles)
    meter.start()
    time.sleep(seconds)
    used = meter.stop(0)
    return {role: figures["pct_core"] for role, figures in used["roles"].items()}


async def measure(system: Any, roles: dict[str, list[Any]], quick: bool = False, idle_s: float = 60.0) -> dict:
    """The lengths, their fit, the 1-token level's CPU per request, and an idle stretch, for one system."""
    levels = await lengths(system, roles, quick=quick)
    one = next(level for level in levels if level["max_tokens"] == 1)
    per_request = {role: 1e3 * s / max(one["requests"], 1) for role, s in one["cpu_s"].items()}
    await asyncio.sleep(2.0)  # (the last answers' ends settle before the idle clock starts)
    quiet = await asyncio.to_thread(idle, roles, idle_s)
    print("  idle: " + ", ".join(f"{role} {pct:.1f}%" for role, pct in quiet.items()) + " of a core", flush=True)
    return {"levels": levels, "fit": fit(levels), "per_request_1tok_ms": per_request, "idle_pct_core": quiet}
