"""Streaming input end to end: REST sessions, NDJSON chat, the realtime WebSocket; prefill while input
arrives, KV handed to decode, answers identical to one request with the whole input."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import websockets

from tests.integration.conftest import TOOLS_APP, engine_stats, wait_for, wait_idle

pytestmark = pytest.mark.integration

SESSIONS = "/v1/streaming_input/sessions"
TEXT = (
    "Retrieved document one: the pipeline streams tokens as the crawler finds pages. "
    "Retrieved document two: prefill starts before the prompt is complete, so time to first token "
    "follows the last chunk closely. Question: what starts before the prompt is complete? "
) * 3


def split_inside_words(text: str, n: int) -> list[str]:
    """`n` chunks whose boundaries fall mid-word (never on a space)."""
    size = len(text) // n
    cuts = [i * size + 3 for i in range(1, n)]
    cuts = [c + 1 if text[c] == " " or text[c - 1] == " " else c for c in cuts]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def whole_chat(server: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def create(server: str, **body) -> dict:
    r = httpx.post(f"{server}{SESSIONS}", json=body, timeout=60)
    assert r.status_code == 201, r.text
    data = r.json()
    assert data["session_id"].startswith("sess_") and data["expires_in"] > 0
    return data


def send_chunk(server: str, sid: str, seq: int, payload: str, end: bool = False) -> httpx.Response:
    body = {"sequence_id": seq, "modality": "text", "payload": payload, "end_of_input": end}
    return httpx.post(f"{server}{SESSIONS}/{sid}/chunks", json=body, timeout=60)


def info(server: str, sid: str) -> dict:
    r = httpx.get(f"{server}{SESSIONS}/{sid}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def wait_resident(server: str, sid: str, timeout: float = 10.0) -> dict:
    """The session's info once some of its input is on the engine (input goes once it has stood for the
    sender's settle time, prefill/streaming.py SETTLE_S)."""
    deadline = time.time() + timeout
    while (got := info(server, sid))["resident_tokens"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    return got


def assert_compute_bounds(server: str, sid: str, prompt_tokens: int, extra: int = 0) -> None:
    """Prefill computed each input token once (+ at most a block around the hand-off and the retokenised
    tail); decode computed at most one block of the prompt."""
    session = info(server, sid)
    block = session["block_size"]
    assert session["prompt_tokens_computed"] <= prompt_tokens + extra + block, session
    decode = engine_stats("decode", sid)
    assert 1 <= decode["prompt_tokens_computed"] <= block, decode


@pytest.mark.parametrize("policy", ["on_first_chunk", "on_min_length", "on_end_only"])
def test_rest_session_matches_whole_request(server, policy):
    messages = [{"role": "system", "content": "Answer from the context."}, {"role": "user", "content": TEXT}]
    expected = whole_chat(server, messages, 16)

    extra = {"min_tokens": 64} if policy == "on_min_length" else {}
    sid = create(server, messages=messages[:1], max_tokens=16, temperature=0, start_policy=policy, **extra)[
        "session_id"
    ]
    chunks = split_inside_words(TEXT, 12)
    started = []
    for seq, piece in enumerate(chunks):
        r = send_chunk(server, sid, seq, piece)
        assert r.status_code == 202, r.text
        started.append(r.json()["started"])
    assert started[0] is (policy == "on_first_chunk")
    assert started[-1] is (policy != "on_end_only")
    if policy != "on_end_only":
        assert wait_resident(server, sid)["resident_tokens"] > 0  # prefilled while input arrived
    r = httpx.post(f"{server}{SESSIONS}/{sid}/finish", timeout=60)
    assert r.status_code == 202, r.text
    assert httpx.post(f"{server}{SESSIONS}/{sid}/finish", timeout=60).status_code == 202  # idempotent

    result = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=120).json()
    answer = result["answer"]
    assert answer["status"] == "completed"
    assert answer["text"] == expected["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    session = info(server, sid)
    assert session["turns"] == 1  # the second finish did not start another answer
    assert_compute_bounds(server, sid, expected["usage"]["prompt_tokens"])

    assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    assert httpx.get(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 404
    wait_idle("prefill")


def test_a_short_sessions_answer_is_computed_by_decode(tools_app):
    """A session whose input is under `router.disaggregation.min_session_prompt_tokens` (the tools app keeps the
    shipped 256; the main app hands every answer off, 0): its input streams to prefill as ever, but at its end decode
    computes the whole prompt itself, with no hand-off and no NIXL read, and the answer is the whole request's."""
    messages = [{"role": "system", "content": "Answer from the context."}, {"role": "user", "content": TEXT[:200]}]
    sid = create(tools_app, messages=messages[:1], max_tokens=16, temperature=0)["session_id"]
    for seq, piece in enumerate(split_inside_words(TEXT[:200], 4)):
        assert send_chunk(tools_app, sid, seq, piece).status_code == 202
    assert wait_resident(tools_app, sid)["resident_tokens"] > 0  # (prefilled while it arrived)
    assert httpx.post(f"{tools_app}{SESSIONS}/{sid}/finish", timeout=60).status_code == 202
    answer = httpx.get(f"{tools_app}{SESSIONS}/{sid}/result", timeout=120).json()["answer"]
    decode = engine_stats("decode", sid, app=TOOLS_APP)
    expected = whole_chat(tools_app, messages, 16)  # (after: its prompt is in decode's prefix cache then)
    assert answer["status"] == "completed"
    assert answer["text"] == expected["choices"][0]["message"]["content"]
    prompt_tokens = expected["usage"]["prompt_tokens"]
    assert answer["usage"]["prompt_tokens"] == prompt_tokens < 256
    assert decode["prompt_tokens_computed"] >= prompt_tokens - info(tools_app, sid)["block_size"], decode
    assert httpx.delete(f"{tools_app}{SESSIONS}/{sid}", timeout=60).status_code == 200


def wait_prefilled(server: str, sid: str, timeout: float = 30.0) -> dict:
    """The session's info once the engine holds all of its stable input (the conversation with its answer,
    prefilled again after the answer)."""
    deadline = time.time() + timeout
    while not (got := info(server, sid))["prefilled"] and time.time() < deadline:
        time.sleep(0.05)
    assert got["prefilled"], got
    return got


def test_the_hand_off_starts_from_the_streamed_partial_block(server):
    """vLLM's prefix cache hits whole blocks only: a hand-off begins from a copy of the block where its session's
    streamed input ends part-way, and computes only what was not streamed. (Checked once all of the stable input
    has streamed: with the end of input right behind a chunk, what the stream had not computed yet is the
    hand-off's, and what it shares depends on that race.)"""
    system = {"role": "system", "content": f"Answer from the context (conversation {uuid.uuid4().hex[:8]})."}
    sid = create(server, messages=[system], max_tokens=8, temperature=0)["session_id"]
    try:
        for seq, piece in enumerate(split_inside_words(TEXT, 6)):
            assert send_chunk(server, sid, seq, piece).status_code == 202
        resident, deadline = -1, time.time() + 30
        while (got := wait_prefilled(server, sid))["resident_tokens"] != resident:  # nothing more to stream
            assert time.time() < deadline, got
            resident = got["resident_tokens"]
            time.sleep(0.3)
        assert httpx.post(f"{server}{SESSIONS}/{sid}/finish", timeout=60).status_code == 202
        answer = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=120).json()["answer"]
        session = info(server, sid)
        block, work = session["block_size"], session["work"]
        assert resident % block, "the stream ended on a block boundary: nothing to share (change the text)"
        assert session["scheduler"].get("partial_block_shared_tokens", 0) == resident % block, session["scheduler"]
        assert work["handoff_tokens"] == answer["usage"]["prompt_tokens"] - resident, work
        expected = whole_chat(server, [system, {"role": "user", "content": TEXT}], 8)
        assert answer["text"] == expected["choices"][0]["message"]["content"]
    finally:  # (a failure here must not leave KV held for the tests after it)
        assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("prefill")


def test_rest_turn_sent_whole_is_computed_once(server):
    """A turn that arrives in one piece is computed by its hand-off; the conversation streamed again after the
    answer (for the next turn) shares the hand-off's blocks instead of computing them again, and the next
    turn's answer, prefilled onto those shared blocks, is the whole request's."""
    # Its own system prompt: nothing of this conversation is in the prefix cache before its hand-off.
    system = {"role": "system", "content": f"Answer from the context (conversation {uuid.uuid4().hex[:8]})."}
    sid = create(server, messages=[system], max_tokens=10, temperature=0)["session_id"]
    try:
        assert send_chunk(server, sid, 0, TEXT, end=True).status_code == 202
        first = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=120).json()["answer"]
        session = wait_prefilled(server, sid)
        work, block = session["work"], session["block_size"]
        assert work["handoff_tokens"] >= first["usage"]["prompt_tokens"] - block, work  # nothing streamed before
        # Streamed again: the answer and what follows the hand-off's last full block, not the whole conversation.
        resident = session["resident_tokens"]
        assert work["streamed_tokens"] <= resident - first["usage"]["prompt_tokens"] + 2 * block, work
        convo = [system, {"role": "user", "content": TEXT}]
        assert first["text"] == whole_chat(server, convo, 10)["choices"][0]["message"]["content"]

        follow_up = "And which part of it arrives last?"
        for seq, piece in enumerate(split_inside_words(follow_up, 3), start=1):
            assert send_chunk(server, sid, seq, piece, end=seq == 3).status_code == 202
            time.sleep(0.15)  # typed: prefilled as it comes
        second = httpx.get(f"{server}{SESSIONS}/{sid}/result", params={"turn": 1}, timeout=120).json()["answer"]
        convo += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": follow_up}]
        expected = whole_chat(server, convo, 10)
        assert second["text"] == expected["choices"][0]["message"]["content"]
        assert second["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    finally:  # (a failure here must not leave KV held for the tests after it)
        assert httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60).status_code == 200
    wait_idle("prefill")


