"""Preemptive answers end to end (prefill/preemptive.py): Ray Serve, both vLLM engines and NIXL on the local model.
A session whose input pauses gets its answer started; if the turn then ends unchanged, that answer is the answer
(the same text as one request with the whole input, and no prefill or hand-off after the end of input); new
input cancels it on decode."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import pytest
import websockets
from ray import serve

from tests.integration.conftest import APP, METRICS_PORT, engine_stats, wait_for, wait_idle
from tests.integration.test_streaming_input import (
    SESSIONS,
    TEXT,
    Realtime,
    create,
    info,
    read_events,
    send_chunk,
    split_inside_words,
    whole_chat,
    ws_url,
)

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "Answer from the context."}
OPTIONS = {"after_idle_ms": 200, "max_tokens": 6}  # fewer than the answer: it goes on past the cap on adoption
# For tests that send their turn as several chunks and then ask for no discarded answer: a pause that no gap between
# two of the test's own chunk POSTs reaches on a loaded machine (each waits for the journal's write before its 202).
STEADY = {**OPTIONS, "after_idle_ms": 1000}
ANSWER_TOKENS = 16
SHORT = 12  # an answer below the preemptive cap (its default, 64): decode makes it whole while the user pauses


@pytest.fixture(autouse=True)
def sessions_closed(server, monkeypatch):
    """Every session a test made is deleted after it, also when an assertion stopped it midway: a session left
    open holds KV blocks that the next tests' idle checks (`wait_idle`) would wait on, and fail."""
    made, original = [], globals()["create"]

    def recording(base: str, **body) -> dict:
        data = original(base, **body)
        made.append(data["session_id"])
        return data

    monkeypatch.setitem(globals(), "create", recording)
    yield
    for sid in made:
        httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)  # (404 for those the test deleted itself)


def text_of(frames: list[dict]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for f in frames for c in f.get("choices") or [])


def test_an_unchanged_turn_gets_its_preemptive_answer(server):
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT}], ANSWER_TOKENS)
    sid = create(server, messages=[SYSTEM], max_tokens=ANSWER_TOKENS, temperature=0, preemptive=STEADY)["session_id"]
    chunks = split_inside_words(TEXT, 6)
    for seq, piece in enumerate(chunks):
        assert send_chunk(server, sid, seq, piece).status_code == 202
    # The user pauses: past after_idle_ms the answer starts, below all other work, and decode holds it at its
    # cap (decode/hold.py): its request and KV stay there, and nothing runs.
    assert wait_for(lambda: engine_stats("decode", sid)["prompt_tokens_computed"] > 0), info(server, sid)
    assert wait_for(lambda: held(sid)), engine_stats("decode")
    computed = engine_stats("decode", sid)["prompt_tokens_computed"]
    before = info(server, sid)["work"]
    assert before.get("preemptive_tokens", 0) > 0 and before.get("handoff_tokens", 0) == 0, before

    assert send_chunk(server, sid, len(chunks), "", end=True).status_code == 202  # the turn ends unchanged
    frames, _ = read_events(server, sid)
    assert text_of(frames) == expected["choices"][0]["message"]["content"]
    after = info(server, sid)
    assert after["preemptive"]["delivered"] == 1 and after["preemptive"]["discarded"] == 0
    assert after["work"].get("handoff_tokens", 0) == 0  # no hand-off after the end of input
    timing = after["answers"][-1]["timing"]
    assert timing["handoff_ms"] < 50 and timing["preempted_ms"] > 0, timing
    assert after["answers"][-1]["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    # It went on from its cap: only the token it sampled last is fed again, none of its input is computed again.
    assert engine_stats("decode", sid)["prompt_tokens_computed"] == computed + 1
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("prefill")
    wait_idle("decode")


def held(sid: str, cap: int = OPTIONS["max_tokens"]) -> bool:
    """Decode holds the session's preemptive answer at its cap: its one request has computed its input (its KV is
    in), runs no more, and its stream has taken all `cap` tokens from the engine (the engine's figures run ahead of
    its serving layer's on a loaded machine)."""
    stats, mine = engine_stats("decode"), engine_stats("decode", sid)
    engine = (stats["num_requests"], stats["num_running"])
    return mine["prompt_tokens_computed"] > 0 and mine["parked_tokens_made"] == cap and engine == (1, 0)


def test_a_held_preemptive_answer_is_given_up_when_input_comes(server):
    """New input after the pause: the answer held at its cap ends on decode, its KV blocks freed."""
    more = " One more question: what follows the last chunk closely?"
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT + more}], ANSWER_TOKENS)
    sid = create(server, messages=[SYSTEM], max_tokens=ANSWER_TOKENS, temperature=0, preemptive=OPTIONS)["session_id"]
    assert send_chunk(server, sid, 0, TEXT).status_code == 202
    assert wait_for(lambda: held(sid)), engine_stats("decode")
    assert send_chunk(server, sid, 1, more).status_code == 202
    assert wait_for(lambda: engine_stats("decode")["num_requests"] == 0), engine_stats("decode")
    got = info(server, sid)["preemptive"]
    assert got["discarded"] == 1 and got["discarded_tokens"] == OPTIONS["max_tokens"], got
    assert send_chunk(server, sid, 2, "", end=True).status_code == 202
    frames, _ = read_events(server, sid)
    assert text_of(frames) == expected["choices"][0]["message"]["content"]
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("decode")


