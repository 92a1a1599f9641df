"""An answer's text cut into pieces to be spoken (core/sentences.py): sentence ends with a look-ahead,
abbreviations, numbers and initials left whole, the minimum length, the first piece's clause, line breaks, text with
no punctuation, and pieces that join to the text exactly however the text is split into deltas."""

from __future__ import annotations

import random

import pytest

from core.sentences import LONG_CHARS, MAX_CHARS, SentenceSplitter, ends_a_clause, sentence_spans


def pieces(text: str, step: int | None = None, **settings: int | None) -> list[str]:
    """The pieces of `text` fed `step` characters at a time (None: whole), the flush included if not empty."""
    splitter = SentenceSplitter(**settings)
    out: list[str] = []
    step = step or len(text) or 1
    for i in range(0, len(text), step):
        out += splitter.feed(text[i : i + step])
    if rest := splitter.flush():
        out.append(rest)
    assert "".join(out) == text
    return out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "The weather is sunny today. Bring a hat if you go out! Is that all you need?",
            ["The weather is sunny today. ", "Bring a hat if you go out! ", "Is that all you need?"],
        ),
        # too short a sentence waits for the next one
        ("Hi! How are you doing today? I am fine.", ["Hi! How are you doing today? ", "I am fine."]),
        # abbreviations, initials, decimals and e.g. are not sentence ends
        (
            "Dr. Smith will see you at 3.5 past nine. J. R. R. Tolkien wrote it, e.g. The Hobbit. Done now.",
            ["Dr. Smith will see you at 3.5 past nine. ", "J. R. R. Tolkien wrote it, e.g. The Hobbit. ", "Done now."],
        ),
        # a period before a lowercase word, and an ellipsis before one, do not end a sentence
        (
            "I bought apples, pears etc. and then I left... and went home. Then it rained all day.",
            ["I bought apples, pears etc. and then I left... and went home. ", "Then it rained all day."],
        ),
        # closing quotes and brackets stay with their sentence
        (
            'He said "Stop right there now." Then he left (after a while.) It was late that night.',
            ['He said "Stop right there now." ', "Then he left (after a while.) ", "It was late that night."],
        ),
        # line breaks end a piece; a list's number stays with its item
        (
            "Here are the steps to follow:\n1. Open the door and walk in.\n2. Sit down on the chair.\n",
            ["Here are the steps to follow:\n", "1. Open the door and walk in.\n", "2. Sit down on the chair.\n"],
        ),
        # leading whitespace stays with the first piece, whitespace after a sentence with it
        (
            "  Good morning to you all.  \n\nHow can I help you today?",
            ["  Good morning to you all.  \n\n", "How can I help you today?"],
        ),
        ("", []),
        ("Short.", ["Short."]),
    ],
)
def test_sentences(text: str, expected: list[str]) -> None:
    assert pieces(text) == expected


def test_the_first_piece_may_end_at_a_clause_once_it_is_long_enough() -> None:
    text = "Sure, the weather in Paris is sunny today, with a high of twenty degrees. Anything else, my friend?"
    assert pieces(text) == [
        "Sure, the weather in Paris is sunny today, ",  # (not at "Sure, ": shorter than first_clause_chars)
        "with a high of twenty degrees. ",
        "Anything else, my friend?",  # (only the first piece ends at a clause)
    ]
    assert pieces(text, first_clause_chars=5)[0] == "Sure, "
    assert pieces("One two; three four five six seven: eight.", first_clause_chars=10) == [
        "One two; three four five six seven: ",
        "eight.",
    ]


def test_the_minimum_length_is_settable() -> None:
    assert pieces("Yes. No. Maybe so.", min_sentence_chars=3) == ["Yes. ", "No. ", "Maybe so."]
    assert pieces("Yes. No. Maybe so.", min_sentence_chars=10) == ["Yes. No. Maybe so."]


def test_a_cut_waits_for_the_next_non_space_character() -> None:
    splitter = SentenceSplitter()
    assert splitter.feed("The weather is sunny today.") == []
    assert splitter.feed(" ") == []  # (the sentence may go on: "today. and", or the space may be longer)
    assert splitter.feed("  ") == []
    assert splitter.feed("It") == ["The weather is sunny today.   "]
    assert splitter.flush() == "It"
    assert splitter.flush() == ""


