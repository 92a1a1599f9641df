"""The speech-out role's audio: a backend's samples at its own rate as PCM16 mono at `RATE`, resampled as a stream.

Every backend hands over float32 or int16 samples at its model's rate (22050 Hz for espeak-ng and Piper's medium
voices); the client gets 16-bit little-endian PCM at 24 kHz. libsoxr resamples, its filter state kept across the
pieces of one call, so no seam is heard where one piece ends and the next begins. Its filter holds back a few ms
of audio until the next piece or the end of the call (`flush`). Times are in ms of audio, the same at either rate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.pcm import as_float, pcm16
from tts.client import RATE


def ms(n_bytes: int) -> float:
    """The length of `n_bytes` of PCM16 at `RATE`, in ms."""
    return n_bytes / 2 / RATE * 1000.0


class Resampler:
    """One call's audio from `rate` to `RATE` (libsoxr, HQ: speech heard by people, not a recognizer), as PCM16."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._stream: Any = None
        if rate != RATE:
            import soxr

            self._stream = soxr.ResampleStream(rate, RATE, 1, dtype="float32", quality="HQ")

    def push(self, samples: np.ndarray) -> bytes:
        """The audio resampled so far of `samples` (the filter may hold the last few ms back until the next)."""
        x = as_float(samples)
        if self._stream is None:
            return pcm16(x)
        return pcm16(self._stream.resample_chunk(x, last=False))

    def flush(self) -> bytes:
        """What the filter held back: the call's last samples."""
        if self._stream is None:
            return b""
        return pcm16(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))