def test_input_after_the_pause_cancels_the_preemptive_answer(server):
    more = " One more question: what follows the last chunk closely?"
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT + more}], ANSWER_TOKENS)
    options = {**OPTIONS, "max_tokens": 4096}  # uncapped: it would generate its whole answer on decode
    sid = create(server, messages=[SYSTEM], max_tokens=ANSWER_TOKENS, temperature=0, preemptive=options)["session_id"]
    assert send_chunk(server, sid, 0, TEXT).status_code == 202
    assert wait_for(lambda: info(server, sid)["preemptive"]["live"])
    assert send_chunk(server, sid, 1, more, end=True).status_code == 202
    frames, _ = read_events(server, sid)
    assert text_of(frames) == expected["choices"][0]["message"]["content"]
    got = info(server, sid)["preemptive"]
    assert got["discarded"] == 1 and got["delivered"] == 0
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("decode")  # the discarded answer was stopped there: nothing left running, no block held


class EarlyReader:
    """A client that opens `/events` before its turn ends (as a voice client does): its frames, the response's
    headers, and when the first content arrived."""

    def __init__(self, server: str, sid: str) -> None:
        self.frames: list[dict] = []
        self.events: list[tuple[str, dict, int]] = []  # named events: (name, data, answer frames before it)
        self.headers: dict[str, str] = {}
        self.first_at: float | None = None
        self.thread = threading.Thread(target=self._read, args=(server, sid), daemon=True)
        self.thread.start()

    def _read(self, server: str, sid: str) -> None:
        with httpx.stream("GET", f"{server}{SESSIONS}/{sid}/events", timeout=120) as r:
            self.headers = dict(r.headers)
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: {") and event is not None:
                    self.events.append((event, json.loads(line[6:]), len(self.frames)))
                    event = None
                elif line.startswith("data: {") and event is None:
                    frame = json.loads(line[6:])
                    if self.first_at is None and text_of([frame]):
                        self.first_at = time.perf_counter()
                    self.frames.append(frame)

    def result(self) -> tuple[str, dict[str, float]]:
        """The answer's text, and its Server-Timing (ms by name)."""
        self.thread.join(120)
        assert not self.thread.is_alive()
        timing = {}
        for part in filter(None, self.headers.get("server-timing", "").split(",")):  # (none once events went early)
            name, _, dur = part.strip().partition(";dur=")
            timing[name] = float(dur)
        return text_of(self.frames), timing


@pytest.mark.parametrize("end", ["chunk", "finish"])
def test_a_reader_waiting_for_the_turn_holds_the_preemptive_answer(server, end):
    """The client reads `/events` from the start: its router holds the preemptive answer's frames before the turn
    ends, so the answer's first token goes out with no hand-off and no call to decode after the end of input.
    An empty end chunk with the next sequence id releases it on its router, before the owner has the chunk
    (Server-Timing `released`); `/finish` (no sequence id: only the owner knows what input it ends) releases it
    with the owner's confirmation (`held`, `handoff` ~ 0)."""
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT}], ANSWER_TOKENS)
    sid = create(server, messages=[SYSTEM], max_tokens=ANSWER_TOKENS, temperature=0, preemptive=OPTIONS)["session_id"]
    reader = EarlyReader(server, sid)
    chunks = split_inside_words(TEXT, 4)
    for seq, piece in enumerate(chunks):
        assert send_chunk(server, sid, seq, piece).status_code == 202
    assert wait_for(lambda: engine_stats("decode", sid)["prompt_tokens_computed"] > 0), info(server, sid)
    assert wait_for(lambda: held(sid)), engine_stats("decode")  # held at its cap
    assert reader.first_at is None  # nothing reaches the client before the turn is confirmed
    if end == "chunk":
        assert send_chunk(server, sid, len(chunks), "", end=True).status_code == 202
    else:
        assert httpx.post(f"{server}{SESSIONS}/{sid}/finish", timeout=60).status_code == 202
    text, timing = reader.result()
    assert text == expected["choices"][0]["message"]["content"]  # (it went on past the cap)
    if end == "chunk":
        assert "held" in timing and "released" in timing and "handoff" not in timing, timing
    else:
        assert "held" in timing and "released" not in timing and timing["handoff"] < 50, timing
    assert [e[0] for e in reader.events] == ["session.done"]  # no provisional text: not asked
    after = info(server, sid)
    assert after["preemptive"]["delivered"] == 1 and after["work"].get("handoff_tokens", 0) == 0, after
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("decode")


