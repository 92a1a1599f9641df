"""What bounding the engines' IPC spin (`engine.ipc_spin_us`, engine/ipc_wait.py) does to the token path.

The app with the config's setting against the app with vLLM's own 1 s spin (`ipc_spin_us: null`), alternated
(A B A B ...), each start in a process of its own: on this shared machine whichever system runs first in a
process measured faster, so one A/B in one run says little. Per run: streamed chats of 128 tokens at 1, 32 and 128
streams (8, 3 and 1 answers per stream, after 4 warm-ups), tokens/s, TTFT P50, and the CPU of every vLLM
process (`VLLM::*`: engine cores and workers of prefill, decode and speech) per 1,000 output tokens.

    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/ipc_spin.py [--pairs 3]

Writes bench/results/ipc_spin.json and ipc_spin.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import clients
import cpu
import systems
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LEVELS = ((1, 8), (32, 3), (128, 1))  # streams, answers per stream
MAX_TOKENS = 128


def app_args(vllm_spin: bool) -> dict[str, Any]:
    args = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["applications"][0]["args"]
    return systems.vllm_spin(args) if vllm_spin else args


async def measure(system: systems.System) -> dict[str, Any]:
    one = functools.partial(clients.chat, model=system.model, max_tokens=MAX_TOKENS)
    await clients.run_level(one, 1, 4, system.base)  # warm-up
    meter = cpu.CpuMeter(cpu.find_roles({"engines": systems.ENGINES}, system.root))
    levels: dict[str, Any] = {}
    for c, n in LEVELS:
        meter.start()
        level = await clients.run_level(one, c, n, system.base)
        engines = meter.stop(level["completion_tokens"])["roles"]["engines"]
        levels[str(c)] = {
            "answers": level["requests"],
            "errors": level["errors"],
            "tok_s": level["output_tok_s"],
            "ttft_p50_ms": level["ttft_p50_ms"],
            "engines_cpu_ms_per_1k_tokens": engines["ms_per_1k_tokens"],
        }
    return levels


def one(vllm_spin: bool) -> None:
    """One app start and its measurement, printed as a JSON line (run in a process of its own)."""
    with systems.app(app_args(vllm_spin)) as system:
        print("RESULT " + json.dumps(asyncio.run(measure(system))), flush=True)


def report(runs: list[dict[str, Any]], command: str, stamp: str) -> str:
    names = {False: "bounded (config)", True: "vLLM's 1 s spin"}
    lines = [
        "# Engines' IPC spin: the config's bound against vLLM's 1 s",
        "",
        f"`{command}` ({stamp}); app with `configs/config.yaml` against the same with `ipc_spin_us: null`, "
        f"alternated, each start a process of its own; streamed chats of {MAX_TOKENS} tokens; engines' CPU: every "
        "`VLLM::*` process (prefill, decode, speech) per 1,000 output tokens.",
        "",
        "| run | system | streams | tok/s | TTFT P50 ms | engines' CPU ms / 1k tok |",
        "|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(runs):
        for c, level in run["levels"].items():
            lines.append(
                f"| {i + 1} | {names[run['vllm_spin']]} | {c} | {level['tok_s']:,.0f} | {level['ttft_p50_ms']:,.0f} "
                f"| {level['engines_cpu_ms_per_1k_tokens']:,.0f} |"
            )
    lines += ["", "Ratios, bounded / vLLM's, each pair's (the bounded run first):", ""]
    lines += ["| pair | streams | tok/s | engines' CPU / 1k tok |", "|---|---|---|---|"]
    for p in range(0, len(runs) - 1, 2):
        a, b = runs[p]["levels"], runs[p + 1]["levels"]
        for c in a:
            tok = a[c]["tok_s"] / b[c]["tok_s"]
            cpu = a[c]["engines_cpu_ms_per_1k_tokens"] / b[c]["engines_cpu_ms_per_1k_tokens"]
            lines.append(f"| {p // 2 + 1} | {c} | {tok:.2f} | {cpu:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--one", choices=["bounded", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one == "vllm")
        return
    runs = []
    for i in range(2 * args.pairs):
        vllm_spin = i % 2 == 1
        print(f"run {i + 1}/{2 * args.pairs}: {'vllm spin' if vllm_spin else 'bounded'}", flush=True)
        out = subprocess.run(
            [sys.executable, __file__, "--one", "vllm" if vllm_spin else "bounded"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        levels = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        for c, level in levels.items():
            print(f"  c={c}: {level['tok_s']:,.0f} tok/s, engines {level['engines_cpu_ms_per_1k_tokens']:,.0f} ms/1k")
        runs.append({"vllm_spin": vllm_spin, "levels": levels})
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = f"python bench/ipc_spin.py --pairs {args.pairs}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ipc_spin.json").write_text(json.dumps({"stamp": stamp, "command": command, "runs": runs}, indent=1))
    (RESULTS / "ipc_spin.md").write_text(report(runs, command, stamp))
    print(report(runs, command, stamp))


if __name__ == "__main__":
    main()
