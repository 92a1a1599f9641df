"""Speech as a client hears it: the TTS role's 16-bit PCM (24 kHz) in a client's output format
(router/voice/audio.py `AudioFormat`), resampled with libsoxr's streaming resampler, then 16-bit PCM or G.711 μ-law
or A-law (the ITU-T reference code's segment search, vectorized)."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.pcm import from_pcm16
from router.voice.audio import AudioFormat

# ITU-T G.711 compression (the reference C code's segment search, vectorized): each segment's largest magnitude.
_ULAW_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def ulaw(x: np.ndarray) -> bytes:
    """16-bit samples as G.711 μ-law bytes."""
    v = x.astype(np.int32) >> 2  # 14 bits
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), 8159) + 33  # (clipped, biased)
    segment = np.searchsorted(_ULAW_ENDS, v)
    code = np.where(segment >= 8, 0x7F, (segment << 4) | ((v >> (segment + 1)) & 0x0F))
    return (code ^ mask).astype(np.uint8).tobytes()


def alaw(x: np.ndarray) -> bytes:
    """16-bit samples as G.711 A-law bytes."""
    v = x.astype(np.int32) >> 3  # 13 bits
    mask = np.where(v >= 0, 0xD5, 0x55)
    v = np.where(v >= 0, v, -v - 1)
    segment = np.searchsorted(_ALAW_ENDS, v)
    code = np.where(segment >= 8, 0x7F, (segment << 4) | ((v >> np.maximum(segment, 1)) & 0x0F))
    return (code ^ mask).astype(np.uint8).tobytes()


class Encoder:
    """Speech made at `rate` (16-bit PCM, the TTS role's) as a client's output format: resampled with libsoxr's
    streaming resampler, then 16-bit PCM or G.711. One per stretch of audio (a sentence), flushed at its end, so that
    each stretch's audio is whole and as long as it was made."""

    def __init__(self, fmt: AudioFormat, rate: int) -> None:
        self.format = fmt
        self._stream: Any = None
        if fmt.rate != rate:
            import soxr

            self._stream = soxr.ResampleStream(rate, fmt.rate, 1, dtype="float32", quality="HQ")

    def __call__(self, pcm: bytes | memoryview) -> bytes:
        if self._stream is None and self.format.codec == "pcm16":
            return bytes(pcm)  # (as made)
        x = from_pcm16(pcm)
        return self._encode(self._stream.resample_chunk(x) if self._stream is not None else x)

    def flush(self) -> bytes:
        """What the resampler still holds (a few ms), at the end of the stretch."""
        if self._stream is None:
            return b""
        return self._encode(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))

    def _encode(self, x: np.ndarray) -> bytes:
        pcm = np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2")
        if self.format.codec == "ulaw":
            return ulaw(pcm)
        if self.format.codec == "alaw":
            return alaw(pcm)
        return pcm.tobytes()
