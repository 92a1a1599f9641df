"""espeak-ng, the default backend: formant synthesis through espeak-ng's own C library, loaded at run time.

The library and its voice data come from PyPI's `espeakng-loader` (its own package, GPL-3.0; this project calls it
and copies none of it). Its C API (speak_lib.h) is used through ctypes: `espeak_Initialize` in synchronous mode
(the audio comes to a callback, 100 ms buffers, while `espeak_Synth` runs), word events with each buffer
(`espeakEVENT_WORD`: the word's position in the text, in characters from 1, and its first sample), the voice by
name (`en-us+f3`: a language and a variant), the pace in words per minute.

espeak-ng keeps its state in globals and is not thread-safe: one synthesis at a time per process (`_Library.lock`),
in a worker thread (tts/backends/threaded.py) so that the event loop stays free: a sentence takes a few ms, a
4,096-character input under a second. Its audio (22,050 Hz) is resampled to 24 kHz as it streams
(tts/audio.py); a word's time is its first sample's, the same in ms at either rate.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from core.config import TtsConfig
from tts.audio import Resampler, ms
from tts.backends.threaded import Pieces
from tts.client import SpeechChunk
from tts.errors import backend_failed
from tts.words import WordLocator, WordQueue

logger = logging.getLogger(__name__)

AUDIO_OUTPUT_SYNCHRONOUS = 2
BUFFER_MS = 100
INITIALIZE_DONT_EXIT = 0x8000
PARAM_RATE = 1  # espeakRATE: words per minute
POS_CHARACTER = 1
CHARS_UTF8 = 1
EVENT_LIST_TERMINATED, EVENT_WORD = 0, 1
MIN_WPM, MAX_WPM = 80, 450  # espeak-ng's range of paces
EE_OK = 0


class _Event(ctypes.Structure):
    """`espeak_EVENT` (speak_lib.h); `id` is a union of a pointer, an int and a name: 8 bytes."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))

# One synthesis's pieces: its samples (int16 at the library's rate) and its word events (position in the text,
# 0-based characters; first sample).
Piece = tuple[np.ndarray, list[tuple[int, int]]]


