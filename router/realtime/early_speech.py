"""A preemptive answer's first sentence, synthesized before its turn is confirmed (router/realtime/response.py
`EarlyRead` holds one when the router has a TTS role).

While the user may still be speaking, the next turn's preemptive answer is held on this router
(router/sessions/provisional.py `Held`), its frames queued unread. `watch` sees their text as it arrives: once the
first sentence is complete (cut as the response will cut it, core/sentences.py), it goes to the TTS role at
once, with the session's voice and speed, if the session speaks. Nothing is sent: if that answer becomes the
response's (released, or confirmed by the owner), the response's first sentence takes the synthesis when its text,
voice and speed are the same (router/realtime/audio_out.py `AudioOut`), so its first audio needs no call to the TTS
role; if the held answer is discarded (the user went on) or another one replaces it, the synthesis is cancelled and
the next one held starts over (`discard`). Once the response has taken it, or needs it not (a text response, the
early read closed), it is retired: the synthesis closed, and the rest of the answer's text, which the hold may still
show while the owner confirms it, ignored (`retire`).
"""

from __future__ import annotations

from collections.abc import Callable

from core.config import TtsConfig
from core.sentences import SentenceSplitter, split_long
from router.realtime.audio_out import Speaking
from router.realtime.audio_settings import OutputAudio
from router.realtime.synthesis import Key, Synthesis


class EarlySpeech:
    """The first sentence of the preemptive answer held now, synthesized as soon as it is complete."""

    def __init__(self, connection: Speaking, speech: Callable[[], OutputAudio | None]) -> None:
        self.tts = connection.ingress.tts
        self.config: TtsConfig = getattr(connection.ingress.config, "tts", None) or TtsConfig()
        self.speech = speech  # how the session speaks now (None: text)
        self.attempt: str | None = None  # the held answer it follows (its decode stream's id)
        self.splitter = self._splitter()
        self.cut = False  # its first sentence was complete (synthesized, or the session did not speak)
        self.synthesis: Synthesis | None = None
        self.retired = False  # taken, or not needed: nothing more to synthesize

    def _splitter(self) -> SentenceSplitter:
        return SentenceSplitter.of(self.config)

    def watch(self, attempt: str, text: str | None) -> None:
        """The held answer `attempt`'s text as it arrives (router/sessions/provisional.py `Held`); None: it is
        discarded."""
        if self.retired:
            return
        if text is None:
            if attempt == self.attempt:
                self.discard()
            return
        if attempt != self.attempt:  # another preemptive answer: the old one's synthesis is of no use
            self.discard()
            self.attempt = attempt
        if self.cut:
            return
        if pieces := self.splitter.feed(text):
            self.cut = True
            first = split_long(pieces[0], self.config.max_input_chars)[0]  # (as the response speaks it)
            if (speech := self.speech()) is not None and (spoken := first.strip()):
                self.synthesis = Synthesis(self.tts, spoken, speech.voice, speech.speed)

    def take(self, key: Key) -> Synthesis | None:
        """The synthesis, for a response whose first sentence is `key` (anything else closes it); retired either
        way: the response synthesizes the rest itself."""
        synthesis, self.synthesis = self.synthesis, None
        self.retire()
        if synthesis is not None and synthesis.key != key:
            synthesis.close()
            return None
        return synthesis

    def discard(self) -> None:
        """The held answer was discarded (or replaced): its synthesis is cancelled, and the next one starts over."""
        self._close()
        self.attempt, self.cut, self.splitter = None, False, self._splitter()

    def retire(self) -> None:
        """Not needed any more (taken, a text response, the early read closed): the synthesis is cancelled, and no
        more text is watched."""
        self._close()
        self.retired = True

    def _close(self) -> None:
        if self.synthesis is not None:
            self.synthesis.close()
            self.synthesis = None
