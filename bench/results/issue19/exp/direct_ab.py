"""What "direct streaming" (the decode replica as the HTTP ingress, no router hop, as Ray Serve LLM's
RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING) could win, measured as its upper bound in one Ray instance behind HAProxy:

- `/local`: the shipped router (a second router app, min_prompt_tokens 4096: decode prefills the bench prompt) ->
  Ray call -> the app's decode replica -> its feed -> router -> HAProxy;
- `/direct`: a deployment holding its own decode engine (same config) with a FastAPI route that returns vLLM's
  SSE generator straight to HAProxy: decode-local prefill, no router, no feed, no Ray hop for the request;
- `app`: the shipped app (the prompt is prefilled on the prefill replica and moved over NIXL);
- `plain`: vLLM's own OpenAI server (bench/systems.py `plain`), started beside them.

Same prompt, 128 output tokens: one stream (TTFT, 30 interleaved rounds), then 32 streams for 15 s per path,
4 rounds, rotating the order; tok/s from the usage frame and the serving processes' CPU per 1,000 tokens."""

import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main")
import clients
import httpx
import psutil
import systems
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

direct_api = FastAPI()


@serve.deployment(name="direct", max_ongoing_requests=1024)
@serve.ingress(direct_api)
class Direct:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        from serve_app.config import AppConfig
        from serve_app.engine import Engine

        self.engine = Engine(AppConfig.model_validate(app_config), "decode")
        await self.engine.start()

    @direct_api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        result = await self.engine.openai("chat", await request.json())
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump(mode="json"))


class Prefixed(httpx.AsyncClient):
    """The bench client's chat() posts to /v1/chat/completions: this puts the path's prefix before it."""

    def __init__(self, prefix: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.prefix = prefix

    def stream(self, method: str, url: str, **kw: Any) -> Any:  # type: ignore[override]
        return super().stream(method, self.prefix + url, **kw)


def procs(substr: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if substr in " ".join(p.info["cmdline"] or [])]


def cpu(ps: list[psutil.Process]) -> float:
    total = 0.0
    for p in ps:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


Targets = dict[str, tuple[str, str]]  # label -> (base URL, path prefix)


async def ttft(targets: Targets, model: str, rounds: int) -> None:
    paths = list(targets)
    res: dict[str, list[float]] = {p: [] for p in paths}
    for i in range(rounds):
        for p in paths[i % len(paths) :] + paths[: i % len(paths)]:
            base, prefix = targets[p]
            async with Prefixed(prefix, base_url=base, timeout=120) as c:
                s = await clients.chat(c, model, 16)
            if s.ttft is not None:
                res[p].append(s.ttft * 1e3)
            await asyncio.sleep(0.1)
    for p, v in res.items():
        print(f"c=1 {p}: TTFT p50 {statistics.median(v):.1f} ms (n={len(v)})", flush=True)


async def load(base: str, model: str, prefix: str, seconds: float, conc: int) -> tuple[int, float, list[float], int]:
    limits = httpx.Limits(max_connections=256)
    async with Prefixed(prefix, base_url=base, timeout=120, limits=limits) as c:
        stop, tokens, itls, errors = time.monotonic() + seconds, 0, [], 0

        async def loop() -> None:
            nonlocal tokens, errors
            while time.monotonic() < stop:
                s = await clients.chat(c, model, 128)
                if s.error is None:
                    tokens += s.tokens
                    itls.extend(s.itls)
                else:
                    errors += 1
                    await asyncio.sleep(0.05)

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(conc)))
        return tokens, time.monotonic() - t0, itls, errors


def main() -> None:
    from router.app import Router
    from serve_app.config import AppConfig

    args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
    with systems.app(args) as s:
        cfg = copy.deepcopy(args)
        cfg["router"]["disaggregation"]["min_prompt_tokens"] = 4096
        config = AppConfig.model_validate(cfg)
        payload = config.model_dump(mode="json", exclude={r: {"deployment"} for r in ("router", "prefill", "decode")})
        prefill = serve.get_deployment_handle("prefill", app_name=systems.APP_NAME)
        decode = serve.get_deployment_handle("decode", app_name=systems.APP_NAME)
        router = Router.options(**config.router.deployment).bind(prefill, decode, payload)
        serve.run(router, name="local", route_prefix="/local")
        serve.run(Direct.bind(payload), name="direct", route_prefix="/direct")
        systems.wait_health(s.base, 300, path="/local/health")
        time.sleep(5)
        plain_cm = systems.plain(config)
        plain = plain_cm.__enter__()
        targets = {
            "/local": (s.base, "/local"),
            "/direct": (s.base, "/direct"),
            "app": (s.base, ""),
            "plain": (plain.base, ""),
        }
        paths = list(targets)
        serving = {
            "/local": procs("ServeReplica:local:router") + procs(s.roles["decode_replica"]) + procs("haproxy"),
            "/direct": procs("ServeReplica:direct:direct") + procs("haproxy"),
            "app": procs(s.roles["router"])
            + procs(s.roles["decode_replica"])
            + procs(s.roles["prefill_replica"])
            + procs("haproxy"),
            "plain": procs(plain.roles["frontend"]),
        }
        asyncio.run(ttft(targets, s.model, 6))  # warm-up
        asyncio.run(ttft(targets, s.model, 30))
        rows: dict[str, list[tuple[float, float, float, int]]] = {p: [] for p in paths}
        itls: dict[str, list[float]] = {p: [] for p in paths}
        for rnd in range(4):
            for p in paths[rnd % 4 :] + paths[: rnd % 4]:
                c0 = cpu(serving[p])
                tokens, wall, gaps, errors = asyncio.run(load(targets[p][0], s.model, targets[p][1], 15, 32))
                used = cpu(serving[p]) - c0
                rows[p].append((tokens / wall, used / tokens * 1e6 if tokens else 0.0, wall, errors))
                itls[p] += gaps
                print(
                    f"round {rnd} c=32 {p}: {tokens / wall:,.0f} tok/s, serving CPU {rows[p][-1][1]:.0f} ms/1k tok, "
                    f"{errors} errors",
                    flush=True,
                )
        for p in paths:
            tps = statistics.mean(r[0] for r in rows[p])
            ms = statistics.mean(r[1] for r in rows[p])
            p99 = clients.pct_ms(itls[p], 99)
            print(f"c=32 {p}: mean {tps:,.0f} tok/s, serving CPU {ms:.0f} ms/1k tok, frame gap p99 {p99:.1f} ms")
        plain_cm.__exit__(None, None, None)


main()
