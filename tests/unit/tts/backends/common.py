"""What every backend's stream must be (tests of tts/backends/): PCM16 at 24 kHz, each word once, in the text's
order, sent with the audio it starts in, at times that never go back and fall within the audio."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from tts.audio import ms
from tts.words import word_spans


async def collect(stream: AsyncIterator[Any]) -> tuple[bytes, list[dict[str, Any]], list[dict[str, Any]]]:
    """(the audio, its words, the items), checking that each word came with the audio it starts in or later."""
    audio, words, items = b"", [], []
    async for item in stream:
        items.append(item)
        if "error" in item:
            break
        audio += item["audio"]
        assert len(item["audio"]) % 2 == 0
        for word in item["words"]:
            assert word["audio_ms"] < ms(len(audio)) or not item["audio"], (word, ms(len(audio)))
        words += item["words"]
    return audio, words, items


def seconds(audio: bytes) -> float:
    return len(audio) / 2 / 24000


def check_words(text: str, audio: bytes, words: list[dict[str, Any]]) -> None:
    assert [(w["start"], w["end"]) for w in words] == word_spans(text)
    times = [w["audio_ms"] for w in words]
    assert times == sorted(times)
    assert times[0] >= 0.0 and times[-1] < ms(len(audio))


def loud(audio: bytes) -> float:
    """RMS of PCM16, in [0, 1]."""
    x = np.frombuffer(audio, "<i2").astype(np.float32) / 32768
    return float(np.sqrt(np.mean(x * x)))
