"""Server VAD: Silero VAD (v6, the ONNX model shipped in the `silero-vad` package) on each connection's audio.

One ONNX Runtime session per router process, one thread, shared by every connection; each connection keeps its own
recurrent state and context (`SpeechDetector`), as vLLM-Omni's realtime socket does. The detector turns the
model's per-frame speech probability (32 ms frames at 16 kHz) into OpenAI's `server_vad` events on the audio's own
clock: speech starts when a frame's probability reaches `threshold`; it stops `silence_duration_ms` after the last
frame at `threshold` or above, once the frames since have fallen under `threshold - 0.15` (Silero's own
hysteresis); `speech_started` carries the onset less `prefix_padding_ms` and `speech_stopped` the end plus the
silence window, as OpenAI's do. The model's probability stays high for a frame or two after the sound stops (its
recurrent state lags); the end is therefore placed by the audio itself within those last confident frames: after
the last 4 ms whose level is within 20 dB of the turn's speech (`END_LOOKBACK` frames at most). The model decides
that speech ended; the level only says where, so that the window counts the silence the user left. The window
ends with the append that completes it, not at the end of the frame it falls in (up to 32 ms later): what the
model has heard since the sound's end is silence, and the rest of the window is under a frame, less than the model
needs to hear an onset (speech that resumes in the window's last ~30 ms starts the next turn; a frame ending past
the window's end used to hear some of it, by chance of where it fell). A pause of `pause_ms` (at least
`PAUSE_MS`) inside that window is reported too: the turn's audio is transcribed then, so that its transcript, and a
preemptive answer, are ready when the window ends.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

import numpy as np

RATE = 16000
FRAME = 512  # samples per Silero frame at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous frame the model sees with each one
FRAME_MS = FRAME * 1000 // RATE
PAUSE_MS = 96  # silence (3 frames) after speech that counts as a pause: its audio is transcribed at once
NEG_MARGIN = 0.15  # Silero's hysteresis: speech goes on while the probability stays over threshold - this
END_LOOKBACK = 3  # confident frames at the end of speech in which the sound's own end is looked for
END_BLOCK = 64  # samples (4 ms) the sound's end is placed to
END_LEVEL = 0.1  # a block quieter than this share of the turn's speech RMS (-20 dB) is silence after it


@functools.cache
def _session() -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # one frame is ~0.1 ms: threads only cost
    path = resources.files("silero_vad") / "data" / "silero_vad.onnx"
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def warm_up() -> None:
    """Load the model in a thread of its own (a router replica starts before its first audio arrives)."""
    threading.Thread(target=_session, name="vad-load", daemon=True).start()


_RUN_LOCK = threading.Lock()  # (an ONNX session's `run` is thread-safe; the lock keeps one frame at a time cheap)


@dataclass
class VadSettings:
    """OpenAI's `server_vad` settings (defaults as OpenAI's)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    pause_ms: int = PAUSE_MS  # (this server's: silence that counts as a pause, at least PAUSE_MS)


@dataclass
class VadEvent:
    kind: Literal["started", "paused", "resumed", "stopped"]
    ms: int  # started: onset less the padding; paused: the speech's end; stopped: the end plus the silence window
    sample: int  # the same point on the 16 kHz sample clock


