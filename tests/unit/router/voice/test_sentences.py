"""An answer's text cut into pieces to be spoken (router/voice/sentences.py): sentence ends with a look-ahead,
abbreviations, numbers and initials left whole, the minimum length, the first piece's clause, line breaks, text with
no punctuation, and pieces that join to the text exactly however the text is split into deltas."""

from __future__ import annotations

import random

import pytest

from router.voice.sentences import LONG_CHARS, MAX_CHARS, SentenceSplitter


def pieces(text: str, step: int | None = None, **settings: int) -> list[str]:
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
    assert len(cut) > 1 and all(MAX_CHARS <= len(p.strip()) < MAX_CHARS + 6 for p in cut[:-1])


ANSWERS = [
    "Sure, the weather in Paris is sunny today, with a high of 20 degrees. Dr. Smith says hi!\n\nAnything else? "
    "Maybe e.g. a hat... or not. 3.14 is pi. J. Doe left.",
    "Here are the steps to follow:\n1. Open the door and walk in.\n2. Sit down on the chair.\n",
    ", ".join(["a clause of some words"] * 14) + ". " + " ".join(["word"] * 120),
]


@pytest.mark.parametrize("text", ANSWERS)
def test_the_cuts_do_not_depend_on_how_the_text_is_split_into_deltas(text: str) -> None:
    """A preemptive answer's first piece is cut the same in its held frames and in its response
    (router/realtime/early_speech.py), whatever the deltas decode sent."""
    whole = pieces(text)
    assert pieces(text, step=1) == whole
    rng = random.Random(7)
    for _ in range(20):
        splitter, out, i = SentenceSplitter(), [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            out += splitter.feed(text[i : i + n])
            i += n
        if rest := splitter.flush():
            out.append(rest)
        assert out == whole