def test_rest_session_events_stream_and_completion_prompt(server):
    prompt = "def stream_prefill(chunks):\n    " + TEXT
    whole = httpx.post(
        f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=120
    ).json()
    sid = create(server, prompt="", max_tokens=12, temperature=0)["session_id"]
    pieces = split_inside_words(prompt, 8)
    for seq, piece in enumerate(pieces):
        assert send_chunk(server, sid, seq, piece, end=seq == len(pieces) - 1).status_code == 202
    frames, done = read_events(server, sid)
    assert [f["object"] for f in frames] == ["text_completion"] * len(frames)
    text = "".join(c["text"] for f in frames for c in f["choices"])
    assert text == whole["choices"][0]["text"] == done["text"]
    assert done["status"] == "completed" and frames[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("usage" in f and not f["choices"] for f in frames)  # not asked for at creation
    assert_compute_bounds(server, sid, whole["usage"]["prompt_tokens"])
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)


def read_events(server: str, sid: str) -> tuple[list[dict], dict]:
    """A session's `/events`: its OpenAI frames up to `[DONE]`, and the `session.done` event after it."""
    frames, done, event = [], None, None
    with httpx.stream("GET", f"{server}{SESSIONS}/{sid}/events", timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "session.done":
                    done = json.loads(line[6:])
                elif line != "data: [DONE]":
                    assert done is None, "OpenAI frames after the session event"
                    frames.append(json.loads(line[6:]))
                else:
                    frames.append({"done": True})
    assert frames and frames.pop() == {"done": True}, "the OpenAI frames end with [DONE]"
    assert done is not None and done["session_id"] == sid
    return frames, done


def _set(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _shape(chunk) -> list:
    """A chat chunk's content, without its id and timestamps."""
    choices = [(c.index, c.delta.role, c.delta.content, c.finish_reason) for c in chunk.choices]
    return [chunk.object, chunk.model, choices, chunk.usage.model_dump() if chunk.usage else None]


def _shapes(chunks: list) -> list[list]:
    """The chunks' shapes with runs of text frames joined into one (the last may carry the finish): vLLM merges
    the deltas a slow reader has not taken yet (RequestOutputCollector), so where a busy machine cuts the text is
    timing, not the answer."""

    def delta(shape: list) -> tuple | None:  # a frame's one choice when it carries only text (and maybe the finish)
        one = len(shape[2]) == 1 and shape[2][0][1] is None and shape[3] is None
        return shape[2][0] if one else None

    out: list[list] = []
    for shape in map(_shape, chunks):
        last, this = (delta(out[-1]) if out else None), delta(shape)
        if last is not None and this is not None and last[3] is None and last[0] == this[0]:
            out[-1][2] = [(this[0], None, (last[2] or "") + (this[2] or ""), this[3])]
        else:
            out.append(shape)
    return out


def test_rest_events_are_the_chat_completion_stream(server):
    """A session's `/events`, read by the official openai client's SSE decoder, equals the streamed chat
    completion of the same input frame for frame (up to vLLM's merging of deltas); `/result` equals the
    non-streaming completion; a second reader gets the same answer again."""
    from openai import OpenAI, Stream
    from openai.types.chat import ChatCompletionChunk

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": TEXT}]
    params = {"max_tokens": 12, "temperature": 0, "stream_options": {"include_usage": True}}
    chat = list(client.chat.completions.create(model=model, messages=messages, stream=True, **params))
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)

    sid = create(server, messages=messages[:1], **params)["session_id"]
    pieces = split_inside_words(TEXT, 6)
    for seq, piece in enumerate(pieces):
        assert send_chunk(server, sid, seq, piece, end=seq == len(pieces) - 1).status_code == 202
    path = f"/streaming_input/sessions/{sid}/events"
    events = list(client.get(path, cast_to=ChatCompletionChunk, stream=True, stream_cls=Stream[ChatCompletionChunk]))
    assert _shapes(events) == _shapes(chat)
    assert events[0].choices[0].delta.role == "assistant" and events[-1].usage.prompt_tokens > 0

    # A second reader of the same answer: the same frames, replayed from what the owner kept.
    frames, done = read_events(server, sid)
    text = "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])
    assert text == whole.choices[0].message.content == done["text"]
    assert _set(frames[-1]["usage"]) == chat[-1].usage.model_dump(exclude_none=True)

    result = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=60).json()
    assert result["object"] == "chat.completion" and result["session_id"] == sid and result["turn"] == 0
    assert result["choices"][0]["message"] == {"role": "assistant", "content": whole.choices[0].message.content}
    assert result["choices"][0]["finish_reason"] == whole.choices[0].finish_reason
    assert _set(result["usage"]) == whole.usage.model_dump(exclude_none=True)
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)


