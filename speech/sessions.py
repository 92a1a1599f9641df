"""REST sessions' audio, held by a speech replica: the turn's audio so far and its transcript as it grows.

A REST session's chunks may reach any router replica, so its audio cannot live in one: the router sends each audio
chunk here, to the replica the session id hashes to (`SpeechRouter`, router/placement.py), which appends it to the
session's current turn (speech/utterance.py, the same growing-utterance transcription as the realtime socket's)
and answers the turn's latest transcript; the router hands that to the session's owner as a `transcript` chunk
(the owner replaces the turn's last transcript with it: only the changed suffix is prefilled again). The end
chunk waits for the final transcript of the whole turn. Audio chunks of a session are applied in the order of
their sequence ids as they arrive: a client sends them one after the other, as a microphone makes them.

A replica that stops loses the turns it held: the next chunk of such a turn is refused (409, `audio_turn_lost`),
never transcribed from half the audio.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve_app.protocol import error_body
from speech.utterance import MODEL_RATE, TranscriptionFailed, Utterance

IDLE_S = 600.0  # a session's audio state with no chunk for this long is dropped (the session idles out first)


@dataclass
class AudioTurn:
    utterance: Utterance
    rate: int
    last_seq: int
    resampler: Any = None
    text: str = ""
    touched: float = field(default_factory=time.monotonic)


class _Local:
    """This replica's own transcription, in the shape of a handle (`transcribe.remote(...)`) for `Utterance`."""

    def __init__(self, server: Any) -> None:
        self.transcribe = self
        self.server = server

    def remote(self, pcm: bytes, **kwargs: Any) -> Any:
        return self.server.transcribe(pcm, **kwargs)


class AudioSessions:
    """Mixin of `SpeechServer`: `session_audio`, per session id."""

    config: Any
    engine: Any

    def _audio_turns(self) -> dict[str, AudioTurn]:
        if not hasattr(self, "_turns"):
            self._turns: dict[str, AudioTurn] = {}
        return self._turns

    async def session_audio(
        self,
        *,
        session_id: str,
        sequence_id: int,
        pcm16: bytes,
        rate: int,
        end_of_input: bool = False,
        language: str | None = None,
    ) -> dict[str, Any]:
        """Append one chunk (mono 16-bit PCM at `rate`) to the session's turn: `{"text": <the turn's transcript
        so far>, "final": end_of_input}`; at the end of input the whole turn's final transcript."""
        turns = self._audio_turns()
        self._reap(turns)
        turn = turns.get(session_id)
        if turn is not None and sequence_id <= turn.last_seq:  # a retry of a chunk taken: the same answer
            return {"text": turn.text, "final": False, "duplicate": True}
        if turn is None and getattr(self, "_ended", {}).get(session_id, -1) >= sequence_id:
            return {"text": "", "final": True, "duplicate": True}
        x = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
        start = turn is None
        if turn is None:
            speech = self.config.speech
            utterance = Utterance(
                _Local(self),
                self._on_text(session_id),
                language=language or speech.language,
                every_ms=speech.partial_every_ms,
                window_s=self.engine.max_clip_s,
                surface="session",
            )
            turn = turns[session_id] = AudioTurn(utterance, rate, sequence_id)
        if rate != MODEL_RATE:
            if turn.resampler is None:
                import soxr

                turn.resampler = soxr.ResampleStream(rate, MODEL_RATE, 1, dtype="float32")
            x = turn.resampler.resample_chunk(x, last=end_of_input)
        limit = self.config.speech.max_turn_audio_s
        if turn.utterance.seconds + len(x) / MODEL_RATE > limit:
            message = f"the turn's audio would exceed {limit:g} s (speech.max_turn_audio_s); end the turn first"
            return error_body(413, message, "payload")
        turn.last_seq, turn.touched = sequence_id, time.monotonic()
        turn.utterance.extend(x)
        if not end_of_input:
            return {"text": turn.text, "final": False, "start": start, "seconds": turn.utterance.seconds}
        turns.pop(session_id, None)
        self._ended = {**getattr(self, "_ended", {}), session_id: sequence_id}
        try:
            text = await turn.utterance.final(turn.utterance.length)
        except TranscriptionFailed as e:
            return error_body(502, f"the turn's audio could not be transcribed: {e.message}", "payload")
        finally:
            turn.utterance.close()
        seconds = turn.utterance.seconds
        return {"text": text, "final": True, "start": start, "seconds": seconds, "usage": turn.utterance.usage}

    def _on_text(self, session_id: str) -> Any:
        async def on_text(text: str, delay: float) -> None:
            turn = self._audio_turns().get(session_id)
            if turn is not None:
                turn.text = text

        return on_text

    def _reap(self, turns: dict[str, AudioTurn]) -> None:
        now = time.monotonic()
        for sid in [sid for sid, t in turns.items() if now - t.touched > IDLE_S]:
            turns.pop(sid).utterance.close()

    async def session_audio_close(self, *, session_id: str) -> None:
        turn = self._audio_turns().pop(session_id, None)
        if turn is not None:
            turn.utterance.close()
        await asyncio.sleep(0)
