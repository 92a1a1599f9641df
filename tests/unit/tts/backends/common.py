"""What every backend's stream must be (tests of tts/backends/): PCM16 at 24 kHz, each word once, in the text's
order, sent with the audio it starts in, at times that never go back and fall within the audio."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

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


def record_threads(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """The names of the threads that hand a backend's pieces over (`put`) and resample its audio (`resample`), as
    the calls made from now on run."""
    from tts import audio as tts_audio
    from tts.backends import threaded

    threads: dict[str, set[str]] = {"put": set(), "resample": set()}
    put, push = threaded.Pieces.put, tts_audio.Resampler.push

    def recording_put(self: threaded.Pieces, piece: object) -> None:
        threads["put"].add(threading.current_thread().name)
        put(self, piece)

    def recording_push(self: tts_audio.Resampler, samples: object) -> bytes:
        threads["resample"].add(threading.current_thread().name)
        return push(self, samples)  # type: ignore[arg-type]

    monkeypatch.setattr(threaded.Pieces, "put", recording_put)
    monkeypatch.setattr(tts_audio.Resampler, "push", recording_push)
    return threads


def assert_off_the_loop(threads: dict[str, set[str]]) -> None:
    """The backend's work ran in its own thread: not the default pool's (`asyncio_*`), not the event loop's."""
    assert threads["put"] and threads["resample"]
    assert not any(name.startswith("asyncio") for name in threads["put"]), threads
    assert threading.current_thread().name not in threads["resample"], threads
