"""A realtime session's audio settings, GA and beta shapes, validated (`session.update`): input, and the output
(spoken answers, router/realtime/audio_out.py).

GA: `session.audio.input.{format, transcription, turn_detection, noise_reduction}` and `session.type`
("realtime" or "transcription"). Beta: `input_audio_format`, `input_audio_transcription`, `turn_detection`,
`input_audio_noise_reduction`. `turn_detection`: `server_vad` (Silero VAD in the router, router/voice/vad.py),
`semantic_vad` (no turn model here: its eagerness sets the silence window, `SEMANTIC_WAIT_MS`), or null (the
client commits). Output: GA `session.audio.output.{format, voice, speed}`; beta `output_audio_format`, `voice`,
`speed` (router/realtime/settings.py reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.voice.audio import PCM24K, AudioFormat
from router.voice.vad import PAUSE_MS, VadSettings

# semantic_vad's eagerness as the silence that ends a turn. OpenAI's semantic model waits up to 8 / 4 / 2 s for
# low / medium / high when the user seems unfinished, less when they seem done; with no turn model, the windows
# are shorter than those caps, and "auto" is "medium" as OpenAI's is.
SEMANTIC_WAIT_MS = {"low": 2000, "medium": 1000, "auto": 1000, "high": 500}
# OpenAI's transcription model names, served by the configured speech model (clients send them by default).
OPENAI_TRANSCRIBE_MODELS = {"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-realtime-whisper"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TurnDetection(_Model):
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=10_000)
    silence_duration_ms: int = Field(500, ge=32, le=10_000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = Field(None, ge=1000, le=600_000)
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"

    def vad(self, pause_lead_ms: int | None = None) -> VadSettings:
        """The VAD's settings; `pause_lead_ms` (`speech.pause_lead_ms`): a pause is reported this long before the
        silence window would end (None: at PAUSE_MS)."""
        silence = SEMANTIC_WAIT_MS[self.eagerness] if self.type == "semantic_vad" else self.silence_duration_ms
        pause = PAUSE_MS if pause_lead_ms is None else silence - pause_lead_ms  # (the VAD keeps PAUSE_MS at least)
        return VadSettings(self.threshold, self.prefix_padding_ms, silence, pause)

    def shown(self) -> dict[str, Any]:
        if self.type == "semantic_vad":
            keys = ("type", "eagerness", "create_response", "interrupt_response")
            return self.model_dump(include=set(keys))
        return self.model_dump(exclude={"eagerness"})


class Transcription(_Model):
    model: str | None = None
    language: str | None = Field(None, min_length=2, max_length=8)
    prompt: str | None = Field(None, max_length=4096)


class AudioInputSettings(_Model):
    """GA `session.audio.input` (the format as its raw value: audio.parse_format checks it)."""

    format: Any = None
    transcription: Transcription | None = None
    turn_detection: TurnDetection | None = None
    noise_reduction: Any = None


class AudioOutputSettings(_Model):
    """GA `session.audio.output` and `response.audio.output` (format and voice as their raw values: checked by
    router/realtime/settings.py against the formats and the configured voices)."""

    format: Any = None
    voice: Any = None
    speed: float | None = Field(None, ge=0.25, le=1.5)


class AudioSettings(_Model):
    input: AudioInputSettings | None = None
    output: AudioOutputSettings | None = None


@dataclass(frozen=True)
class OutputAudio:
    """How answers are spoken: the client's format, the voice (one of `tts.voices`), the pace (OpenAI's 0.25-1.5)."""

    format: AudioFormat = PCM24K
    voice: str = "alloy"
    speed: float = 1.0

    def shown(self, beta: bool) -> dict[str, Any]:
        """As the session object shows them (GA: `audio.output`'s fields)."""
        if beta:
            return {"output_audio_format": self.format.beta(), "voice": self.voice, "speed": self.speed}
        return {"format": self.format.ga(), "voice": self.voice, "speed": self.speed}


class VoiceSettings:
    """What a connection's audio input does; starts from OpenAI's defaults (server_vad, 24 kHz PCM)."""

    def __init__(self) -> None:
        self.format: AudioFormat = PCM24K
        self.turn_detection: TurnDetection | None = TurnDetection()
        self.transcription = Transcription()
        self.transcription_only = False

    def shown(self, beta: bool, speech_model: str | None) -> dict[str, Any]:
        """As the session object shows them."""
        transcription = {"model": speech_model, **self.transcription.model_dump(exclude={"model"})}
        detection = self.turn_detection.shown() if self.turn_detection else None
        if beta:
            return {
                "input_audio_format": self.format.beta(),
                "input_audio_transcription": transcription,
                "turn_detection": detection,
            }
        return {
            "audio": {
                "input": {"format": self.format.ga(), "transcription": transcription, "turn_detection": detection}
            }
        }
