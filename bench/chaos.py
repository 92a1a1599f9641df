"""The chaos run: a steady mix of every input surface while a seeded schedule kills and drains replicas.

On the faults app of the tests (tests/integration/faults/conftest.py: two prefill and two decode replicas, a
12 s NIXL lease, the default config's engines in float32 and eager), with two router replicas here, clients loop
over four surfaces, each answer greedy (temperature 0) over one of a few prompts:

- `rest`: a streaming-input session (POST, chunks, `GET /events`, DELETE);
- `realtime`: the WebSocket, text typed with `input_text_buffer.append`, then `response.create`;
- `ndjson`: an NDJSON request body (`X-Streaming-Input`), its answer streamed;
- `chat`: a plain streamed chat completion.

Meanwhile a schedule drawn from `--seed` SIGKILLs a prefill replica, a decode replica and a router replica, and
drains a prefill replica (scale-down to one, as an operator or the autoscaler does, then back to two), in turn
until `--duration-s` is over. A fault waits until its role again runs all its replicas (Serve replaced the last
victim): killing the only prefill replica left is an outage, not a failover.

Every answer must equal its fault-free answer (each prompt's non-streamed chat completion, asked before the
first fault), or end in a retryable protocol error (HTTP 429/503, realtime close 1012/1013 or an `error` event
whose code says retry, an SSE error frame of that kind) after which the client starts the answer over and the
retry must match. A connection cut with no protocol error (the router process holding it was killed) is retried
too and counted apart (`cut`): no server can answer from a dead process, but the client had no clear signal. No
answer may be delivered twice (one `[DONE]` / `session.done` / `response.done`, nothing after it). Afterwards,
once Serve runs every replica again: no engine runs a request or holds a KV block or a host swap slot (a prefill
block held for a NIXL read is a KV block: none may be left past the lease), no session is open on any prefill
replica, the routers count nothing in flight, and no journal record is left in the GCS store.

Reported (bench/results/chaos.md and chaos.json): answers intact / retried / cut / failed by surface and by fault
(the fault that happened during the answer, or `none`), and per fault the time until each surface answered again
(an answer started after the fault that completed) and until Serve ran the replacement.

The speech role is left out: four vLLM engines (two per core) already share the two cores, a fifth (Whisper) would
share a core with two of them and slow every answer, and audio only adds a transcription before the same
text path (a voice session is a realtime session: its faults are the ones measured here).

    flock /tmp/rtpd-heavy.lock .venv/bin/python bench/chaos.py [--duration-s 300] [--seed 7] [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

SURFACES = ("rest", "realtime", "ndjson", "chat")
FAULTS = ("prefill_kill", "decode_kill", "router_kill", "prefill_drain")
SESSIONS = "/v1/streaming_input/sessions"
MAX_TOKENS = 32
ATTEMPTS = 30  # (a lone router's death refuses connections until Serve replaces it)
ANSWER_TIMEOUT_S = 180.0
EFFECT_S = 30.0  # a fault's effect, when its victim's replacement was not timed
RETRYABLE_CODES = {"server_restarting", "server_overloaded", "rate_limit_exceeded", "service_unavailable"}
BASE_TEXT = (
    "Retrieved document one: the pipeline streams tokens as the crawler finds pages. "
    "Retrieved document two: prefill starts before the prompt is complete, so time to first token "
    "follows the last chunk closely. Retrieved document three: a replica may die at any moment, and the "
    "sessions it held are adopted by another one from their journals. "
)
QUESTIONS = (
    "Question: what starts before the prompt is complete?",
    "Question: who adopts the sessions of a dead replica?",
    "Question: what does the crawler find?",
    "Question: what follows the last chunk closely?",
)
PROMPTS = [BASE_TEXT * 3 + q for q in QUESTIONS]  # long enough to be prefilled on prefill (disaggregated)


class Retry(Exception):
    """The answer ended in a way a client acts on by asking again; `kind` says which (`cut`: no protocol error)."""

    def __init__(self, kind: str, after_s: float = 1.0) -> None:
        super().__init__(kind)
        self.kind, self.after_s = kind, after_s


class Wrong(Exception):
    """Anything else: a non-retryable error, a doubled or different answer."""


@dataclass
class Answer:
    surface: str
    prompt: int
    started: float
    ended: float = 0.0
    retries: list[str] = field(default_factory=list)  # the kinds of error each retried attempt ended in
    retry_times: list[float] = field(default_factory=list)  # when each of them ended (monotonic)
    outcome: str = ""  # intact | retried | cut | failed
    detail: str = ""
    attempt_started: float = 0.0  # the successful attempt's start
    session_ids: list[str] = field(default_factory=list)


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text) - 1), rng.randint(2, 5)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def retry_after(r: httpx.Response) -> float:
    with contextlib.suppress(ValueError, TypeError):
        return float(r.headers.get("retry-after"))
    return 1.0


def proxy_error(status: int, body: bytes | None) -> bool:
    """The proxy's own answer (the app's errors are OpenAI JSON) to a request or handshake whose router replica
    died under it: the cut a dead process makes, which the run checks comes only across a router's kill."""
    if status not in (500, 502):
        return False
    with contextlib.suppress(ValueError, TypeError):
        json.loads(body or b"")
        return False
    return True


