"""The OpenAI-compatible backend (tts/backends/openai_http.py) against a small speech server on a local port
(Starlette under uvicorn in a thread): PCM streamed on as it arrives (odd-sized reads included), the request's body
and key, word times spread over the audio; a remote's 500, a refused connection and a timeout as error items."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.config import OpenAISpeechServer, TtsConfig
from tts.backends.openai_http import OpenAIBackend
from tts.words import proportional

from .common import check_words, collect, seconds

TEXT = "Hello there, this is a remote voice speaking."
AUDIO_S = 2.0
PCM = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(24000 * AUDIO_S)) / 24000) * 32767).astype("<i2").tobytes()
received: list[dict[str, Any]] = []


async def speech(request: Request) -> Response:
    body = await request.json()
    received.append({"body": body, "authorization": request.headers.get("authorization")})
    voice = body["voice"]
    if voice == "broken":
        return JSONResponse({"error": {"message": "the model fell over", "type": "server_error"}}, status_code=500)
    if voice == "whole":  # one body with its length
        return Response(PCM, media_type="audio/pcm")

    async def pieces() -> Any:
        if voice == "slow":
            await asyncio.sleep(2.0)
        for i in range(0, len(PCM), 4801):  # odd-sized: samples split between reads
            yield PCM[i : i + 4801]
            await asyncio.sleep(0.01)

    return StreamingResponse(pieces(), media_type="audio/pcm")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"])])
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    uv.should_exit = True
    thread.join(5)


def backend(url: str, **server: Any) -> OpenAIBackend:
    config = TtsConfig(backend="openai", openai=OpenAISpeechServer(url=url, model="tts-remote", **server))
    return OpenAIBackend(config)


async def test_audio_streams_as_it_arrives_with_the_words_spread_over_it(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REMOTE_TTS_KEY", "sk-remote")
    remote = backend(server + "/", api_key_env="REMOTE_TTS_KEY")
    await remote.start(["alloy"])
    try:
        audio, words, items = await collect(remote.synthesize(TEXT, "alloy", 1.25))
    finally:
        await remote.close()
    assert audio == PCM
    assert len([i for i in items if i["audio"]]) > 3  # streamed, not gathered
    check_words(TEXT, audio, words)
    assert words[-1]["audio_ms"] > 1000  # spread over the audio
    assert received[-1] == {
        "body": {"model": "tts-remote", "input": TEXT, "voice": "alloy", "response_format": "pcm", "speed": 1.25},
        "authorization": "Bearer sk-remote",
    }


async def test_a_body_with_its_length_places_the_words_as_it_streams(server: str) -> None:
    remote = backend(server)
    audio, words, _ = await collect(remote.synthesize(TEXT, "whole", 1.0))
    await remote.close()
    assert seconds(audio) == AUDIO_S
    check_words(TEXT, audio, words)
    assert received[-1]["authorization"] is None  # no key configured: none sent


async def test_a_remote_error_is_an_error_item(server: str) -> None:
    remote = backend(server)
    _, _, items = await collect(remote.synthesize(TEXT, "broken", 1.0))
    await remote.close()
    (item,) = items
    assert item["error"]["type"] == "server_error" and item["error"]["code"] == "tts_backend_error"
    assert "500" in item["error"]["message"] and "the model fell over" in item["error"]["message"]
    json.dumps(item)  # plain JSON


async def test_a_refused_connection_and_a_timeout_are_error_items(server: str) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = sock.getsockname()[1]
    sock.close()
    remote = backend(f"http://127.0.0.1:{closed}/v1")
    _, _, items = await collect(remote.synthesize(TEXT, "alloy", 1.0))
    await remote.close()
    assert items[0]["error"]["code"] == "tts_backend_error" and "ConnectError" in items[0]["error"]["message"]
    remote = backend(server, timeout_s=0.3)
    _, _, items = await collect(remote.synthesize(TEXT, "slow", 1.0))
    await remote.close()
    assert items[-1]["error"]["code"] == "tts_backend_error" and "Timeout" in items[-1]["error"]["message"]


class Trickle(httpx.AsyncByteStream):
    """A body in `n` small reads, `gap_s` apart."""

    def __init__(self, pieces: list[bytes], gap_s: float) -> None:
        self.pieces, self.gap_s = pieces, gap_s

    async def __aiter__(self) -> Any:
        for i, piece in enumerate(self.pieces):
            if i:
                await asyncio.sleep(self.gap_s)
            yield piece


def trickling(pieces: list[bytes], gap_s: float) -> OpenAIBackend:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Trickle(pieces, gap_s), headers={"content-type": "audio/pcm"})

    config = TtsConfig(backend="openai", openai=OpenAISpeechServer(url="http://remote/v1", model="tts-remote"))
    return OpenAIBackend(config, transport=httpx.MockTransport(answer))


async def test_many_small_reads_are_sent_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read goes at once; later ones as they pile up, at most every LINGER_S (not one item per read);
    and the words' times are worked out for the next words only, not the whole text at every read."""
    from tts.backends import openai_http

    calls: list[int] = []

    def counting(spans: list[tuple[int, int]], start_ms: float, end_ms: float) -> list[float]:
        calls.append(len(spans))
        return proportional(spans, start_ms, end_ms)

    monkeypatch.setattr(openai_http, "proportional", counting)
    pieces = [PCM[i : i + 481] for i in range(0, len(PCM), 481)]  # (odd-sized: samples split between reads)
    remote = trickling(pieces, 0.001)
    audio, words, items = await collect(remote.synthesize(TEXT, "alloy", 1.0))
    await remote.close()
    assert audio == PCM and len(pieces) == 200
    assert items[0]["audio"] == pieces[0][:480]  # the first read at once
    assert len(items) <= 20, len(items)  # ~0.25 s of reads: a handful of items, not 200
    check_words(TEXT, audio, words)
    assert len(calls) <= 2, calls


async def test_a_read_after_a_pause_is_not_held() -> None:
    pieces = [PCM[i : i + 9600] for i in range(0, 3 * 9600, 9600)]
    remote = trickling(pieces, 0.2)
    t0 = time.perf_counter()
    stream = remote.synthesize(TEXT, "alloy", 1.0)
    arrivals = []
    async for item in stream:
        if item["audio"]:
            arrivals.append(time.perf_counter() - t0)
    await remote.close()
    assert len(arrivals) == 3 and arrivals[1] < 0.35 and arrivals[2] < 0.55, arrivals
