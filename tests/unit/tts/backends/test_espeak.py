"""The espeak-ng backend (tts/backends/espeak.py), on the real library: audio of the text's length at 24 kHz, word
events mapped to the text's words (non-ASCII text too), speed, voices, streaming, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from core.config import ESPEAK_VOICES, TtsConfig
from tts.backends.espeak import EspeakBackend, words_per_minute
from tts.words import word_spans

from .common import assert_off_the_loop, check_words, collect, loud, record_threads, seconds

QUESTION = "What is the capital of Spain?"
FRENCH = "Café au lait, s'il vous plaît."


@pytest.fixture(scope="module")
async def espeak() -> EspeakBackend:
    backend = EspeakBackend(TtsConfig())
    await backend.start(sorted(set(ESPEAK_VOICES.values())))
    return backend


async def test_a_question_is_spoken_at_its_length_with_its_words(espeak: EspeakBackend) -> None:
    audio, words, items = await collect(espeak.synthesize(QUESTION, "en-us", 1.0))
    assert 1.2 < seconds(audio) < 3.5  # six words at 150 a minute
    assert loud(audio) > 0.02
    check_words(QUESTION, audio, words)
    assert len(items) <= 2  # a sentence is made in a few ms: one item (two if the end came apart)


async def test_non_ascii_text_maps_to_python_offsets(espeak: EspeakBackend) -> None:
    audio, words, _ = await collect(espeak.synthesize(FRENCH, "en-us", 1.0))
    check_words(FRENCH, audio, words)
    assert [FRENCH[w["start"] : w["end"]] for w in words] == ["Café", "au", "lait", "s'il", "vous", "plaît"]
    text = "Naïve façade — 東京 is big, $1,200 for 👋 Mr. Smith."
    audio, words, _ = await collect(espeak.synthesize(text, "en-us", 1.0))
    check_words(text, audio, words)
    assert words[-1]["audio_ms"] > words[0]["audio_ms"] + 2000  # the times are the words', not all at the start


async def test_speed_two_halves_the_length(espeak: EspeakBackend) -> None:
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
    normal, _, _ = await collect(espeak.synthesize(text, "en-us", 1.0))
    fast, words, _ = await collect(espeak.synthesize(text, "en-us", 2.0))
    assert 0.35 < len(fast) / len(normal) < 0.65
    check_words(text, fast, words)
    assert words_per_minute(TtsConfig(), 4.0) == 450 and words_per_minute(TtsConfig(), 0.25) == 80


async def test_every_configured_voice_speaks_and_an_unknown_one_is_refused(espeak: EspeakBackend) -> None:
    lengths = set()
    for voice in sorted(set(ESPEAK_VOICES.values())):
        audio, words, _ = await collect(espeak.synthesize("Hello there.", voice, 1.0))
        assert seconds(audio) > 0.3 and len(words) == 2, voice
        lengths.add(len(audio))
    assert len(lengths) > 1  # the voices differ
    _, _, items = await collect(espeak.synthesize("Hello there.", "no-such-voice", 1.0))
    assert items == [{"error": items[0]["error"]}] and items[0]["error"]["code"] == "voice_not_found"
    audio, _, _ = await collect(espeak.synthesize("Hello there.", "en-us", 1.0))  # and the next call is fine
    assert seconds(audio) > 0.3
    with pytest.raises(ValueError, match="no-such-voice"):
        await EspeakBackend(TtsConfig()).start(["en-us", "no-such-voice"])


async def test_a_long_text_streams_in_few_items(espeak: EspeakBackend) -> None:
    text = " ".join(["Goodbye, see you later. What is the capital of Spain?"] * 40)
    audio, words, items = await collect(espeak.synthesize(text, "en-us", 1.0))
    assert seconds(audio) > 60
    assert 1 <= len(items) < 60  # (~1,100 buffers of 100 ms: sent together as they pile up)
    assert len(words) == len(word_spans(text))
    check_words(text, audio, words)


async def test_a_caller_that_leaves_stops_the_synthesis_and_frees_espeak(espeak: EspeakBackend) -> None:
    text = " ".join(["Goodbye, see you later."] * 200)
    stream = espeak.synthesize(text, "en-us", 1.0)
    first = await anext(stream)
    assert first["audio"]
    await stream.aclose()
    audio, words, _ = await collect(espeak.synthesize(QUESTION, "en-us+f3", 1.0))
    check_words(QUESTION, audio, words)


async def test_calls_at_once_take_turns(espeak: EspeakBackend) -> None:
    results = await asyncio.gather(*(collect(espeak.synthesize(QUESTION, v, 1.0)) for v in ("en-us", "en-us+f3")))
    for audio, words, _ in results:
        check_words(QUESTION, audio, words)


LONG = " ".join(["Goodbye, see you later. What is the capital of Spain? Turn on the kitchen lights."] * 60)[:4096]


async def test_a_short_sentence_is_not_held_behind_a_long_input(espeak: EspeakBackend) -> None:
    """A long input takes turns with other calls a sentence at a time: a short one's first audio comes while the
    long one is still being made, and both come out whole."""
    long = espeak.synthesize(LONG, "en-us", 1.0)
    first = await anext(long)
    long_items: list[dict] = [first]
    ended = asyncio.get_running_loop().create_future()

    async def drain() -> None:
        async for item in long:
            long_items.append(item)
        ended.set_result(asyncio.get_running_loop().time())

    reader = asyncio.create_task(drain())
    short = espeak.synthesize(QUESTION, "en-us+f3", 1.0)
    short_first = await anext(short)
    heard_at = asyncio.get_running_loop().time()
    assert short_first["audio"] and not ended.done()
    audio, words, _ = await collect(_chain(short_first, short))
    check_words(QUESTION, audio, words)
    await reader
    assert heard_at < ended.result()
    audio = b"".join(i["audio"] for i in long_items)
    check_words(LONG, audio, [w for i in long_items for w in i["words"]])
    assert seconds(audio) > 200


async def _chain(first: dict, rest: object) -> object:
    yield first
    async for item in rest:  # type: ignore[attr-defined]
        yield item


async def test_espeak_runs_in_its_own_thread_and_resamples_there(
    espeak: EspeakBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the shared default pool's threads (a call waiting for espeak-ng would hold one) nor the event loop
    (resampling a long input's audio would stall every call of the replica) do espeak-ng's work."""
    threads = record_threads(monkeypatch)
    audio, words, _ = await collect(espeak.synthesize(LONG[:600], "en-us", 1.0))
    check_words(LONG[:600], audio, words)
    assert_off_the_loop(threads)