def refused(r: httpx.Response, body: str = "") -> Exception:
    if r.status_code in (429, 503):
        return Retry(
            f"http_{r.status_code}" + ("" if "retry-after" in r.headers else "_no_retry_after"), retry_after(r)
        )
    if proxy_error(r.status_code, body.encode()):
        return Retry("cut")
    return Wrong(f"HTTP {r.status_code}: {body[:300]}")


async def sse_text(r: httpx.Response, answer: Answer) -> str:
    """The content of a chat stream (REST events, NDJSON, chat); exactly one `[DONE]`, nothing after it but a
    REST answer's one `session.done`."""
    if r.status_code != 200:
        raise refused(r, (await r.aread()).decode("utf-8", "replace"))
    text, done, summaries = "", 0, 0
    try:
        async for line in r.aiter_lines():
            if line.startswith("event: session.done"):
                summaries += 1
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            data = json.loads(line[6:])
            if done and "choices" in data:
                raise Wrong(f"a frame after [DONE]: {line[:200]}")
            if error := (data.get("error") if "choices" not in data else None):
                code = str(error.get("code") or error.get("type") or "")
                if code in RETRYABLE_CODES or code in ("429", "503"):
                    raise Retry(f"sse_{code}", float(error.get("retry_after") or 1))
                raise Wrong(f"SSE error frame: {error}")
            for choice in data.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise Retry("cut") from e
    if done != 1 or summaries > 1:
        raise Wrong(f"{done} [DONE] and {summaries} session.done frames: answered twice or never")
    return text


