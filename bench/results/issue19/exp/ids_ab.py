"""A/B in one app: decode reuses the prefill replica's prompt ids, or renders the chat again.

Needs a temporary switch in prefill/server.py `prefill`: `... and body.get("user") != "noids"` on the condition that
adds `prompt_token_ids` to the kv_transfer_params. One stream: 30 interleaved pairs (TTFT, decode's Server-Timing
segment). 32 streams: non-streaming 128-token chats for 20 s per mode, 4 rounds alternating, with the decode
replica's CPU per request."""

import asyncio
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main")
import clients
import httpx
import psutil
import systems
import yaml


def find(substr: str) -> psutil.Process:
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        if substr in " ".join(p.info["cmdline"] or []) or substr in (p.info["name"] or ""):
            return p
    raise LookupError(substr)


def body_for(model: str, mode: str, max_tokens: int, stream: bool) -> dict:
    body = clients.chat_body(model, max_tokens)
    if not stream:
        body.pop("stream_options", None)
        body["stream"] = False
    if mode == "noids":
        body["user"] = "noids"
    return body


async def one(c: httpx.AsyncClient, model: str, mode: str) -> tuple[float, float]:
    t0, first = time.perf_counter(), None
    async with c.stream("POST", "/v1/chat/completions", json=body_for(model, mode, 16, True)) as r:
        timing = r.headers.get("server-timing")
        async for line in r.aiter_lines():
            if first is None and '"content":"' in line:
                first = time.perf_counter()
    return (first - t0) * 1e3, float(re.search(r"decode;dur=([\d.]+)", timing)[1])


async def ttft(base: str, model: str, pairs: int) -> None:
    res: dict[str, list[tuple[float, float]]] = {"ids": [], "noids": []}
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for i in range(pairs):
            for mode in ("ids", "noids") if i % 2 else ("noids", "ids"):
                res[mode].append(await one(c, model, mode))
                await asyncio.sleep(0.1)
    for m, v in res.items():
        ttft_p50, decode_p50 = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        print(f"c=1 {m}: TTFT p50 {ttft_p50:.1f} ms, decode segment p50 {decode_p50:.1f} ms (n={len(v)})")


async def load(base: str, model: str, seconds: float, conc: int, mode: str) -> tuple[int, int]:
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
        stop, tokens, n = time.monotonic() + seconds, 0, 0

        async def loop() -> None:
            nonlocal tokens, n
            while time.monotonic() < stop:
                r = await c.post("/v1/chat/completions", json=body_for(model, mode, 128, False))
                if r.status_code == 200:
                    tokens, n = tokens + r.json()["usage"]["completion_tokens"], n + 1

        await asyncio.gather(*(loop() for _ in range(conc)))
        return tokens, n


app_args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
with systems.app(app_args) as s:
    asyncio.run(ttft(s.base, s.model, 4))
    asyncio.run(ttft(s.base, s.model, 30))
    decode = find(s.roles["decode_replica"])
    for rnd in range(4):
        for mode in ("ids", "noids") if rnd % 2 == 0 else ("noids", "ids"):
            c0, t0 = sum(decode.cpu_times()[:2]), time.monotonic()
            tokens, n = asyncio.run(load(s.base, s.model, 20, 32, mode))
            wall, cpu = time.monotonic() - t0, sum(decode.cpu_times()[:2]) - c0
            print(
                f"c=32 {mode}: {tokens / wall:,.0f} tok/s, {n} requests, decode replica {cpu / n * 1e3:.1f} ms CPU each"
            )
