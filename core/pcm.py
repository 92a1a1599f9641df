"""16-bit little-endian PCM, the one sample format the roles pass audio in (speech in, speech out, the clients'
`pcm16`), and float32 in [-1, 1], the one they compute in."""

from __future__ import annotations

import io
import wave
from typing import Any

import numpy as np


def pcm16(samples: np.ndarray) -> bytes:
    """float32 samples (clipped to [-1, 1]) as 16-bit little-endian PCM."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def from_pcm16(data: bytes | bytearray | memoryview) -> np.ndarray:
    """16-bit little-endian PCM as float32 samples in [-1, 1)."""
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def as_float(samples: np.ndarray) -> np.ndarray:
    """int16 or float samples as float32 in [-1, 1]."""
    if samples.dtype == np.int16:
        return samples.astype(np.float32) / 32768.0
    return samples.astype(np.float32, copy=False)


def resample_stream(rate: int, to: int, quality: str = "LQ") -> Any:
    """libsoxr's streaming resampler from `rate` to `to` (its filter state kept between chunks: no seams
    where one chunk ends and the next begins). Low quality (LQ: a 16-bit passband to 0.9 of Nyquist, plenty for
    speech) for what is transcribed: its filter holds back ~6 ms of audio against HQ's 21 ms (24 -> 16 kHz; its
    output comes in bursts, up to a 20 ms append late). Quick (QQ: cubic interpolation) holds back a sample: what
    the VAD hears, so that it hears the end of speech at once."""
    import soxr

    return soxr.ResampleStream(rate, to, 1, dtype="float32", quality=quality)


def wav_bytes(pcm16: bytes, rate: int) -> bytes:
    """Mono 16-bit PCM as a WAV file (what vLLM's transcription layer decodes)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16)
    return out.getvalue()


def decode_upload(data: bytes, rate: int) -> bytes:
    """An uploaded audio file (WAV, FLAC, OGG, MP3: what libsndfile reads) as mono 16-bit PCM at `rate`
    (ValueError if it cannot be read)."""
    import soundfile
    import soxr

    try:
        samples, native = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # libsndfile's own errors say little; the client gets one clear message
        raise ValueError(f"the file is not audio this server can read (WAV, FLAC, OGG, MP3): {e}") from None
    mono = samples.mean(axis=1)
    if native != rate:
        mono = soxr.resample(mono, native, rate)
    return pcm16(mono)
