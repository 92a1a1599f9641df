"""A text cut into sentences for the embedded backends (tts/sentences.py)."""

from __future__ import annotations

from tts.sentences import ends_a_clause, sentences


def test_sentences_are_cut_at_their_ends_and_long_ones_at_a_clause() -> None:
    text = "Hello there. It costs $1,200 on Dec. 3rd! Is it?\nYes"
    cut = [text[a:b].strip() for a, b in sentences(text)]
    assert cut == ["Hello there.", "It costs $1,200 on Dec.", "3rd!", "Is it?", "Yes"]
    long = ", ".join(["one two three four five"] * 20) + "."
    parts = sentences(long)
    assert all(b - a <= 200 for a, b in parts) and "".join(long[a:b] for a, b in parts) == long
    assert long[parts[0][0] : parts[0][1]].endswith(", ")
    text = "  Hello there.\n\nHow are you? \n"
    assert [text[a:b] for a, b in sentences(text)] == ["  Hello there.\n\n", "How are you? \n"]


def test_a_pause_follows_a_mark_or_a_line_break_not_a_cut_at_a_space() -> None:
    assert ends_a_clause("Hello there. ") and ends_a_clause("one, ") and ends_a_clause("Is it?\n")
    assert ends_a_clause('He said "no." ') and not ends_a_clause("one two three ") and not ends_a_clause("  ")
