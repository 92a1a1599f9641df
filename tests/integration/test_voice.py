"""Voice in, end to end on the real stack: the router's VAD and audio handling, the speech role's vLLM Whisper engine
(`local:tiny-whisper`, fitted to the clips in speech/samples/), and the LLM's prefill and decode engines.

The clips are sent as the official `openai` SDK's realtime client sends audio (24 kHz PCM16, base64, in 100 ms
appends), followed by silence so that the server's VAD ends the turn. The app is the tools app
(tests/integration/conftest.py `tools_app`): the LLM is fitted to answer a few questions, so a spoken question's
answer can be compared with the same question typed, and a spoken tool question ends in its tool call.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from openai import AsyncOpenAI

from core.pcm import wav_bytes
from local_models.tools_fit import PARIS, TOOLS
from local_models.whisper import SENTENCES, load_sample
from tests.integration.conftest import TOOLS_APP, engine_stats

pytestmark = pytest.mark.integration

REALTIME_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
SESSION = {"type": "realtime", "output_modalities": ["text"], "tools": REALTIME_TOOLS, "temperature": 0}
CHUNK_S = 0.1
PCM11K = {"type": "audio/pcm", "rate": 11025}  # (refused: not a rate this server takes)
TIMEOUT_S = 60


def pcm24k(slug: str, before_s: float = 0.3, after_s: float = 1.2) -> bytes:
    import soxr

    audio = np.concatenate([np.zeros(int(before_s * 16000)), load_sample(slug), np.zeros(int(after_s * 16000))])
    return (np.clip(soxr.resample(audio.astype(np.float32), 16000, 24000), -1, 1) * 32767).astype("<i2").tobytes()


def chunks(pcm: bytes, rate: int = 24000, width: int = 2) -> Iterator[str]:
    step = int(rate * CHUNK_S) * width
    for i in range(0, len(pcm), step):
        yield base64.b64encode(pcm[i : i + step]).decode()


async def until(conn: Any, kind: str, seen: list[Any]) -> Any:
    async with asyncio.timeout(TIMEOUT_S):
        async for event in conn:
            seen.append(event)
            if event.type == kind:
                return event
            if event.type == "error":
                raise AssertionError(f"error event: {event}")
    raise AssertionError(f"the connection closed before {kind}")


def answer_text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def typed_answer(base: str, text: str) -> tuple[str, Any]:
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
        await conn.session.update(session={**SESSION, "audio": {"input": {"turn_detection": None}}})
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await conn.conversation.item.create(item=item)
        await conn.response.create()
        seen: list[Any] = []
        done = await until(conn, "response.done", seen)
        return answer_text(seen), done


async def spoken(base: str, slug: str, detection: dict[str, Any] | None, **session: Any) -> list[Any]:
    """One spoken turn on a new connection: every event up to `response.done` (with `create_response`) or the
    transcript's `completed`."""
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
        audio = {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": detection}}
        await conn.session.update(session={**SESSION, "audio": audio, **session})
        seen: list[Any] = []
        await until(conn, "session.updated", seen)
        # (the client commits: the turn is all it sent, within the trailing silence the model was fitted to)
        for b64 in chunks(pcm24k(slug, after_s=0.5 if detection is None else 1.2)):
            await conn.input_audio_buffer.append(audio=b64)
        if detection is None:
            await conn.input_audio_buffer.commit()
        await until(conn, "conversation.item.input_audio_transcription.completed", seen)
        if detection is None:
            await conn.response.create()
        if session.get("type") != "transcription" and (detection is None or detection.get("create_response", True)):
            await until(conn, "response.done", seen)
        return seen


def kinds(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def test_a_spoken_turn_with_server_vad_is_transcribed_and_answered_as_the_same_text_typed(tools_app: str) -> None:
    slug = "say_hello"
    events = asyncio.run(spoken(tools_app, slug, {"type": "server_vad", "silence_duration_ms": 500}))
    names = kinds(events)
    for kind in (
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
        "response.done",
    ):
        assert kind in names, (kind, names)
    order = [names.index(k) for k in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped")]
    assert order == sorted(order)
    started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    clip_ms = len(load_sample(slug)) / 16
    # The clip starts 300 ms in; speech_started includes the 300 ms padding, speech_stopped the 500 ms window.
    assert 0 <= started.audio_start_ms <= 150, started
    assert 300 + clip_ms + 300 <= stopped.audio_end_ms <= 300 + clip_ms + 800, (stopped, clip_ms)
    completed = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert completed.transcript == SENTENCES[slug]
    assert completed.item_id == stopped.item_id == started.item_id
    deltas = "".join(e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta")
    assert deltas == SENTENCES[slug]
    item = next(e.item for e in events if e.type == "conversation.item.created")
    assert item.content[0].type == "input_audio" and item.content[0].transcript == SENTENCES[slug]
    typed, _ = asyncio.run(typed_answer(tools_app, SENTENCES[slug]))
    assert answer_text(events) == typed and typed


async def paced_turn(base: str, slug: str, silence_ms: int) -> list[dict[str, Any]]:
    """One spoken turn sent as a microphone sends it (100 ms appends paced at the audio's rate), with the default
    voice settings (preemptive answers on) and their text streamed, on a one-turn connection: every event up to
    `response.done`."""
    detection = {"type": "server_vad", "silence_duration_ms": silence_ms}
    audio = {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": detection}}
    session = {**SESSION, "audio": audio, "preemptive": {"after_idle_ms": None, "stream": True}}
    seen: list[dict[str, Any]] = []
    url = base.replace("http://", "ws://") + "/v1/realtime?close_after_answer=true"
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))

        async def read() -> None:
            async for raw in ws:
                seen.append(json.loads(raw))
                assert seen[-1]["type"] != "error", seen[-1]
                if seen[-1]["type"] == "response.done":
                    return

        reader = asyncio.create_task(read())
        start = time.perf_counter()
        for i, b64 in enumerate(chunks(pcm24k(slug, after_s=silence_ms / 1000 + 0.5))):
            await asyncio.sleep(max(0.0, start + i * CHUNK_S - time.perf_counter()))
            if reader.done():
                break  # (answered: the one-turn connection closes)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64}))
        await asyncio.wait_for(reader, TIMEOUT_S)
    return seen


def test_a_spoken_turn_is_answered_by_the_answer_its_pause_started(tools_app: str) -> None:
    """The VAD's pause (well inside its silence window) starts the answer from the pause's transcript; the turn
    ends unchanged, so that answer is the response, the same as the text typed."""
    slug = "say_hello"  # (a pause inside it too: the answer started there is given up when speech resumes)
    events = asyncio.run(paced_turn(tools_app, slug, silence_ms=1500))  # (time to spare on a loaded machine)
    names = [e["type"] for e in events]
    *given_up, delivered = [e["status"] for e in events if e["type"] == "rtpd.response.provisional.done"]
    assert delivered == "confirmed" and set(given_up) <= {"discarded"}, (given_up, delivered)
    last = len(names) - 1 - names[::-1].index("rtpd.response.provisional.done")
    assert last > names.index("input_audio_buffer.speech_stopped")  # (confirmed when the turn ended)
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert completed["transcript"] == SENTENCES[slug]
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    typed, _ = asyncio.run(typed_answer(tools_app, SENTENCES[slug]))
    assert answer == typed and typed
    # Each token of the turn's input is computed once: streamed as it was heard, and not again by the hand-off
    # of an answer started at a pause, which computes only the assistant's header over it (and decode its last
    # token). The answer given up at the inner pause computed its own header and last token too.
    sid = events[0]["session"]["id"]
    prompt = next(e for e in events if e["type"] == "response.done")["response"]["usage"]["input_tokens"]
    prefill, decode = (engine_stats(role, sid, TOOLS_APP) for role in ("prefill", "decode"))
    computed = prefill["prompt_tokens_computed"] + decode["prompt_tokens_computed"]
    # (The two answers' assistant headers, ~10 tokens each, and decode's last token of each: 360 of 340 here;
    # 438 when the answer started at a pause computed its input itself, and the session's request did again.)
    assert computed <= prompt + 32, (computed, prompt, prefill, decode)


def test_a_spoken_turn_committed_by_the_client_is_answered_on_response_create(tools_app: str) -> None:
    events = asyncio.run(spoken(tools_app, "joke", None))
    names = kinds(events)
    assert "input_audio_buffer.speech_started" not in names  # no VAD
    assert "input_audio_buffer.committed" in names
    completed = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert completed.transcript == SENTENCES["joke"]
    assert completed.usage.type == "duration" and completed.usage.seconds > len(load_sample("joke")) / 16000
    typed, _ = asyncio.run(typed_answer(tools_app, SENTENCES["joke"]))
    assert answer_text(events) == typed


def test_a_spoken_tool_question_ends_in_the_tool_call(tools_app: str) -> None:
    events = asyncio.run(spoken(tools_app, "weather_paris", {"type": "server_vad"}, tool_choice="auto"))
    completed = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert completed.transcript == PARIS[0]["content"]
    done = next(e for e in events if e.type == "response.done")
    output = done.response.output
    assert [(o.type, o.name, json.loads(o.arguments)) for o in output] == [
        ("function_call", "get_weather", {"city": "Paris"})
    ]


def test_speech_during_an_answer_cancels_it(tools_app: str) -> None:
    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=f"{tools_app}/v1", api_key="unused")
        async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
            audio = {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}
            await conn.session.update(session={**SESSION, "tools": [], "audio": audio, "max_output_tokens": 1500})
            seen: list[Any] = []
            # (the tools model's fitted 115-token story: still streaming when the user speaks over it; an answer of
            # its own to an unfitted question was 3 tokens, done before the VAD heard the speech)
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until(conn, "response.output_text.delta", seen)
            for b64 in chunks(pcm24k("goodbye", after_s=0.1)):
                await conn.input_audio_buffer.append(audio=b64)
            await until(conn, "response.done", seen)
            # The answer as the user heard it: its first characters stay in the conversation.
            answer = next(e.item.id for e in seen if e.type == "response.output_item.added")
            await conn.send(
                {"type": "conversation.item.truncate", "item_id": answer, "audio_end_ms": 300, "text_end": 3}
            )
            await until(conn, "conversation.item.truncated", seen)
            return seen

    # The case needs the VAD to hear the speech while the answer streams. On a starved machine the router may decode
    # and detect the appended audio only after the story's last token: that run did not test barge-in, so it is
    # tried again (three times at most; in each run that did, the answer must be cancelled).
    for _ in range(3):
        names = kinds(events := asyncio.run(run()))
        heard = "input_audio_buffer.speech_started" in names
        if heard and names.index("input_audio_buffer.speech_started") < names.index("response.done"):
            break
    else:
        raise AssertionError(f"the answer ended before the speech was heard in three runs: {names}")
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "cancelled"


def test_a_transcription_session_transcribes_and_answers_nothing(tools_app: str) -> None:
    events = asyncio.run(spoken(tools_app, "moon", {"type": "server_vad"}, type="transcription"))
    completed = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert completed.transcript == SENTENCES["moon"]
    assert not [e for e in events if e.type.startswith("response.")]


def test_vllms_realtime_client_flow(tools_app: str) -> None:
    """As vLLM's streaming-input post shows it: top-level `model`, PCM16 at 16 kHz, commit to start, commit with
    `final: true` to end, `transcription.delta` / `transcription.done`."""

    async def run() -> list[dict[str, Any]]:
        url = tools_app.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "session.update", "model": "local:tiny-whisper"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            pcm = (np.concatenate([load_sample("lights"), np.zeros(4000)]) * 32767).astype("<i2").tobytes()
            for b64 in chunks(pcm, rate=16000):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            seen = []
            async with asyncio.timeout(TIMEOUT_S):
                while True:
                    event = json.loads(await ws.recv())
                    seen.append(event)
                    if event["type"] == "transcription.done":
                        return seen

    events = asyncio.run(run())
    done = events[-1]
    assert done["text"] == SENTENCES["lights"]
    assert "".join(e["delta"] for e in events if e["type"] == "transcription.delta") == SENTENCES["lights"]
    assert not [e for e in events if e["type"] == "error"]


def test_audio_transcriptions_rest_plain_and_streamed(tools_app: str) -> None:
    wav = wav_bytes((load_sample("bread") * 32767).astype("<i2").tobytes(), 16000)
    files = {"file": ("bread.wav", wav, "audio/wav")}
    plain = httpx.post(f"{tools_app}/v1/audio/transcriptions", files=files, data={"model": "whisper-1"}, timeout=60)
    assert plain.status_code == 200, plain.text
    assert plain.json()["text"].strip() == SENTENCES["bread"]
    with httpx.stream(
        "POST", f"{tools_app}/v1/audio/transcriptions", files=files, data={"stream": "true"}, timeout=60
    ) as streamed:
        assert streamed.status_code == 200
        body = streamed.read().decode()
    deltas = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    text = "".join(d["choices"][0].get("delta", {}).get("content") or "" for d in deltas if d.get("choices"))
    assert text.strip() == SENTENCES["bread"]
    # A 24 kHz file is resampled by the server.
    import soxr

    wav24 = wav_bytes((soxr.resample(load_sample("bread"), 16000, 24000) * 32767).astype("<i2").tobytes(), 24000)
    resampled = httpx.post(
        f"{tools_app}/v1/audio/transcriptions", files={"file": ("b.wav", wav24, "audio/wav")}, timeout=60
    )
    assert resampled.status_code == 200 and resampled.json()["text"].strip() == SENTENCES["bread"]


def test_bad_audio_gets_clear_errors_and_the_session_goes_on(tools_app: str, server: str) -> None:
    async def run() -> dict[str, Any]:
        errors: dict[str, Any] = {}
        url = tools_app.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(url) as ws:

            async def send(event: dict[str, Any]) -> dict[str, Any]:
                await ws.send(json.dumps(event))
                async with asyncio.timeout(TIMEOUT_S):
                    while True:
                        reply = json.loads(await ws.recv())
                        if reply["type"] in ("error", "session.updated", "conversation.item.created"):
                            return reply

            await ws.recv()  # session.created
            odd = base64.b64encode(b"\x01\x02\x03").decode()
            errors["odd"] = await send({"type": "input_audio_buffer.append", "audio": odd, "event_id": "e1"})
            errors["base64"] = await send({"type": "input_audio_buffer.append", "audio": "not base64!!"})
            errors["format"] = await send(
                {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/ogg"}}}}}
            )
            errors["rate"] = await send(
                {
                    "type": "session.update",
                    "session": {"audio": {"input": {"format": PCM11K}}},
                }
            )
            errors["model"] = await send(
                {"type": "session.update", "session": {"input_audio_transcription": {"model": "nope"}}}
            )
            errors["empty"] = await send({"type": "input_audio_buffer.commit"})
            errors["text"] = await send(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                }
            )
        # A server without a speech role refuses audio, and the session goes on.
        url = server.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(url) as ws:
            await ws.recv()
            await ws.send(
                json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0\0").decode()})
            )
            errors["no_speech"] = json.loads(await ws.recv())
        return errors

    errors = asyncio.run(run())
    assert errors["odd"]["error"]["param"] == "audio" and errors["odd"]["error"]["event_id"] == "e1"
    assert "even" in errors["odd"]["error"]["message"]
    assert errors["base64"]["error"]["param"] == "audio"
    assert errors["format"]["error"]["param"] == "session.audio.input.format"
    assert errors["rate"]["error"]["param"] == "session.audio.input.format.rate"
    assert errors["model"]["error"]["code"] == "model_not_found"
    assert errors["empty"]["error"]["code"] == "input_audio_buffer_commit_empty"
    assert errors["text"]["type"] == "conversation.item.created"  # the session goes on
    assert errors["no_speech"]["error"]["code"] == "audio_not_supported"
    # REST transcriptions: no file, not audio, unknown model; no speech role.
    url = f"{tools_app}/v1/audio/transcriptions"
    assert httpx.post(url, data={"model": "whisper-1"}, timeout=30).json()["error"]["param"] == "file"
    not_audio = httpx.post(url, files={"file": ("x.wav", b"hello", "audio/wav")}, timeout=30)
    assert not_audio.status_code == 400 and not_audio.json()["error"]["param"] == "file"
    wav = wav_bytes(b"\0\0" * 1600, 16000)
    unknown = httpx.post(url, files={"file": ("x.wav", wav, "audio/wav")}, data={"model": "nope"}, timeout=30)
    assert unknown.status_code == 404
    refused = httpx.post(f"{server}/v1/audio/transcriptions", files={"file": ("x.wav", wav)}, timeout=30)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"


def test_the_models_list_names_the_speech_and_tts_models(tools_app: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{tools_app}/v1/models", timeout=30).json()["data"]]
    assert ids == ["local:tiny-llama-tools", "local:tiny-whisper", "espeak-ng"]


def test_g711_ulaw_audio_is_decoded_and_heard(tools_app: str) -> None:
    import audioop  # (deprecated, still in 3.11-3.12: an independent G.711 encoder for the test)

    import soxr

    audio = np.concatenate([np.zeros(2400), soxr.resample(load_sample("thanks"), 16000, 8000), np.zeros(8000)])
    ulaw = audioop.lin2ulaw((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(), 2)

    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=f"{tools_app}/v1", api_key="unused")
        async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
            detection = {"type": "server_vad", "create_response": False}
            audio_in = {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": detection}}
            await conn.session.update(session={**SESSION, "audio": audio_in})
            seen: list[Any] = []
            await until(conn, "session.updated", seen)
            for b64 in chunks(ulaw, rate=8000, width=1):
                await conn.input_audio_buffer.append(audio=b64)
            await until(conn, "conversation.item.input_audio_transcription.completed", seen)
            return seen

    started = time.time()
    events = asyncio.run(run())
    assert time.time() - started < TIMEOUT_S
    names = kinds(events)
    assert "input_audio_buffer.speech_started" in names and "input_audio_buffer.committed" in names
    assert isinstance(next(e for e in events if e.type.endswith("completed")).transcript, str)


def test_bad_audio_events_fuzzed_are_refused_and_the_session_goes_on(tools_app: str) -> None:
    """The realtime fuzzer's `audio` family (tests/integration/test_fuzz.py) on the app with a speech role: bad
    audio events interleaved with valid ones, each refused with an `error` naming its event; at the end a valid
    conversation is answered."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.integration.fuzzing import fuzz_settings
    from tests.integration.test_fuzz import realtime_episode, run_hypothesis

    @settings(**fuzz_settings(8))
    @given(data=st.data())
    def fuzz(data: Any) -> None:
        asyncio.run(realtime_episode(tools_app, "audio", data))

    run_hypothesis(fuzz)


def test_an_audio_rest_session_and_an_ndjson_body_are_transcribed_into_the_turn(tools_app: str) -> None:
    """REST audio chunks (24 kHz PCM16 as created) are transcribed into the session's turn: the end chunk's 202
    says the final transcript, and the answer is the chat answer for that text. An NDJSON body's audio lines
    likewise."""
    import soxr

    slug = "capital_spain"
    pcm = (np.clip(soxr.resample(load_sample(slug), 16000, 24000), -1, 1) * 32767).astype("<i2").tobytes()
    sessions = f"{tools_app}/v1/streaming_input/sessions"
    created = httpx.post(sessions, json={"messages": [], "max_tokens": 12, "temperature": 0, "audio": {"rate": 24000}})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    seq = 0
    for b64 in chunks(pcm):
        reply = httpx.post(f"{sessions}/{sid}/chunks", json={"sequence_id": seq, "modality": "audio", "payload": b64})
        assert reply.status_code == 202, reply.text
        seq += 1
    end = httpx.post(
        f"{sessions}/{sid}/chunks",
        json={"sequence_id": seq, "modality": "audio", "payload": "", "end_of_input": True},
        timeout=60,
    )
    assert end.status_code == 202 and end.json()["transcript"] == SENTENCES[slug], end.text
    answer = httpx.get(f"{sessions}/{sid}/result", timeout=60).json()["choices"][0]["message"]["content"]
    body = {"messages": [{"role": "user", "content": SENTENCES[slug]}], "max_tokens": 12, "temperature": 0}
    chat = httpx.post(f"{tools_app}/v1/chat/completions", json=body, timeout=60).json()
    assert answer == chat["choices"][0]["message"]["content"]
    httpx.delete(f"{sessions}/{sid}")
    # Audio chunks are refused by name: bad base64, odd byte counts, a replace.
    for chunk, param in (
        ({"modality": "audio", "payload": "!!"}, "payload"),
        ({"modality": "audio", "payload": base64.b64encode(b"\1\2\3").decode()}, "payload"),
        ({"modality": "audio", "payload": "AAAA", "mode": "replace"}, "mode"),
    ):
        sid = httpx.post(sessions, json={"messages": [], "audio": {"rate": 16000}}).json()["session_id"]
        refused = httpx.post(f"{sessions}/{sid}/chunks", json={"sequence_id": 0, **chunk})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        httpx.delete(f"{sessions}/{sid}")
    # NDJSON: the first line a chat request with its audio rate, then audio lines.
    lines = [json.dumps({**body, "messages": [], "audio": {"rate": 24000}})]
    lines += [json.dumps({"modality": "audio", "payload": b64}) for b64 in chunks(pcm)]
    lines.append(json.dumps({"modality": "audio", "payload": "", "end_of_input": True}))
    ndjson = httpx.post(
        f"{tools_app}/v1/chat/completions",
        content="\n".join(lines).encode(),
        headers={"X-Streaming-Input": "true", "content-type": "application/x-ndjson"},
        timeout=60,
    )
    assert ndjson.status_code == 200, ndjson.text
    assert ndjson.json()["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]


@pytest.mark.usefixtures("replaced_after")
def test_a_speech_replica_killed_mid_turn_fails_the_turn_clearly_and_the_session_goes_on(tools_app: str) -> None:
    """The realtime router holds the turn's audio and asks another replica; with none alive it reports the
    transcription `failed` (naming why), and the conversation goes on in text."""
    import os
    import signal

    from ray import serve

    speech = serve.get_deployment_handle("speech", app_name=TOOLS_APP)

    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=f"{tools_app}/v1", api_key="unused")
        async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
            await conn.session.update(session={**SESSION, "audio": {"input": {"turn_detection": None}}})
            seen: list[Any] = []
            await until(conn, "session.updated", seen)
            for b64 in chunks(pcm24k("timer", after_s=0.3)):
                await conn.input_audio_buffer.append(audio=b64)
            pid = (await speech.pid.remote())["pid"]
            os.kill(pid, signal.SIGKILL)
            await conn.input_audio_buffer.commit()
            async with asyncio.timeout(TIMEOUT_S):
                async for event in conn:
                    seen.append(event)
                    if event.type.startswith(
                        "conversation.item.input_audio_transcription."
                    ) and not event.type.endswith(".delta"):
                        break
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until(conn, "response.done", seen)
            return seen

    events = asyncio.run(run())
    ended = next(
        e
        for e in events
        if e.type.startswith("conversation.item.input_audio_transcription.") and not e.type.endswith(".delta")
    )
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "completed", done.response
    if ended.type.endswith(".failed"):
        assert ended.error.code in ("speech_unavailable", "transcription_failed", "timeout")
        assert ended.error.message
        assert answer_text(events)  # the typed turn is answered
    else:  # (Serve's replacement came up within the wait, 25 s in one CI run: the turn was heard after all)
        # The answer to the heard question and "Say hello." together is whatever the fitted tools model makes of
        # them (CI saw no text): only the typed turn after a failed one has a known answer.
        assert ended.transcript == SENTENCES["timer"]
