"""The soak's mixed traffic: open-loop (Poisson) arrivals of five kinds of answer, each timed as its client sees it.

- `chat`: a plain streamed chat completion (TTFT from the request);
- `rest`: a REST streaming-input session, its user text in several chunks (the last one `end_of_input`), then its
  `events` stream, then DELETE (TTFT from the last chunk);
- `realtime`: a `/v1/realtime` WebSocket with text input: appends, `response.create` (TTFT from it), close;
- `ndjson`: a chat completion whose body is NDJSON lines sent as they are typed (TTFT from the last line);
- `voice`: a spoken turn on the realtime socket (a speech/samples/ clip paced as a microphone sends it, the server's
  VAD ends the turn and answers): TTFT is end of speech -> first token, so it is kept apart from the text kinds'.

Prompts differ per arrival (random words, 30-300 of them: some under the router's disaggregation threshold, some
over), so prefix caching does not flatter the run. Every answer is greedy with a fixed length (`ignore_eos`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx
import websockets
from clients import SESSIONS, SYSTEM, Sample, _until, read_stream, realtime_answer

WORDS = [
    "the",
    "service",
    "streams",
    "tokens",
    "while",
    "the",
    "crawler",
    "finds",
    "pages",
    "and",
    "the",
    "user",
    "keeps",
    "typing",
    "a",
    "question",
    "about",
    "latency",
    "budgets",
    "queues",
    "batches",
    "caches",
    "replicas",
    "sessions",
    "journals",
    "memory",
    "threads",
    "sockets",
    "answers",
]
# Share of arrivals per kind. Spoken turns are few: each holds a socket for its audio's real duration (~3 s).
MIX = {"chat": 0.3, "rest": 0.25, "realtime": 0.2, "ndjson": 0.2, "voice": 0.05}
TEXT_KINDS = ("chat", "rest", "realtime", "ndjson")
ANSWER_TIMEOUT_S = 120.0
VOICE_SLUGS = ("moon", "bread", "joke", "lights")


@dataclass
class Answer:
    """One arrival: when it came (s from the run's start), its kind, and what its client saw."""

    kind: str
    arrived: float
    sample: Sample
    done: float = 0.0


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 300))) + "."


