"""A backend's audio as PCM16 at 24 kHz (tts/audio.py): resampled as one stream across pieces."""

from __future__ import annotations

import numpy as np

from tts.audio import Resampler, ms, pcm16
from tts.client import RATE


def test_pieces_resample_to_the_length_of_the_whole() -> None:
    rate = 22050
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)  # 1 s
    resampler = Resampler(rate)
    out = b"".join(resampler.push(piece) for piece in np.array_split(tone, 7)) + resampler.flush()
    assert abs(ms(len(out)) - 1000.0) < 1.0
    whole = Resampler(rate)
    once = whole.push(tone) + whole.flush()
    assert len(once) == len(out)
    a, b = np.frombuffer(out, "<i2").astype(float), np.frombuffer(once, "<i2").astype(float)
    assert np.max(np.abs(a - b)) <= 2  # no seams where the pieces met


def test_int16_in_and_the_models_rate_passes_through() -> None:
    samples = np.array([0, 16384, -16384, 32767], np.int16)
    same = Resampler(RATE)
    assert np.array_equal(np.frombuffer(same.push(samples), "<i2"), [0, 16383, -16383, 32766])
    assert same.flush() == b""
    assert pcm16(np.array([2.0, -2.0], np.float32)) == np.array([32767, -32767], "<i2").tobytes()
