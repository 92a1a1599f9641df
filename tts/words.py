"""The words of a text to be spoken, and when each starts in its audio (`Word`: a span of the text and a time).

A word is a run of non-space characters without the punctuation and symbols around it (`"Mr."` is `Mr`,
`"$1,200"` is `1,200`, `"s'il"` stays whole); a run of punctuation or symbols alone (`—`, an emoji) is no word.
Spans are Python str offsets (code points), as the client's `Word` says. A backend that knows where each word
starts (espeak-ng's word events, Piper's phoneme alignments) gives those times; one that does not spreads the words
over the audio in proportion to where they stand in the text (`proportional`). `WordQueue` hands each word out
with the piece of audio it starts in.
"""

from __future__ import annotations

import bisect
import re
import unicodedata

from tts.client import Word

_TOKEN = re.compile(r"\S+")


def _is_mark(ch: str) -> bool:
    """Punctuation or a symbol (`.,!?"()$€—`, emoji): what is trimmed off a word's ends."""
    return unicodedata.category(ch)[0] in "PS"


def _words(text: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each word's span and the span of the token (run of non-space characters) it was cut from, in order."""
    found = []
    for token in _TOKEN.finditer(text):
        start, end = token.span()
        while start < end and _is_mark(text[start]):
            start += 1
        while end > start and _is_mark(text[end - 1]):
            end -= 1
        if start < end:
            found.append(((start, end), token.span()))
    return found


def word_spans(text: str) -> list[tuple[int, int]]:
    """Each word's `[start, end)` in `text`, in order."""
    return [word for word, _ in _words(text)]


class WordLocator:
    """Which word of `text` a character position falls in: the word whose token (its run of non-space characters,
    punctuation included) holds it. A backend's position inside `"$1,200"` is the word `1,200`."""

    def __init__(self, text: str) -> None:
        found = _words(text)
        self.spans = [word for word, _ in found]
        self._token_starts = [token[0] for _, token in found]
        self._token_ends = [token[1] for _, token in found]

    def word_at(self, position: int) -> int | None:
        """The index of the word at character `position` (0-based), or None (a space, a mark standing alone)."""
        i = bisect.bisect_right(self._token_starts, position) - 1
        if i >= 0 and position < self._token_ends[i]:
            return i
        return None


def proportional(spans: list[tuple[int, int]], start_ms: float, end_ms: float) -> list[float]:
    """Start times for `spans` spread over `[start_ms, end_ms)` in proportion to where each starts among them (the
    first at `start_ms`): for audio whose backend says nothing of its words."""
    if not spans:
        return []
    first, last = spans[0][0], spans[-1][1]
    width = max(last - first, 1)
    return [start_ms + (start - first) / width * (end_ms - start_ms) for start, _ in spans]


class WordQueue:
    """Words whose times are known, waiting for the piece of audio they start in: `due(ms)` hands out those that
    start before `ms` of audio has been sent (a word is never sent before its audio), `rest()` the others once the
    audio is all out. Times never go back: a word given an earlier time than the one before it gets that one's."""

    def __init__(self) -> None:
        self._words: list[Word] = []
        self._last_ms = 0.0

    def add(self, start: int, end: int, audio_ms: float) -> None:
        self._last_ms = max(self._last_ms, audio_ms)
        self._words.append(Word(start=start, end=end, audio_ms=round(self._last_ms, 1)))

    def due(self, until_ms: float) -> list[Word]:
        n = 0
        while n < len(self._words) and self._words[n]["audio_ms"] < until_ms:
            n += 1
        out, self._words = self._words[:n], self._words[n:]
        return out

    def rest(self) -> list[Word]:
        out, self._words = self._words, []
        return out
