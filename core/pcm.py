"""16-bit little-endian PCM, the one sample format the roles pass audio in (speech in, speech out, the clients'
`pcm16`), and float32 in [-1, 1], the one they compute in."""

from __future__ import annotations

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
