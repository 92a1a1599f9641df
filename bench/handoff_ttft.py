"""TTFT of the prefill → NIXL → decode hand-off at one stream, and where it goes, against a plain vLLM server.

One request at a time (after warm-up), the same prompts to both systems: a long prompt (prefilled on the
prefill replica, its KV pulled by decode over NIXL) and a short one (prefilled by decode itself under the
config's conditional disaggregation). For the app, each response's `Server-Timing` splits its time to first
byte into `router` (deciding), `prefill` (router → prefill replica → engine → back) and `decode` (decode's first
item: NIXL pull, the first token, the hop back). Reported: p50, p90, max and standard deviation in ms.

    .venv/bin/python bench/handoff_ttft.py [--requests 40] [--systems app plain]
    .venv/bin/python bench/handoff_ttft.py --sweep     # the conditional-disaggregation threshold

`--sweep` measures what `router.disaggregation.min_prompt_tokens` trades: for prompts of 64 to 2,048 tokens,
the app is run twice (every prompt disaggregated; every prompt prefilled by decode) and, with `--load` (8)
streams decoding in the background, reports each prompt's TTFT and the background streams' inter-token
latency while it is prefilled (a prefill on decode stalls the streams it shares the engine with).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import record
import systems
import yaml

from core.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LONG = "Summarise the incident log below in one line.\n" + "\n".join(
    f"{i:03d} the queue drained {i * 3} jobs, retried {i % 7} and paged the on-call engineer twice" for i in range(25)
)
SHORT = "Say hello."


def timings(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


async def one(client: httpx.AsyncClient, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        sample: dict[str, Any] = {
            "where": r.headers.get("x-prefilled-by"),
            **timings(r.headers.get("server-timing", "")),
        }
        async for line in r.aiter_lines():
            if "ttft" in sample or not line.startswith("data: {"):
                continue
            if any((c.get("delta") or {}).get("content") for c in json.loads(line[6:]).get("choices", [])):
                sample["ttft"] = (time.perf_counter() - start) * 1000
    return sample


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None, "stdev": None}
    xs = sorted(values)
    return {
        "p50": statistics.median(xs),
        "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
        "max": xs[-1],
        "stdev": statistics.pstdev(xs),
    }


async def measure(system: systems.System, requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=system.base, timeout=120) as client:
        for name, prompt in (("long", LONG), ("short", SHORT)):
            for _ in range(3):  # warm-up: compile, NIXL handshake, prefix cache of the template
                await one(client, system.model, prompt)
            samples = [await one(client, system.model, prompt) for _ in range(requests)]
            keys = sorted({k for s in samples for k in s if k not in ("where",)})
            out[name] = {k: stats([s[k] for s in samples if s.get(k) is not None]) for k in keys}
            out[name]["prefilled_by"] = sorted({str(s.get("where")) for s in samples})
            print(f"  {system.name} {name}: TTFT {out[name]['ttft']}", flush=True)
    return out


def words(tokens: int) -> str:
    """About `tokens` tokens of chat input for the local tokenizer (measured: ~3.8 tokens per word, ~10 for
    the template)."""
    return " ".join(f"w{i % 97}x" for i in range(max(1, int((tokens - 10) / 3.8))))


async def background(client: httpx.AsyncClient, model: str, gaps: list[float], stop: asyncio.Event) -> None:
    """A long decode whose inter-token gaps (client side) are recorded while `stop` is unset."""
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    while not stop.is_set():
        last = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if stop.is_set():
                    break
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now


async def sweep_one(system: systems.System, lengths: list[int], load: int, probes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=load + 4)
    async with httpx.AsyncClient(base_url=system.base, timeout=300, limits=limits) as client:
        for _ in range(3):
            await one(client, system.model, words(512))
        for length in lengths:
            prompt = words(length)
            idle = [await one(client, system.model, prompt) for _ in range(probes)]
            gaps: list[float] = []
            stop = asyncio.Event()
            streams = [asyncio.create_task(background(client, system.model, gaps, stop)) for _ in range(load)]
            await asyncio.sleep(1.0)
            gaps.clear()
            loaded = [await one(client, system.model, prompt) for _ in range(probes)]
            stop.set()
            await asyncio.gather(*streams, return_exceptions=True)
            out[str(length)] = {
                "where": sorted({str(s.get("where")) for s in idle}),
                "ttft_idle": stats([s["ttft"] for s in idle if "ttft" in s]),
                "ttft_loaded": stats([s["ttft"] for s in loaded if "ttft" in s]),
                "background_itl_ms": stats([g * 1000 for g in gaps]),
            }
            print(f"  {length} tokens: {out[str(length)]}", flush=True)
    return out


def sweep(app_args: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import copy

    results: dict[str, Any] = {}
    for mode, threshold in (("disaggregated", 0), ("decode_prefills", 10**9)):
        mode_args = copy.deepcopy(app_args)
        mode_args.setdefault("router", {}).setdefault("disaggregation", {})["min_prompt_tokens"] = threshold
        mode_args["router"]["disaggregation"]["max_inflight_prefills"] = None
        print(f"== app, {mode}", flush=True)
        with systems.app(mode_args) as system:
            results[mode] = asyncio.run(sweep_one(system, args.lengths, args.load, args.probes))
    return results


def sweep_table(results: dict[str, Any]) -> str:
    lines = [
        "| prompt tokens | TTFT P/D | TTFT decode-local | loaded TTFT P/D | loaded TTFT local "
        "| background ITL p50/p90 P/D | background ITL p50/p90 local |",
        "|---|---|---|---|---|---|---|",
    ]
    pd, local = results["disaggregated"], results["decode_prefills"]
    for length in pd:
        a, b = pd[length], local[length]

        def ms(x: dict[str, Any], key: str = "p50") -> str:
            return "-" if x[key] is None else f"{x[key]:.1f}"

        lines.append(
            f"| {length} | {ms(a['ttft_idle'])} | {ms(b['ttft_idle'])} | {ms(a['ttft_loaded'])} "
            f"| {ms(b['ttft_loaded'])} | {ms(a['background_itl_ms'])} / {ms(a['background_itl_ms'], 'p90')} "
            f"| {ms(b['background_itl_ms'])} / {ms(b['background_itl_ms'], 'p90')} |"
        )
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    lines = ["| system | prompt | part | p50 ms | p90 ms | max ms | stdev ms |", "|---|---|---|---|---|---|---|"]
    for system, prompts in results.items():
        for prompt, parts in prompts.items():
            for part, s in parts.items():
                if part == "prefilled_by":
                    continue
                cells = " | ".join("-" if s[k] is None else f"{s[k]:.1f}" for k in ("p50", "p90", "max", "stdev"))
                lines.append(f"| {system} | {prompt} ({'/'.join(parts['prefilled_by'])}) | {part} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--systems", nargs="+", default=["app", "plain"], choices=["app", "plain"])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "config.yaml")
    parser.add_argument("--sweep", action="store_true", help="measure the conditional-disaggregation threshold")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 1800])
    parser.add_argument("--load", type=int, default=8, help="--sweep: background decode streams")
    parser.add_argument("--probes", type=int, default=5, help="--sweep: prompts per length and condition")
    args = parser.parse_args()
    app_args: dict[str, Any] = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(app_args)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = record.command()
    if args.sweep:
        found = sweep(app_args, args)
        text = sweep_table(found)
        print("\n" + text)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "disagg_sweep.json").write_text(json.dumps({"command": command, "stamp": stamp, "results": found}))
        (RESULTS / "disagg_sweep.md").write_text(
            f"# Conditional disaggregation threshold ({stamp})\n\nCommand: `{command}`; times in ms, p50 "
            f"(ITL p50/p90) of {args.probes} prompts, idle and with {args.load} streams decoding.\n\n{text}\n"
        )
        return
    results: dict[str, Any] = {}
    for name in args.systems:
        print(f"== {name}", flush=True)
        start = systems.app(app_args) if name == "app" else systems.plain(config)
        with start as system:
            results[name] = asyncio.run(measure(system, args.requests))
    text = table(results)
    print("\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "handoff_ttft.json").write_text(
        json.dumps({"command": command, "stamp": stamp, "results": results}, indent=2)
    )
    (RESULTS / "handoff_ttft.md").write_text(
        f"# Hand-off TTFT at one stream ({stamp})\n\nCommand: `{command}`\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
