"""Text cut into pieces to be spoken, where a speaker would pause: an answer as it streams from decode (the router's
realtime audio output: the first piece goes out as soon as it is complete, while the rest of the answer is still
being generated), and a whole text a TTS backend speaks a piece at a time (`sentence_spans`: its first sound comes
after the first piece is made, and calls on one backend take turns between pieces). A speech engine speaks a whole
sentence better than any part of it.

A piece ends after a sentence's end (`.`, `!`, `?`, `…`, with closing quotes or brackets) or a line break, followed
by whitespace; the whitespace belongs to the piece, so that the pieces joined are the text exactly. A cut needs the
next non-space character (the look-ahead): "Dr. Smith", "e.g. this", "J. Smith" and "wait... what" are not cut, and
"3.5" has no space to cut at. Chinese and Japanese put no space after a sentence: a fullwidth end (`。` `！` `？` `；`)
needs none, only the look-ahead. A piece is `min_sentence_chars` long at least (a shorter sentence waits for the next
one: "Hi! How are you?" is one piece). The first piece may end at a clause (`,` `;` `:` and a space, or a fullwidth
`，` `、` `：`) once it is `first_clause_chars` long, to get sound out sooner; a long sentence may end at a clause past
`LONG_CHARS`; and, with `first_word_chars`, the first piece may end at any word once it is that long (text with
no early clause, or no punctuation at all, still gets its first sound after a few words). No piece is longer than
`MAX_CHARS` (whitespace aside): text with no end or clause before that ends at its last space past half of it, or,
with none (a language written without spaces, a long URL), at `MAX_CHARS` itself. The cuts depend on the text
only, never on how it was split into deltas (a preemptive answer's first piece is cut the same in its held frames
and in its response).

`split_long` cuts a piece further, for a TTS role that takes fewer characters at once (`tts.max_input_chars`);
`ends_a_clause` says whether a speaker pauses after a piece.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.config import TtsConfig

LONG_CHARS = 120  # a sentence this long may end at a clause
MAX_CHARS = 240  # no piece is longer (whitespace aside)
# Words that end with a period and rarely end a sentence (lowercase, without their last period).
ABBREVIATIONS = frozenset(
    {
        *("mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "e.g", "i.e", "cf", "approx", "dept"),
        *("est", "fig", "inc", "ltd", "corp", "co", "gen", "col", "lt", "sgt", "capt", "gov", "rev", "hon", "vol"),
        *("ca", "a.m", "p.m", "u.s", "u.k", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct"),
        *("nov", "dec"),
    }
)
_CLOSING = "\"'”’)]」』）】》〉"  # closing quotes and brackets, after a sentence's end
# A break: (1) a sentence's end (terminators, then closing quotes or brackets), a clause mark, or a line break (the
# empty group), then the whitespace after it, up to the next non-space character (the look-ahead); or (2) a fullwidth
# sentence end or clause mark, then any whitespace, up to the next character that is neither space nor one that
# would belong to the end (more terminators, closing quotes: "好！”" is not cut before its quote when it comes later).
_BREAK = re.compile(
    rf"""([.!?…]+[{re.escape(_CLOSING)}]*|[,;:]|(?=\n))\s+(?=\S)"""
    rf"""|([。！？；]+[…]*[{re.escape(_CLOSING)}]*|[，、：])\s*(?=[^\s。！？；…{re.escape(_CLOSING)}])"""
)
_SPACE = re.compile(r"\s+(?=\S)")
_LEAD = re.compile(r"\s*")
_TEXT = re.compile(r"\S")
_WORD_CHARS = "_.'’-"  # (with letters and digits: what a word before a period may hold, "e.g", "U.S", "o'clock")


class SentenceSplitter:
    """Feed it an answer's text deltas (`feed`) and take the complete pieces; `flush()` at the end gives the rest."""

    def __init__(
        self, min_sentence_chars: int = 20, first_clause_chars: int = 24, first_word_chars: int | None = None
    ) -> None:
        self.min_chars, self.first_clause_chars = min_sentence_chars, first_clause_chars
        self.first_word_chars = first_word_chars
        self.buffer = ""  # the text not cut yet
        self.first = True  # no piece cut yet
        # Where the search for breaks goes on in the buffer: the breaks before it were refused, and stay refused (a
        # break is found only with its look-ahead, and whether it ends the piece depends on the text up to that).
        self._scan = 0

    def feed(self, delta: str) -> list[str]:
        """The pieces `delta` completes (none if it completes none)."""
        self.buffer += delta
        pieces = []
        while (end := self._cut()) is not None:
            pieces.append(self.buffer[:end])
            self.buffer = self.buffer[end:]
            self.first, self._scan = False, 0
        return pieces

    @classmethod
    def of(cls, config: TtsConfig) -> SentenceSplitter:
        """As the config (`tts.*_chars`) says."""
        return cls(config.min_sentence_chars, config.first_clause_chars, config.first_word_chars)

    def flush(self) -> str:
        """The rest of the text (the answer ended): the last piece, perhaps short, perhaps only whitespace."""
        rest, self.buffer, self._scan = self.buffer, "", 0
        return rest

    def _cut(self) -> int | None:
        """Where the first piece of the buffer ends, if it is complete."""
        text = self.buffer
        lead = _LEAD.match(text).end()  # type: ignore[union-attr]  # (its first non-space character)
        word_cut = None  # the first piece's end at a word (`first_word_chars`), if the text reaches one
        if self.first and self.first_word_chars is not None:
            space = _SPACE.search(text, lead + self.first_word_chars)
            word_cut = space.end() if space is not None else None
        for match in _BREAK.finditer(text, self._scan):
            if word_cut is not None and match.end() > word_cut:
                return word_cut  # (the word comes first: the cut is where the whole text would put it)
            fullwidth = match.group(1) is None
            mark = match.group(2) if fullwidth else match.group(1)
            end = match.end(2 if fullwidth else 1)
            while end > lead and text[end - 1].isspace():  # (a line break's: the spaces before it)
                end -= 1
            size = end - lead  # the piece's length, whitespace aside
            if size > MAX_CHARS:
                break  # (the piece ends before it: below)
            if not mark or (not fullwidth and "\n" in match.group(0)):  # a line break
                ok = size >= self.min_chars
            elif mark[0] in ",;:，、：":
                ok = (self.first and size >= self.first_clause_chars) or size >= LONG_CHARS
            else:
                ok = size >= self.min_chars and (fullwidth or self._ends_sentence(text, match))
            if ok:
                return match.end()
            self._scan = match.end()
        if word_cut is not None:
            return word_cut
        if _TEXT.search(text, lead + MAX_CHARS) is None:
            return None  # (not past MAX_CHARS yet)
        return _space_cut(text, lead, MAX_CHARS)

    @staticmethod
    def _ends_sentence(text: str, match: re.Match[str]) -> bool:
        """Whether the terminator `match` found ends a sentence: not after an abbreviation or an initial, and a
        period or an ellipsis not followed by a lowercase word."""
        terminators = match.group(1).rstrip(_CLOSING)
        if terminators[-1] not in ".…":
            return True  # (! and ?)
        if text[match.end()].islower():
            return False
        if terminators == ".":
            start = i = match.start(1)
            while i > 0 and (text[i - 1].isalnum() or text[i - 1] in _WORD_CHARS):
                i -= 1
            word = text[i:start].lstrip(".")
            if word.lower() in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                return False
            while i > 0 and text[i - 1] in " \t":
                i -= 1
            if word.isdigit() and (i == 0 or text[i - 1] == "\n"):
                return False  # a list's number at the start of a line ("1. Open the door"): it goes with its item
        return True


