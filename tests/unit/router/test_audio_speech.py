"""`POST /v1/audio/speech` at the router (router/openai/audio_speech.py), with a fake TTS role: validation in
OpenAI's error form, the formats, SSE, a replica that dies before any audio asked again once, and errors after
the status went out. The real TTS role is tested in tests/integration/test_speech_out.py."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from fastapi import FastAPI, Request

from core.config import AppConfig
from router.app import read_json_object
from router.openai import audio_speech
from tts.client import RATE, SpeechChunk


class FakeTts:
    """Yields `pieces` chunks of 100 ms of a sine, with one word each; `fail_first` calls raise at once (a replica
    that died), `fail_after` chunks in, a chunk raises."""

    def __init__(self, pieces: int = 3, fail_first: int = 0, fail_after: int | None = None) -> None:
        self.pieces, self.fail_first, self.fail_after = pieces, fail_first, fail_after
        self.calls: list[dict[str, Any]] = []

    def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncIterator[SpeechChunk]:
        self.calls.append({"text": text, "voice": voice, "speed": speed})
        call = len(self.calls)

        async def stream() -> AsyncIterator[SpeechChunk]:
            if call <= self.fail_first:
                raise RuntimeError("replica died")
            for i in range(self.pieces):
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("replica died mid-stream")
                t = np.arange(RATE // 10) / RATE
                audio = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16).tobytes()
                yield {"audio": audio, "words": [{"start": i, "end": i + 1, "audio_ms": 100.0 * i}]}

        return stream()


def app_with(tts: Any, config: AppConfig | None = None) -> FastAPI:
    app = FastAPI()
    app.include_router(audio_speech.api)

    async def read_body(request: Request) -> dict[str, Any]:
        return await read_json_object(request, 1 << 20)

    app.state.ingress = SimpleNamespace(tts=tts, config=config or AppConfig(), read_body=read_body)
    return app


async def post(app: FastAPI, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/audio/speech", json=body)


BODY = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm"}


async def test_pcm_streams_the_replicas_audio_and_wav_wraps_it() -> None:
    tts = FakeTts(pieces=3)
    response = await post(app_with(tts), BODY)
    assert response.status_code == 200 and response.headers["content-type"] == "audio/pcm"
    assert len(response.content) == 3 * RATE // 10 * 2
    assert tts.calls == [{"text": "Hello there.", "voice": "alloy", "speed": 1.0}]
    response = await post(app_with(FakeTts(pieces=2)), {**BODY, "response_format": "wav", "voice": {"id": "echo"}})
    with wave.open(io.BytesIO(response.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        assert len(w.readframes(10**6)) == 2 * RATE // 10 * 2


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac"])
async def test_compressed_formats_decode_to_the_audio_length(fmt: str) -> None:
    response = await post(app_with(FakeTts(pieces=5)), {**BODY, "response_format": fmt})
    assert response.status_code == 200, response.text
    audio, rate = soundfile.read(io.BytesIO(response.content))
    assert abs(len(audio) / rate - 0.5) < 0.1


async def test_sse_sends_deltas_then_done_with_usage() -> None:
    response = await post(app_with(FakeTts(pieces=4)), {**BODY, "stream_format": "sse"})
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) == 4 and sum(len(base64.b64decode(e["audio"])) for e in deltas) == 4 * RATE // 10 * 2
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"] == {"input_tokens": 4, "output_tokens": 20, "total_tokens": 24}


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"voice": "nobody"}, 400, "voice"),
        ({"response_format": "aac"}, 400, "response_format"),
        ({"response_format": "ogg"}, 400, "response_format"),
        ({"speed": 5.0}, 400, "speed"),
        ({"speed": 0.1}, 400, "speed"),
        ({"input": ""}, 400, "input"),
        ({"input": "x" * 5000}, 400, "input"),
        ({"instructions": "whisper it"}, 400, "instructions"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"stream_format": "chunks"}, 400, "stream_format"),
        ({"surprise": 1}, 400, "surprise"),
    ],
)
async def test_bad_fields_are_refused_naming_them(change: dict[str, Any], status: int, param: str) -> None:
    tts = FakeTts()
    response = await post(app_with(tts), {**BODY, **change})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert tts.calls == []  # refused before the TTS role is asked


async def test_no_tts_role_is_404_naming_the_config() -> None:
    response = await post(app_with(None), BODY)
    assert response.status_code == 404 and "tts.backend" in response.json()["error"]["message"]


async def test_a_replica_that_dies_before_any_audio_is_asked_again_once() -> None:
    tts = FakeTts(fail_first=1)
    response = await post(app_with(tts), BODY)
    assert response.status_code == 200 and len(response.content) == 3 * RATE // 10 * 2 and len(tts.calls) == 2
    tts = FakeTts(fail_first=2)
    response = await post(app_with(tts), BODY)
    assert response.status_code == 502 and "replica" in response.json()["error"]["message"] and len(tts.calls) == 2


async def test_an_error_chunk_before_audio_is_its_status() -> None:
    class Refusing(FakeTts):
        def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncIterator[SpeechChunk]:
            async def stream() -> AsyncIterator[SpeechChunk]:
                yield {"error": {"message": "bad voice", "type": "invalid_request_error", "param": "voice"}}

            return stream()

    response = await post(app_with(Refusing()), BODY)
    assert response.status_code == 400 and response.json()["error"]["param"] == "voice"


async def test_a_failure_after_the_status_is_an_sse_error_event() -> None:
    response = await post(app_with(FakeTts(pieces=3, fail_after=1)), {**BODY, "stream_format": "sse"})
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"]


@pytest.mark.parametrize("fmt", ["mp3", "flac"])
async def test_a_failure_of_a_format_encoded_whole_is_an_error_status(fmt: str) -> None:
    response = await post(app_with(FakeTts(pieces=3, fail_after=1)), {**BODY, "response_format": fmt})
    assert response.status_code == 502 and "replica" in response.json()["error"]["message"]