async def rest(http: httpx.AsyncClient, prompt: str, rng: random.Random, answer: Answer) -> str:
    body = {"messages": [], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = await http.post(SESSIONS, json=body)
    if r.status_code != 201:
        raise refused(r, r.text)
    sid = r.json()["session_id"]
    answer.session_ids.append(sid)
    try:
        parts = pieces(prompt, rng)
        for seq, part in enumerate(parts):
            chunk = {"sequence_id": seq, "payload": part, "end_of_input": seq == len(parts) - 1}
            r = await http.post(f"{SESSIONS}/{sid}/chunks", json=chunk)
            if r.status_code != 202:
                raise refused(r, r.text)
            await asyncio.sleep(rng.uniform(0, 0.2))
        async with http.stream("GET", f"{SESSIONS}/{sid}/events") as r:
            return await sse_text(r, answer)
    finally:
        await delete(http, sid)


async def delete(http: httpx.AsyncClient, sid: str) -> None:
    """DELETE the session, through whichever router answers (a client that leaves cleans up)."""
    for _ in range(30):
        with contextlib.suppress(httpx.HTTPError):
            if (await http.delete(f"{SESSIONS}/{sid}")).status_code in (200, 404):
                return
        await asyncio.sleep(1)


async def ndjson(http: httpx.AsyncClient, prompt: str, rng: random.Random, answer: Answer) -> str:
    parts = pieces(prompt, rng)

    async def body() -> AsyncIterator[bytes]:
        first = {"messages": [{"role": "user", "content": parts[0]}], "max_tokens": MAX_TOKENS, "temperature": 0}
        yield (json.dumps({**first, "stream": True}) + "\n").encode()
        for part in parts[1:]:
            await asyncio.sleep(rng.uniform(0, 0.2))
            yield (json.dumps({"payload": part}) + "\n").encode()
        yield b'{"end_of_input": true}\n'

    headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
    async with http.stream("POST", "/v1/chat/completions", content=body(), headers=headers) as r:
        if sid := r.headers.get("x-session-id"):
            answer.session_ids.append(sid)
        return await sse_text(r, answer)


async def chat(http: httpx.AsyncClient, prompt: str, rng: random.Random, answer: Answer) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0}
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return await sse_text(r, answer)


async def realtime(http: httpx.AsyncClient, prompt: str, rng: random.Random, answer: Answer) -> str:
    url = str(http.base_url).rstrip("/").replace("http://", "ws://") + "/v1/realtime"
    text, done = "", 0
    try:
        async with websockets.connect(url, open_timeout=30, max_size=None) as ws:

            async def event() -> dict[str, Any]:
                got = json.loads(await asyncio.wait_for(ws.recv(), ANSWER_TIMEOUT_S))
                if got["type"] == "error":
                    code = got["error"].get("code")
                    if code in RETRYABLE_CODES:
                        raise Retry(f"realtime_error_{code}", float(got["error"].get("retry_after") or 1))
                    raise Wrong(f"realtime error: {got['error']}")
                return got

            created = await event()
            answer.session_ids.append(created["session"]["id"])
            await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0, "instructions": ""}}))
            while (await event())["type"] != "session.updated":
                pass
            for part in pieces(prompt, rng):
                await ws.send(json.dumps({"type": "input_text_buffer.append", "delta": part}))
                await asyncio.sleep(rng.uniform(0, 0.2))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": MAX_TOKENS}}))
            while True:
                got = await event()
                if got["type"] == "response.output_text.delta":
                    if done:
                        raise Wrong("text after response.done: answered twice")
                    text += got["delta"]
                elif got["type"] == "response.done":
                    done += 1
                    status = got["response"]["status"]
                    if status not in ("completed", "incomplete"):
                        raise Wrong(f"response {status}: {got['response'].get('status_details')}")
                    # Anything more within a moment (a second delivery) would show up here.
                    with contextlib.suppress(TimeoutError):
                        extra = json.loads(await asyncio.wait_for(ws.recv(), 0.3))
                        if extra["type"].startswith("response."):
                            raise Wrong(f"after response.done: {extra['type']}")
                    return text
    except websockets.ConnectionClosed as e:
        code = e.rcvd.code if e.rcvd else 1006
        if code in (1012, 1013):
            raise Retry(f"close_{code}", 1.0) from e
        raise Retry("cut") from e
    except websockets.InvalidStatus as e:
        status = e.response.status_code
        if status in (429, 503):
            raise Retry(f"http_{status}", 1.0) from e
        if proxy_error(status, e.response.body):  # (the connection never opened: nothing was admitted)
            raise Retry("cut") from e
        raise Wrong(f"WebSocket handshake HTTP {status}: {e.response.body[:200]!r}") from e
    except (OSError, TimeoutError) as e:
        raise Retry("cut") from e
    raise AssertionError("unreachable")


CLIENTS: dict[str, Callable[..., Any]] = {"rest": rest, "realtime": realtime, "ndjson": ndjson, "chat": chat}