def test_result_claims_the_answer_without_events(server):
    """No one streams the answer: `/result` reads it from decode as one non-streaming response."""
    messages = [{"role": "user", "content": TEXT}]
    whole = whole_chat(server, messages, 8)
    sid = create(server, messages=[], max_tokens=8, temperature=0)["session_id"]
    assert send_chunk(server, sid, 0, TEXT, end=True).status_code == 202
    result = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=60).json()
    assert result["object"] == "chat.completion"
    assert {k: result[k] for k in ("choices", "usage")} == {k: whole[k] for k in ("choices", "usage")}
    assert (
        result["answer"]["status"] == "completed"
        and result["answer"]["text"] == result["choices"][0]["message"]["content"]
    )
    # The owner heard the end before /result returned: the conversation is resident again, the next turn may begin.
    assert info(server, sid)["state"] in ("open", "prefilling")
    assert send_chunk(server, sid, 1, " And one more question?").status_code == 202
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)


def test_out_of_order_and_duplicate_chunks(server):
    messages = [{"role": "user", "content": TEXT}]
    expected = whole_chat(server, messages, 8)["choices"][0]["message"]["content"]
    sid = create(server, messages=[], max_tokens=8, temperature=0)["session_id"]
    pieces = split_inside_words(TEXT, 4)
    r = send_chunk(server, sid, 1, pieces[1]).json()
    assert r["applied"] == [] and r["pending"] == [1]
    r = send_chunk(server, sid, 0, pieces[0]).json()
    assert r["applied"] == [0, 1] and r["pending"] == []
    assert send_chunk(server, sid, 1, pieces[1]).json()["duplicate"] is True  # applied once
    r = send_chunk(server, sid, 3, pieces[3], end=True).json()
    assert r["pending"] == [3]
    assert send_chunk(server, sid, 3, pieces[3], end=True).json()["duplicate"] is True
    r = send_chunk(server, sid, 2, pieces[2]).json()
    assert r["applied"] == [2, 3]
    answer = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=120).json()["answer"]
    assert answer["text"] == expected
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)


