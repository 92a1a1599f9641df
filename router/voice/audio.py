"""Audio as clients send it, made what the speech model and the VAD take: mono float32 at 16 kHz (the other way,
speech in a client's output format: router/voice/encode.py).

The OpenAI Realtime formats: 16-bit little-endian PCM at 24 kHz (GA `{"type": "audio/pcm", "rate": 24000}`, beta
`"pcm16"`; GA's `rate` may also be another common rate here), and G.711 μ-law and A-law at 8 kHz (GA
`audio/pcmu`, `audio/pcma`; beta `g711_ulaw`, `g711_alaw`). REST sessions name their PCM rate at create
(`audio: {"rate": ...}`). Resampled with libsoxr's streaming resampler (one per connection, so that chunk edges
leave no clicks), decoded with G.711's own tables.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.pcm import from_pcm16
from speech.client import MODEL_RATE, resample_stream  # (the rate: Whisper's, and Silero VAD's)

Codec = Literal["pcm16", "ulaw", "alaw"]
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


class AudioError(ValueError):
    """Audio refused: the message, the error code and the field it names."""

    def __init__(self, message: str, code: str = "invalid_audio", param: str | None = "audio") -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass(frozen=True)
class AudioFormat:
    codec: Codec
    rate: int

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.codec == "pcm16" else 1

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_sample / self.rate

    def ga(self) -> dict[str, Any]:
        """As GA sessions show it."""
        if self.codec == "pcm16":
            return {"type": "audio/pcm", "rate": self.rate}
        return {"type": "audio/pcmu" if self.codec == "ulaw" else "audio/pcma"}

    def beta(self) -> str:
        return {"pcm16": "pcm16", "ulaw": "g711_ulaw", "alaw": "g711_alaw"}[self.codec]


PCM24K = AudioFormat("pcm16", 24000)
_BETA = {"pcm16": PCM24K, "g711_ulaw": AudioFormat("ulaw", 8000), "g711_alaw": AudioFormat("alaw", 8000)}
_GA = {"audio/pcmu": AudioFormat("ulaw", 8000), "audio/pcma": AudioFormat("alaw", 8000)}


def parse_format(value: Any, param: str) -> AudioFormat:
    """A session's input audio format, GA (`{"type": "audio/pcm", "rate": 24000}`) or beta (`"pcm16"`)."""
    if isinstance(value, str) and value in _BETA:
        return _BETA[value]
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        kind = value["type"]
        if kind in _GA:
            return _GA[kind]
        if kind == "audio/pcm":
            # OpenAI's API takes 24 kHz only; other common rates are this server's extension (vLLM's clients
            # send 16 kHz), resampled like the rest.
            rate = value.get("rate", 24000)
            if type(rate) is not int or rate not in PCM_RATES:
                rates = ", ".join(map(str, PCM_RATES))
                raise AudioError(f"audio/pcm `rate` must be one of {rates}", "invalid_value", f"{param}.rate")
            return AudioFormat("pcm16", rate)
    known = '{"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcmu"}, {"type": "audio/pcma"}'
    raise AudioError(f"unknown audio format {value!r}: one of {known}, or (beta) {', '.join(_BETA)}", param=param)


def _ulaw_table() -> np.ndarray:
    # ITU-T G.711 μ-law expansion of every byte value (the bits are stored inverted).
    u = ~np.arange(256, dtype=np.uint8)
    sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    magnitude = ((mantissa.astype(np.int32) << 3) + 0x84) << exponent.astype(np.int32)
    return np.where(sign != 0, 0x84 - magnitude, magnitude - 0x84).astype(np.float32) / 32768.0


def _alaw_table() -> np.ndarray:
    # ITU-T G.711 A-law expansion (even bits inverted).
    a = np.arange(256, dtype=np.uint8) ^ 0x55
    sign, exponent, mantissa = a & 0x80, (a >> 4) & 0x07, (a & 0x0F).astype(np.int32)
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent.astype(np.int32) - 1, 0)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.float32) / 32768.0


_TABLES = {"ulaw": _ulaw_table(), "alaw": _alaw_table()}


def b64decode(data: Any, param: str = "audio") -> bytes:
    if not isinstance(data, str):
        raise AudioError(f"`{param}` must be base64 text", param=param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError(f"`{param}` is not valid base64", param=param) from None


def samples(raw: bytes, fmt: AudioFormat, param: str = "audio") -> np.ndarray:
    """Raw audio bytes as float32 samples in [-1, 1] at the format's own rate."""
    if fmt.codec == "pcm16":
        if len(raw) % 2:
            raise AudioError(f"`{param}` holds {len(raw)} bytes: 16-bit PCM needs an even count", param=param)
        return from_pcm16(raw)
    return _TABLES[fmt.codec][np.frombuffer(raw, dtype=np.uint8)]


class Resampler:
    """One stream's audio, resampled chunk by chunk to `MODEL_RATE` (libsoxr keeps the filter's state between
    chunks: no edge effects where one append ends and the next begins)."""

    def __init__(self, fmt: AudioFormat, quality: str = "LQ") -> None:
        self.format = fmt
        self._stream = None if fmt.rate == MODEL_RATE else resample_stream(fmt.rate, quality)

    def __call__(self, raw: bytes, param: str = "audio") -> np.ndarray:
        x = samples(raw, self.format, param)
        if self._stream is None or not len(x):
            return x
        return self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        """What the filter still holds (a few ms), at the end of a stream."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