async def test_sentences_keep_their_pauses(espeak: EspeakBackend) -> None:
    """Spoken a sentence at a time, a text keeps the pause espeak-ng makes between its sentences (and clauses)."""
    one, _, _ = await collect(espeak.synthesize("Hello there.", "en-us", 1.0))
    two, _, _ = await collect(espeak.synthesize("How are you?", "en-us", 1.0))
    both, words, _ = await collect(espeak.synthesize("Hello there. How are you?", "en-us", 1.0))
    assert seconds(both) > seconds(one) + seconds(two) + 0.25
    assert words[2]["audio_ms"] > seconds(one) * 1000 + 250  # "How": after the pause


async def test_a_bug_in_placing_the_words_is_not_a_missing_voice(
    espeak: EspeakBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tts.backends import espeak as module

    class Broken(module.WordLocator):
        def word_at(self, position: int) -> int | None:
            raise IndexError(position)

    monkeypatch.setattr(module, "WordLocator", Broken)
    with pytest.raises(IndexError):
        await collect(espeak.synthesize(QUESTION, "en-us", 1.0))
    monkeypatch.undo()
    audio, words, _ = await collect(espeak.synthesize(QUESTION, "en-us", 1.0))  # and espeak-ng goes on
    check_words(QUESTION, audio, words)
