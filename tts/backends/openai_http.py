"""An OpenAI-compatible speech server (`tts.backend: openai`): `POST {url}/audio/speech` with `response_format: pcm`
(PCM16 mono at 24 kHz, OpenAI's and vLLM-Omni's), its body streamed on as it arrives.

The body is read as it arrives (a task of its own) and sent on in batches as tts/backends/threaded.py's workers'
pieces are: the first read at once, later ones together at most every `LINGER_S` (a remote's many small reads are
not one item each), a read after a pause at once.

The remote says nothing of its words, so their times are estimated: each word's place is its position in the text
(`tts/words.py` `proportional`, worked out once) times the audio's length. While the audio streams that length is
the response's `Content-Length` when it has one, else a pace of `PACE_CHARS_PER_S` at speed 1.0 (raised to what has
arrived), and the next words go out with the piece of audio their estimated starts fall in; at the end the words
left get their places in the real length (an estimate that was too long sends them late, with the times they
should have had).

A remote that fails (a status of 400 or more, a refused connection, a timeout, a body cut short) ends the call
with an error item (`server_error`, `tts_backend_error`), never an exception: the replica goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx

from core.config import TtsConfig
from tts.audio import ms
from tts.backends.threaded import Pieces
from tts.client import SpeechChunk
from tts.errors import backend_failed
from tts.words import WordQueue, proportional, word_spans

logger = logging.getLogger(__name__)

PACE_CHARS_PER_S = 15.0  # ~150 words a minute, the pace of OpenAI's voices at speed 1.0
MAX_ERROR_BYTES = 4096  # of a remote's error body, read for its message


class OpenAIBackend:
    name = "openai"

    def __init__(self, config: TtsConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.server = config.openai
        self.url = self.server.url.rstrip("/") + "/audio/speech"
        self._transport = transport
        self.client: httpx.AsyncClient | None = None

    async def start(self, voices: list[str]) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.server.timeout_s), transport=self._transport)

    def _headers(self) -> dict[str, str]:
        env = self.server.api_key_env
        key = os.environ.get(env) if env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def synthesize(self, text: str, voice: str, speed: float) -> AsyncIterator[SpeechChunk]:
        if self.client is None:
            await self.start([])
        assert self.client is not None
        body = {"model": self.server.model, "input": text, "voice": voice, "response_format": "pcm", "speed": speed}
        spans = word_spans(text)
        places = proportional(spans, 0.0, 1.0)  # each word's start as a share of the audio's length
        words, sent, odd = WordQueue(), 0, b""
        next_word = 0
        try:
            async with self.client.stream("POST", self.url, json=body, headers=self._headers()) as response:
                if response.status_code >= 400:
                    yield backend_failed(await _remote_error(response))
                    return
                length = response.headers.get("content-length")
                expected_ms = ms(int(length)) if length and length.isdigit() else None
                pace_ms = len(text) / PACE_CHARS_PER_S / speed * 1000.0
                pieces: Pieces[bytes] = Pieces()
                reader = asyncio.create_task(_read(response, pieces))
                try:
                    async for batch, _ in pieces.batches():
                        data, odd = _even(odd + b"".join(batch))
                        if not data:
                            continue
                        sent += len(data)
                        estimate = max(expected_ms or pace_ms, ms(sent))
                        while next_word < len(spans) and places[next_word] * estimate < ms(sent):
                            words.add(*spans[next_word], places[next_word] * estimate)
                            next_word += 1
                        yield {"audio": data, "words": words.due(ms(sent))}
                finally:
                    pieces.cancel()
                    reader.cancel()
                    await asyncio.wait([reader])
        except httpx.HTTPError as e:
            yield backend_failed(f"the speech server at {self.server.url} failed: {type(e).__name__}: {e}")
            return
        if sent == 0:
            yield backend_failed(f"the speech server at {self.server.url} sent no audio")
            return
        for i in range(next_word, len(spans)):
            words.add(*spans[i], places[i] * ms(sent))
        if rest := words.rest():
            yield {"audio": b"", "words": rest}

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


async def _read(response: httpx.Response, pieces: Pieces[bytes]) -> None:
    """(A task.) The body's reads into `pieces`, then their end (with the error that cut it short)."""
    try:
        async for data in response.aiter_bytes():
            pieces.put(data)
    except Exception as e:  # raised in the caller: its error item
        pieces.end(e)
        return
    pieces.end()


def _even(data: bytes) -> tuple[bytes, bytes]:
    """Whole 16-bit samples, and the odd byte left for the next read."""
    cut = len(data) - len(data) % 2
    return data[:cut], data[cut:]


async def _remote_error(response: httpx.Response) -> str:
    """A remote's refusal as one line: its status and its error message (OpenAI's `error.message`) or body."""
    raw = b""
    async for data in response.aiter_bytes():
        raw += data
        if len(raw) >= MAX_ERROR_BYTES:
            break
    text = raw[:MAX_ERROR_BYTES].decode("utf-8", "replace").strip()
    message: Any = text
    try:
        payload = json.loads(text)
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message", error) if isinstance(error, dict) else payload.get("detail", text)
    except (ValueError, AttributeError):
        pass
    logger.warning("speech server answered %d: %s", response.status_code, str(message)[:200])
    return f"the speech server answered {response.status_code}: {message}"
