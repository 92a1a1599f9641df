"""Time from the last input chunk to the first answer token: streaming prefill against `on_end_only`.

A long input (thousands of tokens) arrives over a REST streaming-input session in dozens of chunks with a
gap between them, as a RAG pipeline or a crawler would send it. With `on_first_chunk` the prefill replica
prefills each chunk as it arrives and hands the KV to decode at the end; with `on_end_only` (the
non-streaming baseline) it prefills the whole input after the last chunk. Both run in the same process, on
the same app, alternating, each session with fresh text (no prefix-cache help across sessions).

    .venv/bin/python bench/streaming_ttft.py [--chunks 40] [--gap-ms 50] [--sessions 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml

from core.protocol import choice_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PORT = 8792
SESSIONS = "/v1/streaming_input/sessions"
WORDS = ["pipeline", "crawler", "vector", "search", "document", "token", "prefill", "decode", "cache", "stream"]


def make_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 999)}" for _ in range(words))


async def one_session(client: httpx.AsyncClient, policy: str, text: str, args: argparse.Namespace) -> dict[str, Any]:
    body = {"messages": [], "max_tokens": args.max_tokens, "temperature": 0, "start_policy": policy}
    sid = (await client.post(SESSIONS, json=body)).json()["session_id"]
    size = len(text) // args.chunks
    pieces = [text[i * size : (i + 1) * size if i < args.chunks - 1 else len(text)] for i in range(args.chunks)]
    first_token = asyncio.get_running_loop().create_future()

    async def watch() -> None:
        async with client.stream("GET", f"{SESSIONS}/{sid}/events") as r:
            async for line in r.aiter_lines():
                is_delta = line.startswith("data: {") and choice_text(json.loads(line[6:]))[0] != ""
                if is_delta and not first_token.done():
                    first_token.set_result(time.perf_counter())

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    for seq, piece in enumerate(pieces):
        if seq:
            await asyncio.sleep(args.gap_ms / 1000)
        last = seq == len(pieces) - 1
        if last:
            last_chunk_sent = time.perf_counter()
        r = await client.post(
            f"{SESSIONS}/{sid}/chunks", json={"sequence_id": seq, "payload": piece, "end_of_input": last}
        )
        r.raise_for_status()
    first = await asyncio.wait_for(first_token, 120)
    await watcher
    info = (await client.get(f"{SESSIONS}/{sid}")).json()
    await client.delete(f"{SESSIONS}/{sid}")
    return {
        "policy": policy,
        "last_chunk_to_first_token_s": first - last_chunk_sent,
        "session_wall_s": time.perf_counter() - started,
        "prompt_tokens": info["answers"][0]["usage"]["prompt_tokens"],
        "prefill_tokens_computed": info["prompt_tokens_computed"],
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300) as client:
        await one_session(client, "on_first_chunk", make_text(-1, 200), args)  # warm-up, not counted
        for i in range(args.sessions):
            for policy in ("on_first_chunk", "on_end_only"):
                result = await one_session(client, policy, make_text(hash((i, policy)) % 10**6, args.words), args)
                print(json.dumps(result), flush=True)
                results.append(result)
    return results


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for policy in ("on_first_chunk", "on_end_only"):
        xs = sorted(r["last_chunk_to_first_token_s"] for r in results if r["policy"] == policy)
        out[policy] = {
            "median_ms": 1000 * statistics.median(xs),
            "p90_ms": 1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))],
            "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in results if r["policy"] == policy),
        }
    out["ratio"] = {
        "end_only_over_streaming_median": out["on_end_only"]["median_ms"] / out["on_first_chunk"]["median_ms"]
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--words", type=int, default=700, help="input size (about 4.7 tokens per word here)")
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--sessions", type=int, default=5, help="sessions per policy")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--config", default=str(ROOT / "configs" / "config.yaml"))
    args = parser.parse_args()

    import ray
    from ray import serve

    from serve_app.builder import build_app

    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    app_args.setdefault("engine", {})["max_model_len"] = 4096  # the local model's full context
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(app_args), name="realtime-pd", route_prefix="/")
        results = asyncio.run(run(args))
    finally:
        serve.shutdown()
        ray.shutdown()

    summary = summarise(results)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "summary": summary, "results": results}
    (RESULTS / "streaming_ttft.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# Last chunk → first token, streaming prefill vs on_end_only",
        "",
        f"`python bench/streaming_ttft.py --chunks {args.chunks} --words {args.words} --gap-ms {args.gap_ms} "
        f"--sessions {args.sessions}` ({stamp})",
        "",
        "| policy | prompt tokens | median ms | p90 ms |",
        "|---|---|---|---|",
    ]
    for policy in ("on_first_chunk", "on_end_only"):
        s = summary[policy]
        lines.append(f"| {policy} | {s['mean_prompt_tokens']:.0f} | {s['median_ms']:.1f} | {s['p90_ms']:.1f} |")
    lines += [
        "",
        f"on_end_only / on_first_chunk (median): **{summary['ratio']['end_only_over_streaming_median']:.2f}×**",
    ]
    (RESULTS / "streaming_ttft.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