def test_long_text_without_sentence_ends_is_cut_at_clauses_then_spaces() -> None:
    clauses = ", ".join(["a clause of some words"] * 12) + "."
    cut = pieces(clauses)
    assert len(cut) > 1 and all(p.endswith(", ") for p in cut[:-1])
    assert len(cut[0].strip()) < LONG_CHARS  # (the first piece: at its first clause past first_clause_chars)
    assert all(LONG_CHARS <= len(p.strip()) < LONG_CHARS + 30 for p in cut[1:-1])
    words = " ".join(["word"] * 200)
    cut = pieces(words)
    assert len(cut) > 1 and all(MAX_CHARS - 5 <= len(p.strip()) <= MAX_CHARS for p in cut[:-1])


def test_long_text_with_no_space_is_cut_at_the_limit() -> None:
    for text in ["x" * 1000, "字" * 1000, "https://example.com/" + "a" * 600 + " done."]:
        cut = pieces(text)
        assert len(cut) > 1 and all(len(p.strip()) == MAX_CHARS for p in cut[:-1]), [len(p) for p in cut]
    words = "w" * 200 + " " + " ".join(["word"] * 100)  # (a space past half the limit: cut there)
    assert len(pieces(words)[0].strip()) <= MAX_CHARS


CHINESE = "今天天气很好，我们去公园散步吧。你想一起去吗？好的，我们下午三点见面。"


def test_fullwidth_terminators_cut_without_a_space() -> None:
    assert pieces(CHINESE) == ["今天天气很好，我们去公园散步吧。你想一起去吗？", "好的，我们下午三点见面。"]
    splitter = SentenceSplitter()
    assert splitter.feed(CHINESE[:23]) == []  # (a cut still waits for the next character)
    assert splitter.feed(CHINESE[23:24]) == [CHINESE[:23]]
    assert pieces("これはペンです。あれは本ですか？はい、そうです。", min_sentence_chars=5) == [
        "これはペンです。",
        "あれは本ですか？",
        "はい、そうです。",
    ]
    # The first piece at a fullwidth clause, once it is long enough; a space after a fullwidth mark stays with it.
    first = pieces("我们今天下午三点在公园门口见面，然后一起去吃饭。好吗？", first_clause_chars=10)
    assert first[0] == "我们今天下午三点在公园门口见面，"
    assert pieces("你好，朋友们。 今天我们来谈谈天气。", min_sentence_chars=5)[0] == "你好，朋友们。 "


def test_a_long_chinese_answer_is_spoken_as_it_streams() -> None:
    """3,800 characters of Chinese: pieces as it streams (not one piece at its end, past the TTS role's limit)."""
    text = "这是一个关于天气的很长的回答，我们会一句一句地说出来。" * 140
    splitter, cut = SentenceSplitter(), []
    for i in range(0, len(text), 3):
        cut += splitter.feed(text[i : i + 3])
    assert len(cut) >= 130 and all(len(p) <= MAX_CHARS for p in cut)
    assert "".join(cut) + splitter.flush() == text


ANSWERS = [
    "Sure, the weather in Paris is sunny today, with a high of 20 degrees. Dr. Smith says hi!\n\nAnything else? "
    "Maybe e.g. a hat... or not. 3.14 is pi. J. Doe left.",
    "Here are the steps to follow:\n1. Open the door and walk in.\n2. Sit down on the chair.\n",
    ", ".join(["a clause of some words"] * 14) + ". " + " ".join(["word"] * 120),
    CHINESE * 3 + "他说：“好！”然后走了……" + "没有标点的中文" * 50 + "。结束。",
    "Mr. Smith arrived at 3.5 p.m. e.g. on time... and left. " * 8 + "x" * 500 + " End of it.",
]


