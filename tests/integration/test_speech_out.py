"""Speech out, end to end on the real stack: the TTS role (tts/, the embedded espeak-ng voice), the router's
realtime audio output and `/v1/audio/speech`, with the speech role (`local:tiny-whisper`) hearing it back and the
LLM's prefill and decode engines answering. The app is the tools app (tests/integration/conftest.py `tools_app`):
its LLM is fitted to answer the sample questions, so a spoken question's spoken answer can be compared with the
same question's text answer.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import wave
from typing import Any

import httpx
import pytest
import websockets
from openai import AsyncOpenAI, OpenAI

from local_models.whisper import SENTENCES
from tests.integration.conftest import TOOLS_APP
from tests.integration.test_voice import SESSION, TIMEOUT_S, chunks, pcm24k, typed_answer, until

pytestmark = pytest.mark.integration

AUDIO = {"output_modalities": ["audio"]}
RATE = 24_000
# The tools model's fitted 115-token story (tests/integration/test_voice.py): an answer still streaming when the
# user speaks over it.
STORY = {**SESSION, "tools": [], "max_output_tokens": 1500}
KILLED = {**STORY, "max_output_tokens": 300}  # (~1 s of decode: over before Serve replaces a killed TTS replica)


def transcribe(base: str, pcm: bytes) -> str:
    """The speech role's transcript of 24 kHz PCM16 (sent as a WAV upload, as a client would)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(RATE)
        w.writeframes(pcm)
    files = {"file": ("answer.wav", out.getvalue(), "audio/wav")}
    response = httpx.post(f"{base}/v1/audio/transcriptions", files=files, data={"model": "whisper-1"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["text"].strip()


def test_each_sample_sentence_spoken_by_the_embedded_voice_is_heard_back_exactly(tools_app: str) -> None:
    client = OpenAI(base_url=f"{tools_app}/v1", api_key="unused")
    for slug, text in SENTENCES.items():
        pcm = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm").content
        assert 0.8 < len(pcm) / 2 / RATE < 5.0, (slug, len(pcm))
        assert transcribe(tools_app, pcm) == text, slug


def test_audio_speech_streams_wav_and_sse(tools_app: str) -> None:
    client = OpenAI(base_url=f"{tools_app}/v1", api_key="unused")
    text = SENTENCES["moon"]
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="coral", input=text, response_format="wav", speed=1.5
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        wav = response.read()
    pcm = wav[44:]
    normal = client.audio.speech.create(model="tts-1", voice="coral", input=text, response_format="pcm").content
    assert 0.5 < len(pcm) / len(normal) < 0.85  # (1.5x faster: ~2/3 the length; the pauses do not all shrink)
    response = httpx.post(
        f"{tools_app}/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", "stream_format": "sse"},
        timeout=60,
    )
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["input_tokens"] == len(text.split())
    assert transcribe(tools_app, audio) == text


def test_audio_speech_bad_fields_are_refused_naming_them(tools_app: str, server: str) -> None:
    base = {"model": "tts-1", "voice": "alloy", "input": "Hello.", "response_format": "pcm"}
    for change, param in [
        ({"voice": "nobody"}, "voice"),
        ({"response_format": "aac"}, "response_format"),
        ({"speed": 9}, "speed"),
        ({"input": "x" * 5000}, "input"),
        ({"model": "no-such-tts"}, "model"),
    ]:
        response = httpx.post(f"{tools_app}/v1/audio/speech", json={**base, **change}, timeout=30)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text
    # The main test app has no TTS role: 404 naming the setting.
    response = httpx.post(f"{server}/v1/audio/speech", json=base, timeout=30)
    assert response.status_code == 404 and "tts.backend" in response.json()["error"]["message"]


def test_the_openai_backend_speaks_through_this_projects_own_endpoint(tools_app: str) -> None:
    """The TTS role's client backend for a remote OpenAI-compatible server (a GPU TTS server such as vLLM-Omni),
    pointed at this project's `/v1/audio/speech`: the same audio as the embedded voice, with word timings."""
    from core.config import TtsConfig
    from tts.backends.openai_http import OpenAIBackend

    config = TtsConfig(backend="openai", openai={"url": f"{tools_app}/v1", "model": "tts-1"})
    backend = OpenAIBackend(config)
    text = SENTENCES["lights"]

    async def run() -> tuple[bytes, list[Any]]:
        audio, words = b"", []
        async for chunk in backend.synthesize(text, voice="alloy", speed=1.0):
            assert "error" not in chunk, chunk
            audio += chunk.get("audio", b"")
            words += chunk.get("words", [])
        return audio, words

    audio, words = asyncio.run(run())
    assert transcribe(tools_app, audio) == text
    assert [text[w["start"] : w["end"]].strip(".,") for w in words] == [w.strip(".,") for w in text.split()]


async def spoken_in_audio(base: str, slug: str, **session: Any) -> list[Any]:
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
        detection = {"type": "server_vad", "silence_duration_ms": 500}
        audio = {"input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": detection}}
        audio["output"] = session.pop("output", {"voice": "alloy"})
        await conn.session.update(session={**SESSION, **AUDIO, "audio": audio, **session})
        seen: list[Any] = []
        await until(conn, "session.updated", seen)
        for b64 in chunks(pcm24k(slug)):
            await conn.input_audio_buffer.append(audio=b64)
        await until(conn, "response.done", seen)
        return seen


