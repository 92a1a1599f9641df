"""End of turn → first token, with and without preemptive answers (prefill/preemptive.py).

Voice-assistant-like turns over REST streaming-input sessions: a user's turn arrives in chunks at speech pace
(a transcript growing word group by word group), sometimes with a pause mid-turn, and the end of turn is known
only `--eot-lag-ms` after the last chunk (a voice-activity or end-of-turn detector's silence), when the client
ends the input: an empty end chunk with the next sequence id (`--end chunk`, the default: a router holding the
preemptive answer releases it at once) or `/finish` (`--end finish`: only the owner knows what input that ends,
so its reply releases it). The figure is the time from that call to the first token. Without `preemptive` the
answer starts then; with it, the server starts it once the input has been idle for `after_idle_ms`, and a turn that
ends unchanged is delivered from it. Mid-turn pauses longer than `after_idle_ms` make preemptive answers that new
input discards: their tokens are the cost, reported per turn.

Both systems run in the same process on the same app, alternating turn by turn, each turn with fresh text (no
prefix-cache help across turns); at `--concurrency 1` (low load) and at a saturating concurrency.

    .venv/bin/python bench/preemptive.py [--quick] [--eot-lag-ms 300 600] [--concurrency 1 12]

`--release`: the release path alone, one user, typed turns (`--release-chars` characters typed in pieces
`--release-gap-ms` apart, then a `--release-pause-ms` pause, then the end of the turn), on both surfaces: REST (a
reader on `/events` from the start; the turn ends with the empty end chunk) and realtime
(`input_text_buffer.commit` then `response.create`, sent back to back; measured from the commit). Two cases: the
answer's `max_tokens` below `preemptive.max_tokens` (its default, 64) and equal to it; each against the same
kind of turns without preemptive answers, in the same run. Each preemptive answer's text is checked against one
request over the same input (greedy: the same tokens).

    .venv/bin/python bench/preemptive.py --release [--turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import record as record_io
import systems
import websockets
import yaml
from clients import pct_ms
from tqdm import tqdm

from core.protocol import choice_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SESSIONS = "/v1/streaming_input/sessions"
WORDS = ["pipeline", "crawler", "vector", "search", "document", "token", "prefill", "decode", "cache", "stream"]
SYSTEMS = ("preemptive", "off")


def make_turn(rng: random.Random, words: int, chunks: int) -> list[str]:
    text = " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 999)}" for _ in range(words)) + "?"
    cuts = sorted(rng.sample(range(1, len(text) - 1), chunks - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


async def one_turn(
    client: httpx.AsyncClient, system: str, pieces: list[str], pause_at: int | None, args: argparse.Namespace
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [], "max_tokens": args.max_tokens, "temperature": 0}
    body["close_after_answer"] = True
    if system == "preemptive":
        body["preemptive"] = {"after_idle_ms": args.after_idle_ms, "max_tokens": args.preemptive_tokens}
    r = await client.post(SESSIONS, json=body)
    r.raise_for_status()
    sid = r.json()["session_id"]
    first_token: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    content_at: list[float] = []  # when each content frame arrived (their gaps: the decode step a client sees)

    async def watch() -> None:
        async with client.stream("GET", f"{SESSIONS}/{sid}/events") as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and choice_text(json.loads(line[6:]))[0]:
                    content_at.append(time.perf_counter())
                    if not first_token.done():
                        first_token.set_result(content_at[-1])

    watcher = asyncio.create_task(watch())
    try:
        for seq, piece in enumerate(pieces):
            if seq:
                gap = args.pause_ms if seq == pause_at else args.gap_ms
                await asyncio.sleep(gap / 1000)
            r = await client.post(f"{SESSIONS}/{sid}/chunks", json={"sequence_id": seq, "payload": piece})
            r.raise_for_status()
        await asyncio.sleep(args.eot_lag_ms / 1000)  # the end-of-turn detector's silence
        end_of_turn = time.perf_counter()
        if args.end == "chunk":
            end = {"sequence_id": len(pieces), "payload": "", "end_of_input": True}
            r = await client.post(f"{SESSIONS}/{sid}/chunks", json=end)
        else:
            r = await client.post(f"{SESSIONS}/{sid}/finish")
        r.raise_for_status()
        finished = time.perf_counter()
        first = await asyncio.wait_for(first_token, 120)
        await asyncio.wait_for(watcher, 120)
        info = (await client.get(f"{SESSIONS}/{sid}")).json()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await client.delete(f"{SESSIONS}/{sid}")
    preemptive = info.get("preemptive") or {}
    work = info.get("work") or {}
    return {
        "system": system,
        "eot_to_first_token_s": first - end_of_turn,
        "finish_rtt_s": finished - end_of_turn,  # the end call's own round trip (the control path)
        # The median gap between content frames once the first is out: a decode step as the client sees it.
        "step_s": statistics.median(gaps) if (gaps := [b - a for a, b in pairwise(content_at[1:])]) else None,
        "paused": pause_at is not None,
        "delivered": preemptive.get("delivered", 0),
        "discarded": preemptive.get("discarded", 0),
        "discarded_tokens": preemptive.get("discarded_tokens", 0),
        "prompt_tokens": work.get("prompt_tokens"),
        "computed_tokens": work.get("computed_tokens"),
    }


async def level(
    client: httpx.AsyncClient, concurrency: int, args: argparse.Namespace, seed: int, bar: tqdm
) -> list[dict[str, Any]]:
    """`concurrency` users at once, each alternating the two systems turn by turn."""

    async def user(u: int) -> list[dict[str, Any]]:
        rng = random.Random(seed * 1000 + u)
        out = []
        for t in range(args.turns):
            for system in SYSTEMS if (t + u) % 2 == 0 else reversed(SYSTEMS):
                pieces = make_turn(rng, args.words, args.chunks)
                pause_at = rng.randrange(1, len(pieces)) if rng.random() < args.pause_share else None
                out.append(await one_turn(client, system, pieces, pause_at, args))
                bar.update(1)
        return out

    results = await asyncio.gather(*(user(u) for u in range(concurrency)))
    return [r for rs in results for r in rs]


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in SYSTEMS:
        mine = [r for r in results if r["system"] == system]
        ttft = [r["eot_to_first_token_s"] for r in mine]
        prompt = sum(r["prompt_tokens"] or 0 for r in mine)
        steps = [r["step_s"] for r in mine if r.get("step_s") is not None]
        out[system] = {
            **{f"p{q}_ms": pct_ms(ttft, q) for q in (50, 95, 99)},
            "decode_step_ms": statistics.median(steps) * 1e3 if steps else None,
            "finish_rtt_p50_ms": pct_ms([r["finish_rtt_s"] for r in mine], 50),
            "turns": len(mine),
            "delivered_share": sum(r["delivered"] for r in mine) / max(len(mine), 1),
            "discarded_tokens_per_turn": sum(r["discarded_tokens"] for r in mine) / max(len(mine), 1),
            "work_ratio": sum(r["computed_tokens"] or 0 for r in mine) / prompt if prompt else None,
        }
    on, off = out["preemptive"], out["off"]
    out["speedup"] = {f"p{q}": off[f"p{q}_ms"] / on[f"p{q}_ms"] for q in (50, 95, 99) if on[f"p{q}_ms"]}
    # The low-load goal: an unchanged turn's first token within one decode step (the answer's own, without
    # preemptive answers, as its client saw it) plus 10 ms of the end of turn.
    step = off["decode_step_ms"]
    out["goal_ms"] = step + 10 if step is not None else None
    return out


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=4 * max(args.concurrency) + 16)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        warm = make_turn(random.Random(-1), 20, 3)
        for system in SYSTEMS:  # warm-up, not counted
            await one_turn(client, system, warm, None, _with_lag(args, args.eot_lag_ms[0]))
        for lag in args.eot_lag_ms:
            for c in args.concurrency:
                label = f"lag {lag} ms, {c} users"
                with tqdm(total=c * args.turns * len(SYSTEMS), desc=label, unit="turn") as bar:
                    results = await level(client, c, _with_lag(args, lag), seed=lag * 100 + c, bar=bar)
                summary = summarise(results)
                runs[f"lag{lag}_c{c}"] = {"eot_lag_ms": lag, "concurrency": c, "summary": summary, "turns": results}
                on, off, speed = summary["preemptive"], summary["off"], summary["speedup"]
                print(
                    f"  {label}: end of turn -> first token P50/P95/P99 {_ms(on)} with preemptive, {_ms(off)} "
                    f"without ({speed.get('p50', 0):.2f}x / {speed.get('p95', 0):.2f}x / {speed.get('p99', 0):.2f}x); "
                    f"delivered {on['delivered_share']:.0%}, discarded {on['discarded_tokens_per_turn']:.1f} "
                    f"tokens/turn; work {on['work_ratio']:.3f} vs {off['work_ratio']:.3f}; decode step "
                    f"{off['decode_step_ms'] or 0:.1f} ms, end call round trip {on['finish_rtt_p50_ms']:.0f} ms",
                    flush=True,
                )
    return runs


# --- --release: end of turn -> first token on the release path, both surfaces --------------------------------
CASES = {"below": None, "equal": "answer"}  # preemptive.max_tokens: its default (64), or the answer's own


def typed_turn(rng: random.Random, chars: int, pieces: int) -> list[str]:
    text = ""
    while len(text) < chars:
        text += f"{rng.choice(WORDS)}{rng.randint(0, 999)} "
    text = text[: chars - 1] + "?"
    cuts = sorted(rng.sample(range(1, len(text) - 1), pieces - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _preemptive_options(args: argparse.Namespace, case: str) -> dict[str, Any]:
    options: dict[str, Any] = {"after_idle_ms": args.release_idle_ms}
    if CASES[case] == "answer":
        options["max_tokens"] = args.release_tokens
    return options


async def rest_release_turn(
    client: httpx.AsyncClient, system: str, case: str, pieces: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [], "max_tokens": args.release_tokens, "temperature": 0}
    body["close_after_answer"] = True
    if system == "preemptive":
        body["preemptive"] = _preemptive_options(args, case)
    r = await client.post(SESSIONS, json=body)
    r.raise_for_status()
    sid = r.json()["session_id"]
    content: list[tuple[float, str]] = []
    headers: dict[str, str] = {}

    async def watch() -> None:
        async with client.stream("GET", f"{SESSIONS}/{sid}/events") as resp:
            headers.update(resp.headers)
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and (text := choice_text(json.loads(line[6:]))[0]):
                    content.append((time.perf_counter(), text))

    watcher = asyncio.create_task(watch())
    try:
        for seq, piece in enumerate(pieces):
            if seq:
                await asyncio.sleep(args.release_gap_ms / 1000)
            chunk = {"sequence_id": seq, "payload": piece}
            (await client.post(f"{SESSIONS}/{sid}/chunks", json=chunk)).raise_for_status()
        await asyncio.sleep(args.release_pause_ms / 1000)
        end = {"sequence_id": len(pieces), "payload": "", "end_of_input": True}
        end_of_turn = time.perf_counter()
        (await client.post(f"{SESSIONS}/{sid}/chunks", json=end)).raise_for_status()
        await asyncio.wait_for(watcher, 120)
        info = (await client.get(f"{SESSIONS}/{sid}")).json()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await client.delete(f"{SESSIONS}/{sid}")
    timing = headers.get("server-timing", "")
    return _release_result("rest", system, case, pieces, end_of_turn, content, info, how=_how(timing))


async def realtime_release_turn(
    client: httpx.AsyncClient, system: str, case: str, pieces: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    url = str(client.base_url).replace("http://", "ws://").rstrip("/") + "/v1/realtime"
    content: list[tuple[float, str]] = []
    marks: dict[str, float] = {}
    async with websockets.connect(url, max_size=None) as ws:

        async def until(kind: str) -> dict[str, Any]:
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 120))
                marks.setdefault(event["type"], time.perf_counter())
                if event["type"] == "response.output_text.delta":
                    content.append((time.perf_counter(), event["delta"]))
                if event["type"] == "error":
                    raise RuntimeError(event["error"])
                if event["type"] == kind:
                    return event

        sid = (await until("session.created"))["session"]["id"]
        update: dict[str, Any] = {"temperature": 0, "max_output_tokens": args.release_tokens}
        if system == "preemptive":
            update["preemptive"] = _preemptive_options(args, case)
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        await until("session.updated")
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(args.release_gap_ms / 1000)
            await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": piece}))
        await asyncio.sleep(args.release_pause_ms / 1000)
        marks.clear()
        end_of_turn = time.perf_counter()
        await ws.send(json.dumps({"type": "input_text_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        await until("response.done")
        info = (await client.get(f"{SESSIONS}/{sid}")).json()
    result = _release_result("realtime", system, case, pieces, end_of_turn, content, info)
    # Where the time went, from the commit: its acknowledgement, then the response's first event.
    for name in ("input_text_buffer.committed", "response.created"):
        result[f"{name}_s"] = marks[name] - end_of_turn if name in marks else None
    return result


def _how(server_timing: str) -> str:
    names = {part.strip().split(";")[0] for part in server_timing.split(",")}
    return "released" if "released" in names else "held" if "held" in names else "handoff"


def _release_result(
    surface: str,
    system: str,
    case: str,
    pieces: list[str],
    end_of_turn: float,
    content: list[tuple[float, str]],
    info: dict[str, Any],
    how: str | None = None,
) -> dict[str, Any]:
    preemptive = info.get("preemptive") or {}
    answer = (info.get("answers") or [{}])[-1]
    gaps = [b[0] - a[0] for a, b in pairwise(content[1:])]
    return {
        "surface": surface,
        "system": system,
        "case": case,
        "input": "".join(pieces),
        "text": "".join(t for _, t in content),
        "eot_to_first_token_s": content[0][0] - end_of_turn if content else None,
        "step_s": statistics.median(gaps) if gaps else None,
        "how": how,
        "delivered": preemptive.get("delivered", 0),
        "discarded_tokens": preemptive.get("discarded_tokens", 0),
        "completion_tokens": (answer.get("usage") or {}).get("completion_tokens"),
        "finish_reason": answer.get("finish_reason"),
    }


async def release_run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=16)
    turns: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        rng = random.Random(7)
        surfaces = {"rest": rest_release_turn, "realtime": realtime_release_turn}
        for turn in surfaces.values():  # warm-up, not counted
            for system in SYSTEMS:
                await turn(client, system, "below", typed_turn(rng, 400, 3), args)
        plan = [(s, c, t) for t in range(args.turns) for s in surfaces for c in CASES]
        with tqdm(total=len(plan) * len(SYSTEMS), desc="release", unit="turn") as bar:
            for surface, case, t in plan:
                order = SYSTEMS if t % 2 == 0 else tuple(reversed(SYSTEMS))  # (fresh text each turn: no cache help)
                for system in order:
                    pieces = typed_turn(rng, args.release_chars, args.release_pieces)
                    turns.append(await surfaces[surface](client, system, case, pieces, args))
                    bar.update(1)
        # Greedy: each preemptive answer is the one request over the same input would have made, token for token.
        for r in turns:
            if r["system"] == "preemptive":
                body = {"messages": [{"role": "user", "content": r["input"]}], "temperature": 0}
                body["max_tokens"] = args.release_tokens
                reply = (await client.post("/v1/chat/completions", json=body)).json()
                r["same_as_one_request"] = reply["choices"][0]["message"]["content"] == r["text"]
    summary: dict[str, Any] = {}
    for surface in ("rest", "realtime"):
        for case in CASES:
            mine = [r for r in turns if r["surface"] == surface and r["case"] == case]
            on = [r for r in mine if r["system"] == "preemptive"]
            off = [r for r in mine if r["system"] == "off"]
            steps = [r["step_s"] for r in off if r["step_s"] is not None]
            row = {
                "preemptive_p50_ms": pct_ms([r["eot_to_first_token_s"] for r in on], 50),
                "preemptive_p95_ms": pct_ms([r["eot_to_first_token_s"] for r in on], 95),
                "off_p50_ms": pct_ms([r["eot_to_first_token_s"] for r in off], 50),
                "decode_step_ms": statistics.median(steps) * 1e3 if steps else None,
                "delivered_share": sum(r["delivered"] for r in on) / max(len(on), 1),
                "same_text_share": sum(bool(r.get("same_as_one_request")) for r in on) / max(len(on), 1),
                "tokens_per_turn": statistics.mean((r["completion_tokens"] or 0) + r["discarded_tokens"] for r in on),
                "how": sorted({r["how"] for r in on if r["how"]}),
            }
            if surface == "realtime":
                row["committed_p50_ms"] = pct_ms([r["input_text_buffer.committed_s"] for r in on], 50)
                row["response_created_p50_ms"] = pct_ms([r["response.created_s"] for r in on], 50)
            row["speedup_p50"] = row["off_p50_ms"] / row["preemptive_p50_ms"] if row["preemptive_p50_ms"] else None
            summary[f"{surface}_{case}"] = row
    return {"summary": summary, "turns": turns}


def release_main(args: argparse.Namespace, app_args: dict[str, Any]) -> None:
    app_args.pop("speech", None)  # (text only: no third engine)
    with systems.app(app_args) as app:
        record = asyncio.run(release_run(args, app.base))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    record["args"] = record_io.portable(vars(args))
    (args.out / "preemptive_release.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# End of turn → first token on the release path (one user)",
        "",
        f"`python bench/preemptive.py --release --turns {args.turns}` ({stamp}); answers of max_tokens "
        f"{args.release_tokens}, turns of {args.release_chars} characters and a {args.release_pause_ms:.0f} ms "
        f"pause, after_idle_ms {args.release_idle_ms}; REST: the empty end chunk, `/events` read from the start; "
        "realtime: from `input_text_buffer.commit` (then `response.create`)",
        "",
        "| surface | preemptive.max_tokens | preemptive P50 / P95 | off P50 | speedup | decode step | delivered "
        "| same text | tokens/turn | path (P50) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in record["summary"].items():
        surface, case = key.split("_")
        cap = "64 (default)" if case == "below" else str(args.release_tokens)
        path = ", ".join(row["how"])  # REST: Server-Timing; realtime: its events' P50 from the commit
        if surface == "realtime":
            path = f"committed {row['committed_p50_ms']:.0f} ms, created {row['response_created_p50_ms']:.0f} ms"
        lines.append(
            f"| {surface} | {cap} | {row['preemptive_p50_ms']:.0f} / {row['preemptive_p95_ms']:.0f} ms | "
            f"{row['off_p50_ms']:.0f} ms | {row['speedup_p50'] or 0:.2f}x | {row['decode_step_ms'] or 0:.1f} ms | "
            f"{row['delivered_share']:.0%} | {row['same_text_share']:.0%} | {row['tokens_per_turn']:.1f} | "
            f"{path} |"
        )
    (args.out / "preemptive_release.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ms(s: dict[str, Any]) -> str:
    return "/".join(f"{s[f'p{q}_ms']:.0f}" for q in (50, 95, 99)) + " ms"


def _with_lag(args: argparse.Namespace, lag: float) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.eot_lag_ms = lag
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: one lag, fewer turns")
    parser.add_argument("--eot-lag-ms", type=float, nargs="+", default=[300.0, 600.0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 12], help="low and saturating load")
    parser.add_argument("--turns", type=int, default=6, help="turns per user and system")
    parser.add_argument("--words", type=int, default=60, help="a spoken turn's length")
    parser.add_argument("--chunks", type=int, default=12, help="transcript updates per turn")
    parser.add_argument("--gap-ms", type=float, default=150.0, help="between transcript updates (speech pace)")
    parser.add_argument("--pause-share", type=float, default=0.3, help="turns with a pause mid-turn")
    parser.add_argument("--pause-ms", type=float, default=700.0, help="a mid-turn pause (past after_idle_ms)")
    parser.add_argument("--end", choices=["chunk", "finish"], default="chunk", help="how a turn's input ends")
    parser.add_argument("--after-idle-ms", type=int, default=200)
    parser.add_argument("--preemptive-tokens", type=int, default=16, help="preemptive `max_tokens`")
    parser.add_argument("--max-tokens", type=int, default=24, help="the answer's")
    parser.add_argument("--release", action="store_true", help="the release path alone, REST and realtime")
    parser.add_argument("--release-tokens", type=int, default=12, help="--release: the answer's max_tokens")
    parser.add_argument("--release-chars", type=int, default=2500, help="--release: a typed turn's length")
    parser.add_argument("--release-pieces", type=int, default=10, help="--release: pieces a turn is typed in")
    # (typed: under after_idle_ms apart, so that no preemptive answer starts, and none of max_attempts goes, mid-turn)
    parser.add_argument("--release-gap-ms", type=float, default=50.0, help="--release: between typed pieces")
    parser.add_argument("--release-pause-ms", type=float, default=600.0, help="--release: before the end of turn")
    parser.add_argument("--release-idle-ms", type=int, default=150, help="--release: preemptive after_idle_ms")
    parser.add_argument("--config", default=str(ROOT / "configs" / "config.yaml"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.eot_lag_ms, args.turns, args.concurrency = [300.0], 2, [1, 6]

    logging.getLogger("httpx").setLevel(logging.WARNING)
    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    if args.release:
        release_main(args, app_args)
        return
    with systems.app(app_args) as app:  # behind the default ingress, as the other benches run it
        runs = asyncio.run(run(args, app.base))

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"args": record_io.portable(vars(args)), "runs": runs, "stamp": stamp}
    (args.out / "preemptive.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# End of turn → first token, with and without preemptive answers",
        "",
        f"`python bench/preemptive.py{' --quick' if args.quick else ''} --end {args.end}` ({stamp}); P50 / P95 / P99 "
        "in ms; the turn's input ends with " + ("an empty end chunk" if args.end == "chunk" else "`/finish`"),
        "",
        "| EOT lag | users | preemptive | off | speedup | delivered | discarded tokens/turn | work on / off "
        "| decode step | end call P50 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_ in runs.values():
        s = run_["summary"]
        on, off, speed = s["preemptive"], s["off"], s["speedup"]
        lines.append(
            f"| {run_['eot_lag_ms']:.0f} ms | {run_['concurrency']} | {_ms(on)} | {_ms(off)} | "
            f"{'/'.join(f'{speed.get(k, 0):.2f}x' for k in ('p50', 'p95', 'p99'))} | {on['delivered_share']:.0%} | "
            f"{on['discarded_tokens_per_turn']:.1f} | {on['work_ratio']:.3f} / {off['work_ratio']:.3f} | "
            f"{off['decode_step_ms'] or 0:.1f} ms | {on['finish_rtt_p50_ms']:.0f} ms |"
        )
    (args.out / "preemptive.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
