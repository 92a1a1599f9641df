"""Speech replica: transcribes audio for the router (speech/engine.py), nothing else.

The realtime socket's audio is the router's (router/voice/): it sends the utterance so far each time it is
transcribed again, and a replica that dies costs one transcription, which the router asks of another. A REST
session's audio turn is held here (speech/sessions.py), by the replica its session id hashes to.
It reports its transcriptions in flight for autoscaling (`record_autoscaling_stats`, as decode reports its streams),
and the audio seconds it transcribed and how long that took as Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from core import logs, metrics
from core.autoscaling import ACTIVE_STREAMS
from core.config import AppConfig
from core.pcm import decode_upload, wav_bytes
from core.protocol import error_body, error_payload, error_status
from speech.engine import SpeechEngine
from speech.sessions import AudioSessions

logger = logging.getLogger(__name__)


@serve.deployment(name="speech", max_ongoing_requests=256, health_check_period_s=10)
class SpeechServer:
    async def __init__(self, app_config: dict[str, Any]) -> None:
        logs.setup()
        self.config = AppConfig.model_validate(app_config)
        self.engine = SpeechEngine(self.config)
        await self.engine.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.in_flight = 0
        self.audio_seconds = 0.0  # audio transcribed (an utterance counts again each time it is transcribed)
        self.transcriptions = 0
        self.busy_s = 0.0  # time spent transcribing (one transcription at a time: the replica's load)
        self.sessions = AudioSessions(self)  # REST sessions' audio turns held here (speech/sessions.py)

    def info(self) -> dict[str, Any]:
        """What the router needs to know of the model: its sample rate and window (seconds of audio one
        transcription sees whole; longer audio is split)."""
        return {"sample_rate": self.engine.sample_rate, "window_s": self.engine.max_clip_s, "replica": self.replica}

    def _fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        speech = self.config.speech
        defaults = {"model": speech.model_name, "language": speech.language, "temperature": 0.0}
        return {**defaults, **{k: v for k, v in fields.items() if v is not None}}

    async def transcribe(self, pcm16: bytes, *, language: str | None = None, prompt: str = "") -> dict[str, Any]:
        """The transcript of mono 16-bit PCM at the model's rate: `{"text", "usage", "seconds", "replica"}` or
        `{"error": ...}`. The router's realtime and session audio: the utterance so far, again as it grows."""
        seconds = len(pcm16) / 2 / self.engine.sample_rate
        fields = self._fields({"language": language, "prompt": prompt or None})
        if self.config.speech.max_transcript_tokens is not None:
            fields["max_completion_tokens"] = self.config.speech.max_transcript_tokens
        started = time.perf_counter()
        self.in_flight += 1
        try:
            result = await self.engine.transcribe(wav_bytes(pcm16, self.engine.sample_rate), fields)
        finally:
            self.in_flight -= 1
        elapsed = time.perf_counter() - started
        if hasattr(result, "error"):
            return error_payload(result)
        self.audio_seconds, self.transcriptions, self.busy_s = (
            self.audio_seconds + seconds,
            self.transcriptions + 1,
            self.busy_s + elapsed,
        )
        metrics.inc(metrics.SPEECH_AUDIO_SECONDS, seconds, "audio seconds transcribed", replica=self.replica)
        metrics.observe(metrics.SPEECH_LATENCY, elapsed, "time one transcription took", replica=self.replica)
        usage = result.usage.model_dump(mode="json") if getattr(result, "usage", None) else None
        return {"text": result.text.strip(), "usage": usage, "seconds": seconds, "replica": self.replica}

    async def transcription(self, data: bytes, fields: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """`POST /v1/audio/transcriptions`: an uploaded file. Yields one item, `{"error": ...}` or
        `{"response": ...}`, or for `stream: true` `{"stream": True}` and then the SSE strings vLLM makes."""
        try:
            pcm = await asyncio.to_thread(decode_upload, data, self.engine.sample_rate)
        except ValueError as e:
            yield error_body(400, str(e), "file")
            return
        fields = self._fields(fields)
        self.in_flight += 1
        try:
            result = await self.engine.transcribe(wav_bytes(pcm, self.engine.sample_rate), fields)
            if hasattr(result, "__aiter__"):
                yield {"stream": True}
                async for frame in result:
                    yield frame
            elif hasattr(result, "error"):
                payload = error_payload(result)
                yield payload if error_status(payload) < 500 else {**payload, "replica": self.replica}
            else:
                seconds = len(pcm) / 2 / self.engine.sample_rate
                metrics.inc(metrics.SPEECH_AUDIO_SECONDS, seconds, "audio seconds transcribed", replica=self.replica)
                self.audio_seconds, self.transcriptions = self.audio_seconds + seconds, self.transcriptions + 1
                yield {"response": result.model_dump(mode="json")}
        finally:
            self.in_flight -= 1

    async def session_audio(
        self,
        *,
        session_id: str,
        sequence_id: int,
        pcm16: bytes,
        rate: int,
        end_of_input: bool = False,
        language: str | None = None,
        route_to: str | None = None,
    ) -> dict[str, Any]:
        """One REST audio chunk into its session's turn (speech/sessions.py); routed here by session id (or by
        `route_to`, router/placement.py). The answer names this replica: the router sends the turn's next chunks
        here."""
        answer = await self.sessions.append(session_id, sequence_id, pcm16, rate, end_of_input, language)
        return answer if "error" in answer else {**answer, "replica": self.replica}

    def session_audio_close(self, *, session_id: str, route_to: str | None = None) -> None:
        self.sessions.close(session_id)

    def session_audio_holds(self, *, session_id: str, route_to: str | None = None) -> dict[str, Any]:
        """Whether this replica holds the session's audio turn (a router looking for it after the pool grew)."""
        return {"holds": session_id in self.sessions.turns, "replica": self.replica}

    def record_autoscaling_stats(self) -> dict[str, float]:
        metrics.set_gauge(metrics.SPEECH_IN_FLIGHT, self.in_flight, "transcriptions in flight", replica=self.replica)
        return {ACTIVE_STREAMS: float(self.in_flight)}

    async def stats(self) -> dict[str, Any]:
        counts = {"audio_seconds": self.audio_seconds, "transcriptions": self.transcriptions, "busy_s": self.busy_s}
        return {**self.engine.totals.as_dict(), **counts, "in_flight": self.in_flight, "replica": self.replica}

    def pid(self) -> dict[str, Any]:
        import os

        return {"pid": os.getpid(), "replica": self.replica}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
