"""Realtime load test: hundreds of concurrent `/v1/realtime` sessions, under and above the server's capacity.

Each simulated client opens a session, then for a few turns streams its user turn in chunks
(`input_text_buffer.append`, as typed), sends `response.create` and reads the answer to `response.done`; then it
closes and opens a new session. A client refused at the handshake (`error` `server_overloaded`, close 1013) waits
the `retry_after` it was given and tries again. Per phase it reports the sessions opened, the latency from
`response.create` to the first `response.output_text.delta` (P50/P99), errors by kind (zero expected under
capacity; refusals above it) and the router replica's RSS over time (bounded if nothing leaks).

    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/load_realtime.py --start configs/config.yaml \
        --phase under:60:90 --phase over:300:90
    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/load_realtime.py --start configs/config.yaml \
        --admission min_sessions=8 --phase under:16:90 --phase over:300:90   # router.admission overridden
    .venv/bin/python bench/load_realtime.py --url ws://127.0.0.1:8000 --phase under:60:60   # a running server

The default config's prefill replica holds 96 sessions (128 engine slots, three quarters of them) and admission
refuses new ones from 95 % of that, or past the router's adaptive latency limit (never under `min_sessions`,
80 by default): 60 clients are under capacity, 300 above it. Refusals also report how long the handshake took
to be refused (`refusal_ms`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workloads import percentile

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "input", "streams", "in"]


@dataclass
class PhaseStats:
    """What one phase's clients saw."""

    name: str
    clients: int
    duration_s: float
    sessions: int = 0  # handshakes answered `session.created`
    refused: int = 0  # handshakes refused as overloaded (1013)
    turns: int = 0  # responses that reached `response.done`
    latencies_s: list[float] = field(default_factory=list)  # response.create -> first delta
    refusal_s: list[float] = field(default_factory=list)  # connect -> the overload error (how quickly excess is told)
    errors: Counter[str] = field(default_factory=Counter)


def summarize(stats: PhaseStats) -> dict[str, Any]:
    """The phase's figures, JSON-ready: latencies in ms, errors by kind, refusals apart from other errors."""
    lat = [x * 1000 for x in stats.latencies_s]
    refusal = [x * 1000 for x in stats.refusal_s]
    overload = {"server_overloaded", "close_1013", "http_429"}
    return {
        "phase": stats.name,
        "clients": stats.clients,
        "duration_s": stats.duration_s,
        "sessions": stats.sessions,
        "refused": stats.refused,
        "turns": stats.turns,
        "first_delta_ms": {
            "n": len(lat),
            "p50": round(percentile(lat, 50), 1) if lat else None,
            "p99": round(percentile(lat, 99), 1) if lat else None,
            "max": round(max(lat), 1) if lat else None,
        },
        "refusal_ms": {
            "p50": round(percentile(refusal, 50), 1) if refusal else None,
            "p99": round(percentile(refusal, 99), 1) if refusal else None,
        },
        "errors": dict(sorted(stats.errors.items())),
        "unexpected_errors": sum(n for kind, n in stats.errors.items() if kind not in overload),
    }


def rss_summary(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """The router's RSS (MiB) over the run: first, max, last, and the samples (seconds from start, MiB)."""
    if not samples:
        return {"samples": []}
    values = [mb for _, mb in samples]
    return {"first_mb": values[0], "max_mb": max(values), "last_mb": values[-1], "samples": samples}


def turn_chunks(rng: random.Random, chunks: int) -> list[str]:
    text = " ".join(rng.choice(WORDS) for _ in range(8 * chunks)) + "."
    cuts = sorted(rng.sample(range(1, len(text)), chunks - 1))  # inside words too, as typing does
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


async def client(url: str, stats: PhaseStats, deadline: float, rng: random.Random, args: argparse.Namespace) -> None:
    import websockets

    await asyncio.sleep(rng.uniform(0, args.ramp_s))
    while time.monotonic() < deadline:
        try:
            connecting = time.monotonic()
            async with websockets.connect(url, open_timeout=60, max_size=None, ping_timeout=None) as ws:
                first = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if first["type"] == "error":
                    if first["error"].get("code") == "server_overloaded":
                        stats.refused += 1
                        stats.refusal_s.append(time.monotonic() - connecting)
                    stats.errors[str(first["error"].get("code"))] += 1
                    await asyncio.sleep(float(first["error"].get("retry_after") or 1) * rng.uniform(0.5, 1.5))
                    continue
                stats.sessions += 1
                for _ in range(args.turns):
                    if time.monotonic() >= deadline:
                        break
                    await one_turn(ws, stats, rng, args)
                    await asyncio.sleep(rng.uniform(0, 2 * args.think_s))
        except websockets.ConnectionClosed as e:
            stats.errors[f"close_{e.rcvd.code if e.rcvd else 'abnormal'}"] += 1
        except TimeoutError:
            stats.errors["timeout"] += 1
        except OSError as e:
            stats.errors[f"connect_{type(e).__name__}"] += 1


async def one_turn(ws: Any, stats: PhaseStats, rng: random.Random, args: argparse.Namespace) -> None:
    for piece in turn_chunks(rng, args.chunks):
        await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": piece}))
        await asyncio.sleep(rng.uniform(0, 2 * args.chunk_gap_s))
    sent = time.monotonic()
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": args.max_tokens}}))
    first_delta = False
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), args.answer_timeout_s))
        if event["type"] == "response.output_text.delta" and not first_delta:
            first_delta = True
            stats.latencies_s.append(time.monotonic() - sent)
        elif event["type"] == "error":
            stats.errors[str(event["error"].get("code"))] += 1
        elif event["type"] == "response.done":
            status = event["response"]["status"]
            if status not in ("completed", "incomplete"):
                stats.errors[f"response_{status}"] += 1
            stats.turns += 1
            return


