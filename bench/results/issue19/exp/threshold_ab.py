"""A/B in one app: the shipped router (min_prompt_tokens 256: the bench's 416-token prompt is disaggregated) and a
second router app on the same prefill and decode replicas with min_prompt_tokens 4096 (decode prefills it),
requests interleaved: TTFT at one stream (30 pairs), and 32 streams for 15 s per router, 4 rounds alternating."""

import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main")
import clients
import httpx
import systems
import yaml
from ray import serve


async def one(c: httpx.AsyncClient, model: str, prefix: str) -> tuple[float, str | None]:
    t0, first = time.perf_counter(), None
    async with c.stream("POST", f"{prefix}/v1/chat/completions", json=clients.chat_body(model, 16)) as r:
        by = r.headers.get("x-prefilled-by")
        async for line in r.aiter_lines():
            if first is None and '"content":"' in line:
                first = time.perf_counter()
    return (first - t0) * 1e3, by


async def ttft(base: str, model: str, pairs: int) -> None:
    res: dict[str, list[tuple[float, str | None]]] = {"": [], "/local": []}
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for i in range(pairs):
            for p in ("", "/local") if i % 2 else ("/local", ""):
                res[p].append(await one(c, model, p))
                await asyncio.sleep(0.1)
    for p, v in res.items():
        p50, where = statistics.median(x[0] for x in v), {x[1] for x in v}
        print(f"c=1 {p or '/'}: TTFT p50 {p50:.1f} ms, prefilled by {where} (n={len(v)})", flush=True)


async def load(base: str, model: str, seconds: float, conc: int) -> tuple[list[clients.Sample], float, int]:
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
        stop, samples, errors = time.monotonic() + seconds, [], 0

        async def loop() -> None:
            nonlocal errors
            while time.monotonic() < stop:
                s = await clients.chat(c, model, 128)
                if s.tokens:
                    samples.append(s)
                else:
                    errors += 1
                    await asyncio.sleep(0.05)

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(conc)))
        return samples, time.monotonic() - t0, errors


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3


def local_router(args: dict) -> None:
    from router.app import Router
    from serve_app.config import AppConfig

    cfg = copy.deepcopy(args)
    cfg["router"]["disaggregation"]["min_prompt_tokens"] = 4096
    config = AppConfig.model_validate(cfg)
    payload = config.model_dump(mode="json", exclude={r: {"deployment"} for r in ("router", "prefill", "decode")})
    prefill = serve.get_deployment_handle("prefill", app_name=systems.APP_NAME)
    decode = serve.get_deployment_handle("decode", app_name=systems.APP_NAME)
    router = Router.options(**config.router.deployment).bind(prefill, decode, payload)
    serve.run(router, name="local", route_prefix="/local")


app_args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
with systems.app(app_args) as s:
    local_router(app_args)
    systems.wait_health(s.base + "/local", 300)
    asyncio.run(ttft(s.base, s.model, 4))  # (the second router loads its tokenizer meanwhile)
    asyncio.run(ttft(s.base, s.model, 30))
    for rnd in range(4):
        for p in ("", "/local") if rnd % 2 == 0 else ("/local", ""):
            samples, wall, errors = asyncio.run(load(s.base + p, s.model, 15, 32))
            tokens, gaps = sum(x.tokens for x in samples), [g for x in samples for g in x.itls]
            ttft50 = pct([x.ttft for x in samples], 50)
            print(
                f"c=32 {p or '/'}: {tokens / wall:,.0f} tok/s, TTFT p50 {ttft50:.0f} ms, "
                f"gap p50/p99 {pct(gaps, 50):.1f}/{pct(gaps, 99):.1f} ms, errors {errors}",
                flush=True,
            )