def test_gap_that_never_fills_closes_the_session(server):
    sid = create(server, messages=[], max_tokens=4, limits={"gap_timeout_s": 1.0})["session_id"]
    assert send_chunk(server, sid, 0, TEXT[:200]).status_code == 202
    assert send_chunk(server, sid, 2, "later").json()["pending"] == [2]
    time.sleep(2.5)
    r = send_chunk(server, sid, 3, "more")
    assert r.status_code == 409 and "chunk 1 never arrived" in r.json()["error"]["message"]
    wait_idle("prefill")


def test_session_expiry_frees_kv(server):
    # (3 s: the checks below must come before the expiry on a loaded machine; reading a session's info does not
    # keep it alive)
    sid = create(server, messages=[], max_tokens=4, limits={"idle_timeout_s": 3.0})["session_id"]
    assert send_chunk(server, sid, 0, TEXT).status_code == 202
    assert wait_resident(server, sid)["resident_tokens"] > 0  # (sent to the engine: its blocks come with its step)

    def holds_kv() -> bool:
        stats = engine_stats("prefill")
        return stats["kv_blocks_free"] < stats["kv_blocks_total"]

    assert wait_for(holds_kv, timeout=2.5, every=0.02), engine_stats("prefill")
    time.sleep(4.5)
    r = send_chunk(server, sid, 1, "too late")
    assert r.status_code == 409 and "expired" in r.json()["error"]["message"]
    wait_idle("prefill")