def test_a_held_preemptive_answer_is_let_go_when_input_comes(server):
    """New input after the pause: the held stream is stopped on decode and let go; the reader gets the ordinary
    answer over the whole input."""
    more = " One more question: what follows the last chunk closely?"
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT + more}], ANSWER_TOKENS)
    options = {**OPTIONS, "max_tokens": 4096}  # uncapped: it would go on generating on decode
    sid = create(server, messages=[SYSTEM], max_tokens=ANSWER_TOKENS, temperature=0, preemptive=options)["session_id"]
    reader = EarlyReader(server, sid)
    assert send_chunk(server, sid, 0, TEXT).status_code == 202
    assert wait_for(lambda: engine_stats("decode", sid)["prompt_tokens_computed"] > 0), info(server, sid)
    assert send_chunk(server, sid, 1, more, end=True).status_code == 202
    text, timing = reader.result()
    assert text == expected["choices"][0]["message"]["content"]
    assert "held" not in timing and timing["handoff"] > 0, timing
    got = info(server, sid)["preemptive"]
    assert got["discarded"] == 1 and got["delivered"] == 0 and got["discarded_tokens"] > 0, got
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("decode")  # the held answer was stopped there


def test_provisional_text_when_asked(server):
    """`preemptive.stream`: each preemptive answer's text reaches the client as it is made, as named events
    OpenAI parsers skip, then `discarded` (input came) or `confirmed` (the turn ended unchanged: the answer's own
    frames follow, the same text)."""
    more = " And then?"
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT + more}], ANSWER_TOKENS)
    options = {**OPTIONS, "stream": True}
    sid = create(server, messages=[SYSTEM], max_tokens=ANSWER_TOKENS, temperature=0, preemptive=options)["session_id"]
    reader = EarlyReader(server, sid)
    assert send_chunk(server, sid, 0, TEXT).status_code == 202
    assert wait_for(lambda: any(e[0] == "rtpd.provisional" for e in reader.events)), info(server, sid)
    assert send_chunk(server, sid, 1, more).status_code == 202  # the user goes on: that answer is discarded
    assert wait_for(lambda: any(e[0] == "rtpd.provisional.done" for e in reader.events))
    first = [e for e in reader.events if e[0] == "rtpd.provisional.done"][0][1]
    assert first["status"] == "discarded"
    assert wait_for(lambda: info(server, sid)["preemptive"]["live"])  # paused again: a second one
    assert wait_for(
        lambda: (
            len([e for e in reader.events if e[0] == "rtpd.provisional"]) > 0
            and any(e[0] == "rtpd.provisional" and e[1]["attempt"] != first["attempt"] for e in reader.events)
        )
    )
    assert send_chunk(server, sid, 2, "", end=True).status_code == 202
    text, _ = reader.result()
    assert text == expected["choices"][0]["message"]["content"]
    second = [e for e in reader.events if e[0].startswith("rtpd.") and e[1]["attempt"] != first["attempt"]]
    shown = "".join(e[1]["delta"] for e in second if e[0] == "rtpd.provisional")
    assert second[-1][0] == "rtpd.provisional.done" and second[-1][1]["status"] == "confirmed", second
    assert shown and text.startswith(shown)  # the provisional text was the answer's start
    assert all(before == 0 for name, _, before in reader.events if name.startswith("rtpd."))  # then the answer
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("decode")


