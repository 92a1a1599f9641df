"""`POST /v1/audio/speech`: OpenAI's REST text to speech, served by the speech-out role (tts/).

The body as OpenAI's (`model`, `input`, `voice`, `instructions`, `response_format`, `speed`, `stream_format`). `pcm`
(PCM16 mono 24 kHz) and `wav` stream as the TTS replica synthesizes; `mp3`, `opus` (Ogg) and `flac` are encoded once
the whole input is spoken (libsndfile). `stream_format: "sse"` sends `speech.audio.delta` events (base64 of the
format's bytes) and `speech.audio.done` with the usage. Errors are OpenAI error JSON: 400 naming the field (unknown
voice, a format this server cannot write, speed outside 0.25-4.0, input empty or past `tts.max_input_chars`,
`instructions`, which no local voice follows), 404 for an unknown model or with no TTS role, 502 when the TTS
replica fails before any audio (a replica that dies is asked again once).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import math
import struct
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core import metrics
from core.protocol import error_body
from router.openai.schemas import validation_error
from tts.client import RATE, SpeechChunk, SpeechStream, TtsClient

logger = logging.getLogger(__name__)
api = APIRouter()

OPENAI_SPEECH_MODELS = {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15"}
MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
}
# libsndfile's container and subtype per format (encoded whole, at the end).
SOUNDFILE_FORMATS = {"mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS"), "flac": ("FLAC", "PCM_16")}
CHUNK_TIMEOUT_S = 30.0  # longest wait for the TTS replica's next chunk
TOKEN_MS = 20.0  # usage: output audio counted in 20 ms frames (a codec's frame), input in words


class VoiceId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str = Field(min_length=1)
    voice: str | VoiceId
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"


def _refuse(status: int, message: str, param: str | None = None) -> JSONResponse:
    metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{status}")
    return JSONResponse(error_body(status, message, param), status_code=status)


def check(body: dict[str, Any], config: Any) -> SpeechBody | JSONResponse:
    """The body, validated against OpenAI's shape and this server's TTS role (`config`: AppConfig), or the refusal."""
    try:
        speech = SpeechBody.model_validate(body)
    except ValidationError as e:
        error = validation_error(e)
        return _refuse(400, error["error"]["message"], error["error"]["param"])
    tts = config.tts
    if speech.model not in {tts.model_name, *OPENAI_SPEECH_MODELS}:
        return _refuse(404, f"The model `{speech.model}` does not exist.", "model")
    if len(speech.input) > tts.max_input_chars:
        return _refuse(400, f"input is {len(speech.input)} characters; at most {tts.max_input_chars}", "input")
    voice = speech.voice.id if isinstance(speech.voice, VoiceId) else speech.voice
    if voice not in (voices := tts.voice_map()):
        return _refuse(400, f"unknown voice {voice!r}; this server has {', '.join(sorted(voices))}", "voice")
    if speech.instructions:
        return _refuse(400, "this server's voices do not take instructions (leave `instructions` out)", "instructions")
    if speech.response_format == "aac":
        return _refuse(400, "aac is not supported here: use mp3, opus, flac, wav or pcm", "response_format")
    return speech


def wav_header(rate: int = RATE) -> bytes:
    """A PCM16 mono WAV header for a stream of unknown length (its sizes at their maximum, as streamed WAV is
    written)."""
    data = 0xFFFFFFFF - 36
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def encode(pcm: bytes, fmt: str) -> bytes:
    """PCM16 mono at RATE in one of SOUNDFILE_FORMATS."""
    import numpy as np
    import soundfile

    container, subtype = SOUNDFILE_FORMATS[fmt]
    out = io.BytesIO()
    soundfile.write(out, np.frombuffer(pcm, np.int16), RATE, format=container, subtype=subtype)
    return out.getvalue()


class Synthesis:
    """One input's audio from a TTS replica: the first chunk read before the response starts (so that an error is
    a status), a replica that dies before any audio asked again once, and every wait bounded."""

    def __init__(self, tts: TtsClient, speech: SpeechBody, voice: str) -> None:
        self.tts, self.speech, self.voice = tts, speech, voice
        self.stream: SpeechStream | None = None
        self.words = 0
        self.audio_bytes = 0

    def _open(self) -> SpeechStream:
        self.stream = SpeechStream(
            self.tts.synthesize(self.speech.input, voice=self.voice, speed=self.speech.speed), CHUNK_TIMEOUT_S
        )
        return self.stream

    async def _next(self) -> SpeechChunk | None:
        return await self.stream.next() if self.stream is not None else None

    async def first(self) -> SpeechChunk | None:
        """The first chunk, or an error chunk (`{"error": ...}`) for a replica that failed twice or timed out."""
        for attempt in (1, 2):
            self._open()
            try:
                return await self._next()
            except TimeoutError:
                self.close()
                return {"error": error_body(504, "the TTS replica did not answer in time")["error"]}
            except Exception as e:  # (a replica that died: Ray's error) another replica, once
                self.close()
                logger.warning("TTS replica failed (attempt %d): %s", attempt, e)
                if attempt == 2:
                    return {"error": error_body(502, f"the TTS replica failed: {e}")["error"]}
        return None

    async def rest(self) -> AsyncIterator[SpeechChunk]:
        while (chunk := await self._next()) is not None:
            yield chunk

    def count(self, chunk: SpeechChunk) -> bytes:
        audio = chunk.get("audio", b"")
        self.words += len(chunk.get("words", []))
        self.audio_bytes += len(audio)
        return audio

    def usage(self) -> dict[str, int]:
        output = math.ceil(self.audio_bytes / 2 / RATE * 1000 / TOKEN_MS)
        return {"input_tokens": self.words, "output_tokens": output, "total_tokens": self.words + output}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()  # (a client gone: the replica stops synthesizing)
        self.stream = None


def _status(error: dict[str, Any]) -> int:
    code = error.get("code")
    if isinstance(code, int) and 400 <= code < 600:
        return code
    return 400 if error.get("type") in ("invalid_request_error", "BadRequestError") else 502


@api.post("/v1/audio/speech")
async def speech(request: Request) -> Response:
    ingress = request.app.state.ingress
    tts: TtsClient | None = getattr(ingress, "tts", None)
    if tts is None:
        return _refuse(404, "this server has no TTS role (`tts.backend` in its config)", "model")
    body = await ingress.read_body(request)
    checked = check(body, ingress.config)
    if isinstance(checked, JSONResponse):
        return checked
    started = time.perf_counter()
    voice = checked.voice.id if isinstance(checked.voice, VoiceId) else checked.voice
    synthesis = Synthesis(tts, checked, voice)
    first = await synthesis.first()
    fmt, sse = checked.response_format, checked.stream_format == "sse"
    whole: bytes | None = None
    if fmt in SOUNDFILE_FORMATS and (first is None or "error" not in first):
        # Encoded whole: the audio is all read before the status, so that a failure is still an error status.
        parts = [] if first is None else [synthesis.count(first)]
        try:
            async for chunk in synthesis.rest():
                if "error" in chunk:
                    first = chunk
                    break
                parts.append(synthesis.count(chunk))
        except Exception as e:  # (a replica that died mid-input, or the wait ran out)
            first = {"error": error_body(502, f"the TTS replica failed: {e!r}")["error"]}
        else:
            whole = await asyncio.to_thread(encode, b"".join(parts), fmt)
    if first is not None and "error" in first:
        synthesis.close()
        error = first["error"]
        metrics.inc(metrics.ERRORS, 1, "errors by kind", kind=f"http_{_status(error)}")
        metrics.inc(metrics.TTS_ERRORS, 1, metrics.TTS_FAILED, code=str(error.get("code")), surface="speech")
        return JSONResponse({"error": error}, status_code=_status(error))
    if whole is not None:
        _sent(started, synthesis)
        if not sse:
            return Response(whole, media_type=MEDIA_TYPES[fmt])

    async def chunks() -> AsyncIterator[bytes]:
        """The format's bytes as they are ready."""
        if whole is not None:
            yield whole
            return
        if fmt == "wav":
            yield wav_header()
        sent_first = False
        async for chunk in _empty() if first is None else _chain(first, synthesis.rest()):
            if "error" in chunk:
                code = str(chunk["error"].get("code"))
                metrics.inc(metrics.TTS_ERRORS, 1, metrics.TTS_FAILED, code=code, surface="speech")
                raise RuntimeError(chunk["error"].get("message", "TTS failed"))
            if audio := synthesis.count(chunk):
                if not sent_first:
                    sent_first = True
                    _sent(started, synthesis, first_only=True)
                yield audio
        _sent(started, synthesis, seconds_only=True)

    async def audio_body() -> AsyncIterator[bytes]:
        try:
            async for data in chunks():
                yield data
        finally:
            synthesis.close()

    async def sse_body() -> AsyncIterator[str]:
        try:
            async for data in chunks():
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                yield f"data: {json.dumps(event)}\n\n"
            yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': synthesis.usage()})}\n\n"
        except Exception as e:  # after the status went out: the error as an event
            logger.warning("speech stream failed: %s", e)
            yield f"data: {json.dumps({'type': 'error', **error_body(502, str(e))})}\n\n"
        finally:
            synthesis.close()

    if sse:
        return StreamingResponse(sse_body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return StreamingResponse(audio_body(), media_type=MEDIA_TYPES[fmt])


def _sent(started: float, synthesis: Synthesis, first_only: bool = False, seconds_only: bool = False) -> None:
    """The metrics of audio sent: the first audio's time, the audio seconds."""
    if not seconds_only:
        elapsed = time.perf_counter() - started
        metrics.observe(metrics.FIRST_AUDIO_SECONDS, elapsed, metrics.FIRST_AUDIO, surface="speech")
    if not first_only:
        seconds = synthesis.audio_bytes / 2 / RATE
        metrics.inc(metrics.AUDIO_OUT_SECONDS, seconds, metrics.AUDIO_OUT, surface="speech")


async def _empty() -> AsyncIterator[SpeechChunk]:
    return
    yield


async def _chain(first: SpeechChunk, rest: AsyncIterator[SpeechChunk]) -> AsyncIterator[SpeechChunk]:
    yield first
    async for chunk in rest:
        yield chunk
