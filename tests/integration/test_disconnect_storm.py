"""Hardening: a storm of clients that vanish at random points, on the real stack.

A few hundred clients (bounded concurrency, a fixed seed) each drop at one point of a request's life:

- mid-input (after some chunks or lines), mid-prefill (while a long chunk or prompt is being prefilled),
  mid-hand-off (right after the end of input, before the answer's first byte) and mid-answer (after the
  first streamed text);
- over REST sessions (the client just stops calling and closes its connections; no DELETE), NDJSON request
  bodies (the connection closes mid-body or mid-answer), the Realtime WebSocket (a close handshake or an
  abrupt TCP abort) and plain streamed chat completions.

What must hold once the storm is over (within a bounded settle time, SETTLE_S):

- both engines run nothing and hold no KV block (prefill: nor host swap slots, nor evicted sessions);
- no NDJSON or Realtime session is left open on the prefill replica: those die with their connection;
- a REST session whose reader vanished mid-answer does not hold its answer: the answer ends (cancelled,
  keeping its text) and decode stops generating it;
- a REST session abandoned mid-input legitimately lives until its idle timeout (an `EventSource` may come
  back), so REST sessions come in two variants: `expire` (created with `limits.idle_timeout_s` = 4 s, never
  touched again: it must expire and free everything on its own) and `delete` (default limits: after the storm
  the test checks its state, then DELETEs it, and everything must be freed);
- no client saw a 5xx before it dropped, and the server is healthy afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import websockets
from ray import serve

from tests.integration.conftest import APP, METRICS_PORT, engine_stats
from tests.integration.fuzzing import COUNTS, dump, record, reset, summary_lines

pytestmark = pytest.mark.integration

SEED = 20260117
CLIENTS = int(os.environ.get("RTPD_STORM_CLIENTS", "240"))
CONCURRENCY = int(os.environ.get("RTPD_STORM_CONCURRENCY", "24"))
SETTLE_S = float(os.environ.get("RTPD_STORM_SETTLE_S", "60"))
EXPIRE_IDLE_S = 4.0
ANSWER_TOKENS = 48  # long enough to drop mid-answer (ignore_eos: never shorter)
SESSIONS = "/v1/streaming_input/sessions"
MODULE = "test_disconnect_storm"

TEXT = (
    "Retrieved document one: the pipeline streams tokens as the crawler finds pages. "
    "Retrieved document two: prefill starts before the prompt is complete, so time to first token "
    "follows the last chunk closely. Question: what starts before the prompt is complete? "
)
LONG = "The quick brown fox jumps over the lazy dog while the compiler parses every token. " * 30

KINDS = [
    *(
        f"rest:{point}:{variant}"
        for point in ("mid_input", "mid_prefill", "mid_handoff", "mid_answer")
        for variant in ("delete", "expire")
    ),
    *(f"ndjson:{point}" for point in ("mid_body", "mid_handoff", "mid_answer", "nonstream_drop")),
    *(
        f"realtime:{point}:{how}"
        for point in ("after_created", "mid_input", "mid_handoff", "mid_answer")
        for how in ("close", "abort")
    ),
    "chat:mid_prefill",
    "chat:mid_answer",
]


@dataclass
class Client:
    index: int
    kind: str
    rng: random.Random
    session_id: str | None = None
    dropped: str = ""  # where it dropped, in words
    statuses: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def protocol(self) -> str:
        return self.kind.split(":")[0]

    @property
    def variant(self) -> str:
        return self.kind.split(":")[-1]

    async def saw_stream(self, r: httpx.Response) -> None:
        """A streamed response's status (and, for an error, its body)."""
        body = (await r.aread()).decode("utf-8", "replace") if r.status_code >= 400 else ""
        self.saw(r.status_code, body)
        if r.status_code >= 400:
            self.error = f"{r.status_code}: {body[:300]}"

    def saw(self, status: int, body: str = "") -> None:
        self.statuses.append(status)
        COUNTS[f"status:{status}"] += 1
        if status >= 500:
            record("storm_5xx", kind=self.kind, client=self.index, status=status, body=body)