def test_a_preemptive_tool_call_reaches_the_client_only_when_the_turn_is_confirmed(server):
    """A forced call (structured outputs make it whatever the weights): the preemptive answer is made whole (a
    continuation could not reproduce it), its call is never shown provisionally, and the confirmed answer
    carries the same call as one request over the whole input."""
    from tests.integration.test_tools import FORCED_TOOLS

    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": [SYSTEM, {"role": "user", "content": TEXT}], "max_tokens": 40, "temperature": 0}
    body.update(tools=FORCED_TOOLS, tool_choice=choice)
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    expected = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    options = {**OPTIONS, "stream": True}
    sid = create(
        server,
        messages=[SYSTEM],
        max_tokens=40,
        temperature=0,
        tools=FORCED_TOOLS,
        tool_choice=choice,
        preemptive=options,
    )["session_id"]
    reader = EarlyReader(server, sid)
    assert send_chunk(server, sid, 0, TEXT).status_code == 202
    assert wait_for(lambda: engine_stats("decode", sid)["prompt_tokens_computed"] > 0), info(server, sid)
    assert wait_for(lambda: engine_stats("decode")["num_requests"] == 0)  # made whole: no cap for a call
    assert reader.first_at is None and not any(e[0] == "rtpd.provisional" for e in reader.events)
    assert send_chunk(server, sid, 1, "", end=True).status_code == 202
    reader.result()
    streamed: dict = {"name": "", "arguments": ""}
    for frame in reader.frames:
        for c in frame.get("choices") or []:
            for call in (c.get("delta") or {}).get("tool_calls") or []:
                for k in streamed:
                    streamed[k] += (call.get("function") or {}).get(k) or ""
    assert streamed == {"name": expected["name"], "arguments": expected["arguments"]}
    got = info(server, sid)
    assert got["preemptive"]["delivered"] == 1, json.dumps([got["preemptive"], got["answers"], got["work"]])
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200


