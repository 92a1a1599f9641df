"""A response's spoken message (router/realtime/output.py holds one per message of an audio response): its text, as
decode streams it, cut into sentences (core/sentences.py), each spoken by the TTS role (tts/client.py) the
moment it is complete, and sent as Realtime audio events in the session's format (router/voice/encode.py `Encoder`).

The pipeline: a sender goes through the sentences in order; for each, its transcript delta (its exact text, when its
first audio is ready), then its audio deltas (100-200 ms each) as the TTS role streams them. Each sentence is
synthesized in a task of its own (router/realtime/synthesis.py `Synthesis`), started as soon as the sentence is
complete and at most `LOOKAHEAD` sentences ahead of the one being sent: the next sentence's audio is ready when the
current one's ends, and a barge-in wastes little synthesis. A sentence longer than the TTS role takes at once
(`tts.max_input_chars`) is spoken in parts. A preemptive answer's first sentence may come synthesized already
(router/realtime/early_speech.py): it is taken if its text, voice and speed are this sentence's.

Interrupted (barge-in, `response.cancel`): every synthesis is cancelled (its TTS stream closed) and the sending stops
at once; the transcript is what the user heard: the sentences whose audio all went out, then the words of the one
being spoken whose audio had started (the TTS role's word timings). `heard_chars(ms)` applies the same rule to a
truncate's `audio_end_ms` on the message's audio timeline (its sentences' audio back to back).

A TTS failure (an error chunk, an exception: its replica died, or nothing for `CHUNK_TIMEOUT_S`) ends this message's
audio with one `error` event (server_error, naming the TTS role), after the audio made before it; a failure of the
audio output itself (a bug) likewise. No retry: the sentence's start may be out already, and a replica that died
takes a while to be replaced. The transcript deltas go on, and the response completes with its whole text. A send
that fails (the client's socket) ends the audio silently: the response's own next send fails too.

Nothing outlives the message: `finish()` and `interrupt()` end the sender and close every synthesis not read to its
end, whatever the sender died of; `abort()` (the response's task cancelled, or failed) stops everything at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from core import metrics
from core.config import TtsConfig
from core.sentences import SentenceSplitter, split_long
from router.realtime.audio_settings import OutputAudio
from router.realtime.synthesis import Key, Synthesis
from router.voice.encode import Encoder
from tts.client import RATE, Word

logger = logging.getLogger(__name__)

LOOKAHEAD = 2  # sentences synthesized ahead of the one being sent
DELTA_MIN_BYTES, DELTA_MAX_BYTES = RATE // 10 * 2, RATE // 5 * 2  # 100-200 ms of the TTS role's PCM16 a delta
STOP_WAIT_S = 5.0  # how long an interruption waits for the send in flight
AUDIO_OUTPUT_FAILED = "audio_output_failed"  # the error's code when the audio output itself failed (a bug)


class Ready(Protocol):
    """A first sentence synthesized before the response (router/realtime/early_speech.py `EarlySpeech`)."""

    def take(self, key: Key) -> Synthesis | None: ...  # its synthesis if it speaks `key` (else it is closed)

    def retire(self) -> None: ...  # not needed (any more): closed, and the rest of its answer ignored


class Speaking(Protocol):
    """What the spoken message needs of its connection (router/realtime/socket.py)."""

    ingress: Any  # its `tts` (tts/client.py `TtsClient`) and `config.tts`
    beta: bool

    async def send(self, type_: str, **fields: Any) -> None: ...


class SendFailed(Exception):
    """A send to the client failed (its socket closed): nothing more can go out."""


@dataclass
class Piece:
    """A sentence of the message: its text as the answer has it (its transcript delta) and what became of it."""

    text: str
    start: int  # where it starts in the message's text
    synthesis: Synthesis | None = None
    words: list[Word] = field(default_factory=list)  # (offsets in `spoken`, ms from its own audio's start)
    reached: bool = False  # the sender got to it: its audio starts at `offset_ms` on the message's timeline
    told: bool = False  # its transcript delta went out
    offset_ms: float = 0.0
    sent_ms: float = 0.0
    done: bool = False  # its audio all sent (or it had none)

    @property
    def spoken(self) -> str:
        return self.text.strip()

    def heard(self, ms: float) -> int:
        """How much of its text `ms` of its audio says: all of it once its audio is all out, else up to the end
        of the last word whose audio had started."""
        if self.done and ms >= self.sent_ms:
            return len(self.text)
        ends = [w["end"] for w in self.words if w["audio_ms"] < ms]
        return len(self.text) - len(self.text.lstrip()) + max(ends) if ends else 0


def _last(encoder: Encoder, pending: bytes) -> bytes:
    """A sentence's last audio: what is pending (whole samples), then what the encoder's resampler holds."""
    return encoder(pending[: len(pending) // 2 * 2]) + encoder.flush()


class AudioOut:
    """One message's spoken output: `add` its text as it arrives, then `finish()` (or `interrupt()`)."""

    def __init__(
        self,
        connection: Speaking,
        where: dict[str, Any],
        speech: OutputAudio,
        on_audio: Callable[[float], None],
        ready: Ready | None = None,
        base: int = 0,
        stopped: bool = False,
    ) -> None:
        self.connection, self.where, self.speech, self.on_audio = connection, where, speech, on_audio
        self.item_id: str = where["item_id"]
        self.base = base  # where the message's text starts in the answer's text
        self.tts = connection.ingress.tts
        config = getattr(connection.ingress.config, "tts", None) or TtsConfig()
        self.splitter = SentenceSplitter.of(config)
        self.max_chars = config.max_input_chars  # (what the TTS role speaks at once)
        self._text: list[str] = []  # the message's text so far, as it came (joined when needed)
        self.pieces: list[Piece] = []
        self.current = 0  # the piece being sent
        self.audio_ms = 0.0  # sent
        self.stopped = stopped  # interrupted: nothing more goes out
        self.failed = stopped  # the audio ended (a TTS failure): the transcript goes on
        self.cut: int | None = None  # interrupted: how much of the text was heard
        self.closing = False
        self._ready = ready
        self._arrived = asyncio.Event()
        kind = "response.audio" if connection.beta else "response.output_audio"
        self._audio_event, self._transcript_event = f"{kind}.delta", f"{kind}_transcript.delta"
        self._sender = asyncio.create_task(self._send_all())

    @property
    def text(self) -> str:
        """The message's text so far."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @property
    def transcript(self) -> str:
        return self.text if self.cut is None else self.text[: self.cut]

    def add(self, delta: str) -> None:
        """More of the message's text: the sentences it completes go to be spoken at once."""
        if self.stopped:
            return  # (interrupted: the rest was never heard)
        self._text.append(delta)
        self._queue(self.splitter.feed(delta))

    async def finish(self) -> str:
        """The message's text is whole: its last piece, then every sentence's audio sent; its transcript."""
        if not self.stopped and (rest := self.splitter.flush()):
            self._queue([rest])
        self.closing = True
        self._arrived.set()
        await asyncio.wait({self._sender})
        self._ended()
        self._settle()
        return self.transcript

    async def interrupt(self) -> None:
        """Stop now (barge-in, cancel): the syntheses are cancelled, nothing more is sent after the send in flight,
        and the transcript is what was heard. Never raises for what the sender met (the client's socket failed)."""
        if self.stopped:
            return
        self.stopped = True
        self._close_all()
        self._arrived.set()
        done, _ = await asyncio.wait({self._sender}, timeout=STOP_WAIT_S)
        if not done:
            self._sender.cancel()
        self._ended()
        self._settle()

    def _ended(self) -> None:
        """The sender has stopped (or is cancelled): what it died of logged, and nothing of the message left."""
        if self._sender.done() and not self._sender.cancelled() and (error := self._sender.exception()) is not None:
            logger.warning("realtime audio output failed: %r", error)
        self._close_all()

    def _settle(self) -> None:
        """Interrupted: what was heard, once the sender has stopped (its last send counted)."""
        if self.stopped and self.cut is None:
            self.cut = self.heard_chars(self.audio_ms) or 0

    def abort(self) -> None:
        """The response itself was cancelled (the connection closes) or failed: every task stops."""
        self.stopped = True
        self._close_all()
        self._sender.cancel()

    def heard_chars(self, ms: float) -> int | None:
        """How much of the message's text the user heard by `ms` on its audio timeline (None: past the audio)."""
        if ms > math.ceil(self.audio_ms):
            return None
        chars = 0
        for piece in self.pieces:
            if not piece.reached:
                break
            if not (piece.done and ms - piece.offset_ms >= piece.sent_ms):
                return piece.start + piece.heard(ms - piece.offset_ms)
            chars = piece.start + len(piece.text)
        return chars

    # --- the pipeline ------------------------------------------------------------------------------
    def _queue(self, texts: list[str]) -> None:
        for text in texts:
            for part in split_long(text, self.max_chars) if len(text) > self.max_chars else [text]:
                start = self.pieces[-1].start + len(self.pieces[-1].text) if self.pieces else 0
                self.pieces.append(Piece(part, start))
        if texts:
            self._start_ahead()
            self._arrived.set()

    def _start_ahead(self) -> None:
        """Synthesis starts for the sentence being sent and the `LOOKAHEAD` after it."""
        if self.failed or self.stopped:
            return
        for piece in self.pieces[self.current : self.current + 1 + LOOKAHEAD]:
            if piece.synthesis is None and piece.spoken:
                key = (piece.spoken, self.speech.voice, self.speech.speed)
                ready, self._ready = self._ready, None  # (the first sentence only)
                piece.synthesis = (ready.take(key) if ready is not None else None) or Synthesis(self.tts, *key)

    async def _send_all(self) -> None:
        try:
            while not self.stopped:
                if self.current == len(self.pieces):
                    if self.closing:
                        return
                    self._arrived.clear()
                    await self._arrived.wait()
                    continue
                piece = self.pieces[self.current]
                try:
                    self._start_ahead()
                    await self._speak(piece)
                except SendFailed:
                    raise
                except Exception as e:  # (a bug of this router's: the audio ends, its transcript goes on)
                    logger.exception("realtime audio output failed")
                    await self._fail(f"the audio output failed ({type(e).__name__})", AUDIO_OUTPUT_FAILED)
                    if not piece.told and not self.stopped:
                        await self._transcript(piece)
                    piece.done = True
                if self.stopped:
                    return
                self.current += 1
        except SendFailed as e:  # the client's socket: nothing more goes out (the response's next send fails too)
            logger.info("realtime audio output stopped: the client's socket failed (%r)", e.__cause__)
            self.failed = True
            self._close_all()

    async def _speak(self, piece: Piece) -> None:
        """One sentence: its transcript delta once its first audio is ready, then its audio as it comes (each
        chunk cut into deltas where it lies: a sentence may come as one item of 100s of KB; cut at whole samples, a
        chunk's odd byte waiting for the next one's)."""
        piece.reached, piece.offset_ms = True, self.audio_ms
        encoder, pending = Encoder(self.speech.format, RATE), b""
        while piece.synthesis is not None and not self.failed:
            chunk = await piece.synthesis.next()
            if self.stopped:
                return
            if chunk is None:
                break
            if "error" in chunk:
                await self._audio(piece, _last(encoder, pending))  # (what was made before it)
                error = chunk["error"]
                detail = str(error.get("message") or "no audio")
                code = str(error.get("code") or "tts_failed")
                await self._fail(f"the TTS role could not speak the answer ({detail})", code)
                break
            if not piece.told:
                await self._transcript(piece)
            piece.words.extend(chunk.get("words") or [])
            audio = chunk.get("audio") or b""
            data = memoryview(pending + audio if pending else audio)
            at = 0
            while len(data) - at >= DELTA_MIN_BYTES:
                size = min(len(data) - at, DELTA_MAX_BYTES) // 2 * 2
                await self._audio(piece, encoder(data[at : at + size]))
                at += size
                if self.stopped:
                    return
            pending = bytes(data[at:])
        if piece.synthesis is not None and not self.failed:
            await self._audio(piece, _last(encoder, pending))
        if not piece.told and not self.stopped:
            await self._transcript(piece)
        piece.done = True

    async def _send(self, type_: str, **fields: Any) -> None:
        try:
            await self.connection.send(type_, **fields)
        except Exception as e:
            raise SendFailed from e

    async def _transcript(self, piece: Piece) -> None:
        piece.told = True
        await self._send(self._transcript_event, **self.where, content_index=0, delta=piece.text)

    async def _audio(self, piece: Piece, data: bytes) -> None:
        if not data or self.stopped:
            return
        delta = base64.b64encode(data).decode()
        await self._send(self._audio_event, **self.where, content_index=0, delta=delta)
        ms = self.speech.format.seconds(len(data)) * 1000
        piece.sent_ms += ms
        self.audio_ms += ms
        self.on_audio(ms / 1000)

    async def _fail(self, detail: str, code: str) -> None:
        """The audio ends here (the transcript goes on): one `error` event says why (`tts_failed`, or
        `audio_output_failed` for this router's own failure); the TTS role's failures counted by their code."""
        self.failed = True
        self._close_all()
        logger.warning("realtime audio output stopped: %s", detail)
        ours = code == AUDIO_OUTPUT_FAILED
        if not ours:
            metrics.inc(metrics.TTS_ERRORS, 1, metrics.TTS_FAILED, code=code, surface="realtime")
        message = f"{detail}: its audio stops here, its transcript goes on"
        error = {"type": "server_error", "code": code if ours else "tts_failed", "message": message, "param": None}
        await self._send("error", error={**error, "event_id": None})

    def _close_all(self) -> None:
        for piece in self.pieces:
            if piece.synthesis is not None and not piece.done:
                piece.synthesis.close()
        self._drop_ready()

    def _drop_ready(self) -> None:
        if self._ready is not None:
            self._ready.retire()
            self._ready = None