class _Library:
    """The process's espeak-ng: loaded and initialised once, one synthesis at a time."""

    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.restype = ctypes.c_int
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        self.lib.espeak_SetSynthCallback.restype = None
        self.lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        data = espeakng_loader.get_data_path().encode()
        self.rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS, data, INITIALIZE_DONT_EXIT)
        if self.rate <= 0:
            raise RuntimeError(f"espeak-ng did not start (espeak_Initialize returned {self.rate})")
        self.lock = threading.Lock()
        self.voice: str | None = None  # the voice set last
        self.current: Pieces[Piece] | None = None  # the synthesis the callback feeds
        # The C side holds only a pointer to this object: it must live as long as the library (it does: here).
        self._callback = _SYNTH_CALLBACK(self._on_audio)
        self.lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav: Any, n: int, events: Any) -> int:
        """espeak-ng's callback (in `espeak_Synth`'s thread): a buffer of samples and its events. 1 aborts."""
        pieces = self.current
        if pieces is None or pieces.cancelled:
            return 1
        samples = np.ctypeslib.as_array(wav, (n,)).copy() if n > 0 and wav else np.zeros(0, np.int16)
        words = []
        i = 0
        while events[i].type != EVENT_LIST_TERMINATED:
            if events[i].type == EVENT_WORD:
                words.append((events[i].text_position - 1, events[i].sample))
            i += 1
        if len(samples) or words:
            pieces.put((samples, words))
        return 0

    def set_voice(self, voice: str) -> bool:
        """(Under `lock`.) Whether espeak-ng has `voice`."""
        if voice != self.voice:
            if self.lib.espeak_SetVoiceByName(voice.encode()) != EE_OK:
                return False
            self.voice = voice
        return True

    def speak(self, pieces: Pieces[Piece], text: str, voice: str, wpm: int) -> None:
        """(A worker thread.) `text` into `pieces`, then their end."""
        error: BaseException | None = None
        if pieces.cancelled:  # the caller left while this call waited for a thread
            return
        try:
            with self.lock:
                self.current = pieces
                try:
                    if not self.set_voice(voice):
                        raise LookupError(voice)
                    self.lib.espeak_SetParameter(PARAM_RATE, wpm, 0)
                    data = text.encode()
                    buffer = ctypes.create_string_buffer(data)  # NUL-terminated
                    status = self.lib.espeak_Synth(buffer, len(data) + 1, 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
                    if status != EE_OK and not pieces.cancelled:
                        raise RuntimeError(f"espeak_Synth returned {status}")
                finally:
                    self.current = None
        except BaseException as e:  # handed to the caller: raised in its task, not lost in this thread
            error = e
        pieces.end(error)


_library: _Library | None = None
_library_lock = threading.Lock()


def library() -> _Library:
    global _library
    with _library_lock:
        if _library is None:
            _library = _Library()
        return _library


def words_per_minute(config: TtsConfig, speed: float) -> int:
    """espeak-ng's pace for `speed`: the config's at 1.0, within espeak-ng's range (80-450)."""
    return max(MIN_WPM, min(MAX_WPM, round(config.words_per_minute * speed)))


class EspeakBackend:
    name = "espeak"

    def __init__(self, config: TtsConfig) -> None:
        self.config = config
        self.lib: _Library | None = None

    async def start(self, voices: list[str]) -> None:
        self.lib = await asyncio.to_thread(library)
        missing = [v for v in voices if not await asyncio.to_thread(self._has_voice, v)]
        if missing:
            raise ValueError(f"espeak-ng has no voice {', '.join(map(repr, missing))} (tts.voices)")
        logger.info("espeak-ng ready: rate=%d voices=%s", self.lib.rate, voices)

    def _has_voice(self, voice: str) -> bool:
        assert self.lib is not None
        with self.lib.lock:
            return self.lib.set_voice(voice)

    async def synthesize(self, text: str, voice: str, speed: float) -> AsyncIterator[SpeechChunk]:
        lib = self.lib or library()
        pieces: Pieces[Piece] = Pieces()
        # NUL would end espeak-ng's text early: a space instead keeps every position where it was.
        asyncio.get_running_loop().run_in_executor(
            None, lib.speak, pieces, text.replace("\0", " "), voice, words_per_minute(self.config, speed)
        )
        locator, words, resampler = WordLocator(text), WordQueue(), Resampler(lib.rate)
        next_word, sent = 0, 0
        try:
            async for batch, done in pieces.batches():
                audio = [resampler.push(np.concatenate([samples for samples, _ in batch]))] if batch else []
                for _, events in batch:
                    for position, sample in events:
                        at = locator.word_at(position)
                        if at is None or at < next_word:  # a mark or a space spoken, or a word's second event
                            continue
                        # A word espeak-ng gave no event of (none seen yet) is said just before the next one.
                        for i in range(next_word, at + 1):
                            words.add(*locator.spans[i], sample / lib.rate * 1000.0)
                        next_word = at + 1
                if done:
                    audio.append(resampler.flush())
                    for i in range(next_word, len(locator.spans)):  # words after the last event: at its time
                        words.add(*locator.spans[i], 0.0)
                pcm = b"".join(audio)
                sent += len(pcm)
                due = words.rest() if done else words.due(ms(sent))
                if pcm or due:
                    yield {"audio": pcm, "words": due}
        except LookupError:
            yield backend_failed(f"espeak-ng has no voice {voice!r}", code="voice_not_found")
        finally:
            pieces.cancel()  # the caller gone early: espeak-ng stops at its next buffer

    async def close(self) -> None:
        """(espeak-ng stays loaded with the process: it cannot be started twice.)"""