async def ask(http: httpx.AsyncClient, surface: str, prompt_index: int, rng: random.Random, expected: str) -> Answer:
    """One answer, started over after each retryable end, until it completes (or ATTEMPTS / the timeout)."""
    answer = Answer(surface, prompt_index, time.monotonic())
    deadline = answer.started + ANSWER_TIMEOUT_S
    for _ in range(ATTEMPTS):
        answer.attempt_started = time.monotonic()
        try:
            left = max(1.0, deadline - time.monotonic())
            text = await asyncio.wait_for(CLIENTS[surface](http, PROMPTS[prompt_index], rng, answer), left)
        except Retry as e:
            answer.retries.append(e.kind)
            answer.retry_times.append(time.monotonic())
            await asyncio.sleep(min(e.after_s, 10.0))
            continue
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:  # the ingress's router died
            answer.retries.append("cut")
            answer.retry_times.append(time.monotonic())
            answer.detail = type(e).__name__
            await asyncio.sleep(2.0)
            continue
        except TimeoutError:
            answer.outcome, answer.detail = "failed", f"no answer within {ANSWER_TIMEOUT_S:.0f} s (a hang)"
            break
        except Exception as e:  # noqa: BLE001 - every other end is a failure, reported with its cause
            answer.outcome, answer.detail = "failed", f"{type(e).__name__}: {e}"[:400]
            break
        if text != expected:
            answer.outcome, answer.detail = "failed", f"answer differs: {text[:120]!r} vs {expected[:120]!r}"
        elif not answer.retries:
            answer.outcome = "intact"
        else:
            answer.outcome = "retried" if any(k != "cut" for k in answer.retries) else "cut"
        break
    else:
        answer.outcome, answer.detail = "failed", f"still refused after {ATTEMPTS} attempts: {answer.retries}"
    answer.ended = time.monotonic()
    return answer


async def expected_answers(http: httpx.AsyncClient) -> list[str]:
    """Each prompt's fault-free answer: the whole (non-streamed) chat completion."""
    out = []
    for prompt in PROMPTS:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0}
        r = await http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


async def traffic(
    base: str, per_surface: int, seed: int, stop: asyncio.Event, expected: list[str], answers: list[Answer]
) -> None:
    """`per_surface` clients of each surface, each answer after the last, until `stop`."""

    async def client(surface: str, index: int) -> None:
        rng = random.Random(f"{seed}-{surface}-{index}")
        limits = httpx.Limits(max_keepalive_connections=0)  # each call its own connection: any router may take it
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(60, read=120), limits=limits) as http:
            while not stop.is_set():
                prompt = rng.randrange(len(PROMPTS))
                answers.append(await ask(http, surface, prompt, rng, expected[prompt]))
                await asyncio.sleep(rng.uniform(0, 0.5))

    await asyncio.gather(*(client(s, i) for s in SURFACES for i in range(per_surface)))


# --- the faults ------------------------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    at: float  # monotonic, when it was done
    victim: str = ""
    replaced_s: float | None = None  # until Serve ran the role's replicas again


@dataclass
class Cluster:
    """What the schedule acts through (the faults app's helpers: tests/integration/faults/conftest.py)."""

    replicas: Callable[[str], dict[str, int]]  # role -> {replica id: pid}
    counts: Callable[[], dict[str, int]]  # role -> replicas deployed
    scale_prefill: Callable[[int], None]
    running: Callable[[str], int]  # role -> replicas Serve runs (started and serving: an alive actor may still load)


def schedule(seed: int, duration_s: float, gap_s: float) -> list[tuple[float, str]]:
    """(seconds after the start, fault): every fault once in a seeded order, again while time is left."""
    rng = random.Random(seed)
    out, at = [], gap_s
    while at < duration_s - gap_s / 2:
        for kind in rng.sample(FAULTS, len(FAULTS)):
            if at >= duration_s - gap_s / 2:
                break
            out.append((round(at, 1), kind))
            at += gap_s * rng.uniform(0.8, 1.2)
    return out


