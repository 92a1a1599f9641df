"""Token-path benchmark: this app against a plain vLLM server and Ray Serve LLM's P/D app, in one run.

All three serve the same model (configs/config.yaml's, `local:tiny-llama` by default) with the same engine
settings, one after another in this process (systems.py). For each concurrency level C, C client loops each
send R streaming chat completions in sequence, after an uncounted warm-up (clients.py). Per level: TTFT,
inter-token latency per token as the client sees it, output tokens/s, errors, and the CPU used by each part
of the serving system, above all the router replica and Serve's proxy (cpu.py). On the app only, the same
figures for the streaming-input session APIs: REST sessions (create, one `end_of_input` chunk, events SSE)
and the realtime WebSocket.

    .venv/bin/python bench/token_path.py [--systems app plain rayllm] [--concurrency 1 32 128] [--quick]

Run it under the heavy-work lock on a shared machine: `flock /tmp/rtpd-heavy.lock .venv/bin/python ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import clients
import cost
import cpu
import record
import report
import systems
import vllm_cli
import yaml

from core.config import AppConfig
from engine.ipc_wait import NOTIFY_ENV

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SYSTEMS = {
    "app": systems.app,  # behind the default ingress (Serve's own proxy)
    "app_serve_proxy": functools.partial(systems.app, haproxy=False),  # behind Serve's own proxy
    "plain": systems.plain,
    "plain_decode": functools.partial(systems.plain, as_decode=True),  # with the decode engine's per-step extras
    "rayllm": systems.rayllm,
    "rayllm_direct": functools.partial(systems.rayllm, direct=True),  # its direct streaming (behind HAProxy)
    # The app without its speech role: with it idle, the text path should not change (a third engine shares the
    # cores; it must not spin while no audio flows).
    "app_no_speech": lambda app_args: systems.app({k: v for k, v in app_args.items() if k != "speech"}),
    # The app with vLLM's own SSE generator for every answer (decode.text_encoder: vllm; decode/sse.py).
    "app_vllm_sse": lambda app_args: systems.app(systems.vllm_sse(app_args)),
    # The app with each token leaving decode at once under load too (decode.pacing.min_streams: null).
    "app_unpaced": lambda app_args: systems.app(systems.unpaced(app_args)),
    # The app with decode's feeds as Serve items (decode.feed: serve), not over their direct connection.
    "app_serve_feed": lambda app_args: systems.app(systems.serve_feed(app_args)),
    # The app with each request's decode start a Serve call (decode.start: serve), not over the feed's connection.
    "app_serve_start": lambda app_args: systems.app(systems.serve_start(app_args)),
    # The app with vLLM's wake-up byte on every message between its engine processes (engine/ipc_wait.py).
    "app_ipc_notify": lambda app_args: systems.app_with_env(app_args, {NOTIFY_ENV: "every"}),
    # The app with vLLM's own 1 s spin between its engine processes (engine.ipc_spin_us: null; and so vLLM's byte on
    # every message too: engine/ipc_wait.py installs both or neither).
    "app_vllm_spin": lambda app_args: systems.app(systems.vllm_spin(app_args)),
}


# The chats' prompt. Short (the default, as issue 42 measures the token path): the app prefills it on decode, or
# hands it off while decode is busy. Long (416 tokens with the local tokenizer): always handed off from prefill.
PROMPTS = {"short": cost.SHORT_PROMPT, "long": clients.PROMPT}
# Chat levels of ~5-20 s on this machine: shorter ones (4 and 2 answers per client at 32 and 128) moved the
# app/plain ratios by up to 2x from one run to the next.
DEFAULT_REQUESTS = {"chat": {1: 16, 32: 8, 128: 4}, "session": {1: 8, 32: 2}, "realtime": {1: 8, 32: 2}}


def requests_per_client(args: argparse.Namespace, kind: str, c: int) -> int:
    if args.requests_per_client:
        return args.requests_per_client
    table = DEFAULT_REQUESTS[kind]
    return table.get(c, 2 if kind == "chat" else 1)


def answer_fn(kind: str, system: systems.System, max_tokens: int, prompt: str) -> clients.Answer:
    """One answer of `kind`, given the user's own HTTP client."""
    if kind == "chat":
        return partial(clients.chat, model=system.model, max_tokens=max_tokens, prompt=prompt)
    if kind == "session":
        return partial(clients.session, model=system.model, max_tokens=max_tokens)
    ws = system.base.replace("http://", "ws://")
    return lambda _client: clients.realtime(ws, system.model, max_tokens)


