"""An answer's text cut into pieces to be spoken, as it streams from decode (realtime audio output, and the REST
speech endpoint): a speech engine speaks a whole sentence better than any part of it, and the first piece goes out
as soon as it is complete, while the rest of the answer is still being generated.

A piece ends after a sentence's end (`.`, `!`, `?`, `…`, with closing quotes or brackets) or a line break, followed
by whitespace; the whitespace belongs to the piece, so that the pieces joined are the text exactly. A cut needs the
next non-space character (the look-ahead): "Dr. Smith", "e.g. this", "J. Smith" and "wait... what" are not cut, and
"3.5" has no space to cut at. A piece is `min_sentence_chars` long at least (a shorter sentence waits for the next
one: "Hi! How are you?" is one piece). The first piece may end at a clause (`,` `;` `:` and a space) once it is
`first_clause_chars` long, to get sound out sooner; a long sentence may end at a clause past `LONG_CHARS`, and text
with no punctuation at all at any space past `MAX_CHARS`. The cuts depend on the text only, never on how it was
split into deltas (a preemptive answer's first piece is cut the same in its held frames and in its response).
"""

from __future__ import annotations

import re

LONG_CHARS = 120  # a sentence this long may end at a clause
MAX_CHARS = 240  # text this long with no sentence end or clause ends at a space
# Words that end with a period and rarely end a sentence (lowercase, without their last period).
ABBREVIATIONS = frozenset(
    {
        *("mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "e.g", "i.e", "cf", "approx", "dept"),
        *("est", "fig", "inc", "ltd", "corp", "co", "gen", "col", "lt", "sgt", "capt", "gov", "rev", "hon", "vol"),
        *("ca", "a.m", "p.m", "u.s", "u.k", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct"),
        *("nov", "dec"),
    }
)
# A break: a sentence's end (terminators, then closing quotes or brackets), a clause mark, or a line break (the
# empty group), then the whitespace after it, up to the next non-space character.
_BREAK = re.compile(r"""([.!?…]+["'”’)\]]*|[,;:]|(?=\n))\s+(?=\S)""")
_SPACE = re.compile(r"\s+(?=\S)")
_WORD = re.compile(r"[\w.'’-]+$")


class SentenceSplitter:
    """Feed it an answer's text deltas (`feed`) and take the complete pieces; `flush()` at the end gives the rest."""

    def __init__(self, min_sentence_chars: int = 20, first_clause_chars: int = 24) -> None:
        self.min_chars, self.first_clause_chars = min_sentence_chars, first_clause_chars
        self.buffer = ""  # the text not cut yet
        self.first = True  # no piece cut yet

    def feed(self, delta: str) -> list[str]:
        """The pieces `delta` completes (none if it completes none)."""
        self.buffer += delta
        pieces = []
        while (end := self._cut()) is not None:
            pieces.append(self.buffer[:end])
            self.buffer = self.buffer[end:]
            self.first = False
        return pieces

    def flush(self) -> str:
        """The rest of the text (the answer ended): the last piece, perhaps short, perhaps only whitespace."""
        rest, self.buffer = self.buffer, ""
        return rest

    def _cut(self) -> int | None:
        """Where the first piece of the buffer ends, if it is complete."""
        text = self.buffer
        for match in _BREAK.finditer(text):
            size = len(text[: match.end()].strip())
            mark = match.group(1)
            if not mark or "\n" in match.group(0):  # a line break
                ok = size >= self.min_chars
            elif mark[0] in ",;:":
                ok = (self.first and size >= self.first_clause_chars) or size >= LONG_CHARS
            else:
                ok = size >= self.min_chars and self._ends_sentence(text, match)
            if ok:
                return match.end()
        if len(text.strip()) < MAX_CHARS:
            return None
        return next((m.end() for m in _SPACE.finditer(text) if len(text[: m.end()].strip()) >= MAX_CHARS), None)

    @staticmethod
    def _ends_sentence(text: str, match: re.Match[str]) -> bool:
        """Whether the terminator `match` found ends a sentence: not after an abbreviation or an initial, and a
        period or an ellipsis not followed by a lowercase word."""
        terminators = match.group(1).rstrip("\"'”’)]")
        if terminators[-1] not in ".…":
            return True  # (! and ?)
        if text[match.end()].islower():
            return False
        if terminators == ".":
            found = _WORD.search(text, 0, match.start(1))
            word = found.group(0).lstrip(".") if found else ""
            if word.lower() in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                return False
            before = text[: found.start()].rstrip(" \t") if found else ""
            if word.isdigit() and (not before or before.endswith("\n")):
                return False  # a list's number at the start of a line ("1. Open the door"): it goes with its item
        return True