def test_a_spoken_turn_is_answered_in_audio_whose_transcript_is_the_text_answer(tools_app: str) -> None:
    slug = "say_hello"
    events = asyncio.run(spoken_in_audio(tools_app, slug))
    typed, _ = asyncio.run(typed_answer(tools_app, SENTENCES[slug]))
    names = [e.type for e in events]
    assert "response.output_text.delta" not in names  # audio sessions get the transcript, not text
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert transcript == typed and transcript
    done = next(e for e in events if e.type == "response.output_audio_transcript.done")
    assert done.transcript == transcript
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    seconds, words = len(audio) / 2 / RATE, len(transcript.split())
    assert 0.15 * words < seconds < 1.0 * words + 0.5, (seconds, transcript)
    first_audio, first_transcript = (
        names.index("response.output_audio.delta"),
        names.index("response.output_audio_transcript.delta"),
    )
    assert first_transcript < first_audio < names.index("response.output_audio.done")
    response = next(e for e in events if e.type == "response.done").response
    assert response.status == "completed"
    content = response.output[0].content[0]
    assert content.type == "output_audio" and content.transcript == transcript


def test_barge_in_mid_audio_and_truncate_by_audio_end_ms(tools_app: str) -> None:
    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=f"{tools_app}/v1", api_key="unused")
        async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
            audio = {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}
            await conn.session.update(session={**STORY, **AUDIO, "audio": audio})
            seen: list[Any] = []
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until(conn, "response.output_audio.delta", seen)
            for b64 in chunks(pcm24k("goodbye", after_s=0.1)):
                await conn.input_audio_buffer.append(audio=b64)
            await until(conn, "response.done", seen)
            answer = next(e.item.id for e in seen if e.type == "response.output_item.added")
            sent_ms = sum(len(base64.b64decode(e.delta)) for e in seen if e.type == "response.output_audio.delta")
            sent_ms = sent_ms / 2 / RATE * 1000
            await conn.send(
                {"type": "conversation.item.truncate", "item_id": answer, "content_index": 0, "audio_end_ms": 400}
            )
            await until(conn, "conversation.item.truncated", seen)
            await conn.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": answer,
                    "content_index": 0,
                    "audio_end_ms": int(sent_ms) + 5000,
                }
            )
            async with asyncio.timeout(TIMEOUT_S):
                async for event in conn:
                    seen.append(event)
                    if event.type == "error":
                        break
            return seen

    for _ in range(3):  # (as test_voice's barge-in: a run where the answer ended before the speech was heard)
        events = asyncio.run(run())
        names = [e.type for e in events]
        if names.index("input_audio_buffer.speech_started") < names.index("response.done"):
            break
    else:
        raise AssertionError(f"the answer ended before the speech was heard in three runs: {names}")
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "cancelled"
    transcript_done = next(e for e in events if e.type == "response.output_audio_transcript.done")
    sent = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert transcript_done.transcript and sent.startswith(transcript_done.transcript)
    assert "response.output_audio.done" in names
    truncated = next(e for e in events if e.type == "conversation.item.truncated")
    assert truncated.audio_end_ms == 400
    error = events[-1]
    assert error.type == "error" and error.error.param and "audio_end_ms" in error.error.param


