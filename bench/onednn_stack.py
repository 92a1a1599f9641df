"""oneDNN's primitive cache in the whole stack: decode's engine worker memory, and the app's speed, with it and off.

bench/onednn_cache.py measures the cache in one process. This starts the app (configs/config.yaml) with each capacity
in every engine's environment (`engine.env`), alternated, and measures:
- decode's engine worker RSS after short completions whose prompts decode computes itself: 61 new prompt lengths
  (what fills once: vLLM's per-layer handlers keep 32 shapes, KV pages are touched the first time), the same prompts
  again (their cached blocks make those steps shorter), 60 more new lengths, then 30 batches of 8 prompts of random
  lengths (new step sizes);
- then streamed chats at 32 at once (bench/clients.py, 4 each): tokens/s and the engines' CPU per 1,000 tokens.

    .venv/bin/python bench/onednn_stack.py [--capacities default 0] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from functools import partial
from typing import Any

import clients
import cpu
import httpx
import psutil
import record
import systems
import yaml
from onednn_cache import MIB
from record import ROOT

PHASES = ("first lengths", "same again", "new lengths", "batches of 8")


def decode_worker() -> psutil.Process:
    for proc in psutil.process_iter(["name"]):
        try:
            parent = proc.parent()
            if proc.info["name"] == "VLLM::EngineCore" and parent is not None and parent.name().endswith(":decode"):
                return next(c for c in proc.children() if c.name() == "VLLM::Worker")
        except (psutil.Error, StopIteration):
            continue
    raise RuntimeError("no decode engine worker")


async def completions(client: httpx.AsyncClient, model: str, lengths: list[int], at_once: int) -> None:
    rng = random.Random(len(lengths))

    async def one(n: int) -> None:
        body = {"model": model, "prompt": [rng.randrange(100, 2000) for _ in range(n)], "max_tokens": 8}
        r = await client.post("/v1/completions", json={**body, "temperature": 0})
        r.raise_for_status()

    for i in range(0, len(lengths), at_once):
        await asyncio.gather(*(one(n) for n in lengths[i : i + at_once]))


async def measure(system: systems.System) -> dict[str, Any]:
    worker = decode_worker()
    rss: list[float] = []
    async with httpx.AsyncClient(base_url=system.base, timeout=120) as client:
        await completions(client, system.model, [16, 32, 64], 1)
        start = worker.memory_info().rss / MIB
        rng = random.Random(1)
        for lengths, at_once in (
            (list(range(9, 250, 4)), 1),
            (list(range(9, 250, 4)), 1),
            (list(range(11, 250, 4)), 1),
            ([rng.randrange(8, 250) for _ in range(240)], 8),
        ):
            await completions(client, system.model, lengths, at_once)
            rss.append(round(worker.memory_info().rss / MIB - start, 1))
    meter = cpu.CpuMeter(cpu.find_roles({"engines": systems.ENGINES}, system.root))
    meter.start()
    level = await clients.run_level(partial(clients.chat, model=system.model, max_tokens=128), 32, 4, system.base)
    engines = meter.stop(level["completion_tokens"])["roles"]["engines"]
    return {
        "rss_growth_mib": rss,
        "tok_s": level["output_tok_s"],
        "errors": level["errors"],  # (failed chats would lower tok/s: shown beside it)
        "engines_ms_per_1k": engines["ms_per_1k_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", nargs="+", default=["default", "0"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"][0]["args"]
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = args.capacities if r % 2 == 0 else args.capacities[::-1]
        for capacity in order:
            app_args = json.loads(json.dumps(config))
            if capacity != "default":
                engine = app_args.setdefault("engine", {})
                engine["env"] = {**engine.get("env", {}), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity}
            with systems.app(app_args) as system:
                row = {"round": r + 1, "capacity": capacity, **asyncio.run(measure(system))}
            print(f"round {r + 1}, capacity {capacity}: {row}", flush=True)
            runs.append(row)
    lines = [
        "# oneDNN's primitive cache in the stack",
        "",
        f"`python bench/onednn_stack.py --capacities {' '.join(args.capacities)} --rounds {args.rounds}` (the app, "
        "configs/config.yaml, the capacity in every engine's environment, alternated). Decode's engine worker RSS "
        "growth in MiB, cumulative, after each phase of short completions decode computes itself: "
        + "; ".join(PHASES)
        + ". Then streamed chats of 128 tokens, 32 at once.",
        "",
        "| round | ONEDNN_PRIMITIVE_CACHE_CAPACITY | "
        + " | ".join(PHASES)
        + " | tok/s at 32 (errors) | engines' CPU ms / 1k tok |",
        "|---|---|" + "---|" * (len(PHASES) + 2),
    ]
    for row in runs:
        growth = " | ".join(f"{g:+.0f}" for g in row["rss_growth_mib"])
        lines.append(
            f"| {row['round']} | {row['capacity']} | {growth} | {row['tok_s']:,.0f} ({row.get('errors', 0)}) "
            f"| {row['engines_ms_per_1k']:.0f} |"
        )
    record.write("onednn_stack", lines, runs)


if __name__ == "__main__":
    main()
