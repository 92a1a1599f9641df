"""What grows in a CPU engine worker under steady load: oneDNN's primitive cache behind vLLM's CPU linear layers.

The soak (bench/soak.py) saw decode's engine worker grow ~120 MiB in an hour, fast then slower. vLLM runs each
linear layer on CPU through a oneDNN matmul handler (`vllm._custom_ops.create_onednn_mm`, an LRU of 32 primitives
per layer, one per token count M of a step); oneDNN itself keeps every primitive it makes in a process-wide cache of
`ONEDNN_PRIMITIVE_CACHE_CAPACITY` entries (default 1,024), and a primitive for a bigger M holds more memory. So a
worker's RSS climbs each time a step of a new, larger token count comes, until that cache is full: a bounded cache
filling at the pace rare shapes arrive, not a leak.

This measures it in one process, for each cache capacity given: RSS after steps of new token counts (growing), after
steps of token counts already seen, and the GEMM time per step for decode-like (a few dozen batch sizes) and
prefill-like (any size up to 512, seen before) steps. Layers: 9 handlers of the local model's MLP shape (128 -> 384),
each capacity in a fresh process (the variable is read once), pinned to one core.

    .venv/bin/python bench/onednn_cache.py [--capacities default 0 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import record

MIB = 2**20


def measure() -> dict:
    """One process's figures (run with the capacity in its environment)."""
    import random
    import time

    import psutil
    import torch
    import vllm._custom_ops as ops

    torch.set_num_threads(1)
    proc = psutil.Process()
    handlers = [ops.create_onednn_mm(torch.randn(384, 128).t(), 32) for _ in range(9)]

    def step(m: int) -> None:
        x = torch.randn(m, 128)
        for h in handlers:
            ops.onednn_mm(h, x, None)

    def per_step_ms(ms: list[int]) -> float:
        started = time.perf_counter()
        for m in ms:
            step(m)
        return (time.perf_counter() - started) / len(ms) * 1000

    rng = random.Random(0)
    decode_like = [rng.randint(1, 24) for _ in range(2000)]
    prefill_like = [rng.randint(1, 512) for _ in range(400)]
    per_step_ms(decode_like[:200])
    base = proc.memory_info().rss / MIB
    growth = []
    for top in (32, 64, 200, 400, 800, 1200):
        for m in range(growth[-1][0] + 1 if growth else 1, top + 1):
            step(m)
        growth.append((top, round(proc.memory_info().rss / MIB - base, 1)))
    for m in range(1, 1200, 7):  # token counts seen before
        step(m)
    seen_again = round(proc.memory_info().rss / MIB - base, 1)
    decode_ms = per_step_ms(decode_like)
    per_step_ms(prefill_like)
    prefill_ms = per_step_ms(prefill_like)
    return {
        "rss_growth_mib_by_largest_m": growth,
        "rss_growth_mib_after_seen_again": seen_again,
        "decode_like_ms_per_step": round(decode_ms, 3),
        "prefill_like_ms_per_step": round(prefill_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", nargs="+", default=["default", "0", "64"])
    parser.add_argument("--core", default="1")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    rows = {}
    for capacity in args.capacities:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
        if capacity != "default":
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
        command = ["taskset", "-c", args.core, sys.executable, __file__, "--child"]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        rows[capacity] = json.loads(out.strip().splitlines()[-1])
        print(f"capacity {capacity}: {rows[capacity]}", flush=True)
    lines = [
        "# oneDNN's primitive cache in a CPU engine worker",
        "",
        "`python bench/onednn_cache.py` (9 matmul handlers of 128 -> 384, as vLLM's CPU linear layers make them; one "
        "core). RSS growth in MiB after steps of every token count M up to the column's (new shapes), then after "
        "steps of counts seen before; GEMM time per step (9 layers).",
        "",
        "| ONEDNN_PRIMITIVE_CACHE_CAPACITY | "
        + " | ".join(f"M <= {m}" for m, _ in rows[args.capacities[0]]["rss_growth_mib_by_largest_m"])
        + " | seen again | decode-like ms / step | prefill-like ms / step |",
        "|---|" + "---|" * (len(rows[args.capacities[0]]["rss_growth_mib_by_largest_m"]) + 3),
    ]
    for capacity, row in rows.items():
        growth = " | ".join(f"{g:+.0f}" for _, g in row["rss_growth_mib_by_largest_m"])
        lines.append(
            f"| {capacity} | {growth} | {row['rss_growth_mib_after_seen_again']:+.0f} "
            f"| {row['decode_like_ms_per_step']:.3f} | {row['prefill_like_ms_per_step']:.3f} |"
        )
    record.write("onednn_cache", lines, rows)


if __name__ == "__main__":
    main()
