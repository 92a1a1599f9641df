"""CPU by thread (Python main loop vs Ray's C++ threads) of the router and decode replica at 32 chat streams."""

import asyncio
import collections
import os
import sys
import time

sys.path.insert(0, "/work/main/bench")
sys.path.insert(0, "/work/main")
from pathlib import Path

import clients
import httpx
import psutil
import systems
import yaml


def find(substr):
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except Exception:
            continue
        if substr in cmd or substr in (p.info["name"] or ""):
            return p
    return None


def thread_times(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[(tid, comm)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def load(base, model, seconds, conc):
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=256)) as c:
        stop = time.monotonic() + seconds
        tokens = 0

        async def loop():
            nonlocal tokens
            while time.monotonic() < stop:
                s = await clients.chat(c, model, 128)
                tokens += s.tokens

        await asyncio.gather(*(loop() for _ in range(conc)))
        return tokens


def main():
    app_args = yaml.safe_load(Path("/work/main/configs/config.yaml").read_text())["applications"][0]["args"]
    with systems.app(app_args) as s:
        asyncio.run(load(s.base, s.model, 8, 8))
        procs = {r: find(s.roles[r]) for r in ("router", "decode_replica", "prefill_replica", "proxy")}
        before = {r: thread_times(p.pid) for r, p in procs.items() if p}
        t0 = time.monotonic()
        tokens = asyncio.run(load(s.base, s.model, 30, 32))
        wall = time.monotonic() - t0
        after = {r: thread_times(p.pid) for r, p in procs.items() if p}
        print(f"tokens {tokens}, {tokens / wall:.0f} tok/s over {wall:.1f}s")
        for r in after:
            groups = collections.Counter()
            for key, t in after[r].items():
                d = t - before[r].get(key, 0.0)
                groups[key[1]] += d
            total = sum(groups.values())
            print(f"{r}: {total / tokens * 1e6:.0f} ms/1k tok, {total / wall * 100:.0f}% core")
            for name, d in groups.most_common(8):
                if d > 0.05:
                    print(f"   {name:20s} {d / tokens * 1e6:6.1f} ms/1k tok")


if __name__ == "__main__":
    main()