def wait_full(cluster: Cluster, role: str, timeout: float = 600) -> float:
    """Until `role` runs as many replicas as deployed, each serving (a replica whose engine still loads is no
    survivor: killing the other one would be an outage); how long that took."""
    start = time.monotonic()
    while min(len(cluster.replicas(role)), cluster.running(role)) < cluster.counts()[role]:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{role} was not replaced within {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - start


def do_fault(cluster: Cluster, kind: str, rng: random.Random) -> Fault:
    """Do one fault (never to the last replica of a role); a thread times Serve's replacement of the victim."""
    import os
    import signal
    import threading

    role = {"prefill_kill": "prefill", "decode_kill": "decode", "router_kill": "router"}.get(kind, "prefill")
    wait_full(cluster, role)
    if kind == "prefill_drain":
        fault = Fault(kind, time.monotonic(), "scale-down 2 -> 1")
        cluster.scale_prefill(1)
        while len(cluster.replicas("prefill")) > 1:  # the drained replica handed its sessions over and stopped
            time.sleep(0.5)
        cluster.scale_prefill(2)  # (back to two: the next prefill fault needs a survivor)
    else:
        victims = cluster.replicas(role)
        victim = rng.choice(sorted(victims))
        os.kill(victims[victim], signal.SIGKILL)
        fault = Fault(kind, time.monotonic(), victim)
        while victim in cluster.replicas(role):  # (until the GCS knows of the death)
            time.sleep(0.2)

    def replaced() -> None:
        with contextlib.suppress(TimeoutError):
            wait_full(cluster, role)
            fault.replaced_s = time.monotonic() - fault.at

    threading.Thread(target=replaced, daemon=True).start()
    return fault


def run_faults(cluster: Cluster, plan: list[tuple[float, str]], start: float, seed: int, faults: list[Fault]) -> None:
    rng = random.Random(seed + 1)
    for at, kind in plan:
        time.sleep(max(0.0, start + at - time.monotonic()))
        faults.append(do_fault(cluster, kind, rng))


# --- the run ---------------------------------------------------------------------------------------------
async def chaos(
    base: str, cluster: Cluster, plan: list[tuple[float, str]], duration_s: float, per_surface: int, seed: int
) -> tuple[float, list[Answer], list[Fault], list[str]]:
    """Traffic for `duration_s` (longer if a fault waits for its role's replacement), the faults of `plan`
    meanwhile; returns the start, the answers, the faults, and prompts whose fault-free answer changed."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        expected = await expected_answers(http)
    answers: list[Answer] = []
    faults: list[Fault] = []
    stop = asyncio.Event()
    start = time.monotonic()
    flow = asyncio.ensure_future(traffic(base, per_surface, seed, stop, expected, answers))
    progress = asyncio.ensure_future(report_progress(start, answers, faults))
    try:
        await asyncio.to_thread(run_faults, cluster, plan, start, seed, faults)
        await asyncio.sleep(max(0.0, start + duration_s - time.monotonic()))
    finally:
        stop.set()
        await flow
        progress.cancel()
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        after = await expected_answers(http)  # the same requests again, on the app as it is now
    drift = [f"prompt {i}: {a!r} then {b!r}" for i, (a, b) in enumerate(zip(expected, after, strict=True)) if a != b]
    return start, answers, faults, drift


async def report_progress(start: float, answers: list[Answer], faults: list[Fault]) -> None:
    while True:
        await asyncio.sleep(10)
        counts = Counter(a.outcome for a in answers)
        last = f", last fault {faults[-1].kind} at {faults[-1].at - start:.0f} s" if faults else ""
        print(
            f"  {time.monotonic() - start:5.0f} s: {len(answers)} answers, {counts['intact']} intact, "
            f"{counts['retried']} retried, {counts['cut']} cut, {counts['failed']} failed{last}",
            flush=True,
        )


def fault_of(answer: Answer, faults: list[Fault]) -> str:
    """The first fault done while the answer was being asked (first attempt to end), or whose effect one of its
    attempts met (it ended between the fault and the victim's replacement: a request the proxy still sent to the
    router just killed), or `none`."""

    def met(f: Fault) -> bool:
        lasted = f.replaced_s if f.replaced_s is not None else EFFECT_S
        return answer.started <= f.at <= answer.ended or any(f.at <= t <= f.at + lasted for t in answer.retry_times)

    during = [f.kind for f in faults if met(f)]
    return during[0] if during else "none"


def tables(answers: list[Answer], faults: list[Fault], start: float) -> dict[str, Any]:
    by_surface = {s: Counter(a.outcome for a in answers if a.surface == s) for s in SURFACES}
    by_fault = {k: Counter(a.outcome for a in answers if fault_of(a, faults) == k) for k in ("none", *FAULTS)}
    recovery = []
    for f in faults:
        row: dict[str, Any] = {"fault": f.kind, "at_s": round(f.at - start, 1), "victim": f.victim}
        row["replaced_s"] = round(f.replaced_s, 1) if f.replaced_s is not None else None
        for s in SURFACES:  # until an answer asked after the fault completed on that surface
            done = [a.ended for a in answers if a.surface == s and a.attempt_started >= f.at and a.outcome != "failed"]
            row[f"{s}_s"] = round(min(done) - f.at, 1) if done else None
        recovery.append(row)
    return {
        "by_surface": {k: dict(v) for k, v in by_surface.items()},
        "by_fault": {k: dict(v) for k, v in by_fault.items()},
        "retry_kinds": dict(Counter(k for a in answers for k in a.retries)),
        "recovery": recovery,
        "failures": [
            {"surface": a.surface, "fault": fault_of(a, faults), "detail": a.detail, "retries": a.retries}
            for a in answers
            if a.outcome == "failed"
        ],
    }


def leftovers(
    app: str, replicas: Callable[[str], dict[str, int]], session_ids: set[str], settle_s: float = 60.0
) -> list[str]:
    """What the run left behind (after `settle_s` for NIXL leases and clean-ups): requests, KV blocks and swap
    slots on any engine, open sessions, router work in flight, journal records of the run's sessions."""
    import ray
    from ray import serve

    from prefill.store import NAMESPACE

    def problems() -> list[str]:
        out = []
        for role, key in (("prefill", "route_to"), ("decode", "replica")):
            handle = serve.get_deployment_handle(role, app_name=app)
            for replica in replicas(role):
                s = handle.stats.remote(**{key: replica}).result(timeout_s=60)
                where = f"{role} {s.get('replica', replica)}"
                busy = {
                    k: s[k] for k in ("num_requests", "unfinished_requests", "num_running", "num_waiting") if s.get(k)
                }
                if busy:
                    out.append(f"{where} runs requests: {busy}")
                if s["kv_blocks_free"] != s["kv_blocks_total"]:
                    out.append(f"{where} holds {s['kv_blocks_total'] - s['kv_blocks_free']} KV blocks")
                sched = s.get("scheduler") or {}
                if sched.get("host_slots_free", 0) != sched.get("host_slots", 0):
                    out.append(f"{where} holds {sched['host_slots'] - sched['host_slots_free']} swap slots")
                if s.get("sessions_open"):
                    out.append(f"{where} has {s['sessions_open']} sessions open")
        router = serve.get_deployment_handle("router", app_name=app)
        states = [router.admission_state.remote().result(timeout_s=60) for _ in range(4)]  # (any replica answers)
        if (busy := max(states, key=lambda state: state["in_flight"]))["in_flight"]:
            out.append(f"a router counts {busy['in_flight']} in flight: {busy}")
        keys = ray.experimental.internal_kv._internal_kv_list(b"s/", namespace=NAMESPACE)
        left = {k.decode().split("/")[1] for k in keys} & session_ids
        if left:
            out.append(f"{len(left)} sessions' journal records in the GCS store: {sorted(left)[:5]}")
        return out

    deadline = time.monotonic() + settle_s
    while (found := problems()) and time.monotonic() < deadline:
        time.sleep(1)
    return found


def markdown(result: dict[str, Any]) -> str:
    cols = ("intact", "retried", "cut", "failed")
    lines = [f"# Chaos run\n\n`{result['command']}` ({result['when']}; {result['settings']})\n"]
    for title, key in (("surface", "by_surface"), ("fault during the answer", "by_fault")):
        lines += [f"| {title} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, counts in result[key].items():
            lines.append(f"| {name} | " + " | ".join(str(counts.get(c, 0)) for c in cols) + " |")
        lines.append("")
    lines.append(f"Retried attempts by how they ended: {result['retry_kinds']}\n")
    lines += [
        "| fault | at (s) | victim | replacement running (s) | "
        + " | ".join(f"{s} answers again (s)" for s in SURFACES)
        + " |"
    ]
    lines.append("|---" * (4 + len(SURFACES)) + "|")
    for r in result["recovery"]:
        cells = [r["fault"], r["at_s"], r["victim"], r["replaced_s"], *(r[f"{s}_s"] for s in SURFACES)]
        lines.append("| " + " | ".join("—" if c is None else str(c) for c in cells) + " |")
    lines.append(f"\nLeft behind afterwards: {result['leaks'] or 'nothing'}")
    lines.append(f"\nFault-free answers the same before and after the run: {not result['drift']}")
    for f in result["failures"][:20]:
        lines.append(f"- failed: {f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse
    import sys
    from datetime import datetime, timezone
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))  # the faults app's helpers (tests/integration/faults/conftest.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--clients", type=int, default=2, help="clients per surface")
    parser.add_argument("--gap-s", type=float, default=45.0, help="about this long between faults")
    parser.add_argument("--quick", action="store_true", help="~90 s: every fault once, 20 s apart")
    parser.add_argument("--port", type=int, default=8970)
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.gap_s = 90.0, 20.0

    import logging

    import record
    from systems import ray_serve

    from tests.integration.faults import conftest as faults

    logging.getLogger("httpx").setLevel(logging.WARNING)
    plan = schedule(args.seed, args.duration_s, args.gap_s)
    print(f"schedule (s after the start): {plan}", flush=True)
    with ray_serve(args.port):
        faults.deploy(router={"num_replicas": 2})
        print("starting the app (2 routers, 2 prefill, 2 decode replicas)...", flush=True)
        faults.wait_running()
        base = f"http://127.0.0.1:{args.port}{faults.PREFIX}"
        from tests.integration.conftest import wait_healthy

        wait_healthy(base, 300)
        cluster = Cluster(
            replicas=faults.replicas,
            counts=lambda: {k: v["num_replicas"] for k, v in faults.SPEC.items()},
            scale_prefill=lambda n: faults.deploy(prefill={"num_replicas": n}),
            running=faults.running,
        )
        start, answers, done, drift = asyncio.run(chaos(base, cluster, plan, args.duration_s, args.clients, args.seed))
        faults.wait_running()
        ids = {sid for a in answers for sid in a.session_ids}
        leaks = leftovers(faults.APP, faults.replicas, ids)
    result = {
        "command": record.command(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": record.portable(vars(args)) | {"max_tokens": MAX_TOKENS, "surfaces": list(SURFACES)},
        "answers": len(answers),
        **tables(answers, done, start),
        "leaks": leaks,
        "drift": drift,
    }
    record.RESULTS.mkdir(exist_ok=True)
    (record.RESULTS / "chaos.json").write_text(json.dumps(result, indent=1) + "\n")
    (record.RESULTS / "chaos.md").write_text(markdown(result))
    print(markdown(result))
    failed = sum(c.get("failed", 0) for c in result["by_surface"].values())
    sys.exit(1 if failed or leaks or drift else 0)


if __name__ == "__main__":
    main()
