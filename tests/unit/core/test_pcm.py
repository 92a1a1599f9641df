"""16-bit PCM to and from float32 (core/pcm.py)."""

from __future__ import annotations

import numpy as np

from core.pcm import as_float, from_pcm16, pcm16


def test_pcm16_round_trips_within_a_step_and_clips() -> None:
    x = np.array([0.0, 0.5, -0.5, 0.999, -1.0], np.float32)
    back = from_pcm16(pcm16(x))
    assert back.dtype == np.float32 and np.max(np.abs(back - x)) < 2 / 32768
    assert pcm16(np.array([2.0, -2.0], np.float32)) == pcm16(np.array([1.0, -1.0], np.float32))  # (clipped)
    assert len(pcm16(x)) == 2 * len(x) and pcm16(np.array([1.0], np.float32)) == (32767).to_bytes(2, "little")


def test_int16_and_float_samples_are_float32_in_range() -> None:
    assert as_float(np.array([-32768, 16384], np.int16)).tolist() == [-1.0, 0.5]
    x = np.array([0.25], np.float32)
    assert as_float(x) is x  # (no copy of what is float32 already)
