"""One spoken turn's audio and its transcript as it grows: the speech role's client, used by the router's realtime
socket (router/voice/) and by the speech replicas' own REST audio sessions (speech/sessions.py).

The utterance so far is sent to a speech replica again each time it has grown by `partial_every_ms` (and at once
at a pause, and at the end), so a later transcript may change earlier words: each new transcript goes to
`on_text`, which revises the session's input with it (only the changed suffix is prefilled again). One
transcription at a time per utterance; a newer request replaces one not yet started, so a slow recognizer never
falls further behind than one transcription. Past the model's window the utterance is cut into segments, at the
VAD's last pause inside the window (else at its quietest 100 ms): a closed segment's text is final.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from core import metrics, pcm

logger = logging.getLogger(__name__)
MODEL_RATE = 16000  # the speech model's rate (Whisper's): what an utterance's samples are
TRANSCRIBE_TIMEOUT_S = 30.0
RETRIES = 2  # a transcription whose replica died is asked of another (the router holds the audio)


class TranscriptionFailed(Exception):
    def __init__(self, message: str, code: str = "transcription_failed") -> None:
        super().__init__(message)
        self.message, self.code = message, code


OnText = Callable[[str, float], Awaitable[None]]


class Utterance:
    def __init__(
        self,
        speech: Any,
        on_text: OnText,
        *,
        language: str | None,
        prompt: str = "",
        every_ms: int | None = 300,
        window_s: float | None = 30.0,
        surface: str = "realtime",
    ) -> None:
        self.speech, self.on_text = speech, on_text
        self.language, self.prompt, self.surface = language, prompt, surface
        self.every = every_ms * MODEL_RATE // 1000 if every_ms is not None else None  # (None: at pauses only)
        self.window = int((window_s or 30.0) * MODEL_RATE) - MODEL_RATE // 4  # (a margin for the padding)
        self._chunks: list[np.ndarray] = []
        self._audio = np.zeros(0, np.float32)
        self.length = 0  # samples
        self.segment = 0  # where the open segment starts
        self.closed: list[tuple[int, int]] = []  # closed segments (sample ranges)
        self.closed_text: list[str] = []  # and their transcripts
        self.pauses: list[int] = []  # the VAD's pauses (sample positions)
        self.text = ""  # the latest transcript of the whole utterance
        self.covered = 0  # the end (sample) the latest transcript covers
        self.failed: TranscriptionFailed | None = None
        self.usage = {"transcriptions": 0, "seconds": 0.0}  # the work: audio seconds sent (again as it grows)
        self._asked = 0  # the end of the newest transcription asked for
        self._last_asked = 0
        # A pause's end (its transcript: `covered` equals it): no periodic transcription until speech resumes.
        self.held_end: int | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._worker: asyncio.Task[None] | None = None

    # --- audio -------------------------------------------------------------------------------------
    def extend(self, audio: np.ndarray) -> None:
        if not len(audio):
            return
        self._chunks.append(audio)
        self.length += len(audio)
        if self.held_end is not None and self._last_asked < self.held_end <= self.length:  # (the pause's audio is in)
            self.ask(self.held_end)
        elif self.held_end is None and self.every is not None and self.length - self._last_asked >= self.every:
            self.ask(self.length)

    def audio(self, start: int = 0, end: int | None = None) -> np.ndarray:
        if self._chunks:
            self._audio = np.concatenate([self._audio, *self._chunks])
            self._chunks.clear()
        return self._audio[start:end]

    @property
    def seconds(self) -> float:
        return self.length / MODEL_RATE

    # --- transcription -----------------------------------------------------------------------------
    def ask(self, end: int) -> None:
        """Transcribe the utterance up to `end` (the newest ask wins over one not started)."""
        self._last_asked = end
        self._asked = min(end, self.length)
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.create_task(self._run())

    def hold(self, end: int) -> None:
        """A pause in the speech (the VAD's): transcribe up to `end` now (once the audio is in: the VAD may hear it a
        few ms before the transcription's resampler gives it), and nothing more until `resume`, so that if the pause
        ends the turn its final transcript is this one, already made."""
        self.held_end = end
        if end <= self.length:
            self.ask(end)

    def resume(self) -> None:
        self.held_end = None

    @property
    def at_pause(self) -> bool:
        """The latest transcript is the pause's (`hold`), and speech has not resumed since."""
        return self.held_end is not None and self.covered == self.held_end

    async def final(self, end: int, timeout: float = TRANSCRIBE_TIMEOUT_S) -> str:
        """The transcript of the utterance up to `end` (what an earlier transcription of the same audio said,
        or a new one). `TranscriptionFailed` if the recognizer failed or took longer than `timeout`."""
        end = min(end, self.length)
        if self.covered != end or self.failed is not None:
            self.failed = None
            self._asked = 0  # (asked again even if the worker's last ask was this end)
            self.ask(end)
            try:
                async with asyncio.timeout(timeout), self._changed:
                    await self._changed.wait_for(lambda: self.covered == end or self.failed is not None)
            except TimeoutError:
                raise TranscriptionFailed(f"the transcription took more than {timeout:g} s", "timeout") from None
        if self.failed is not None:
            raise self.failed
        return self.text

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    async def _run(self) -> None:
        done = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            end = self._asked
            if end == done and self.covered == end:
                continue
            try:
                text = await self._transcribe(end)
            except asyncio.CancelledError:
                raise
            except TranscriptionFailed as e:
                self.failed = e
            except Exception as e:  # (never expected: the worker must not die with the utterance still open)
                logger.exception("transcription failed")
                self.failed = TranscriptionFailed(f"the transcription failed: {e}")
            else:
                done, self.covered, self.text = end, end, text
                delay = (self.length - end) / MODEL_RATE  # audio that arrived meanwhile: how far behind it is
                try:
                    await self.on_text(text, delay)
                except Exception:
                    logger.exception("applying a transcript failed")
            async with self._changed:
                self._changed.notify_all()

    async def _transcribe(self, end: int) -> str:
        """The whole utterance's text up to `end`: closed segments' text and the open segment's."""
        while end - self.segment > self.window:  # close a segment at a pause inside the window
            self._close_segment()
        text = await self._call(self.segment, end)
        return " ".join(t for t in [*self.closed_text, text] if t)

    def _close_segment(self) -> None:
        start, limit = self.segment, self.segment + self.window
        inside = [p for p in self.pauses if start + MODEL_RATE < p <= limit]
        if inside:
            cut = inside[-1]
        else:  # no pause: the quietest 100 ms of the window's last half
            audio = self.audio(start, limit)
            step = MODEL_RATE // 10
            half = len(audio) // 2 // step * step
            energy = [float(np.square(audio[i : i + step]).mean()) for i in range(half, len(audio) - step, step)]
            cut = start + half + step * int(np.argmin(energy)) + step // 2 if energy else limit
        self.closed.append((start, cut))
        self.segment = cut

    async def _call(self, start: int, end: int) -> str:
        # Segments closed since the last call are transcribed first, once: their text is final.
        while len(self.closed_text) < len(self.closed):
            s, e = self.closed[len(self.closed_text)]
            self.closed_text.append(await self._speech(s, e))
        return await self._speech(start, end)

    async def _speech(self, start: int, end: int) -> str:
        data = pcm.pcm16(self.audio(start, end))
        asked = time.perf_counter()
        last: Any = None
        for attempt in range(RETRIES + 1):
            try:
                result = await asyncio.wait_for(
                    self.speech.transcribe(data, language=self.language, prompt=self.prompt),
                    TRANSCRIBE_TIMEOUT_S,
                )
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                raise TranscriptionFailed(f"the transcription took more than {TRANSCRIBE_TIMEOUT_S:g} s") from None
            except Exception as e:  # the replica died mid-call (Ray's actor errors): another one is asked
                last = e
                metrics.inc(metrics.ERRORS, 1, "errors by kind", kind="speech_replica")
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            if "error" in result:
                raise TranscriptionFailed(str(result["error"].get("message")), "transcription_failed")
            self.usage["transcriptions"] += 1
            self.usage["seconds"] += (end - start) / MODEL_RATE
            latency = time.perf_counter() - asked
            metrics.observe(metrics.VOICE_TRANSCRIPT_DELAY, latency, "transcript behind audio", surface=self.surface)
            return str(result.get("text") or "").strip()
        message = f"no speech replica could transcribe the audio ({type(last).__name__})"
        raise TranscriptionFailed(message, "speech_unavailable")


def resample_stream(rate: int, quality: str = "LQ") -> Any:
    """A streaming resampler from `rate` to the model's (core/pcm.py `resample_stream`)."""
    return pcm.resample_stream(rate, MODEL_RATE, quality)