def test_payload_cap(server):
    sid = create(server, messages=[], limits={"max_payload_bytes": 100})["session_id"]
    assert send_chunk(server, sid, 0, "x" * 60).status_code == 202
    r = send_chunk(server, sid, 1, "y" * 60)
    assert r.status_code == 413
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # Refused whole: the session keeps its input and goes on (the refused sequence id is still free).
    assert send_chunk(server, sid, 1, "z").status_code == 202
    assert info(server, sid)["payload_bytes"] == 61
    httpx.delete(f"{server}{SESSIONS}/{sid}")
    wait_idle("prefill")


def test_bad_session_requests(server):
    assert httpx.post(f"{server}{SESSIONS}", json={"model": "nope", "messages": []}).status_code == 404
    assert httpx.post(f"{server}{SESSIONS}", json={"messages": [], "start_policy": "sometimes"}).status_code == 400
    assert send_chunk(server, "sess_nobody_abc", 0, "hi").status_code == 404
    sid = create(server, messages=[])["session_id"]
    r = httpx.post(f"{server}{SESSIONS}/{sid}/chunks", json={"sequence_id": -1, "payload": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sequence_id"
    r = httpx.post(f"{server}{SESSIONS}/{sid}/chunks", json={"sequence_id": 0, "modality": "audio", "payload": "x"})
    assert r.status_code == 400
    httpx.delete(f"{server}{SESSIONS}/{sid}")


def test_ndjson_streaming_body_matches_whole_request(server, model_name):
    messages = [{"role": "user", "content": TEXT}]
    expected = whole_chat(server, messages, 12)["choices"][0]["message"]["content"]
    pieces = split_inside_words(TEXT, 10)

    async def body():
        first = {"model": model_name, "messages": [{"role": "user", "content": pieces[0]}], "max_tokens": 12}
        yield (json.dumps({**first, "temperature": 0, "stream": True}) + "\n").encode()
        for piece in pieces[1:]:
            await asyncio.sleep(0.02)
            yield (json.dumps({"payload": piece}) + "\n").encode()
        yield b'{"end_of_input": true}\n'

    async def run() -> list[dict]:
        headers = {"X-Streaming-Input": "true", "Content-Type": "application/x-ndjson"}
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{server}/v1/chat/completions", content=body(), headers=headers) as r,
        ):
            assert r.status_code == 200
            frames = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        return [json.loads(f) for f in frames[:-1]]

    chunks = asyncio.run(run())
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert all(c["choices"] for c in chunks)  # no usage chunk: the client did not ask
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    wait_idle("prefill")


class Realtime:
    """A minimal raw-WebSocket Realtime client for the tests."""

    def __init__(self, ws) -> None:
        self.ws = ws

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, type_: str, timeout: float = 60) -> tuple[dict, list[dict]]:
        seen = []
        while True:
            event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
            seen.append(event)
            if event["type"] == type_:
                return event, seen


