"""Benchmark clients: one streaming answer each, timed per token as the client sees it.

Three ways to get an answer: an OpenAI streaming chat completion, a REST streaming-input session
(create, one `end_of_input` chunk, its `events` SSE stream) and a realtime WebSocket conversation. Each
returns a `Sample`: TTFT (request sent -> first frame with text), inter-token latencies (gaps between
consecutive text frames; SSE frames that arrive in one network read share a time) and the completion tokens
the server reported. `run_level` runs C client loops of R answers each and `summarise` reduces the samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

PROMPT = "Summarise the following notes in one paragraph.\n" + "\n".join(
    f"Note {i}: the service received {i * 7} requests, answered {i * 5} of them within budget, "
    f"and queued the rest behind a slow batch job."
    for i in range(1, 9)
)
SYSTEM = "You are a concise assistant."
SESSIONS = "/v1/streaming_input/sessions"
ANSWER_TIMEOUT_S = 300.0


@dataclass
class Sample:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    tokens: int = 0
    error: str | None = None
    _start: float = 0.0
    _last: float | None = None

    def begin(self) -> None:
        self._start = time.perf_counter()

    def text_at(self, now: float) -> None:
        """A frame carrying text, parsed at `now`."""
        if self.ttft is None:
            self.ttft = now - self._start
        elif self._last is not None:
            self.itls.append(now - self._last)
        self._last = now

    def finish(self) -> Sample:
        if self.error is None and (self.ttft is None or self.tokens == 0):
            self.error = "stream ended without text or usage"
        return self


def frame_text(obj: dict[str, Any]) -> str:
    """Text of one frame: a `chat.completion.chunk`, or the sessions API's older `{"type": "delta"}` event."""
    if obj.get("type") == "delta":
        return obj.get("delta") or ""
    return "".join((c.get("delta") or {}).get("content") or "" for c in obj.get("choices") or [])


async def sse_objects(resp: httpx.Response) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """(parse time, JSON object) per SSE `data:` frame; `[DONE]` ends it. One network read, one time."""
    buf = ""
    async for chunk in resp.aiter_text():
        now = time.perf_counter()
        buf += chunk.replace("\r\n", "\n")
        *frames, buf = buf.split("\n\n")
        for frame in frames:
            data = "".join(line[5:].strip() for line in frame.split("\n") if line.startswith("data:"))
            if data == "[DONE]":
                return
            if data:
                yield now, json.loads(data)


async def read_stream(resp: httpx.Response, s: Sample) -> None:
    async for now, obj in sse_objects(resp):
        if "error" in obj:
            s.error = str(obj["error"])[:200]
        if obj.get("usage"):
            s.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
            s.tokens = obj["usage"].get("completion_tokens", 0)
        if frame_text(obj):
            s.text_at(now)


def chat_body(model: str, max_tokens: int, prompt: str = PROMPT) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def chat(client: httpx.AsyncClient, model: str, max_tokens: int, prompt: str = PROMPT) -> Sample:
    """One streaming chat completion; TTFT from sending the request."""
    s = Sample()
    s.begin()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(model, max_tokens, prompt)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                s.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return s
            await read_stream(resp, s)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        s.error = f"{type(e).__name__}: {e}"
    return s.finish()


async def session(client: httpx.AsyncClient, model: str, max_tokens: int) -> Sample:
    """A REST streaming-input session: create (system message), one chunk with the whole user text and
    `end_of_input`, then the `events` stream. TTFT from sending that chunk. The session is deleted after."""
    s = Sample()
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sid: str | None = None
    try:
        r = await client.post(SESSIONS, json=body)
        if r.status_code != 201:
            s.error = f"create: HTTP {r.status_code}: {r.text[:200]}"
            return s
        sid = r.json()["session_id"]
        s.begin()
        chunk = {"sequence_id": 0, "modality": "text", "payload": PROMPT, "end_of_input": True}
        r = await client.post(f"{SESSIONS}/{sid}/chunks", json=chunk)
        if r.status_code != 202:
            s.error = f"chunk: HTTP {r.status_code}: {r.text[:200]}"
            return s
        async with client.stream("GET", f"{SESSIONS}/{sid}/events") as resp:
            if resp.status_code != 200:
                await resp.aread()
                s.error = f"events: HTTP {resp.status_code}: {resp.text[:200]}"
                return s
            await read_stream(resp, s)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        if sid is not None:
            try:
                await client.delete(f"{SESSIONS}/{sid}")
            except httpx.HTTPError as e:
                s.error = s.error or f"delete: {type(e).__name__}: {e}"
    return s.finish()