def pieces(rng: random.Random, text: str) -> list[str]:
    """The text cut at random places (inside words too, as typing does), into 3-6 parts."""
    n = rng.randint(3, 6)
    cuts = sorted(rng.sample(range(1, len(text) - 1), n - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def http_error(s: Sample, where: str, r: httpx.Response) -> Sample:
    s.error = f"{where}HTTP {r.status_code}: {r.text[:200]}"
    return s


async def chat(http: httpx.AsyncClient, rng: random.Random, model: str, max_tokens: int) -> Sample:
    s = Sample()
    body = {"model": model, "messages": [{"role": "user", "content": words(rng)}], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    s.begin()
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return http_error(s, "", r)
        await read_stream(r, s)
    return s.finish()


async def rest(http: httpx.AsyncClient, rng: random.Random, model: str, max_tokens: int) -> Sample:
    s = Sample()
    # A system message makes it a chat session (chunks are the user's turn; chat.completion.chunk frames).
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    r = await http.post(SESSIONS, json=body)
    if r.status_code != 201:
        return http_error(s, "create: ", r)
    sid = r.json()["session_id"]
    try:
        parts = pieces(rng, words(rng))
        for seq, part in enumerate(parts):
            last = seq == len(parts) - 1
            if last:
                s.begin()
            chunk = {"sequence_id": seq, "modality": "text", "payload": part, "end_of_input": last}
            r = await http.post(f"{SESSIONS}/{sid}/chunks", json=chunk)
            if r.status_code != 202:
                return http_error(s, "chunk: ", r)
            await asyncio.sleep(rng.uniform(0, 0.2))  # typing
        async with http.stream("GET", f"{SESSIONS}/{sid}/events") as r:
            if r.status_code != 200:
                await r.aread()
                return http_error(s, "events: ", r)
            await read_stream(r, s)
    finally:
        r = await http.delete(f"{SESSIONS}/{sid}")
        if r.status_code != 200 and s.error is None:
            http_error(s, "delete: ", r)
    return s.finish()


async def ndjson(http: httpx.AsyncClient, rng: random.Random, model: str, max_tokens: int) -> Sample:
    s = Sample()
    parts = pieces(rng, words(rng))
    first = {"model": model, "messages": [{"role": "user", "content": parts[0]}], "max_tokens": max_tokens}
    first |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def body() -> AsyncIterator[bytes]:
        yield (json.dumps(first) + "\n").encode()
        for i, part in enumerate(parts[1:], start=1):
            await asyncio.sleep(rng.uniform(0, 0.2))
            last = i == len(parts) - 1
            if last:
                s.begin()
            yield (json.dumps({"payload": part, "end_of_input": last}) + "\n").encode()

    headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
    async with http.stream("POST", "/v1/chat/completions", content=body(), headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return http_error(s, "", r)
        await read_stream(r, s)
    return s.finish()


async def connect(ws_base: str, s: Sample) -> Any:
    ws = await websockets.connect(f"{ws_base}/v1/realtime", max_size=None, open_timeout=60)
    first = json.loads(await ws.recv())
    if first["type"] != "session.created":
        await ws.close()
        s.error = f"handshake: {first.get('error', {}).get('code', first['type'])}"
        return None
    return ws


async def realtime(ws_base: str, rng: random.Random, max_tokens: int) -> Sample:
    s = Sample()
    if (ws := await connect(ws_base, s)) is None:
        return s
    async with ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
        await _until(ws, "session.updated")
        for part in pieces(rng, words(rng)):
            await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": part}))
            await asyncio.sleep(rng.uniform(0, 0.2))
        s.begin()
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": max_tokens}}))
        await realtime_answer(ws, s)
    return s.finish()


@cache
def voice_frames(slug: str) -> tuple[list[str], float]:
    """A clip as base64 PCM16 24 kHz frames of 20 ms, with silence around it, and where its speech ends (s)."""
    from voice import FRAME_S, pcm24k, turn_audio

    audio, speech_end = turn_audio(slug, 0.4, 1.0)
    pcm, step = pcm24k(audio), int(24000 * FRAME_S) * 2
    return [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)], speech_end


async def voice(ws_base: str, rng: random.Random, max_tokens: int) -> Sample:
    """A spoken turn: frames paced at the audio's rate; TTFT from the end of speech."""
    from voice import FRAME_S

    s = Sample()
    frames, speech_end = voice_frames(rng.choice(VOICE_SLUGS))
    if (ws := await connect(ws_base, s)) is None:
        return s
    detection = {"type": "server_vad", "silence_duration_ms": 500, "create_response": True}
    audio = {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": detection}}
    session = {"output_modalities": ["text"], "temperature": 0, "max_output_tokens": max_tokens, "audio": audio}
    async with ws:
        await ws.send(json.dumps({"type": "session.update", "session": session | {"preemptive": None}}))
        await _until(ws, "session.updated")
        reader = asyncio.create_task(realtime_answer(ws, s))
        start, spoken = time.perf_counter(), int(speech_end / FRAME_S)
        for i, frame in enumerate(frames):
            if (delay := start + (i + 1) * FRAME_S - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
            if i == spoken:  # the frame holding the last spoken sample has left: TTFT counts from here
                s.begin()
        await reader
    return s.finish()


class Traffic:
    """Open-loop arrivals against one server: `run(rate, seconds)` starts answers at Poisson times and returns once
    every one has ended (or timed out); `answers` keeps them all, in arrival order."""

    def __init__(self, base: str, model: str, max_tokens: int, seed: int, mix: dict[str, float] = MIX) -> None:
        self.base, self.ws_base, self.model, self.max_tokens = base, base.replace("http", "ws", 1), model, max_tokens
        self.rng, self.mix = random.Random(seed), mix
        self.t0 = time.perf_counter()
        self.answers: list[Answer] = []
        self.http = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(ANSWER_TIMEOUT_S, connect=30))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _client(self, kind: str, rng: random.Random) -> Callable[[], Awaitable[Sample]]:
        if kind in ("realtime", "voice"):
            fn = realtime if kind == "realtime" else voice
            return lambda: fn(self.ws_base, rng, self.max_tokens)
        fn2 = {"chat": chat, "rest": rest, "ndjson": ndjson}[kind]
        return lambda: fn2(self.http, rng, self.model, self.max_tokens)

    async def _one(self, answer: Answer, rng: random.Random) -> None:
        try:
            answer.sample = await asyncio.wait_for(self._client(answer.kind, rng)(), ANSWER_TIMEOUT_S)
        except TimeoutError:
            answer.sample.error = f"timeout: no answer within {ANSWER_TIMEOUT_S:.0f} s"
        except Exception as e:  # a client's failure is a counted error, never the run's end
            answer.sample.error = f"{type(e).__name__}: {e}"[:200]
        answer.done = self.now()

    async def single(self, kind: str) -> Answer:
        """One answer of `kind`, now (not kept in `answers`)."""
        answer = Answer(kind, self.now(), Sample())
        await self._one(answer, random.Random(self.rng.random()))
        return answer

    async def run(self, rate: float, seconds: float, stop: asyncio.Event | None = None) -> list[Answer]:
        kinds, weights = list(self.mix), list(self.mix.values())
        tasks, mine = [], []
        end = self.now() + seconds
        at = self.now()
        while True:
            at += self.rng.expovariate(rate)
            if at >= end or (stop is not None and stop.is_set()):
                break
            await asyncio.sleep(max(0.0, at - self.now()))
            answer = Answer(self.rng.choices(kinds, weights)[0], self.now(), Sample())
            self.answers.append(answer)
            mine.append(answer)
            tasks.append(asyncio.create_task(self._one(answer, random.Random(self.rng.random()))))
        await asyncio.gather(*tasks)
        return mine

    async def close(self) -> None:
        await self.http.aclose()


def error_kind(kind: str, error: str) -> str:
    """An error's class for counting: its surface and the text before the first detail (`rest: create: HTTP 429`)."""
    if m := re.match(r"(.*?HTTP \d+)", error):
        return f"{kind}: {m.group(1)}"
    parts = error.split(": ")
    return f"{kind}: {': '.join(parts[: 2 if parts[0] in ('error event', 'handshake') else 1])[:80]}"