def _space_cut(text: str, lead: int, limit: int) -> int:
    """Where a piece of `text` (its first non-space character at `lead`) too long ends so that it is `limit` long
    at most: after its last space past half of that, else at the limit itself."""
    cut = lead + limit
    for match in _SPACE.finditer(text, lead + max(limit // 2, 1)):
        if match.start() > lead + limit:
            break
        cut = match.end()
    return cut


def split_long(text: str, limit: int) -> list[str]:
    """`text` in parts of at most `limit` characters each, whitespace aside (`_space_cut`); the parts joined are
    `text`."""
    last = len(text)
    while last > 0 and text[last - 1].isspace():
        last -= 1
    parts, start = [], 0
    while last - (lead := _LEAD.match(text, start).end()) > limit:  # type: ignore[union-attr]
        cut = _space_cut(text, lead, limit)
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """A whole text's sentences as spans of `text`, cut as `SentenceSplitter` cuts a streamed answer but for its first
    piece's early cuts (the text came whole: a clause is cut only in a long sentence), and never inside a run of
    non-space characters (a long URL stays one piece: word timings count such runs as words, tts/words.py);
    together they are the text, but for whitespace alone at its end, which is no piece."""
    splitter = SentenceSplitter(first_clause_chars=LONG_CHARS)
    spans: list[tuple[int, int]] = []
    at = 0
    for piece in [*splitter.feed(text), splitter.flush()]:
        end = at + len(piece)
        if spans and spans[-1][1] == at and at and not text[at - 1].isspace() and not text[at].isspace():
            spans[-1] = (spans[-1][0], end)  # (cut inside a run: one piece with the one before)
        elif piece.strip():
            spans.append((at, end))
        at = end
    return spans


def ends_a_clause(piece: str) -> bool:
    """Whether `piece` ends at a mark or a line break, rather than at a space where a long clause was cut: a speaker
    pauses after it."""
    stripped = piece.rstrip(" \t")
    return bool(stripped) and (stripped[-1] == "\n" or not stripped[-1].isalnum())