async def _until(ws: Any, wanted: str) -> dict[str, Any]:
    while True:
        event = json.loads(await ws.recv())
        if event["type"] == "error":
            raise RuntimeError(f"while waiting for {wanted}: {event['error'].get('message')}")
        if event["type"] == wanted:
            return event


async def realtime_answer(ws: Any, s: Sample) -> None:
    """Read to `response.done`, timing `response.output_text.delta` events."""
    while True:
        raw = await ws.recv()
        now = time.perf_counter()
        event = json.loads(raw)
        if event["type"] == "response.output_text.delta" and event.get("delta"):
            s.text_at(now)
        elif event["type"] == "error":
            s.error = f"error event: {event['error'].get('code')}: {event['error'].get('message')}"[:200]
        elif event["type"] == "response.done":
            usage = event["response"].get("usage") or {}
            s.prompt_tokens, s.tokens = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
            if event["response"].get("status") not in ("completed", "incomplete"):
                s.error = s.error or f"response {event['response'].get('status')}"
            return


async def realtime(ws_base: str, model: str, max_tokens: int) -> Sample:
    """A realtime WebSocket conversation: session.update, one user item (acknowledged), then response.create;
    TTFT from sending response.create, tokens are `response.output_text.delta` events."""
    s = Sample()
    try:
        async with websockets.connect(f"{ws_base}/v1/realtime?model={model}", max_size=None) as ws:
            await _until(ws, "session.created")
            update = {"type": "session.update", "session": {"temperature": 0, "max_output_tokens": max_tokens}}
            await ws.send(json.dumps(update))
            await _until(ws, "session.updated")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await _until(ws, "conversation.item.created")
            s.begin()
            await ws.send(json.dumps({"type": "response.create"}))
            await realtime_answer(ws, s)
    except (OSError, RuntimeError, KeyError, json.JSONDecodeError, websockets.WebSocketException) as e:
        s.error = f"{type(e).__name__}: {e}"
    return s.finish()


Answer = Callable[[httpx.AsyncClient], Awaitable[Sample]]


async def run_level(one: Answer, concurrency: int, per_client: int, base: str) -> dict[str, Any]:
    """`concurrency` loops of `per_client` answers each, all at once; the figures of the level.

    Each loop is a user with a client and a connection of its own. One shared `httpx` pool is not: it matches
    every waiting request against every pooled connection on each start and end (httpcore), and a wave of 128
    requests on a pool of ~140 kept-alive connections spent ~3 s of the client's event loop before sending
    (both systems' TTFT at 128 streams counted it, plain vLLM's the more). The clients are made before the clock
    starts, with one TLS context (each client would load the CA bundle: ~23 ms); each user's first answer includes
    its TCP connect (local: well under a millisecond)."""
    tls = ssl.create_default_context()
    users = [
        httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(ANSWER_TIMEOUT_S), verify=tls)
        for _ in range(concurrency)
    ]

    async def guarded(client: httpx.AsyncClient) -> Sample:
        try:
            return await asyncio.wait_for(one(client), ANSWER_TIMEOUT_S)
        except TimeoutError:
            return Sample(error=f"no answer within {ANSWER_TIMEOUT_S:.0f} s")

    async def loop(client: httpx.AsyncClient) -> list[Sample]:
        return [await guarded(client) for _ in range(per_client)]

    async with contextlib.AsyncExitStack() as stack:
        for client in users:
            await stack.enter_async_context(client)
        start = time.perf_counter()
        results = await asyncio.gather(*(loop(client) for client in users), return_exceptions=True)
        wall = time.perf_counter() - start
    samples: list[Sample] = []
    for r in results:
        samples += [Sample(error=f"{type(r).__name__}: {r}")] if isinstance(r, BaseException) else r
    return {"concurrency": concurrency, "requests_per_client": per_client, **summarise(samples, wall)}


def pct_ms(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of seconds, in ms; None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)) * 1000


def summarise(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    itls = [x for s in ok for x in s.itls]
    tokens = sum(s.tokens for s in ok)
    frames = sum(len(s.itls) + (s.ttft is not None) for s in ok)  # (the frames with text the clients read)
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
        # A server whose loop lags writes several tokens a frame: it pays for fewer frames (plain vLLM's API server
        # has run both ways on the same machine, its per-token CPU and tokens/s changing with it).
        "tokens_per_frame": tokens / frames if frames else None,
    }
