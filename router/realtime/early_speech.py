"""A preemptive answer's first sentence, synthesized before its turn is confirmed (router/realtime/response.py
`EarlyRead` holds one when the router has a TTS role).

While the user may still be speaking, the next turn's preemptive answer is held on this router
(router/sessions/provisional.py `Held`), its frames queued unread. `watch` sees their text as it arrives: once the
first sentence is complete (cut as the response will cut it, router/voice/sentences.py), it goes to the TTS role at
once, with the session's voice and speed, if the session speaks. Nothing is sent: if that answer becomes the
response's (released, or confirmed by the owner), the response's first sentence takes the synthesis when its text,
voice and speed are the same (router/realtime/audio_out.py `AudioOut`), so its first audio needs no call to the TTS
role; if the held answer is discarded (the user went on) or another one replaces it, the synthesis is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable

from core.config import TtsConfig
from router.realtime.audio_out import Key, Speaking, Synthesis
from router.realtime.audio_settings import OutputAudio
from router.voice.sentences import SentenceSplitter


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

    def _splitter(self) -> SentenceSplitter:
        return SentenceSplitter(self.config.min_sentence_chars, self.config.first_clause_chars)

    def watch(self, attempt: str, text: str | None) -> None:
        """The held answer `attempt`'s text as it arrives (router/sessions/provisional.py `Held`); None: it is
        discarded."""
        if text is None:
            if attempt == self.attempt:
                self.close()
            return
        if attempt != self.attempt:  # another preemptive answer: the old one's synthesis is of no use
            self.close()
            self.attempt = attempt
        if self.cut:
            return
        if pieces := self.splitter.feed(text):
            self.cut = True
            if (speech := self.speech()) is not None and (spoken := pieces[0].strip()):
                self.synthesis = Synthesis(self.tts, spoken, speech.voice, speech.speed)

    def take(self, key: Key) -> Synthesis | None:
        """The synthesis, for a response whose first sentence is `key`; anything else closes it."""
        synthesis, self.synthesis = self.synthesis, None
        if synthesis is not None and synthesis.key != key:
            synthesis.close()
            return None
        return synthesis

    def close(self) -> None:
        """Discarded (or not needed): the synthesis is cancelled, and it starts over with the next answer held."""
        if self.synthesis is not None:
            self.synthesis.close()
            self.synthesis = None
        self.attempt, self.cut, self.splitter = None, False, self._splitter()
