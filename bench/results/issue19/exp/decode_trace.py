"""TTFT at one stream by stage on the decode side (apply decode-trace.patch first; it writes /tmp/exp/trace-*.log).

Sends 30 streaming chats of the bench prompt one after another with request ids `traceNNN`, then prints each one's
timeline in ms from the client's send: decode `start`, after its render, the engine's add, each schedule, the NIXL
read's completion, the first token, the first frame in the replica, the first frame at the client."""

import asyncio
import collections
import glob
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main")
import clients
import httpx
import systems
import yaml


async def run(base: str, model: str, n: int) -> dict[str, tuple[float, float]]:
    sends = {}
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for i in range(n):
            body = clients.chat_body(model, 16)
            rid, t0, first = f"trace{i:03d}", time.time(), None
            async with c.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}) as r:
                async for line in r.aiter_lines():
                    if first is None and '"content":"' in line:
                        first = time.time()
            sends[rid] = (t0, first)
            await asyncio.sleep(0.2)
    return sends


def report(sends: dict[str, tuple[float, float]]) -> None:
    events = collections.defaultdict(list)
    for f in glob.glob("/tmp/exp/trace-*.log"):
        for line in Path(f).read_text().splitlines():
            t, rid, what = line.split(" ", 2)
            if m := re.search(r"trace\d+", rid):
                events[m[0]].append((float(t), what))
    for rid, (t0, first) in sorted(sends.items())[5:]:
        steps = " | ".join(f"{(t - t0) * 1e3:6.1f} {w[:60]}" for t, w in sorted(events[rid]))
        print(rid, steps, f"| client first {(first - t0) * 1e3:.1f}")


app_args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
with systems.app(app_args) as s:
    report(asyncio.run(run(s.base, s.model, 30)))