def test_realtime_provisional_text_and_a_held_answer(server, model_name):
    """Realtime with `preemptive.stream`: the connection reads the next turn's answer before `response.create`,
    so the preemptive answer's text goes out as `rtpd.response.provisional.delta` while the user pauses, and
    `response.create` after the commit confirms it: the response's text is the same as one-shot."""

    async def run() -> tuple[str, list[dict]]:
        async with websockets.connect(ws_url(server) + f"?model={model_name}") as ws:
            rt = Realtime(ws)
            await rt.until("session.created")
            update = {"instructions": SYSTEM["content"], "temperature": 0, "max_output_tokens": ANSWER_TOKENS}
            update["preemptive"] = {**OPTIONS, "stream": True}
            await rt.send(type="session.update", session=update)
            await rt.until("session.updated")
            for piece in split_inside_words(TEXT, 4):
                await rt.send(type="input_text_buffer.append", delta=piece)
            _, before = await rt.until("rtpd.response.provisional.delta")  # the user pauses: it starts
            await rt.send(type="input_text_buffer.commit")
            await rt.send(type="response.create")
            _, seen = await rt.until("response.done")
            return "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta"), before + seen

    text, events = asyncio.run(run())
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT}], ANSWER_TOKENS)
    assert text == expected["choices"][0]["message"]["content"]
    provisional = [e for e in events if e["type"].startswith("rtpd.response.provisional")]
    done = [e for e in provisional if e["type"] == "rtpd.response.provisional.done"]
    assert done and done[-1]["status"] == "confirmed", provisional
    shown = "".join(
        e["delta"] for e in provisional if e["type"].endswith(".delta") and e["attempt"] == done[-1]["attempt"]
    )
    assert shown and text.startswith(shown)


def test_realtime_typing_with_a_pause_then_commit(server, model_name):
    async def run() -> tuple[str, str]:
        async with websockets.connect(ws_url(server) + f"?model={model_name}") as ws:
            rt = Realtime(ws)
            created, _ = await rt.until("session.created")
            sid = created["session"]["id"]
            update = {"instructions": SYSTEM["content"], "temperature": 0, "max_output_tokens": ANSWER_TOKENS}
            update["preemptive"] = OPTIONS
            await rt.send(type="session.update", session=update)
            updated, _ = await rt.until("session.updated")
            assert updated["session"]["preemptive"] == OPTIONS
            for piece in split_inside_words(TEXT, 4):
                await rt.send(type="input_text_buffer.append", delta=piece)
            await asyncio.sleep(1.5)  # the user pauses: the answer starts
            await rt.send(type="input_text_buffer.commit")
            await rt.until("conversation.item.created")
            await rt.send(type="response.create")  # (settings of its own would make it another answer)
            _, seen = await rt.until("response.done")
            return sid, "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")

    sid, text = asyncio.run(run())
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT}], ANSWER_TOKENS)
    assert text == expected["choices"][0]["message"]["content"]
    stats = engine_stats("prefill", sid)
    assert stats["prompt_tokens_computed_by_kind"].get("preemptive", 0) > 0
    assert stats["prompt_tokens_computed_by_kind"].get("handoff", 0) == 0  # the answer was the preemptive one


def released_reads(settled: bool = False) -> float:
    """Answers read from a preemptive answer released on its router (`rtpd_preemptive_read_total{how="released"}`);
    `settled`: once the count stood still for 3 s (earlier tests' reads reach the metrics port a few seconds late)."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("ray_rtpd_preemptive_read_total{")]
    count = sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'how="released"' in line)
    while settled:
        time.sleep(3)
        now = released_reads()
        count, settled = now, now != count
    return count


def made_whole(sid: str) -> bool:
    """The session's preemptive answer was computed on decode, and decode runs nothing any more."""
    return engine_stats("decode", sid)["prompt_tokens_computed"] > 0 and engine_stats("decode")["num_requests"] == 0