def ws_url(server: str) -> str:
    return server.replace("http://", "ws://") + "/v1/realtime"


def test_realtime_turns_match_whole_requests_and_reuse_kv(server, model_name):
    instructions = "You are a helpful assistant."
    turn1 = TEXT
    turn2 = "And a follow-up question about the second document, typed piece by piece."

    async def run() -> tuple[list[str], list[dict], str]:
        async with websockets.connect(ws_url(server) + f"?model={model_name}") as ws:
            rt = Realtime(ws)
            created, _ = await rt.until("session.created")
            sid = created["session"]["id"]
            await rt.send(type="session.update", session={"instructions": instructions, "temperature": 0})
            await rt.until("session.updated")
            answers, usages = [], []
            for turn in (turn1, turn2):
                for piece in split_inside_words(turn, 6):
                    await rt.send(type="input_text_buffer.append", delta=piece)
                    await asyncio.sleep(0.1)  # typed: input is prefilled as it comes (SETTLE_S after it)
                await rt.send(type="input_text_buffer.commit")
                await rt.until("conversation.item.created")
                await rt.send(type="response.create", response={"max_output_tokens": 10})
                done, seen = await rt.until("response.done")
                deltas = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
                text_done = next(e for e in seen if e["type"] == "response.output_text.done")
                assert text_done["text"] == deltas
                order = [e["type"] for e in seen if e["type"].startswith("response.") and "delta" not in e["type"]]
                assert order[:3] == ["response.created", "response.output_item.added", "response.content_part.added"]
                assert order[-4:] == [
                    "response.output_text.done",
                    "response.content_part.done",
                    "response.output_item.done",
                    "response.done",
                ]
                assert done["response"]["status"] in ("completed", "incomplete")
                answers.append(deltas)
                usages.append(done["response"]["usage"])
                if len(answers) == 1:
                    first_turn = info(server, sid)
        return answers, usages, sid, first_turn

    answers, usages, sid, first_turn = asyncio.run(run())
    convo = [{"role": "system", "content": instructions}, {"role": "user", "content": turn1}]
    first = whole_chat(server, convo, 10)
    assert answers[0] == first["choices"][0]["message"]["content"]
    convo += [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": turn2}]
    second = whole_chat(server, convo, 10)
    assert answers[1] == second["choices"][0]["message"]["content"]
    assert usages[1]["input_tokens"] == second["usage"]["prompt_tokens"]

    # The second turn's prefill did not recompute the first turn: it computed the first answer, the new
    # input and at most one block more.
    block = first_turn["block_size"]
    assert first_turn["prompt_tokens_computed"] <= first["usage"]["prompt_tokens"] + block, first_turn["work"]
    new_tokens = second["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    decode = engine_stats("decode", sid)
    assert decode["prompt_tokens_computed"] <= 2 * block  # one block at most per turn
    wait_idle("prefill")  # the socket closed: the session's KV is gone
    assert new_tokens > 0


def test_realtime_errors_keep_the_session_open(server, model_name):
    async def run() -> None:
        async with websockets.connect(ws_url(server)) as ws:
            rt = Realtime(ws)
            await rt.until("session.created")
            await ws.send("{not json")
            error, _ = await rt.until("error")
            assert error["error"]["code"] == "invalid_json"
            await rt.send(type="no.such.event", event_id="evt_1")
            error, _ = await rt.until("error")
            assert error["error"]["code"] == "unknown_event" and error["error"]["event_id"] == "evt_1"
            await rt.send(type="session.update", session={"output_modalities": ["audio"]})
            error, _ = await rt.until("error")
            assert error["error"]["code"] == "audio_output_not_supported"  # (the main test app has no TTS role)
            await rt.send(type="response.cancel")
            await rt.until("error")
            # still usable
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
            await rt.send(type="conversation.item.create", item=item)
            await rt.until("conversation.item.created")
            await rt.send(type="response.create", response={"max_output_tokens": 3})
            done, _ = await rt.until("response.done")
            assert done["response"]["usage"]["output_tokens"] == 3

    asyncio.run(run())


def test_realtime_cancel_and_beta_names(server, model_name):
    async def run() -> None:
        headers = {"OpenAI-Beta": "realtime=v1"}
        async with websockets.connect(ws_url(server), additional_headers=headers) as ws:
            rt = Realtime(ws)
            created, _ = await rt.until("session.created")
            assert created["session"]["modalities"] == ["text"]
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TEXT}]}
            await rt.send(type="conversation.item.create", item=item)
            await rt.send(type="response.create", response={"max_output_tokens": 1500})
            await rt.until("response.text.delta")  # beta name
            await rt.send(type="response.cancel")
            done, _ = await rt.until("response.done")
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "client_cancelled"
            assert done["response"]["usage"]["output_tokens"] < 1500

    asyncio.run(run())
    wait_idle("decode")
    wait_idle("prefill")


