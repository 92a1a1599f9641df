"""A text cut into sentences for the embedded backends, which synthesize it one sentence at a time: the first sound
comes after the first sentence is made rather than the whole text, and calls on one backend take turns between
sentences (tts/backends/threaded.py `in_turns`), so a long input does not hold a short one back.

A sentence ends at . ! ? … (and closing quotes or brackets) before a space, or at a line break; one longer than
`MAX_SENTENCE_CHARS` is cut at its last clause mark (, ; : — –) before that, else at its last space. Every cut
falls between tokens (runs of non-space characters), so no word is split (tts/words.py).
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|\n+")
_CLAUSE_END = re.compile(r"[,;:—–]\s")
MAX_SENTENCE_CHARS = 200  # a longer one is cut at its last clause (or space) before this: its sound comes sooner


def sentences(text: str) -> list[tuple[int, int]]:
    """`text` as spans of sentences, each with what follows it up to the next (a paragraph's line breaks too: the
    pause after it is its own), a long one cut at a clause or a space; together they are the text (but for spaces
    alone, which are no sentence)."""
    spans, start = [], 0
    for end in [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]:
        while end - start > MAX_SENTENCE_CHARS:
            window = text[start : start + MAX_SENTENCE_CHARS]
            clauses = [m.end() for m in _CLAUSE_END.finditer(window)]
            cut = clauses[-1] if clauses else window.rfind(" ") + 1
            if cut <= 0:
                break
            spans.append((start, start + cut))
            start += cut
        if end > start:
            if spans and not text[start:end].strip():  # (line breaks after a sentence's end: that sentence's)
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
            start = end
    return [(a, b) for a, b in spans if text[a:b].strip()]


def ends_a_clause(sentence: str) -> bool:
    """Whether `sentence` (a span of `sentences`) ends at a mark or a line break, rather than at a space where a
    long clause was cut: a speaker pauses after it."""
    stripped = sentence.rstrip(" \t")
    return bool(stripped) and (stripped[-1] == "\n" or not stripped[-1].isalnum())