def test_beta_shapes_speak_g711(tools_app: str) -> None:
    async def run() -> list[dict[str, Any]]:
        url = tools_app.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(url, additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            session = {
                "modalities": ["text", "audio"],
                "output_audio_format": "g711_ulaw",
                "voice": "echo",
                "turn_detection": None,
            }
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SENTENCES["joke"]}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            seen = []
            async with asyncio.timeout(TIMEOUT_S):
                while (event := json.loads(await ws.recv()))["type"] != "response.done":
                    assert event["type"] != "error", event
                    seen.append(event)
            seen.append(event)
            return seen

    events = asyncio.run(run())
    updated = next(e for e in events if e["type"] == "session.updated")["session"]
    assert updated["modalities"] == ["text", "audio"] and updated["output_audio_format"] == "g711_ulaw"
    assert updated["voice"] == "echo"
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
    assert transcript and audio
    assert 0.15 * len(transcript.split()) < len(audio) / 8000 < 1.0 * len(transcript.split()) + 0.5  # 8 kHz, 1 B
    assert {"response.audio.done", "response.audio_transcript.done"} <= {e["type"] for e in events}
    content = events[-1]["response"]["output"][0]["content"][0]
    assert content["type"] == "audio" and content["transcript"] == transcript


def test_bad_audio_output_settings_are_refused_and_the_session_goes_on(tools_app: str, server: str) -> None:
    async def errors(base: str, updates: list[dict[str, Any]], model: str) -> tuple[list[Any], str]:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        async with client.realtime.connect(model=model) as conn:
            out = []
            for update in updates:
                await conn.session.update(session={"type": "realtime", **update})
                async with asyncio.timeout(TIMEOUT_S):
                    async for event in conn:
                        if event.type in ("error", "session.updated"):
                            out.append(event)
                            break
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create(response={"output_modalities": ["text"]})
            seen: list[Any] = []
            await until(conn, "response.done", seen)
            return out, "".join(e.delta for e in seen if e.type == "response.output_text.delta")

    bad = [
        {"audio": {"output": {"voice": "nobody"}}},
        {"audio": {"output": {"format": {"type": "audio/mp3"}}}},
        {"audio": {"output": {"speed": 3.0}}},
    ]
    events, text = asyncio.run(errors(tools_app, bad, "local:tiny-llama-tools"))
    assert [e.type for e in events] == ["error"] * 3 and text
    params = [e.error.param or "" for e in events]
    assert "voice" in params[0] and "format" in params[1] and "speed" in params[2], params
    events, text = asyncio.run(errors(server, [{"output_modalities": ["audio"]}], "local:tiny-llama"))
    assert events[0].type == "error" and "audio" in (events[0].error.code or "") and text


@pytest.mark.usefixtures("replaced_after")
def test_a_tts_replica_killed_mid_answer_reports_it_and_the_text_answer_goes_on(tools_app: str) -> None:
    from ray import serve

    tts = serve.get_deployment_handle("tts", app_name=TOOLS_APP)

    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=f"{tools_app}/v1", api_key="unused")
        async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
            audio = {"input": {"turn_detection": None}}
            await conn.session.update(session={**KILLED, **AUDIO, "audio": audio})
            seen: list[Any] = []
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
            await conn.conversation.item.create(item=item)
            pid = (await tts.pid.remote())["pid"]
            await conn.response.create()
            await until(conn, "response.output_audio.delta", seen)
            os.kill(pid, signal.SIGKILL)
            async with asyncio.timeout(TIMEOUT_S):
                async for event in conn:
                    seen.append(event)
                    if event.type == "response.done":
                        break
            return seen

    events = asyncio.run(run())
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "incomplete", done.response  # (cut at max_output_tokens, as the text answer)
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert transcript == asyncio.run(text_answer(tools_app, "Tell a story.", KILLED))  # the whole text went out
    # The sentences after the kill: their synthesis failed, reported once as an error naming the TTS role (or, if
    # Serve's replacement came up in time, spoken by it). Either way no audio delta is lost silently: the audio
    # stops with an error, or the transcript's every sentence has audio.
    errors = [e for e in events if e.type == "error"]
    assert all("tts" in (e.error.message or "").lower() for e in errors), errors
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    if not errors:
        assert len(audio) / 2 / RATE > 0.15 * len(transcript.split())


async def text_answer(base: str, text: str, session: dict[str, Any]) -> str:
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    async with client.realtime.connect(model="local:tiny-llama-tools") as conn:
        await conn.session.update(session={**session, "audio": {"input": {"turn_detection": None}}})
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        await conn.conversation.item.create(item=item)
        await conn.response.create()
        seen: list[Any] = []
        await until(conn, "response.done", seen)
        return "".join(e.delta for e in seen if e.type == "response.output_text.delta")
