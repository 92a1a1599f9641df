"""A growing utterance's transcription (router/voice/utterance.py), against a fake speech handle: partials as it
grows, the final transcript reused when it covers the same audio, a replica's death retried, segments past the
window, and the deltas' agreement (router/realtime/audio.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from router.realtime.spoken_turn import common_prefix, stable_prefix  # (the deltas: router/voice/)
from speech.utterance import TranscriptionFailed, Utterance

RATE = 16000


class FakeSpeech:
    """`transcribe(pcm)` answers the audio's length in ms; `fail` raises that many times first."""

    def __init__(self, fail: int = 0, error: dict[str, Any] | None = None, delay: float = 0.0) -> None:
        self.calls: list[int] = []
        self.fail, self.error, self.delay = fail, error, delay

    def transcribe(self, pcm: bytes, **kwargs: Any) -> Any:
        async def answer() -> dict[str, Any]:
            await asyncio.sleep(self.delay)
            self.calls.append(len(pcm) // 2)
            if self.fail:
                self.fail -= 1
                raise RuntimeError("ActorDiedError")
            if self.error is not None:
                return {"error": self.error}
            return {"text": f"{len(pcm) // 2 * 1000 // RATE}ms", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}

        return answer()


async def collect(speech: FakeSpeech, **kwargs: Any) -> tuple[Utterance, list[str]]:
    seen: list[str] = []

    async def on_text(text: str, delay: float) -> None:
        seen.append(text)

    return Utterance(speech, on_text, language="en", **kwargs), seen


async def test_it_is_transcribed_again_as_it_grows_and_the_final_reuses_a_transcript_of_the_same_audio() -> None:
    speech = FakeSpeech()
    utterance, seen = await collect(speech, every_ms=300)
    for _ in range(10):  # 1 s in 100 ms appends
        utterance.extend(np.zeros(1600, np.float32))
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert seen and seen[-1] in ("900ms", "1000ms", "600ms")  # partials every 300 ms of audio
    assert all(n % 4800 == 0 for n in speech.calls[:-1])
    utterance.ask(16000)  # (as at a pause)
    await asyncio.sleep(0.05)
    before = len(speech.calls)
    assert speech.calls[-1] == 16000
    assert await utterance.final(16000) == "1000ms"  # covered: no new transcription
    assert len(speech.calls) == before
    assert utterance.usage["transcriptions"] == len(speech.calls)
    utterance.close()


async def test_without_partials_only_pauses_and_the_end_are_transcribed() -> None:
    speech = FakeSpeech()
    utterance, seen = await collect(speech, every_ms=None)
    for _ in range(20):  # 2 s in 100 ms appends
        utterance.extend(np.zeros(1600, np.float32))
        await asyncio.sleep(0.005)
    assert speech.calls == [] and seen == []
    utterance.hold(16000)  # a pause at 1 s
    await asyncio.sleep(0.05)
    assert speech.calls == [16000] and utterance.at_pause
    assert await utterance.final(32000) == "2000ms"
    assert speech.calls == [16000, 32000]
    utterance.close()


async def test_a_pause_past_the_audio_in_is_transcribed_once_its_audio_is_in() -> None:
    """The VAD may hear a pause a few ms before the transcription's resampler gives its audio: the pause's one
    transcription covers the pause's end (not the audio in so far), so it is the turn's final one."""
    speech = FakeSpeech()
    utterance, seen = await collect(speech, every_ms=None)
    utterance.extend(np.zeros(16000, np.float32))
    utterance.hold(16100)  # (100 samples not in yet)
    await asyncio.sleep(0.02)
    assert speech.calls == [] and not utterance.at_pause
    utterance.extend(np.zeros(320, np.float32))
    await asyncio.sleep(0.02)
    assert speech.calls == [16100] and utterance.at_pause and seen == ["1006ms"]
    assert await utterance.final(16100) == "1006ms" and speech.calls == [16100]
    utterance.close()


async def test_a_dead_replica_is_retried_and_a_refusal_fails_the_turn() -> None:
    utterance, _ = await collect(FakeSpeech(fail=1), every_ms=10_000)
    utterance.extend(np.zeros(8000, np.float32))
    assert await utterance.final(8000) == "500ms"
    utterance.close()
    refused, _ = await collect(FakeSpeech(error={"message": "bad audio", "code": 400}), every_ms=10_000)
    refused.extend(np.zeros(8000, np.float32))
    with pytest.raises(TranscriptionFailed, match="bad audio"):
        await refused.final(8000)
    refused.close()
    dead, _ = await collect(FakeSpeech(fail=10), every_ms=10_000)
    dead.extend(np.zeros(8000, np.float32))
    with pytest.raises(TranscriptionFailed) as e:
        await dead.final(8000)
    assert e.value.code == "speech_unavailable"
    dead.close()


async def test_a_slow_recognizer_times_out_with_a_clear_error() -> None:
    utterance, _ = await collect(FakeSpeech(delay=1.0), every_ms=10_000)
    utterance.extend(np.zeros(8000, np.float32))
    with pytest.raises(TranscriptionFailed) as e:
        await utterance.final(8000, timeout=0.1)
    assert e.value.code == "timeout"
    utterance.close()


async def test_past_the_window_it_is_cut_at_the_vads_last_pause() -> None:
    speech = FakeSpeech()
    utterance, _ = await collect(speech, every_ms=100_000, window_s=2.0)
    utterance.extend(np.zeros(RATE * 3, np.float32))
    utterance.pauses.append(int(RATE * 1.5))
    text = await utterance.final(RATE * 3)
    assert utterance.closed == [(0, int(RATE * 1.5))]
    assert text == "1500ms 1500ms"  # the closed segment's text, then the open one's
    utterance.close()


def test_deltas_are_the_text_two_transcripts_agree_on_in_whole_words() -> None:
    assert stable_prefix("what is the wea", "what is the weather") == "what is the"
    assert stable_prefix("hello there", "hello there") == "hello there"
    assert stable_prefix("", "hello") == ""
    assert common_prefix("abc", "abd") == 2