async def bench_kind(kind: str, system: systems.System, levels: list[int], args: argparse.Namespace) -> dict[str, Any]:
    one = answer_fn(kind, system, args.max_tokens, PROMPTS[args.prompt])
    warm = await clients.run_level(one, min(8, max(levels)), 1, system.base)
    print(f"  {kind} warm-up: {warm['requests'] - warm['errors']}/{warm['requests']} ok", flush=True)
    if warm["errors"]:
        print(f"    {warm['error_examples']}", flush=True)
    meter = cpu.CpuMeter(cpu.find_roles(system.roles, system.root))
    out: dict[str, Any] = {}
    for c in levels:
        meter.start()
        level = await clients.run_level(one, c, requests_per_client(args, kind, c), system.base)
        level["cpu"] = meter.stop(level["completion_tokens"])
        out[str(c)] = level
        print("  " + report.progress_line(kind, level), flush=True)
        await asyncio.sleep(args.pause)
    return out


async def bench_system(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    roles = cpu.find_roles(system.roles, system.root)
    result: dict[str, Any] = {"model": system.model, "base": system.base, "processes": cpu.describe(roles)}
    result["info"] = system.info
    for line in result["processes"].get("engines", []):
        print(f"  engine process {line}", flush=True)
    missing = [role for role, procs in roles.items() if not procs]
    if missing:
        print(f"  no process found for {missing}", flush=True)
    result["chat"] = await bench_kind("chat", system, args.concurrency, args)
    if args.vllm_bench:
        result["vllm_bench_serve"] = await vllm_bench(system, args)
    if system.name == "app" and args.session_concurrency:
        for kind in ("session", "realtime"):
            result[kind] = await bench_kind(kind, system, args.session_concurrency, args)
    if args.cost:
        result["cost"] = await cost.measure(system, roles, quick=args.quick, idle_s=args.idle_s)
    return result


async def vllm_bench(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's own client (`vllm bench serve`, random prompts) against the system, as a cross-check."""
    prompts, concurrency = (16, 4) if args.quick else (128, 32)
    bench_args = vllm_cli.bench_serve_args(
        system.base, system.model, system.tokenizer, prompts, concurrency, 128, args.max_tokens
    )
    out = await asyncio.to_thread(vllm_cli.bench_serve, bench_args)
    fig = out["figures"]
    print(
        f"  vllm bench serve (rc {out['rc']}): {fig.get('Successful requests')} ok, "
        f"{fig.get('Output token throughput (tok/s)')} tok/s, TTFT median {fig.get('Median TTFT (ms)')} ms",
        flush=True,
    )
    await asyncio.sleep(args.pause)
    return out


def machine() -> dict[str, Any]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument(
        "--session-concurrency", type=int, nargs="*", default=[1, 32, 128], help="app sessions; none: skip them"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--requests-per-client", type=int, default=None, help="default: chat 16/8/4, sessions 8/2/1 at c=1/32/more"
    )
    parser.add_argument(
        "--vllm-bench", action="store_true", help="also run `vllm bench serve` (128 prompts, 32 at once) on each"
    )
    parser.add_argument("--prompt", choices=list(PROMPTS), default="short", help="the chats' prompt (default short)")
    parser.add_argument(
        "--cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU per request and per token by process (a fit over max_tokens 1/32/128/512), and an idle stretch",
    )
    parser.add_argument("--idle-s", type=float, default=60.0, help="the idle stretch's length (--quick: 5 s)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of idle between levels")
    parser.add_argument("--quick", action="store_true", help="smoke test: c=1 and 4, 32 tokens, 2 answers/client")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "config.yaml")
    parser.add_argument("--tag", default="token_path", help="results file prefix")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default bench/results/)")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.requests_per_client = [1, 4], 32, 2
        args.session_concurrency = [1, 4] if args.session_concurrency else []
        args.idle_s = min(args.idle_s, 5.0)
    return args


def main() -> None:
    args = parse_args()
    app_args: dict[str, Any] = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(app_args)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for name in args.systems:
        print(f"== {name} ({time.perf_counter() - started:.0f}s)", flush=True)
        t0 = time.perf_counter()
        with SYSTEMS[name](app_args if name.startswith("app") else config) as system:
            print(f"  up in {time.perf_counter() - t0:.0f}s", flush=True)
            results[name] = asyncio.run(bench_system(system, args))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = record.command()
    meta = {"timestamp": stamp, "command": command, "machine": machine(), "model": config.model}
    meta |= {"max_tokens": args.max_tokens, "prompt": args.prompt, "total_s": time.perf_counter() - started}
    summary = report.summary(results)
    out = {**meta, "systems": results, **summary}
    (args.out / f"{args.tag}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    text = report.markdown(meta, results, summary)
    (args.out / f"{args.tag}.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
