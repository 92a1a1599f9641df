"""Round trips of the session control path: where an end of turn's time goes before any token.

Against this app (behind the default ingress, as every bench runs it), one client in sequence: `GET /v1/models`
(the router alone), session create, chunks, `GET` session info (router → owner prefill replica → back, no work)
and `/finish` (the owner starts the answer). The difference between info and models is one Serve call's round
trip between replicas, which every end of turn pays (a preemptive answer's first token included,
bench/preemptive.py).

    .venv/bin/python bench/control_path.py [--sessions 25]

Serve's process settings come from the environment (e.g. `RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0
RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0` to compare, as serve_app/serve_env.py's one-loop setting was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable
from pathlib import Path

import httpx
import systems
import yaml

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = "/v1/streaming_input/sessions"


async def measure(base: str, sessions: int) -> dict[str, list[float]]:
    calls: dict[str, list[float]] = {k: [] for k in ("models", "create", "chunk", "info", "finish")}

    async def timed(name: str, request: Awaitable[httpx.Response]) -> httpx.Response:
        began = time.perf_counter()
        response = await request
        calls[name].append(time.perf_counter() - began)
        response.raise_for_status()
        return response

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for i in range(sessions):
            await timed("models", client.get("/v1/models"))
            body = {"messages": [], "max_tokens": 4, "temperature": 0, "close_after_answer": True}
            sid = (await timed("create", client.post(SESSIONS, json=body))).json()["session_id"]
            for seq in range(3):
                chunk = {"sequence_id": seq, "payload": f"word{seq} pipeline{i} "}
                await timed("chunk", client.post(f"{SESSIONS}/{sid}/chunks", json=chunk))
                await asyncio.sleep(0.05)
            await timed("info", client.get(f"{SESSIONS}/{sid}"))
            await asyncio.sleep(0.3)  # (the chunks settle: the finish is an end of turn, not a flush)
            await timed("finish", client.post(f"{SESSIONS}/{sid}/finish"))
            await client.get(f"{SESSIONS}/{sid}/result")
            await client.delete(f"{SESSIONS}/{sid}")
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=25)
    parser.add_argument("--config", default=str(ROOT / "configs" / "config.yaml"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    with systems.app(app_args) as app:
        calls = asyncio.run(measure(app.base, args.sessions))
    for name, times in calls.items():
        ms = [t * 1e3 for t in times]
        print(f"{name:8s} p50 {statistics.median(ms):6.1f} ms  min {min(ms):6.1f}  max {max(ms):6.1f}")


if __name__ == "__main__":
    main()