def test_realtime_disconnect_mid_session_frees_kv(server):
    async def run() -> None:
        async with websockets.connect(ws_url(server)) as ws:
            rt = Realtime(ws)
            await rt.until("session.created")
            await rt.send(type="input_text_buffer.append", delta=TEXT)
            await asyncio.sleep(0.5)
        # closed without a response

    asyncio.run(run())
    wait_idle("prefill")


def test_realtime_one_turn_session_closes_with_its_answer(server, model_name):
    """`?close_after_answer=true`: the answer streams as usual, then the server closes the socket (1000) and the
    session with it; its conversation is not prefilled again (no idle request holds its KV afterwards)."""

    async def run() -> tuple[str, str, int | None]:
        async with websockets.connect(ws_url(server) + f"?model={model_name}&close_after_answer=true") as ws:
            rt = Realtime(ws)
            created, _ = await rt.until("session.created")
            await rt.send(type="session.update", session={"temperature": 0})
            await rt.until("session.updated")
            await rt.send(type="input_text_buffer.append", delta=TEXT)
            await rt.send(type="response.create", response={"max_output_tokens": 8})
            done, seen = await rt.until("response.done")
            assert done["response"]["status"] in ("completed", "incomplete")
            deltas = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return created["session"]["id"], deltas, ws.close_code

    sid, answer, code = asyncio.run(run())
    assert code == 1000
    expected = whole_chat(server, [{"role": "user", "content": TEXT}], 8)
    assert answer == expected["choices"][0]["message"]["content"]
    r = httpx.get(f"{server}{SESSIONS}/{sid}", timeout=60)
    assert r.status_code != 200 or r.json()["state"] == "closed"
    assert sid not in engine_stats("prefill")["scheduler"].get("idle_session_ids", [])
    wait_idle("prefill")


