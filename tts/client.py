"""The speech-out role's client: what a router calls on TTS replicas (tts/server.py), with typed arguments.

The router imports the TTS role through this module only. One call synthesizes one piece of text (a sentence of an
answer, or a whole `/v1/audio/speech` input): a stream of `SpeechChunk`s, PCM16 mono at `RATE` with the words that
start in it, each item carrying everything synthesized by the time it is sent (a fast backend sends a sentence in
one item; the router cuts it into deltas for its client). Calls go by value over gRPC; each method's handle is made
once. `SpeechStream` reads one call with every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypedDict

from ray.serve.handle import DeploymentHandle

from core.handles import MethodHandles
from core.tasks import detached

RATE = 24_000  # Hz: what every backend's audio is resampled to (OpenAI's realtime and `pcm` audio rate)


class Word(TypedDict):
    """A word of the synthesized text: its span in that text (Python str offsets, `text[start:end]`) and when it
    starts, in ms from the start of this call's audio."""

    start: int
    end: int
    audio_ms: float


class SpeechChunk(TypedDict, total=False):
    """One item of `synthesize`: audio (PCM16 mono at `RATE`, an even number of bytes) and the words that start in
    it; or an error (then the stream ends): an OpenAI error body (`message`, `type`, `param`, `code`)."""

    audio: bytes
    words: list[Word]
    replica: str
    error: dict[str, Any]


class TtsInfo(TypedDict):
    model: str  # the name clients may send as `model` (OpenAI's `tts-1`, `tts-1-hd`, `gpt-4o-mini-tts` too)
    backend: str  # "espeak", "piper" or "openai"
    rate: int
    voices: list[str]  # the voice names it takes (OpenAI's names included)
    default_voice: str
    replica: str


class TtsClient:
    """Each call returns what its handle returns: `synthesize` an async iterator, `info` an awaitable."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._method = MethodHandles(handle)

    def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncIterator[SpeechChunk]:
        """`text` spoken by `voice` at `speed` (1.0: the voice's own pace; 0.25-4.0)."""
        return self._method("synthesize", stream=True).remote(text, voice=voice, speed=speed)

    def info(self) -> Awaitable[TtsInfo]:
        return self._method("info").remote()


class SpeechStream:
    """One `synthesize` call's chunks, read with every wait bounded: `next()` gives the next chunk (None at the end;
    an error chunk is the last), or raises TimeoutError after `timeout_s` with none, or what the call raised (its
    replica died). `close()` stops a stream not read to its end: a Serve stream is cancelled on its replica (which
    stops synthesizing), an async generator closed. Idempotent."""

    def __init__(self, stream: AsyncIterator[SpeechChunk], timeout_s: float) -> None:
        self.stream, self.timeout_s = stream, timeout_s
        self.ended = False  # read to its end (nothing to stop)

    async def next(self) -> SpeechChunk | None:
        if self.ended:
            return None
        try:
            chunk = await asyncio.wait_for(anext(self.stream), self.timeout_s)
        except StopAsyncIteration:
            self.ended = True
            return None
        self.ended = "error" in chunk
        return chunk

    def close(self) -> None:
        if self.ended:
            return
        self.ended = True
        with contextlib.suppress(Exception):  # (a stream that cannot be stopped has stopped: nothing to do)
            if callable(cancel := getattr(self.stream, "cancel", None)):
                cancel()
            elif callable(aclose := getattr(self.stream, "aclose", None)):
                detached(aclose())
