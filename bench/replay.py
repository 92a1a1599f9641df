"""Replays a workload trace (bench/workloads.py) against one system, open loop, as Stream2LLM's drivers do.

Each query starts at its arrival time whatever the others are doing, and its inputs are sent when the trace
says they become available, each chunk at its own time (a chunk call slow to return never delays the next).
TTFT counts from the moment the whole input is available (the trace's time of the last chunk) to the first
token of the answer: retrieval time is excluded, and every system is measured from the same point, however
long its chunk calls take. `send_lag_ms` shows how late requests left against the trace (the client's own
delay, which should stay near zero).

How a query is sent (`mode`):
- `streaming`: a REST streaming-input session (`start_policy: on_first_chunk`): each chunk as it arrives
  (`append`; `replace` from the first character that changed, for update-mode traces), the answer read from
  the session's event stream.
- `on_end_only`: the same session with `start_policy: on_end_only`: the server holds the input and prefills it
  after the last chunk (this system not streaming).
- `whole`: one streamed chat completion with the whole input, sent when the last chunk is available: what a
  user of a server without streaming input (the peer) does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
from workloads import Query, Trace, common_prefix

SESSIONS = "/v1/streaming_input/sessions"
MODES = ("streaming", "on_end_only", "whole")


@dataclass
class Result:
    id: int
    ttft_s: float | None = None
    error: str | None = None
    started_s: float = 0.0  # replay-relative: the query's first request
    ended_s: float = 0.0  # replay-relative: its answer's end (or failure)
    server: dict[str, Any] | None = None  # a session's own record: work, scheduler counters, hand-off timing


class QueryFailed(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}"[:300])
        self.kind = kind


def _p99_ms(values: list[float]) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1) if ordered else 0.0


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def first_token(resp: httpx.Response) -> float:
    """When the first frame with text arrives (or the end, for an answer without text); reads to the end."""
    if resp.status_code != 200:
        await resp.aread()
        raise QueryFailed(f"http_{resp.status_code}", resp.text[:200])
    first: float | None = None
    async for line in resp.aiter_lines():
        if line == "data: [DONE]":
            first = first or time.perf_counter()
            continue
        if not line.startswith("data: {"):
            continue
        frame = json.loads(line[6:])
        if frame.get("error"):
            raise QueryFailed("stream_error", json.dumps(frame["error"])[:200])
        texts = ((c.get("delta") or {}).get("content") or c.get("text") for c in frame.get("choices") or [])
        if first is None and any(texts):
            first = time.perf_counter()
    if first is None:
        raise QueryFailed("no_answer", "the stream ended without an answer")
    return first


def chunk_bodies(q: Query) -> list[dict[str, Any]]:
    """The chunk requests of `q`, in order: appends, or replaces from the first character that changed."""
    bodies, text = [], ""
    for seq, chunk in enumerate(q.chunks):
        body: dict[str, Any] = {"sequence_id": seq, "end_of_input": seq == len(q.chunks) - 1}
        if chunk.mode == "replace" and seq:
            keep = common_prefix(text, chunk.text)
            body |= {"mode": "replace", "offset": keep, "payload": chunk.text[keep:]}
            text = chunk.text
        else:
            body["payload"] = chunk.text
            text += chunk.text
        bodies.append(body)
    return bodies


async def _session(
    client: httpx.AsyncClient, q: Query, body: dict[str, Any], t0: float, lags: list[float], res: Result
) -> float:
    """Sends `q` through a streaming-input session; TTFT in seconds from when its input was whole. The session's
    record (`res.server`: what it cost the engine, by kind, and where its hand-off's time went) is read after
    its answer, so that a slow query can be explained.

    Each chunk is sent at the moment it becomes available, whatever became of the previous ones (the server
    orders chunks by `sequence_id`): a chunk call that is slow to return (a rewrite waiting on the engine)
    must not delay the next chunk, or its time would be left out of the TTFT."""
    r = await client.post(SESSIONS, json=body)
    if r.status_code != 201:
        raise QueryFailed(f"create_{r.status_code}", r.text[:200])
    sid = r.json()["session_id"]
    tasks: list[asyncio.Task[Any]] = []
    try:

        async def read() -> float:
            async with client.stream("GET", f"{SESSIONS}/{sid}/events") as resp:
                return await first_token(resp)

        async def send(chunk_at: float, chunk: dict[str, Any]) -> None:
            await _until(chunk_at)
            lags.append(time.perf_counter() - chunk_at)
            r = await client.post(f"{SESSIONS}/{sid}/chunks", json=chunk)
            if r.status_code >= 400:
                raise QueryFailed(f"chunk_{r.status_code}", r.text[:200])

        answer = asyncio.create_task(read())
        tasks.append(answer)
        for chunk, body_ in zip(q.chunks, chunk_bodies(q), strict=True):
            tasks.append(asyncio.create_task(send(t0 + q.arrival_s + chunk.at_s, body_)))
        await asyncio.gather(*tasks[1:])  # a refused chunk fails the query
        ttft = await answer - (t0 + q.ready_s)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await client.get(f"{SESSIONS}/{sid}")
            if r.status_code == 200:
                res.server = _server_record(r.json())
        return ttft
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(httpx.HTTPError):
            await client.delete(f"{SESSIONS}/{sid}", timeout=30)


def _server_record(info: dict[str, Any]) -> dict[str, Any]:
    """What of a session's record explains its TTFT: its work, its own scheduler counters, its hand-off's timing."""
    scheduler = {k: v for k, v in (info.get("scheduler") or {}).items() if k != "replica"}
    answers = info.get("answers") or [{}]
    return {"work": info.get("work"), "scheduler": scheduler, "timing": answers[-1].get("timing")}


async def _whole(client: httpx.AsyncClient, q: Query, body: dict[str, Any], t0: float, lags: list[float]) -> float:
    await _until(t0 + q.ready_s)
    lags.append(time.perf_counter() - (t0 + q.ready_s))
    async with client.stream("POST", "/v1/chat/completions", json={**body, "messages": _user(q.final_text)}) as r:
        return await first_token(r) - (t0 + q.ready_s)


async def _until(at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))


async def replay(
    trace: Trace,
    *,
    base: str,
    model: str,
    mode: str,
    answer_tokens: int = 2,
    timeout_s: float = 300.0,
    progress: Any = None,
) -> dict[str, Any]:
    """Every query of `trace` against the system at `base`; per-query TTFTs (ms, None if it failed), errors by
    kind and the trace completion time (replay start to the last query's end)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    common = {"model": model, "max_tokens": answer_tokens, "temperature": 0, "stream": True}
    limits = httpx.Limits(max_connections=4 * len(trace.queries) + 16, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        t0 = time.perf_counter()
        lags: list[float] = []  # how late each request left against its trace time (a busy client shows here)

        async def one(q: Query) -> Result:
            await _until(t0 + q.arrival_s)
            res = Result(q.id, started_s=time.perf_counter() - t0)
            try:
                if mode == "whole":
                    call = _whole(client, q, common, t0, lags)
                else:
                    policy = "on_first_chunk" if mode == "streaming" else "on_end_only"
                    # One turn per query: the session closes with its answer (no re-prefill for a next turn).
                    body = {**common, "messages": [], "start_policy": policy, "close_after_answer": True}
                    call = _session(client, q, body, t0, lags, res)
                res.ttft_s = await asyncio.wait_for(call, timeout_s + q.ready_s - q.arrival_s)
            except QueryFailed as e:
                res.error = str(e)
            except asyncio.TimeoutError:
                res.error = f"timeout: after {timeout_s:.0f}s"
            except Exception as e:  # noqa: BLE001 - a failed query is counted, never fatal
                res.error = f"{type(e).__name__}: {e}"[:300]
            res.ended_s = time.perf_counter() - t0
            if progress is not None:
                progress.update(1)
            return res

        results = await asyncio.gather(*(one(q) for q in trace.queries))
        completion = time.perf_counter() - t0
    kinds = Counter((r.error or "").split(":")[0] for r in results if r.error)
    return {
        "ttft_ms": [None if r.ttft_s is None else r.ttft_s * 1000 for r in results],
        "errors": sum(kinds.values()),
        "error_kinds": dict(kinds),
        "error_samples": [r.error for r in results if r.error][:5],
        "completion_s": completion,
        "queries": len(results),
        "spans_s": [[round(r.started_s, 3), round(r.ended_s, 3)] for r in results],
        "server": [r.server for r in results],
        "send_lag_ms": {"max": round(max(lags, default=0.0) * 1000, 1), "p99": _p99_ms(lags)},
    }
