"""REST sessions' audio, held by a speech replica: the turn's audio so far and its transcript as it grows.

A REST session's chunks may reach any router replica, so its audio cannot live in one: the router sends each audio
chunk here, to the replica the session id hashes to (`SpeechRouter`, router/placement.py), which appends it to the
session's current turn (speech/utterance.py, the same growing-utterance transcription as the realtime socket's)
and answers the turn's latest transcript; the router hands that to the session's owner as a `transcript` chunk
(the owner replaces the turn's last transcript with it: only the changed suffix is prefilled again). The end
chunk waits for the final transcript of the whole turn.

Audio chunks are applied in the order of their sequence ids as they arrive, so a client sends them one after the
other, as a microphone makes them. A chunk answered before (a retry) gets the same answer again; one whose
sequence id is below the last taken and was never answered (sent out of order) is refused (409), never dropped.
A replica that stops loses the turns it held: the owner refuses the next chunk of such a turn (409), so it is
never transcribed from half the audio.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from core.pcm import from_pcm16
from core.protocol import error_body
from speech.utterance import MODEL_RATE, TranscriptionFailed, Utterance, resample_stream

IDLE_S = 600.0  # a turn with no chunk for this long is dropped (its session idles out long before)
REAP_EVERY_S = 60.0
ANSWERS_KEPT = 4096  # (session, sequence id) -> the answer given, for retries


@dataclass
class AudioTurn:
    utterance: Utterance
    last_seq: int
    resampler: Any = None
    failed_end: int | None = None  # its end chunk, whose final transcription failed (a retry tries again)
    touched: float = field(default_factory=time.monotonic)


class _Local:
    """This replica's own transcription, in the shape of the speech client (`transcribe`) for `Utterance`."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def transcribe(self, pcm: bytes, *, language: str | None, prompt: str) -> Any:
        return self.server.transcribe(pcm, language=language, prompt=prompt)


class AudioSessions:
    """The audio turns of the REST sessions this replica holds."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.config = server.config.speech
        self.turns: dict[str, AudioTurn] = {}
        self.answers: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()
        self._reaper = asyncio.create_task(self._reap())

    def _answered(self, session_id: str, seq: int, answer: dict[str, Any]) -> dict[str, Any]:
        self.answers[(session_id, seq)] = {**answer, "duplicate": True}
        while len(self.answers) > ANSWERS_KEPT:
            self.answers.popitem(last=False)
        return answer

    async def append(
        self, session_id: str, seq: int, pcm16: bytes, rate: int, end_of_input: bool, language: str | None
    ) -> dict[str, Any]:
        """One chunk (mono 16-bit PCM at `rate`) into the session's turn: `{"text": <the turn's transcript so far>,
        "final", "start": whether it began the turn}`; with `end_of_input` the whole turn's final transcript."""
        if (done := self.answers.get((session_id, seq))) is not None:
            return done  # a retry: the same answer (the owner acknowledges the sequence id as a duplicate)
        turn = self.turns.get(session_id)
        if turn is not None and seq == turn.failed_end:  # its audio is in: the final transcription, again
            return await self._end(session_id, seq, turn, start=False)
        if turn is not None and seq <= turn.last_seq:
            message = f"audio chunk {seq} came after chunk {turn.last_seq}: send a session's audio chunks in order"
            return error_body(409, message, "sequence_id")
        start = turn is None
        if turn is None:
            turn = self.turns[session_id] = AudioTurn(self._utterance(language), seq)
        x = from_pcm16(pcm16)
        if rate != MODEL_RATE:
            if turn.resampler is None:
                turn.resampler = resample_stream(rate)
            x = turn.resampler.resample_chunk(x, last=end_of_input)
        limit = self.config.max_turn_audio_s
        if turn.utterance.seconds + len(x) / MODEL_RATE > limit:
            message = f"the turn's audio would exceed {limit:g} s (speech.max_turn_audio_s); end the turn first"
            return error_body(413, message, "payload")
        turn.last_seq, turn.touched = seq, time.monotonic()
        turn.utterance.extend(x)
        if not end_of_input:
            seconds = turn.utterance.seconds
            answer = {"text": turn.utterance.text, "final": False, "start": start, "seconds": seconds}
            return self._answered(session_id, seq, answer)
        return await self._end(session_id, seq, turn, start)

    async def _end(self, session_id: str, seq: int, turn: AudioTurn, start: bool) -> dict[str, Any]:
        try:  # (the turn stays until its final transcript is made: a retry of a failed end chunk can try again)
            text = await turn.utterance.final(turn.utterance.length)
        except TranscriptionFailed as e:
            turn.failed_end = seq
            return error_body(502, f"the turn's audio could not be transcribed: {e.message}", "payload")
        self.turns.pop(session_id, None)
        turn.utterance.close()
        answer = {"text": text, "final": True, "start": start, "seconds": turn.utterance.seconds}
        return self._answered(session_id, seq, {**answer, "usage": turn.utterance.usage})

    def _utterance(self, language: str | None) -> Utterance:
        return Utterance(
            _Local(self.server),
            self._ignore,  # (the turn's latest transcript is the utterance's own `text`)
            language=language or self.config.language,
            every_ms=self.config.partial_every_ms,
            window_s=self.server.engine.max_clip_s,
            surface="session",
        )

    @staticmethod
    async def _ignore(text: str, delay: float) -> None:
        return None

    def close(self, session_id: str) -> None:
        """The session ended: its turn, if one is open, goes (its answers age out)."""
        if (turn := self.turns.pop(session_id, None)) is not None:
            turn.utterance.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = time.monotonic()
            for sid in [sid for sid, t in self.turns.items() if now - t.touched > IDLE_S]:
                self.close(sid)