def pieces(rng: random.Random, text: str) -> list[str]:
    n = rng.randint(3, 8)
    cuts = sorted(rng.sample(range(1, len(text) - 1), n - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


async def drop_after(task: asyncio.Task[Any], seconds: float) -> None:
    """The client vanishes: its request is cancelled (httpx closes that connection) after `seconds`."""
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- REST sessions -------------------------------------------------------------------------------------
async def rest_client(server: str, c: Client) -> None:
    point = c.kind.split(":")[1]
    limits = {"idle_timeout_s": EXPIRE_IDLE_S} if c.variant == "expire" else {}
    body = {
        "messages": [{"role": "system", "content": "Answer from the context."}],
        "max_tokens": ANSWER_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "limits": limits,
    }
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        r = await http.post(SESSIONS, json=body)
        c.saw(r.status_code, r.text)
        if r.status_code != 201:
            c.error = f"create: {r.status_code} {r.text[:200]}"
            return
        c.session_id = sid = r.json()["session_id"]
        parts = pieces(c.rng, TEXT)

        async def chunk(seq: int, payload: str, end: bool = False) -> None:
            r = await http.post(
                f"{SESSIONS}/{sid}/chunks", json={"sequence_id": seq, "payload": payload, "end_of_input": end}
            )
            c.saw(r.status_code, r.text)

        if point == "mid_input":
            k = c.rng.randint(1, len(parts) - 1)
            for seq in range(k):
                await chunk(seq, parts[seq])
            c.dropped = f"after {k}/{len(parts)} chunks"
            return
        if point == "mid_prefill":
            k = c.rng.randint(0, len(parts) - 1)
            for seq in range(k):
                await chunk(seq, parts[seq])
            delay = c.rng.uniform(0, 0.15)
            await drop_after(asyncio.create_task(chunk(k, LONG)), delay)
            c.dropped = f"{delay * 1000:.0f} ms into a long chunk after {k} chunks"
            return
        for seq, part in enumerate(parts):
            await chunk(seq, part, end=seq == len(parts) - 1)
        if point == "mid_handoff":
            if c.rng.random() < 0.5:
                c.dropped = "right after end_of_input, no reader"
                return
            delay = c.rng.uniform(0, 0.05)
            await drop_after(asyncio.create_task(http.get(f"{SESSIONS}/{sid}/events")), delay)
            c.dropped = f"{delay * 1000:.0f} ms into /events (before its first frame, mostly)"
            return
        # mid_answer: read /events up to the first text delta, then vanish
        async with http.stream("GET", f"{SESSIONS}/{sid}/events") as r:
            await c.saw_stream(r)
            async for line in r.aiter_lines():
                if line.startswith("data: {") and content_of(line):
                    c.dropped = "after the first text delta of /events"
                    break
            else:
                c.dropped = "never: /events ended before any text"


def content_of(sse_line: str) -> str:
    data = json.loads(sse_line[6:])
    for choice in data.get("choices") or []:
        return (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return ""


# --- NDJSON bodies -------------------------------------------------------------------------------------
async def ndjson_client(server: str, c: Client) -> None:
    point = c.kind.split(":")[1]
    parts = pieces(c.rng, TEXT)
    first = {
        "messages": [{"role": "user", "content": parts[0]}],
        "max_tokens": ANSWER_TOKENS,
        "ignore_eos": True,
        "stream": point != "nonstream_drop",
    }
    stop_after = c.rng.randint(1, len(parts) - 1) if point == "mid_body" else len(parts)
    body_sent = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield (json.dumps(first) + "\n").encode()
        for i, part in enumerate(parts[1:stop_after], start=1):
            await asyncio.sleep(0.01)
            yield (json.dumps({"payload": part, "end_of_input": i == len(parts) - 1}) + "\n").encode()
        body_sent.set()
        if point == "mid_body":
            await asyncio.Event().wait()  # the rest of the body never comes

    headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:

        async def request() -> None:
            async with http.stream("POST", "/v1/chat/completions", content=body(), headers=headers) as r:
                await c.saw_stream(r)
                c.session_id = r.headers.get("x-session-id")
                if point == "mid_answer":
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and content_of(line):
                            c.dropped = "after the first text frame"
                            return
                    c.dropped = "never: the answer ended before any text"
                else:
                    await r.aread()

        task = asyncio.create_task(request())
        if point == "mid_answer":
            await task
            return
        await asyncio.wait([task, asyncio.create_task(body_sent.wait())], return_when=asyncio.FIRST_COMPLETED)
        delay = c.rng.uniform(0, 0.2 if point != "mid_handoff" else 0.03)
        if task.done():
            c.dropped = "never: the request ended first"
            return
        await drop_after(task, delay)
        c.dropped = (
            f"{delay * 1000:.0f} ms after {'line ' + str(stop_after) if point == 'mid_body' else 'the whole body'}"
        )


# --- Realtime ------------------------------------------------------------------------------------------
async def realtime_client(server: str, c: Client) -> None:
    _, point, how = c.kind.split(":")
    url = server.replace("http://", "ws://") + "/v1/realtime"
    ws = await websockets.connect(url, open_timeout=60, close_timeout=2)
    try:
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if event["type"] == "session.created":
                c.session_id = event["session"]["id"]
                break
            if event["type"] == "error":
                c.error = f"before session.created: {event}"
                return
        parts = pieces(c.rng, TEXT)
        if point == "mid_input":
            k = c.rng.randint(1, len(parts))
            for part in parts[:k]:
                await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": part}))
            await asyncio.sleep(c.rng.uniform(0, 0.1))
            c.dropped = f"after {k}/{len(parts)} appends"
        elif point in ("mid_handoff", "mid_answer"):
            for part in parts:
                await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": part}))
            await ws.send(json.dumps({"type": "input_text_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": ANSWER_TOKENS}}))
            if point == "mid_handoff":
                delay = c.rng.uniform(0, 0.05)
                await asyncio.sleep(delay)
                c.dropped = f"{delay * 1000:.0f} ms after response.create"
            else:
                c.dropped = "never: no delta within 60 s"
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if event["type"] == "response.output_text.delta":
                        c.dropped = "after the first text delta"
                        break
                    if event["type"] in ("response.done", "error"):
                        c.dropped = f"never: {event['type']} before any delta"
                        c.error = json.dumps(event)[:300] if event["type"] == "error" else None
                        break
        else:
            c.dropped = "right after session.created"
    finally:
        if how == "abort":
            ws.transport.abort()  # no close frame: the TCP connection just goes
        else:
            await ws.close()


# --- plain chat completions ----------------------------------------------------------------------------
async def chat_client(server: str, c: Client) -> None:
    point = c.kind.split(":")[1]
    content = LONG if point == "mid_prefill" else TEXT  # a long prompt is prefilled on prefill
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": ANSWER_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:

        async def request() -> None:
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                await c.saw_stream(r)
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and content_of(line):
                        c.dropped = "after the first text frame"
                        return

        if point == "mid_answer":
            await request()
            return
        delay = c.rng.uniform(0, 0.1)
        await drop_after(asyncio.create_task(request()), delay)
        c.dropped = c.dropped or f"{delay * 1000:.0f} ms into the request"


RUNNERS = {"rest": rest_client, "ndjson": ndjson_client, "realtime": realtime_client, "chat": chat_client}


async def storm(server: str, clients: list[Client], label: str = "storm") -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(c: Client) -> None:
        async with gate:
            COUNTS[f"case:{label} {c.kind}"] += 1
            try:
                await asyncio.wait_for(RUNNERS[c.protocol](server, c), 120)
            except Exception as e:  # a client that failed before it meant to drop: reported, not raised
                c.error = f"{type(e).__name__}: {e}"[:300]

    await asyncio.gather(*(one(c) for c in clients))


# --- afterwards ----------------------------------------------------------------------------------------
def idle_problems(baseline_sessions: int) -> list[str]:
    problems = []
    for role in ("prefill", "decode"):
        s = engine_stats(role)
        busy = {k: s[k] for k in ("num_requests", "unfinished_requests", "num_running", "num_waiting") if s.get(k)}
        if busy:
            problems.append(f"{role} still runs requests: {busy}")
        if s["kv_blocks_free"] != s["kv_blocks_total"]:
            problems.append(f"{role} holds {s['kv_blocks_total'] - s['kv_blocks_free']} KV blocks")
        sched = s.get("scheduler") or {}
        if sched.get("host_slots_free", 0) != sched.get("host_slots", 0):
            problems.append(f"{role} holds {sched['host_slots'] - sched['host_slots_free']} host swap slots")
        if sched.get("evicted_now") or sched.get("idle_sessions"):
            problems.append(
                f"{role} scheduler: evicted_now={sched.get('evicted_now')} idle_sessions={sched.get('idle_sessions')}"
            )
        if role == "prefill" and s["sessions_open"] > baseline_sessions:
            problems.append(f"prefill has {s['sessions_open'] - baseline_sessions} sessions open")
    return problems


def session_state(http: httpx.Client, sid: str) -> dict[str, Any] | None:
    r = http.get(f"{SESSIONS}/{sid}")
    return r.json() if r.status_code == 200 else None


def wait_settled(baseline: int, timeout: float) -> list[str]:
    deadline = time.time() + timeout
    while (problems := idle_problems(baseline)) and time.time() < deadline:
        time.sleep(1)
    return problems


ATTRIBUTION_CLIENTS = 10


def sessions_by_state() -> dict[str, float]:
    """The prefill replicas' `rtpd_sessions_open` gauge by state, as Prometheus scrapes it."""
    try:
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    except httpx.HTTPError as e:
        return {"unavailable": repr(e)}  # type: ignore[dict-item]
    states: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_rtpd_sessions_open{") and (m := re.search(r'state="([a-z]+)"', line)):
            states[m.group(1)] = states.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: v for k, v in states.items() if k != "closed"}


def attribute_anonymous_leaks(server: str) -> dict[str, int]:
    """Sessions the storm left whose id no client learnt (an NDJSON request dropped before its response has no
    X-Session-Id yet): replay a few clients of each such kind alone and count the sessions left open."""
    leaks = {}
    rng = random.Random(SEED + 1)
    for kind in [k for k in KINDS if k.startswith("ndjson:")]:
        before = engine_stats("prefill")["sessions_open"]
        clients = [Client(-1, kind, random.Random(rng.random())) for _ in range(ATTRIBUTION_CLIENTS)]
        asyncio.run(storm(server, clients, label="attribution"))
        deadline = time.time() + 30  # clean-up may take a moment: count what is still open after 30 s
        while (left := engine_stats("prefill")["sessions_open"] - before) > 0 and time.time() < deadline:
            time.sleep(1)
        leaks[kind] = left
    return leaks


def router_admission() -> dict[str, Any]:
    return serve.get_deployment_handle("router", app_name=APP).admission_state.remote().result(timeout_s=60)


def test_disconnect_storm(server: str, pytestconfig: pytest.Config) -> None:
    reset()
    before = wait_settled(10**9, SETTLE_S)  # the engines must be idle to begin with (sessions aside)
    if before:
        pytest.fail(f"the engines were not idle before the storm (left by earlier tests): {before}")
    baseline = engine_stats("prefill")["sessions_open"]
    counted_before = router_admission()["in_flight"]  # (earlier tests' REST sessions may live on until idle)

    rng = random.Random(SEED)
    clients = [Client(i, rng.choice(KINDS), random.Random(rng.random())) for i in range(CLIENTS)]
    started = time.monotonic()
    asyncio.run(storm(server, clients))
    storm_s = time.monotonic() - started

    failures: list[str] = []
    with httpx.Client(base_url=server, timeout=60) as http:
        # A REST session whose reader vanished mid-answer does not hold its answer (within the settle time).
        deadline = time.time() + SETTLE_S
        for c in clients:
            if c.kind.startswith("rest:mid_answer") and c.session_id and c.dropped.startswith("after"):
                while True:
                    state = session_state(http, c.session_id)
                    answer = (state or {}).get("answers", [None])[-1] if state else None
                    if state is None or answer is None or answer["status"] in ("completed", "cancelled", "failed"):
                        break
                    if time.time() > deadline:
                        failures.append(
                            f"REST session {c.session_id} (client {c.index}, {c.kind}, dropped {c.dropped}) holds "
                            f"its answer still: status {answer['status']}, session state {state['state']}"
                        )
                        record("storm_answer_held", kind=c.kind, client=c.index, answer=answer, state=state["state"])
                        break
                    time.sleep(0.5)
        # The `delete` REST sessions: DELETE (a live client would; the alternative is their 300 s idle timeout).
        for c in clients:
            if c.protocol == "rest" and c.variant == "delete" and c.session_id:
                r = http.delete(f"{SESSIONS}/{c.session_id}")
                COUNTS["storm_rest_deleted"] += 1
                if r.status_code != 200:
                    failures.append(f"DELETE of {c.kind} session {c.session_id}: {r.status_code} {r.text[:200]}")

        problems = wait_settled(baseline, SETTLE_S)
        if problems:
            # Which of the sessions we know of are still open, by kind (NDJSON sessions dropped mid-body never
            # told their id to the client: they show up only in the prefill's count).
            left: Counter[str] = Counter()
            for c in clients:
                if c.session_id and (state := session_state(http, c.session_id)) and state["state"] != "closed":
                    left[f"{c.kind} ({state['state']})"] += 1
            unknown = sum(1 for c in clients if c.protocol in ("ndjson", "realtime") and not c.session_id)
            by_state = sessions_by_state()
            leaks = attribute_anonymous_leaks(server)
            record("storm_not_idle", problems=problems, by_kind=dict(left), by_state=by_state, anonymous=leaks)
            failures.append(
                f"{SETTLE_S:.0f} s after the storm: {problems}; open sessions by client kind: {dict(left)}, "
                f"by state (rtpd_sessions_open): {by_state} "
                f"(+ up to {unknown} NDJSON/realtime sessions whose id the client never learnt; replaying "
                f"{ATTRIBUTION_CLIENTS} clients of each such kind alone left open 30 s later: {leaks})"
            )

        fives = [(c.index, c.kind, s) for c in clients for s in c.statuses if s >= 500]
        if fives:
            failures.append(f"{len(fives)} 5xx answers during the storm: {fives[:20]}")
        health = http.get("/health")
        chat = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        )
        if health.status_code != 200 or chat.status_code != 200:
            failures.append(
                f"unhealthy after the storm: /health {health.status_code}, chat {chat.status_code} {chat.text[:200]}"
            )

    # Nothing the storm admitted is still counted by the router's admission (a ticket left behind would shrink
    # its room for new sessions until the longest session's limit).
    deadline, state = time.time() + SETTLE_S, router_admission()
    while state["in_flight"] > counted_before and time.time() < deadline:
        time.sleep(1)
        state = router_admission()
    if state["in_flight"] > counted_before:
        failures.append(
            f"{SETTLE_S:.0f} s after the storm the router counts work in flight: {state} ({counted_before} before it)"
        )

    kinds = Counter(c.kind for c in clients)
    errors = [(c.index, c.kind, c.error) for c in clients if c.error]
    refused = sum(1 for c in clients for s in c.statuses if s == 429)
    COUNTS["storm_clients"] = len(clients)
    COUNTS["storm_client_errors"] = len(errors)
    COUNTS["storm_429"] = refused
    COUNTS["storm_seconds"] = round(storm_s)
    for c in clients:
        dropped = bool(c.dropped) and not c.dropped.startswith("never")
        COUNTS[f"{'dropped' if dropped else 'did_not_drop'}:{c.kind}"] += 1
    for index, kind, error in errors[:20]:
        record("storm_client_error", client=index, kind=kind, error=error)
    data = dump(MODULE)
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")
    lines = summary_lines(MODULE, data) + [f"    clients by kind: {dict(sorted(kinds.items()))}"]
    lines += [f"    client error: {e}" for e in errors[:10]]
    for line in lines:
        reporter.write_line(line) if reporter is not None else print(line)
    assert not failures, "\n".join(failures)
