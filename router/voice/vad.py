"""Server VAD: Silero VAD (v6, the ONNX model shipped in the `silero-vad` package) on each connection's audio.

One ONNX Runtime session per router process, one thread, shared by every connection; each connection keeps its own
recurrent state and context (`SpeechDetector`), as vLLM-Omni's realtime socket does. The detector turns the
model's per-frame speech probability (32 ms frames at 16 kHz) into OpenAI's `server_vad` events on the audio's own
clock: speech starts when a frame's probability reaches `threshold`; it stops `silence_duration_ms` after the last
frame at `threshold` or above, once the frames since have fallen under `threshold - 0.15` (Silero's own
hysteresis); `speech_started` carries the onset less `prefix_padding_ms` and `speech_stopped` the end plus the
silence window, as OpenAI's do. A pause of
`PAUSE_MS` inside that window is reported too: the turn's audio is transcribed then, so that its transcript, and
a preemptive answer, are ready when the window ends.
"""

from __future__ import annotations

import functools
import threading
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
        self.paused = False  # that silence has lasted PAUSE_MS

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
        return events

    def _frame(self, frame: np.ndarray, events: list[VadEvent]) -> None:
        p = self.probability(frame)
        start, self.samples = self.samples, self.samples + FRAME
        s = self.settings
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
        if self.speech_end is None:  # silence since the last confident frame: Silero's probability decays for a few
            self.speech_end = self.last_speech  # frames after speech ends, and the window counts from the speech
        silent_ms = (self.samples - self.speech_end) * 1000 // RATE
        if not self.paused and silent_ms >= PAUSE_MS:
            self.paused = True
            events.append(VadEvent("paused", self.speech_end * 1000 // RATE, self.speech_end))
        if silent_ms >= s.silence_duration_ms:
            end = self.speech_end + s.silence_duration_ms * RATE // 1000
            events.append(VadEvent("stopped", end * 1000 // RATE, end))
            self.speaking, self.speech_end, self.paused = False, None, False