class SpeechDetector:
    """One connection's VAD. `feed` takes 16 kHz float32 audio in any chunk size and returns the events its
    frames gave, in order."""

    def __init__(self, settings: VadSettings) -> None:
        self.settings = settings
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._pending = np.zeros(0, np.float32)
        self.samples = 0  # samples fed as frames (the clock)
        self.speaking = False
        self.speech_end: int | None = None  # while speaking: where the current silence began
        self.last_speech = 0  # the end of the last frame at `threshold` or above
        self.paused = False  # that silence has lasted the settings' pause_ms
        self._recent: deque[np.ndarray] = deque(maxlen=END_LOOKBACK + 1)  # the last frames' audio (the newest last)
        self._level = [0.0, 0]  # the turn's confident frames: sum of their mean squares, and how many

    def probability(self, frame: np.ndarray) -> float:
        x = np.concatenate([self._context, frame])[None, :]
        with _RUN_LOCK:
            out, self._state = _session().run(None, {"input": x, "state": self._state, "sr": np.array(RATE, np.int64)})
        self._context = frame[-CONTEXT:]
        return float(out[0, 0])

    def feed(self, audio: np.ndarray) -> list[VadEvent]:
        events: list[VadEvent] = []
        data = np.concatenate([self._pending, audio]) if len(self._pending) else audio
        n = len(data) // FRAME * FRAME
        for i in range(0, n, FRAME):
            self._frame(data[i : i + FRAME], events)
        self._pending = data[n:].copy()
        if self.speaking and self.speech_end is not None:  # (the window may end inside the frame to come)
            end = self.speech_end + self.settings.silence_duration_ms * RATE // 1000
            if end <= self.samples + len(self._pending):
                self._stop(end, events)
        return events

    def _stop(self, end: int, events: list[VadEvent]) -> None:
        events.append(VadEvent("stopped", end * 1000 // RATE, end))
        self.speaking, self.speech_end, self.paused = False, None, False

    def _frame(self, frame: np.ndarray, events: list[VadEvent]) -> None:
        p = self.probability(frame)
        start, self.samples = self.samples, self.samples + FRAME
        self._recent.append(frame)
        s = self.settings
        if p >= s.threshold:
            if not self.speaking:  # (a new turn: its own level)
                self._level = [0.0, 0]
            self._level[0] += float(np.mean(np.square(frame)))
            self._level[1] += 1
        if not self.speaking:
            if p >= s.threshold:
                self.speaking, self.speech_end, self.paused = True, None, False
                self.last_speech = self.samples
                onset = max(0, start - s.prefix_padding_ms * RATE // 1000)
                events.append(VadEvent("started", onset * 1000 // RATE, onset))
            return
        if p >= s.threshold:
            self.last_speech = self.samples
        if p >= s.threshold - NEG_MARGIN:  # still speech
            if self.speech_end is not None and self.paused:
                events.append(VadEvent("resumed", start * 1000 // RATE, start))
            self.speech_end, self.paused = None, False
            return
        if self.speech_end is None:  # silence since the last confident frame (or the sound's end within it)
            self.speech_end = self._sound_end()
        silent_ms = (self.samples - self.speech_end) * 1000 // RATE
        if not self.paused and silent_ms >= max(PAUSE_MS, s.pause_ms):
            self.paused = True
            events.append(VadEvent("paused", self.speech_end * 1000 // RATE, self.speech_end))
        if silent_ms >= s.silence_duration_ms:
            self._stop(self.speech_end + s.silence_duration_ms * RATE // 1000, events)

    def _sound_end(self) -> int:
        """Where the speech ended (a sample): the end of the last END_BLOCK within END_LOOKBACK confident frames
        of `last_speech` that is within -20 dB of the turn's speech; `last_speech` if the frames are not at hand."""
        frames = list(self._recent)[:-1]  # (the newest is the one the model found silent)
        back = (self.samples - FRAME - self.last_speech) // FRAME  # silent-ish frames between (over neg threshold)
        if back < 0 or back >= len(frames) or not self._level[1]:
            return self.last_speech
        audio = np.concatenate(frames[: len(frames) - back][-END_LOOKBACK:])  # (back < len(frames): not empty)
        floor = END_LEVEL**2 * self._level[0] / self._level[1]  # (in mean squares)
        blocks = np.mean(np.square(audio[: len(audio) // END_BLOCK * END_BLOCK].reshape(-1, END_BLOCK)), axis=1)
        loud = np.nonzero(blocks >= floor)[0]
        earliest = self.last_speech - len(audio)
        return earliest + (int(loud[-1]) + 1) * END_BLOCK if len(loud) else earliest
