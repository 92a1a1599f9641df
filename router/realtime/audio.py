"""A realtime connection's audio input: `input_audio_buffer.*`, server VAD, transcription into the session's input.

Audio is resampled to 16 kHz as it arrives (router/voice/audio.py) and, with `turn_detection`, goes through the
connection's VAD (router/voice/vad.py). From speech start the turn's audio is an `Utterance`
(speech/utterance.py), transcribed again as it grows; its transcripts revise the session's input text
(router/realtime/spoken_turn.py), so the LLM has prefilled the turn when it ends. At a pause in the speech the audio
is transcribed at once; a session with preemptive answers starts its answer then, and when the VAD's silence
window confirms the end of the turn (`speech_stopped`, `committed`), the answer is already made.

Events, as OpenAI's: `input_audio_buffer.speech_started` / `speech_stopped` / `committed` / `cleared` /
`timeout_triggered`, `conversation.item.created` (an `input_audio` content part with its transcript),
`conversation.item.input_audio_transcription.delta` (text two successive transcripts agree on, so deltas are not
taken back) / `.completed` (the final transcript, with usage) / `.failed`. Speech that starts while a response
streams cancels it (`interrupt_response`). A transcription-only session (GA `session.type: "transcription"`, or
vLLM's client flow: `session.update` with a top-level `model`, `commit` then `commit` with `final: true`, answered
with vLLM's `transcription.delta` / `transcription.done`) transcribes and answers nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from core import metrics
from router.realtime.audio_settings import OPENAI_TRANSCRIBE_MODELS, TurnDetection, VoiceSettings
from router.realtime.events import (
    AudioAppend,
    AudioClear,
    AudioCommit,
    InvalidEvent,
    ItemTruncate,
    ResponseCreate,
    Sampling,
    new_id,
)
from router.realtime.spoken_turn import SpokenTurn
from router.sessions.owner import session_truncate, session_update
from router.voice.audio import MODEL_RATE, AudioError, AudioFormat, Resampler, b64decode, parse_format
from router.voice.vad import PAUSE_MS, SpeechDetector, VadEvent
from speech.client import Utterance

if TYPE_CHECKING:
    from router.realtime.connection import VoiceConnection

logger = logging.getLogger(__name__)


class AudioInput:
    """The audio side of one realtime connection (router/realtime/connection.py: what it needs of it); the turn
    being spoken is its `spoken` (router/realtime/spoken_turn.py)."""

    def __init__(self, connection: VoiceConnection) -> None:
        self.conn = connection
        self.settings = VoiceSettings()
        self.vllm_flow = False  # vLLM's realtime client: `transcription.delta` / `transcription.done`
        self._resampler: Resampler | None = None  # what is transcribed (LQ: holds back several ms)
        # What the VAD hears (QQ: a sample held back, the end of speech at once). Its samples are the clock's, only
        # sooner: it starts with the detector (a detection change resets both) or at the clock after a commit.
        self._heard: Resampler | None = None
        self._detector: SpeechDetector | None = None
        self.history: deque[np.ndarray] = deque()  # recent audio while nobody speaks (the prefix padding)
        self.history_start = 0  # its first sample's position on the clock
        self.clock = 0  # 16 kHz samples received
        self.spoken = SpokenTurn(connection, self)  # the turn's utterance and its transcript in the session's input
        self.turn_start = 0  # where on the clock the turn's audio starts
        self.session_seconds = 0.0
        self.idle_samples = 0  # audio with no speech since the last turn or response (idle_timeout_ms)
        self.defaulted = False  # the voice defaults (`speech.preemptive`) were looked at

    # --- settings ----------------------------------------------------------------------------------
    @property
    def speech(self) -> Any:
        return getattr(self.conn.ingress, "speech", None)

    @property
    def speech_model(self) -> str | None:
        return self.conn.ingress.config.speech.model_name

    @property
    def transcription_only(self) -> bool:
        return self.settings.transcription_only or self.vllm_flow

    def configure(self, session: Sampling, where: str = "session") -> VoiceSettings | None:
        """The settings `session.update` asks for, checked whole (`InvalidEvent`); None if it sets none."""
        given = session.model_fields_set & Sampling.AUDIO
        if not given:
            return None
        new = VoiceSettings()
        new.__dict__.update(self.settings.__dict__)
        audio_input = session.audio.input if session.audio is not None else None
        ga = audio_input.model_fields_set if audio_input is not None else set()
        try:
            if "format" in ga and audio_input is not None:
                new.format = parse_format(audio_input.format, f"{where}.audio.input.format")
            if "input_audio_format" in given:
                new.format = parse_format(session.input_audio_format, f"{where}.input_audio_format")
        except AudioError as e:
            raise InvalidEvent(e.message, e.code, e.param) from None
        if "turn_detection" in ga and audio_input is not None:
            new.turn_detection = audio_input.turn_detection
        if "turn_detection" in given:
            new.turn_detection = session.turn_detection
        transcription = audio_input.transcription if audio_input is not None else None
        if "input_audio_transcription" in given:
            transcription = session.input_audio_transcription
        if transcription is not None:
            param = (
                f"{where}.audio.input.transcription.model"
                if "transcription" in ga
                else f"{where}.input_audio_transcription.model"
            )
            self.check_model(transcription.model, param)
            new.transcription = transcription
        if session.type is not None:
            new.transcription_only = session.type == "transcription"
        if self.spoken.turn is not None and new.format != self.settings.format:
            raise InvalidEvent(
                "the input audio format cannot change while a turn's audio is buffered",
                param=f"{where}.audio.input.format",
            )
        return new

    def check_model(self, model: str | None, param: str) -> None:
        if model is None or model == self.speech_model or model in OPENAI_TRANSCRIBE_MODELS:
            return
        raise InvalidEvent(
            f"unknown transcription model {model!r}: this server transcribes with {self.speech_model!r}",
            "model_not_found",
            param,
        )

    def apply(self, settings: VoiceSettings) -> None:
        format_changed = settings.format != self.settings.format
        detection_changed = settings.turn_detection != self.settings.turn_detection
        self.settings = settings
        if format_changed:
            self._resampler = self._heard = None
        if detection_changed:
            self._detector = self._heard = None

    def use_vllm_flow(self, model: str) -> None:
        """vLLM's realtime client: `session.update` with a top-level `model`; the client commits."""
        self.check_model(model if model != self.conn.settings.values["model"] else None, "model")
        self.vllm_flow = True
        self.settings.turn_detection = None
        self.settings.format = AudioFormat("pcm16", MODEL_RATE)  # vLLM's: PCM16 at 16 kHz
        self._resampler, self._heard, self._detector = None, None, None

    # --- client events -----------------------------------------------------------------------------
    def _refuse_without_speech(self) -> None:
        if self.speech is None:
            raise InvalidEvent(
                "this server has no speech model (`speech.model` in its config): audio input is not supported",
                "audio_not_supported",
                "audio",
            )

    async def append(self, event: AudioAppend) -> None:
        self._refuse_without_speech()
        try:
            raw = b64decode(event.audio)
            if self._resampler is None:
                self._resampler = Resampler(self.settings.format)
            seconds = self.settings.format.seconds(len(raw))
            limits = self.conn.ingress.config.speech
            if self.session_seconds + seconds > limits.max_session_audio_s:
                message = f"the session's audio would exceed {limits.max_session_audio_s:g} s"
                raise AudioError(f"{message} (speech.max_session_audio_s): it was not taken", "audio_limit_exceeded")
            turn = self.spoken.turn
            if turn is not None and turn.seconds + seconds > limits.max_turn_audio_s:
                message = f"the turn's audio would exceed {limits.max_turn_audio_s:g} s (speech.max_turn_audio_s)"
                hint = "commit or clear the input audio buffer; this audio was not taken"
                raise AudioError(f"{message}: {hint}", "audio_limit_exceeded")
            x = self._resampler(raw)
            heard = None
            if self.settings.turn_detection is not None:
                if self._heard is None:
                    self._heard = Resampler(self.settings.format, "QQ")
                heard = self._heard(raw)
        except AudioError as e:
            raise InvalidEvent(e.message, e.code, e.param) from None
        self.session_seconds += seconds
        metrics.inc(metrics.VOICE_AUDIO_SECONDS, seconds, "audio seconds received", surface="realtime")
        if not self.defaulted:
            await self.voice_defaults()
        await self.take(x, heard)

    async def voice_defaults(self) -> None:
        """A session that speaks answers preemptively (`speech.preemptive`) unless it set `preemptive` itself."""
        self.defaulted = True
        conn, settings = self.conn, self.conn.settings
        default = settings.default_preemptive(settings.speaks)
        if default is None or "preemptive" in settings.values or self.transcription_only or conn.close_after_answer:
            return
        if (updated := await conn.call(session_update, preemptive=default)) is not None:
            settings.values["preemptive"], settings.defaulted_preemptive = default, True
            if updated.get("state") != "answering" and isinstance(turns := updated.get("turns"), int):
                conn.conversation.read_early(turns)

    async def take(self, x: np.ndarray, heard: np.ndarray | None = None) -> None:
        """16 kHz audio, in order: into the turn, or the pre-speech history; through the VAD (`heard`: the same
        audio from the VAD's own resampler, sooner; None with detection off)."""
        start = self.clock
        self.clock += len(x)
        detection = self.settings.turn_detection
        if self.spoken.turn is not None:
            self.spoken.turn.extend(x)
        elif detection is None:  # the client commits: all audio is the turn's
            self.begin(start).extend(x)
        if detection is None:
            return
        self.history.append(x)
        keep = (detection.prefix_padding_ms + 1000) * MODEL_RATE // 1000
        while self.history and self.clock - self.history_start - len(self.history[0]) > keep:
            self.history_start += len(self.history.popleft())
        assert heard is not None  # (`append` gives it whenever detection is on)
        if self._detector is None:
            self._detector = SpeechDetector(detection.vad(self.conn.ingress.config.speech.pause_lead_ms))
            self._detector.samples = start  # (the detector's clock is the connection's)
        detector = self._detector
        # ~0.1-0.2 ms a 32 ms frame: a long append (seconds of audio) runs in a thread, off the replica's loop.
        found = await asyncio.to_thread(detector.feed, heard) if len(heard) > 16 * 512 else detector.feed(heard)
        for vad in found:
            await self.on_vad(vad, detection)
        if self.spoken.turn is None and not self.conn.conversation.responding:
            await self.idle(len(x), detection)

    def recent(self, start: int) -> np.ndarray:
        audio = np.concatenate(list(self.history)) if self.history else np.zeros(0, np.float32)
        return audio[max(0, start - self.history_start) :]

    def begin(self, start: int) -> Utterance:
        """A turn starts at `start` on the clock: its utterance, transcribed as it grows (the spoken turn's)."""
        self.turn_start = start
        speech = self.conn.ingress.config.speech
        window = getattr(self.conn.ingress, "speech_window_s", None)
        turn: Utterance | None = None

        async def on_text(text: str, delay: float) -> None:
            await self.spoken.on_text(text, delay, turn)

        turn = Utterance(
            self.speech,
            on_text,
            language=self.settings.transcription.language or speech.language,
            prompt=self.settings.transcription.prompt or "",
            every_ms=speech.partial_every_ms,
            window_s=window,
        )
        self.spoken.begin(turn)
        return turn

    async def on_vad(self, vad: VadEvent, detection: TurnDetection) -> None:
        tail = min(PAUSE_MS, detection.vad().silence_duration_ms) * MODEL_RATE // 1000
        spoken, conversation = self.spoken, self.conn.conversation
        if vad.kind == "started":
            self.idle_samples = 0
            if spoken.turn is None:
                self.begin(vad.sample).extend(self.recent(vad.sample))
            await self.conn.send("input_audio_buffer.speech_started", audio_start_ms=vad.ms, item_id=spoken.item_id)
            if detection.interrupt_response and conversation.responding and not self.transcription_only:
                metrics.inc(metrics.VOICE_BARGE_INS, 1, "responses cancelled by speech")
                assert conversation.response is not None
                await conversation.response.cancel("turn_detected")
        elif spoken.turn is None:
            return
        elif vad.kind == "paused":  # transcribe the turn as it is now: it may be its end
            end = vad.sample - self.turn_start
            spoken.turn.pauses.append(end)
            spoken.turn.hold(end + tail)  # (and no more until speech resumes: the turn's end reuses this one)
        elif vad.kind == "resumed":
            spoken.turn.resume()
        elif vad.kind == "stopped":
            speech_end = vad.sample - detection.vad().silence_duration_ms * MODEL_RATE // 1000
            await self.conn.send("input_audio_buffer.speech_stopped", audio_end_ms=vad.ms, item_id=spoken.item_id)
            metrics.inc(metrics.VOICE_TURNS, 1, "turns the VAD ended")
            await self.end_turn(speech_end + tail - self.turn_start, respond=detection.create_response)

    async def idle(self, samples: int, detection: TurnDetection) -> None:
        if detection.idle_timeout_ms is None:
            return
        self.idle_samples += samples
        if self.idle_samples * 1000 // MODEL_RATE < detection.idle_timeout_ms:
            return
        self.idle_samples = 0
        end_ms = self.clock * 1000 // MODEL_RATE
        item_id = new_id("item")
        await self.conn.send(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=end_ms - detection.idle_timeout_ms,
            audio_end_ms=end_ms,
            item_id=item_id,
        )
        if self.transcription_only:
            return
        # As OpenAI's: the silent audio becomes an input_audio item (no text: the owner's conversation gets none)
        # and the model is asked to go on.
        conn, conversation = self.conn, self.conn.conversation
        await conn.send("input_audio_buffer.committed", previous_item_id=conversation.last_item_id, item_id=item_id)
        await conversation.announce_item(item_id, "user", [{"type": "input_audio", "transcript": ""}])
        if detection.create_response:
            await conversation.response_create(ResponseCreate(type="response.create"))

    async def commit(self, event: AudioCommit) -> None:
        self._refuse_without_speech()
        if self.vllm_flow and not event.final:
            return  # (vLLM's "start", `final` absent or false: transcription already runs as audio arrives)
        turn = self.spoken.turn
        if turn is None or turn.length == 0:
            if self.vllm_flow:
                await self.conn.send("transcription.done", text="", usage=None)
                return
            await self.conn.error("the input audio buffer is empty", "input_audio_buffer_commit_empty")
            return
        if self._detector is not None:  # a manual commit ends the turn the VAD was in
            self._detector.speaking = False
        if self._resampler is not None:
            flushed = self._resampler.flush()
            turn.extend(flushed)
            self.clock += len(flushed)  # (the clock counts every sample; the VAD's resampler starts again there)
            self._resampler = self._heard = None
        await self.end_turn(turn.length, respond=False)

    async def end_spoken_turn(self) -> None:
        """A commit while a spoken turn is in progress ends it: its audio so far, with the text typed meanwhile
        before its transcript, is the user's item."""
        if self.spoken.turn is None:
            return
        if self._detector is not None:
            self._detector.speaking = False
        await self.end_turn(self.spoken.turn.length, respond=False)

    async def end_turn(self, end: int, respond: bool) -> None:
        """The turn's audio up to `end` is final (router/realtime/spoken_turn.py `end_turn`); the idle timeout
        counts from here."""
        self.idle_samples = 0
        await self.spoken.end_turn(end, respond)

    async def clear(self, event: AudioClear) -> None:
        await self.spoken.clear()  # the turn's text leaves the session's input
        if self._detector is not None:
            self._detector.speaking = False
        self.history.clear()
        self.history_start = self.clock
        await self.conn.send("input_audio_buffer.cleared")

    async def truncate(self, event: ItemTruncate) -> None:
        """Barge-in's other half: the answer as the user heard it, so that the next turn is answered from that. A
        spoken answer (router/realtime/audio_out.py) is cut at `audio_end_ms` on its audio: its transcript keeps the
        words whose audio had started by then. A text answer is cut at `text_end` (this server's extension, the
        characters heard: a client's own speech synthesis knows); `audio_end_ms` alone cuts nothing in it. Only the
        last answer, once it has ended, is cut (the session's owner keeps the conversation's text)."""
        conversation = self.conn.conversation
        if event.item_id not in conversation.items:
            raise InvalidEvent(f"no conversation item {event.item_id!r}", "item_not_found", "item_id")
        spoken = conversation.answer_audio
        chars = event.text_end
        if chars is None and spoken is not None and event.item_id == spoken.item_id:
            if event.content_index != 0:
                raise InvalidEvent("an answer's audio is its content part 0", "invalid_value", "content_index")
            if conversation.responding:
                raise InvalidEvent("only the last answer, once it has ended, can be cut", "invalid_value", "item_id")
            chars = spoken.heard_chars(event.audio_end_ms)
            if chars is None:
                message = f"audio_end_ms {event.audio_end_ms} is past the answer's audio ({spoken.audio_ms:.0f} ms)"
                raise InvalidEvent(message, "invalid_value", "audio_end_ms")
            chars += spoken.base
        if chars is not None:
            if event.item_id != conversation.answer_item or conversation.responding:
                raise InvalidEvent("only the last answer, once it has ended, can be cut", "invalid_value", "item_id")
            if await self.conn.call(session_truncate, chars=chars) is None:
                return
        fields = {"item_id": event.item_id, "content_index": event.content_index, "audio_end_ms": event.audio_end_ms}
        await self.conn.send("conversation.item.truncated", **fields)

    def close(self) -> None:
        self.spoken.close()
