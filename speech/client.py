"""The speech role's client: what a router calls on speech replicas (speech/server.py), with typed arguments.

The router imports the speech role through this module only: the calls below, and `Utterance` (speech/utterance.py),
a growing utterance transcribed as it grows, with the PCM16 helpers beside it. Calls go by value over gRPC; each
method's Serve handle is made once. `replica` pins a call to one speech replica (router/placement.py `route_to`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypedDict

from ray.serve.handle import DeploymentHandle

from core.handles import MethodHandles
from speech.utterance import MODEL_RATE, TranscriptionFailed, Utterance, resample_stream

__all__ = [
    "MODEL_RATE",
    "Heard",
    "Holds",
    "SpeechClient",
    "SpeechInfo",
    "Transcript",
    "TranscriptionFailed",
    "Utterance",
    "resample_stream",
]


class Transcript(TypedDict, total=False):
    """`transcribe`: the audio's transcript, its usage and length, the replica; or an error."""

    text: str
    usage: dict[str, Any]
    seconds: float
    replica: str
    error: dict[str, Any]


class Heard(TypedDict, total=False):
    """`session_audio`: the turn's transcript so far, whether the chunk started the turn (`start`) or ended it
    (`final`), and the replica holding it; or an error."""

    text: str
    start: bool
    final: bool
    seconds: float  # the turn's audio so far
    usage: dict[str, Any]  # (a final chunk's)
    duplicate: bool  # a retried chunk: the same answer again
    replica: str
    error: dict[str, Any]


class Holds(TypedDict):
    holds: bool
    replica: str


class SpeechInfo(TypedDict):
    sample_rate: int
    window_s: float  # seconds of audio one transcription sees whole (longer audio is split)
    replica: str


class SpeechClient:
    """Each call returns what its handle returns (awaitable); `transcription` an async iterator."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._method = MethodHandles(handle)

    def transcribe(self, pcm16: bytes, *, language: str | None, prompt: str) -> Awaitable[Transcript]:
        """The transcript of mono PCM16 at `MODEL_RATE`: `{"text", "usage", "seconds", "replica"}` or an error."""
        return self._method("transcribe").remote(pcm16, language=language, prompt=prompt)

    def transcription(self, data: bytes, fields: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """`/v1/audio/transcriptions` of an uploaded file: `{"response"}` or `{"error"}`, or `{"stream": True}` then
        vLLM's SSE strings."""
        return self._method("transcription", stream=True).remote(data, fields)

    def session_audio(
        self,
        *,
        session_id: str,
        sequence_id: int,
        pcm16: bytes,
        rate: int,
        end_of_input: bool,
        language: str | None,
        replica: str | None = None,
    ) -> Awaitable[Heard]:
        """One REST audio chunk into its session's turn: the turn's transcript so far, naming the replica."""
        route = {"route_to": replica} if replica is not None else {}
        return self._method("session_audio").remote(
            session_id=session_id,
            sequence_id=sequence_id,
            pcm16=pcm16,
            rate=rate,
            end_of_input=end_of_input,
            language=language,
            **route,
        )

    def session_audio_close(self, *, session_id: str, replica: str | None = None) -> Awaitable[None]:
        route = {"route_to": replica} if replica is not None else {}
        return self._method("session_audio_close").remote(session_id=session_id, **route)

    def session_audio_holds(self, *, session_id: str, replica: str) -> Awaitable[Holds]:
        """`{"holds": bool, "replica": ...}`: whether `replica` holds the session's audio turn."""
        return self._method("session_audio_holds").remote(session_id=session_id, route_to=replica)

    def info(self) -> Awaitable[SpeechInfo]:
        """The model's sample rate and window (`{"sample_rate", "window_s", "replica"}`)."""
        return self._method("info").remote()