def test_official_openai_realtime_client(server, model_name):
    from openai import AsyncOpenAI

    async def run() -> str:
        client = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
        async with client.realtime.connect(model=model_name) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}
            )
            await conn.response.create(response={"max_output_tokens": 8})
            text = ""
            async for event in conn:
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.done":
                    assert event.response.status in ("completed", "incomplete")
                    break
            return text

    assert asyncio.run(run())


def test_rest_replace_chunks_keep_the_common_prefix(server):
    """Update mode: a replace chunk rewrites the input from an offset; the engine keeps the KV of the common
    prefix (invalidating only what follows) and the answer equals the one-shot request over the new input."""
    sid = create(server, messages=[], max_tokens=12, temperature=0)["session_id"]
    first = TEXT + " Candidate documents: alpha beta gamma delta epsilon. " * 4
    assert send_chunk(server, sid, 0, first).status_code == 202
    deadline = time.time() + 60  # the first version prefilled: the rewrite cuts an idle request in place
    while not (before := info(server, sid))["prefilled"]:
        assert time.time() < deadline, before
        time.sleep(0.1)
    offset = len(TEXT)
    replacement = " Candidate documents, re-ranked: omega psi chi phi upsilon. " * 4 + "Question: which came first?"
    body = {"sequence_id": 1, "payload": replacement, "mode": "replace", "offset": offset, "end_of_input": True}
    r = httpx.post(f"{server}{SESSIONS}/{sid}/chunks", json=body, timeout=60)
    assert r.status_code == 202, r.text
    result = httpx.get(f"{server}{SESSIONS}/{sid}/result", timeout=120).json()
    final = TEXT[:offset] + replacement
    expected = whole_chat(server, [{"role": "user", "content": final}], 12)
    assert result["answer"]["text"] == expected["choices"][0]["message"]["content"]
    after = info(server, sid)
    invalidated = after["scheduler"]["invalidated_tokens"]
    assert 0 < invalidated < before["resident_tokens"]  # the common prefix was kept
    assert after["rewrites"] == 1
    # Prefill computed the first input once, then only what followed the common prefix (+ one block).
    assert (
        after["prompt_tokens_computed"]
        <= before["resident_tokens"]
        + expected["usage"]["prompt_tokens"]
        - (before["resident_tokens"] - invalidated)
        + 2 * after["block_size"]
    )
    bad = {"sequence_id": 2, "payload": "x", "mode": "replace", "offset": 10**6}
    r = httpx.post(f"{server}{SESSIONS}/{sid}/chunks", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "offset"
    httpx.delete(f"{server}{SESSIONS}/{sid}", timeout=60)
    wait_idle("prefill")


def test_realtime_input_text_buffer_replace(server, model_name):
    head = "The vector search returned these documents: one two three four. "
    old_tail = "Old candidates: red green blue. " * 6
    new_tail = "New candidates after re-ranking: cyan magenta yellow. " * 6

    async def run() -> str:
        async with websockets.connect(ws_url(server) + f"?model={model_name}") as ws:
            rt = Realtime(ws)
            await rt.until("session.created")
            await rt.send(type="session.update", session={"temperature": 0})
            await rt.until("session.updated")
            await rt.send(type="input_text_buffer.append", delta=head + old_tail)
            await rt.send(type="input_text_buffer.replace", text=new_tail, offset=len(head))
            await rt.send(type="input_text_buffer.replace", text="x", offset=10**6, event_id="evt_bad")
            error, _ = await rt.until("error")
            assert error["error"]["event_id"] == "evt_bad"
            await rt.send(type="input_text_buffer.commit")
            created, _ = await rt.until("conversation.item.created")
            assert created["item"]["content"][0]["text"] == head + new_tail
            await rt.send(type="response.create", response={"max_output_tokens": 8})
            done, seen = await rt.until("response.done")
            return "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")

    answer = asyncio.run(run())
    expected = whole_chat(server, [{"role": "user", "content": head + new_tail}], 8)
    assert answer == expected["choices"][0]["message"]["content"]