def test_an_answer_made_whole_before_the_turn_ends_is_released_at_its_end_chunk(server):
    """The answer's max_tokens below `preemptive.max_tokens`: decode makes the whole answer, its end included, while
    the user pauses. The empty end chunk releases it on the reader's router all the same (Server-Timing
    `released`): the text of one request over the same input, ended at its max_tokens as that request's is, and
    the conversation has it."""
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT}], SHORT)
    options = {"after_idle_ms": STEADY["after_idle_ms"]}
    sid = create(server, messages=[SYSTEM], max_tokens=SHORT, temperature=0, preemptive=options)["session_id"]
    reader = EarlyReader(server, sid)
    chunks = split_inside_words(TEXT, 4)
    for seq, piece in enumerate(chunks):
        assert send_chunk(server, sid, seq, piece).status_code == 202
    assert wait_for(lambda: made_whole(sid)), info(server, sid)
    assert send_chunk(server, sid, len(chunks), "", end=True).status_code == 202
    text, timing = reader.result()
    assert text == expected["choices"][0]["message"]["content"]
    assert "released" in timing and "held" in timing, timing
    finish = [c["finish_reason"] for f in reader.frames for c in f.get("choices") or [] if c.get("finish_reason")]
    assert finish == [expected["choices"][0]["finish_reason"]]
    after = info(server, sid)
    assert after["preemptive"]["delivered"] == 1 and after["preemptive"]["discarded_tokens"] == 0, after
    answer = after["answers"][-1]
    assert (answer["status"], answer["text"], answer["finish_reason"]) == ("completed", text, finish[0]), answer
    assert answer["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("decode")


def test_realtime_response_create_releases_the_held_answer(server, model_name):
    """`response.create` with nothing of its own, after the commit: the connection's router releases the held
    preemptive answer at once (no call to the owner before its first delta; metric `how="released"`), the owner's
    reply confirming it. The same text as one request, and the conversation records it."""
    before = released_reads(settled=True)

    async def run() -> tuple[str, dict, dict]:
        async with websockets.connect(ws_url(server) + f"?model={model_name}") as ws:
            rt = Realtime(ws)
            created, _ = await rt.until("session.created")
            sid = created["session"]["id"]
            update = {"instructions": SYSTEM["content"], "temperature": 0, "max_output_tokens": SHORT}
            update["preemptive"] = {"after_idle_ms": OPTIONS["after_idle_ms"]}
            await rt.send(type="session.update", session=update)
            await rt.until("session.updated")
            for piece in split_inside_words(TEXT, 4):
                await rt.send(type="input_text_buffer.append", delta=piece)
            assert await asyncio.to_thread(wait_for, lambda: made_whole(sid)), info(server, sid)
            await rt.send(type="input_text_buffer.commit")
            await rt.send(type="response.create")
            done, seen = await rt.until("response.done")
            text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
            return text, done["response"], await asyncio.to_thread(info, server, sid)

    text, response, after = asyncio.run(run())
    expected = whole_chat(server, [SYSTEM, {"role": "user", "content": TEXT}], SHORT)
    assert text == expected["choices"][0]["message"]["content"]
    if expected["choices"][0]["finish_reason"] == "length":
        assert response["status"] == "incomplete", response
    assert after["preemptive"]["delivered"] == 1, after
    answer = after["answers"][-1]
    assert (answer["status"], answer["text"]) == ("completed", text), answer  # the conversation has it
    assert wait_for(lambda: released_reads() > before, timeout=30), "not released on the router"
    wait_idle("decode")


def test_a_hand_off_nobody_will_read_is_released_on_decode(server, model_name):
    """A preemptive answer given up while its hand-off was made leaves KV that no decode will read: decode's
    `release` frees it on the prefill replica at once (vLLM's rejected-request path). NIXL held it for the whole
    lease (30 s here), the prefill engine stepping every millisecond meanwhile (a whole core, measured)."""
    body = {"model": model_name, "prompt": "Nobody reads this. " * 40, "max_tokens": 8, "temperature": 0}
    # (an answer first, as the session's turns before: decode's connector knows the prefill replica's; a first
    # contact's handshake would finish after decode's one step for the release, and the release wait for the next)
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200
    wait_idle("prefill")
    prefill = serve.get_deployment_handle("prefill", app_name=APP)
    request_id = f"unread-{uuid.uuid4().hex}"
    made = prefill.prefill.remote("completion", {**body, "request_id": request_id}).result(timeout_s=120)
    time.sleep(0.5)
    assert engine_stats("prefill")["num_requests"] == 1  # held for a decode that will not come
    decode = serve.get_deployment_handle("decode", app_name=APP)
    release = decode.release.remote(request_id=f"{request_id}-released", kv_transfer_params=made["kv_transfer_params"])
    release.result(timeout_s=60)
    wait_idle("prefill", timeout=5)  # freed, well within the lease