@pytest.mark.parametrize("first_word_chars", [None, 32])
@pytest.mark.parametrize("text", ANSWERS)
def test_the_cuts_do_not_depend_on_how_the_text_is_split_into_deltas(text: str, first_word_chars: int | None) -> None:
    """A preemptive answer's first piece is cut the same in its held frames and in its response
    (router/realtime/early_speech.py), whatever the deltas decode sent."""
    whole = pieces(text, first_word_chars=first_word_chars)
    assert pieces(text, step=1, first_word_chars=first_word_chars) == whole
    rng = random.Random(7)
    for _ in range(20):
        splitter, out, i = SentenceSplitter(first_word_chars=first_word_chars), [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            out += splitter.feed(text[i : i + n])
            i += n
        if rest := splitter.flush():
            out.append(rest)
        assert out == whole


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # No clause in the first 32 characters: the first piece ends at the first word past them.
        (
            "The weather in Paris is sunny and warm today with a high of twenty degrees. Tomorrow it rains.",
            ["The weather in Paris is sunny and ", "warm today with a high of twenty degrees. ", "Tomorrow it rains."],
        ),
        # A sentence end or a clause that comes first still ends it there.
        (
            "Sure thing, my dear old friend, the weather in Paris is sunny.",
            ["Sure thing, my dear old friend, ", "the weather in Paris is sunny."],
        ),
        (
            "It is sunny in Paris today. And warm, with a high of twenty.",
            ["It is sunny in Paris today. ", "And warm, with a high of twenty."],
        ),
        # Only the first piece: later sentences are whole.
        (
            "It is sunny in Paris today. " + "And warm and bright with a high of twenty degrees all day long. ",
            ["It is sunny in Paris today. ", "And warm and bright with a high of twenty degrees all day long. "],
        ),
        # Text with no punctuation at all (a random-weight model's): sound after a few words.
        (
            "tributeser ateath than altingSO clsert when lensl max Return",
            ["tributeser ateath than altingSO clsert ", "when lensl max Return"],
        ),
    ],
)
def test_the_first_piece_may_end_at_a_word(text: str, expected: list[str]) -> None:
    assert pieces(text, first_word_chars=32) == expected
    assert pieces(text, step=1, first_word_chars=32) == expected


def test_a_whole_text_is_cut_into_spans_as_a_streamed_one_is() -> None:
    """`sentence_spans` (a TTS backend speaks a long input a piece at a time): the pieces of the text streamed whole,
    as spans; together they are the text but for trailing whitespace alone; none over MAX_CHARS."""
    text = "Hello there, my friend. It costs $1,200 on Dec. 3rd! Is it really that much?\nYes, it is.  "
    spans = sentence_spans(text)
    splitter = SentenceSplitter(first_clause_chars=LONG_CHARS)
    assert [text[a:b] for a, b in spans] == [*splitter.feed(text), splitter.flush()]
    assert "".join(text[a:b] for a, b in spans) == text and len(spans) == 4
    assert text[spans[0][0] : spans[0][1]] == "Hello there, my friend. "  # (a whole text: no early clause cut)
    one = "Tomorrow it will rain in the morning, but it should clear up by the afternoon."
    assert sentence_spans(one) == [(0, len(one))]  # (one sentence: one call, one intonation)
    url = "See https://example.com/" + "a" * 300 + " now."
    assert [url[a:b] for a, b in sentence_spans(url)] == [url]  # (no cut inside the long run)
    assert text[spans[1][0] : spans[1][1]].startswith("It costs $1,200 on Dec. 3rd!")  # (not cut after "Dec.")
    long = ", ".join(["one two three four five"] * 20) + "."
    parts = sentence_spans(long)
    assert "".join(long[a:b] for a, b in parts) == long and len(parts) > 1
    assert all(len(long[a:b].strip()) <= MAX_CHARS for a, b in parts)


def test_a_pause_follows_a_mark_or_a_line_break_not_a_cut_at_a_space() -> None:
    assert ends_a_clause("Hello there. ") and ends_a_clause("one, ") and ends_a_clause("Is it?\n")
    assert ends_a_clause('He said "no." ') and not ends_a_clause("one two three ") and not ends_a_clause("  ")
