"""The words of a text (tts/words.py): spans without the marks around them, the word at a backend's position,
times spread in proportion, and the queue that hands each word out with the audio it starts in."""

from __future__ import annotations

from tts.words import WordLocator, WordQueue, proportional, word_spans


def words(text: str) -> list[str]:
    return [text[a:b] for a, b in word_spans(text)]


def test_words_drop_the_marks_around_them_and_marks_alone() -> None:
    assert words("Café au lait, s'il vous plaît.") == ["Café", "au", "lait", "s'il", "vous", "plaît"]
    text = "It costs $1,200 — on Dec. 3rd, Mr. Smith! 👋 (really)"
    assert words(text) == ["It", "costs", "1,200", "on", "Dec", "3rd", "Mr", "Smith", "really"]
    assert words("  ...  — !") == []


def test_a_position_anywhere_in_a_words_token_is_that_word() -> None:
    text = "Hi $1,200 — 👋 there."
    locate = WordLocator(text)
    assert [text[a:b] for a, b in locate.spans] == ["Hi", "1,200", "there"]
    assert locate.word_at(0) == locate.word_at(1) == 0
    assert locate.word_at(2) is None  # a space
    assert locate.word_at(3) == 1  # `$`: the token of `1,200`
    assert locate.word_at(8) == 1
    assert locate.word_at(10) is None  # `—` alone
    assert locate.word_at(12) is None  # the emoji
    assert locate.word_at(text.index("there")) == 2
    assert locate.word_at(len(text) - 1) == 2  # its full stop
    assert locate.word_at(len(text)) is None


def test_proportional_times_follow_the_text() -> None:
    spans = word_spans("aa bb cc")
    assert proportional(spans, 100.0, 900.0) == [100.0, 100.0 + 3 / 8 * 800, 100.0 + 6 / 8 * 800]
    assert proportional([], 0.0, 1.0) == []
    assert proportional([(0, 5)], 10.0, 20.0) == [10.0]


def test_the_queue_hands_words_out_with_the_audio_they_start_in_and_never_goes_back() -> None:
    queue = WordQueue()
    queue.add(0, 2, 0.0)
    queue.add(3, 5, 150.0)
    queue.add(6, 8, 120.0)  # earlier than the word before: that one's time
    assert queue.due(100.0) == [{"start": 0, "end": 2, "audio_ms": 0.0}]
    assert queue.due(150.0) == []  # (starts at 150: not in the first 150 ms)
    assert queue.due(151.0) == [{"start": 3, "end": 5, "audio_ms": 150.0}, {"start": 6, "end": 8, "audio_ms": 150.0}]
    queue.add(9, 10, 5000.0)
    assert queue.rest() == [{"start": 9, "end": 10, "audio_ms": 5000.0}]
    assert queue.rest() == []
