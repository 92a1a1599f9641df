"""Process placement at 1 and 32 streams: "free" (the OS places every process), "pinned" (every process but the
two engine-core processes and this client bound to core 0, the prefill engine's; core 1 left to decode's engine),
"nice" (pinned, and the prefill engine's threads at nice 10), two rounds."""

import asyncio
import contextlib
import os
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


def engines() -> dict[str, list[psutil.Process]]:
    out: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        if "EngineCore" in (p.info["name"] or "") or "EngineCore" in " ".join(p.info["cmdline"] or []):
            parent = " ".join(p.parent().cmdline()) if p.parent() else ""
            out.setdefault("prefill" if "prefill" in parent else "decode", []).append(p)
    return out


def place(mode: str, eng: dict[str, list[psutil.Process]]) -> None:
    engine_pids = {q.pid for ps in eng.values() for q in ps}
    for p in psutil.process_iter():
        if p.pid in engine_pids or p.pid == os.getpid():
            continue
        with contextlib.suppress(Exception):
            for t in os.listdir(f"/proc/{p.pid}/task"):
                os.sched_setaffinity(int(t), {0} if mode != "free" else {0, 1})
    for p in eng.get("prefill", []):
        for t in os.listdir(f"/proc/{p.pid}/task"):
            with contextlib.suppress(Exception):
                os.setpriority(os.PRIO_PROCESS, int(t), 10 if mode == "nice" else 0)


async def load(base: str, model: str, seconds: float, conc: int) -> tuple[list[clients.Sample], float]:
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=256)) as c:
        stop, samples = time.monotonic() + seconds, []

        async def loop() -> None:
            while time.monotonic() < stop:
                samples.append(await clients.chat(c, model, 128))

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(conc)))
        return samples, time.monotonic() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3


app_args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
with systems.app(app_args) as s:
    asyncio.run(load(s.base, s.model, 8, 8))
    eng = engines()
    for rnd in range(2):
        for mode in ("free", "pinned", "nice"):
            place(mode, eng)
            for conc in (1, 32):
                samples, wall = asyncio.run(load(s.base, s.model, 15 if conc == 32 else 8, conc))
                ok = [x for x in samples if x.tokens]
                gaps, ttfts = [g for x in ok for g in x.itls], [x.ttft for x in ok if x.ttft]
                print(
                    f"round {rnd} {mode:6s} c={conc}: {sum(x.tokens for x in ok) / wall:,.0f} tok/s, "
                    f"gap p50/p99 {pct(gaps, 50):.1f}/{pct(gaps, 99):.1f} ms, TTFT p50 {pct(ttfts, 50):.1f} ms",
                    flush=True,
                )
    place("free", eng)
