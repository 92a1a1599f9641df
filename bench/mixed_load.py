"""Mixed load: decode streams while long prompts prefill, on the default config (no speech role).

Twelve closed-loop streamed chats of 128 tokens (short prompts: decode computes them) and two closed-loop streams of
~900-token prompts answered in 2 tokens (disaggregated: prefill computes them, decode pulls the KV), for 30 s.
Printed and saved (bench/results/mixed_load.json): the chats' inter-token time P50 / P90 and tokens made in the
30 s, the long prompts' TTFT P50 / P90 and how many. It shows whether prefill's work reaches decode's streams:
with each engine on its own core it should not.

    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/mixed_load.py
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import clients
import httpx
import systems
import yaml

ROOT = Path(__file__).resolve().parents[1]
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 60  # ~900 tokens
DURATION_S = 30.0


async def chats(client: httpx.AsyncClient, model: str, stop: asyncio.Event, gaps: list[float], n: int) -> None:
    while not stop.is_set():
        gaps.extend((await clients.chat(client, model, 128, prompt=f"hi {n}")).itls)


async def long_prompts(client: httpx.AsyncClient, model: str, stop: asyncio.Event, ttfts: list[float], k: int) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        answer = await clients.chat(client, model, 2, prompt=f"{k}-{i} " + LONG)
        if answer.ttft is not None:
            ttfts.append(answer.ttft)


async def run(app: Any) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=app.base, timeout=120, limits=limits) as client:
        warm = {"model": app.model, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
        await client.post("/v1/chat/completions", json=warm)
        stop, gaps, ttfts = asyncio.Event(), [], []
        tasks = [asyncio.create_task(chats(client, app.model, stop, gaps, n)) for n in range(12)]
        tasks += [asyncio.create_task(long_prompts(client, app.model, stop, ttfts, k)) for k in range(2)]
        await asyncio.sleep(DURATION_S)
        stop.set()
        await asyncio.gather(*tasks)
    return {
        "itl_p50_ms": clients.pct_ms(gaps, 50),
        "itl_p90_ms": clients.pct_ms(gaps, 90),
        "chat_tokens": len(gaps),
        "long_ttft_p50_ms": clients.pct_ms(ttfts, 50),
        "long_ttft_p90_ms": clients.pct_ms(ttfts, 90),
        "long_prompts": len(ttfts),
    }


def main() -> None:
    app_args = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"][0]["args"]
    app_args.pop("speech", None)
    with systems.app(app_args) as app:
        result = asyncio.run(run(app))
    print(json.dumps(result, indent=1))
    (ROOT / "bench" / "results" / "mixed_load.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
