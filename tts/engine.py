"""The speech-out role's engine: a request checked, spoken by the configured backend (tts/backends/), counted.

The deployment (tts/server.py) is a thin shell around it, so that all of this runs without Ray in the unit tests.
A request's voice is one of the config's names (`tts.voice_map()`: OpenAI's names over the backend's voices, or
the config's own), its speed 0.25-4.0 (OpenAI's range), its input 1-`max_input_chars` characters; any other is
answered with one error item naming the field (`invalid_request_error`). A backend's failure is an error item too
(`server_error`), an exception in it included: a call that fails never takes the replica with it.

Counted: audio seconds, syntheses, and busy seconds per replica; the real-time factor of each call (busy / audio
seconds); the calls the backend failed, by the error's `code` (`tts_backend_error`, `voice_not_found`; a request
refused for its fields is the client's fault, not counted). A call's busy seconds are the time the engine spent
awaiting the backend's next item, summed: the time the consumer held an item (a slow reader, Ray's stream behind
it) is left out. What the backend made meanwhile is left out too (the embedded backends' threads and a remote's
reader run ahead of their reader): with a reader that keeps up it is the synthesis's wall time (waiting for its
turn on a backend shared with other calls included, a remote's time to answer too); with a slow one, less.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from core import metrics
from core.config import AppConfig
from tts.backends import Backend, make_backend
from tts.client import RATE, SpeechChunk, TtsInfo
from tts.errors import backend_failed, invalid_request

logger = logging.getLogger(__name__)

MIN_SPEED, MAX_SPEED = 0.25, 4.0


class TtsEngine:
    def __init__(self, config: AppConfig, replica: str = "", backend: Backend | None = None) -> None:
        self.config = config.tts
        self.voices = self.config.voice_map()
        self.replica = replica
        self.backend = backend if backend is not None else make_backend(self.config)
        self.in_flight = 0
        self.audio_seconds = 0.0
        self.syntheses = 0
        self.busy_s = 0.0

    async def start(self) -> None:
        """The backend loaded, with every voice the config maps to (a missing one fails the replica's start)."""
        await self.backend.start(sorted(set(self.voices.values())))

    def info(self) -> TtsInfo:
        return {
            "model": self.config.model_name,
            "backend": self.backend.name,
            "rate": RATE,
            "voices": list(self.voices),
            "default_voice": self.config.default_voice,
            "replica": self.replica,
        }

    def refusal(self, text: str, voice: str, speed: float) -> SpeechChunk | None:
        """The error item for a request out of bounds, or None."""
        if voice not in self.voices:
            names = ", ".join(repr(v) for v in self.voices)
            return invalid_request("voice", f"Invalid value for 'voice': {voice!r}. Supported values are: {names}.")
        if not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
            return invalid_request(
                "speed", f"Invalid value for 'speed': {speed!r}. It must be between {MIN_SPEED} and {MAX_SPEED}."
            )
        if not text.strip():
            return invalid_request("input", "'input' is empty: there is nothing to speak.")
        if len(text) > self.config.max_input_chars:
            return invalid_request(
                "input",
                f"'input' is {len(text)} characters long; at most {self.config.max_input_chars} are spoken at once.",
                code="string_above_max_length",
            )
        return None

    async def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncIterator[SpeechChunk]:
        """`text` spoken: its items as the backend makes them, each naming this replica."""
        refused = self.refusal(text, voice, speed)
        if refused is not None:
            yield {**refused, "replica": self.replica}
            return
        audio_bytes, busy = 0, 0.0
        self.in_flight += 1
        stream = self.backend.synthesize(text, self.voices[voice], float(speed))
        try:
            while True:
                asked = time.perf_counter()
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                except Exception as e:  # a backend's bug: this call's error, not the replica's
                    logger.exception("TTS backend %s failed", self.backend.name)
                    chunk = backend_failed(f"the {self.backend.name} backend failed: {type(e).__name__}: {e}")
                finally:
                    busy += time.perf_counter() - asked
                audio_bytes += len(chunk.get("audio", b""))
                failed = "error" in chunk
                if failed:
                    code = str(chunk["error"].get("code"))
                    metrics.inc(metrics.TTS_ERRORS, 1, metrics.TTS_FAILED, code=code, replica=self.replica)
                yield {**chunk, "replica": self.replica}
                if failed:
                    break
        finally:
            self.in_flight -= 1
            await _close(stream)
            self._count(audio_bytes / 2 / RATE, busy)

    def _count(self, seconds: float, busy: float) -> None:
        self.syntheses += 1
        self.audio_seconds += seconds
        self.busy_s += busy
        metrics.inc(metrics.TTS_AUDIO_SECONDS, seconds, "audio seconds synthesized", replica=self.replica)
        if seconds > 0:
            metrics.observe(
                metrics.TTS_REALTIME_FACTOR,
                busy / seconds,
                "a synthesis's time over its audio's",
                replica=self.replica,
            )

    def stats(self) -> dict[str, Any]:
        return {
            "audio_seconds": self.audio_seconds,
            "syntheses": self.syntheses,
            "busy_s": self.busy_s,
            "in_flight": self.in_flight,
            "replica": self.replica,
        }

    async def close(self) -> None:
        await self.backend.close()


async def _close(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # (a backend failing as it closes has nothing more to say to this call)
            logger.debug("TTS backend stream failed to close", exc_info=True)