async def run_phase(url: str, name: str, clients: int, duration_s: float, args: argparse.Namespace) -> PhaseStats:
    stats = PhaseStats(name, clients, duration_s)
    deadline = time.monotonic() + duration_s
    rngs = [random.Random(f"{args.seed}/{name}/{i}") for i in range(clients)]
    await asyncio.gather(*(client(url, stats, deadline, rng, args) for rng in rngs))
    return stats


class RssSampler:
    """The router replica's RSS every `period_s`, from its process title (`ray::ServeReplica:<app>:router`)."""

    def __init__(self, app: str, period_s: float = 2.0) -> None:
        self.title, self.period_s = f"ServeReplica:{app}:router", period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        start = time.monotonic()
        while not self._stop.wait(self.period_s):
            rss = 0
            for proc in psutil.process_iter(["cmdline", "memory_info"]):
                if any(self.title in part for part in proc.info["cmdline"] or ()) and proc.info["memory_info"]:
                    rss += proc.info["memory_info"].rss
            if rss:
                self.samples.append((round(time.monotonic() - start, 1), round(rss / 2**20, 1)))


async def run(url: str, phases: list[tuple[str, int, float]], args: argparse.Namespace) -> dict[str, Any]:
    with RssSampler(args.app) as rss:
        results = [summarize(await run_phase(url, *phase, args)) for phase in phases]
    return {"url": url, "phases": results, "router_rss": rss_summary(rss.samples), "settings": settings(args)}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("turns", "chunks", "chunk_gap_s", "think_s", "max_tokens", "ramp_s", "seed", "start", "admission")
    return {k: getattr(args, k, None) for k in keys}  # (callers' namespaces may lack the newer ones)


def parse_setting(text: str) -> tuple[str, Any]:
    """`key=value` with a YAML value: `min_sessions=8`, `target_first_token_s=0.5`."""
    import yaml

    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def parse_phase(text: str) -> tuple[str, int, float]:
    name, clients, seconds = text.split(":")
    return name, int(clients), float(seconds)


def start_server(config: str, port: int, admission: list[tuple[str, Any]] | None = None) -> str:
    """The config's application on this machine, as the integration tests start it (with `router.admission`
    fields overridden by `admission`)."""
    import httpx
    import ray
    import yaml
    from ray import serve

    from serve_app import serve_env
    from serve_app.builder import build_app

    serve_env.apply()
    args = yaml.safe_load(Path(config).read_text())["applications"][0]["args"]
    args.setdefault("router", {}).setdefault("admission", {}).update(dict(admission or []))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="realtime-pd", route_prefix="/")
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return f"ws://127.0.0.1:{port}"


def print_report(report: dict[str, Any]) -> None:
    for p in report["phases"]:
        lat = p["first_delta_ms"]
        print(
            f"{p['phase']:>6}: {p['clients']} clients {p['duration_s']:.0f}s  sessions={p['sessions']} "
            f"refused={p['refused']} (in p50={p['refusal_ms']['p50']} ms p99={p['refusal_ms']['p99']} ms) "
            f"turns={p['turns']}  first delta p50={lat['p50']} ms p99={lat['p99']} ms  "
            f"errors={p['errors']} (unexpected {p['unexpected_errors']})"
        )
    rss = report["router_rss"]
    if rss.get("samples"):
        print(f"router RSS: first {rss['first_mb']} MiB, max {rss['max_mb']} MiB, last {rss['last_mb']} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="ws://127.0.0.1:8000", help="the server (ws://host:port)")
    parser.add_argument("--start", help="start this config's app here first (under the heavy lock)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--app", default="realtime-pd", help="the Serve application (for the router's RSS)")
    parser.add_argument("--phase", action="append", type=parse_phase, help="name:clients:seconds (repeatable)")
    parser.add_argument(
        "--admission", action="append", type=parse_setting, default=[], help="with --start: router.admission key=value"
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-gap-s", type=float, default=0.3)
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ramp-s", type=float, default=10.0)
    parser.add_argument("--answer-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    phases = args.phase or [("under", 80, 150.0), ("over", 300, 150.0)]
    url = start_server(args.start, args.port, args.admission) if args.start else args.url
    report = asyncio.run(run(f"{url}/v1/realtime", phases, args))
    print_report(report)
    out = args.out or RESULTS / "load_realtime.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
