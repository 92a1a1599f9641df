"""espeak-ng, the default backend: formant synthesis through espeak-ng's own C library, loaded at run time.

The library and its voice data come from PyPI's `espeakng-loader` (its own package, GPL-3.0; this project calls it
and copies none of it). Its C API (speak_lib.h) is used through ctypes: `espeak_Initialize` in synchronous mode
(the audio comes to a callback, 100 ms buffers, while `espeak_Synth` runs), word events with each buffer
(`espeakEVENT_WORD`: the word's position in the text, in characters from 1, and its first sample), the voice by
name (`en-us+f3`: a language and a variant), the pace in words per minute.

espeak-ng keeps its state in globals and is not thread-safe: it runs in one thread of its own per process
(`_THREAD`, tts/backends/threaded.py), one synthesis at a time (`_Library.lock` as well). A text is spoken a sentence
(`core/sentences.py`) per `espeak_Synth` call, and the calls at once take turns between sentences: a sentence takes
a few ms, a 4,096-character input ~0.3 s, and a short sentence waits for one of its sentences, not all of them. Each
sentence but the last is spoken with `espeakENDPAUSE` (the pause espeak-ng makes after a sentence or a clause within
one text; cut at a bare space, none). Its audio (22,050 Hz) is resampled to 24 kHz as it streams, in that thread
(tts/audio.py); a word's time is its first sample's, counted from the call's first sentence, the same in ms at
either rate.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from core.config import TtsConfig
from core.sentences import ends_a_clause, sentence_spans
from tts.audio import Resampler
from tts.backends.threaded import Pieces, Speech, in_turns, speech_chunks
from tts.client import SpeechChunk
from tts.errors import backend_failed
from tts.words import WordLocator

logger = logging.getLogger(__name__)

AUDIO_OUTPUT_SYNCHRONOUS = 2
BUFFER_MS = 100
INITIALIZE_DONT_EXIT = 0x8000
PARAM_RATE = 1  # espeakRATE: words per minute
POS_CHARACTER = 1
CHARS_UTF8 = 1
END_PAUSE = 0x1000  # espeakENDPAUSE: the pause after a sentence at the end of the text too
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

# The one thread espeak-ng runs in: every call into the library is made there (it is the process's).
_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="espeak")


class VoiceNotFound(LookupError):
    """espeak-ng has no voice of this name."""


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
        self.current: _Speech | None = None  # the synthesis the callback feeds
        # The C side holds only a pointer to this object: it must live as long as the library (it does: here).
        self._callback = _SYNTH_CALLBACK(self._on_audio)
        self.lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav: Any, n: int, events: Any) -> int:
        """espeak-ng's callback (in `espeak_Synth`'s thread): a buffer of samples and its events. 1 aborts."""
        speech = self.current
        if speech is None or speech.pieces.cancelled or speech.error is not None:
            return 1
        try:
            samples = np.ctypeslib.as_array(wav, (n,)).copy() if n > 0 and wav else np.zeros(0, np.int16)
            words = []
            i = 0
            while events[i].type != EVENT_LIST_TERMINATED:
                if events[i].type == EVENT_WORD:
                    words.append((events[i].text_position - 1, events[i].sample))
                i += 1
            speech.take(samples, words)
        except BaseException as e:  # (an exception cannot cross the C callback: raised once espeak_Synth returns)
            speech.error = e
            return 1
        return 0

    def set_voice(self, voice: str) -> bool:
        """(Under `lock`.) Whether espeak-ng has `voice`."""
        if voice != self.voice:
            if self.lib.espeak_SetVoiceByName(voice.encode()) != EE_OK:
                return False
            self.voice = voice
        return True

    def synth(self, speech: _Speech, text: str, voice: str, wpm: int, flags: int) -> None:
        """(espeak-ng's thread.) One sentence of `speech` (its `text`) through the callback."""
        with self.lock:
            self.current = speech
            try:
                if not self.set_voice(voice):
                    raise VoiceNotFound(voice)
                self.lib.espeak_SetParameter(PARAM_RATE, wpm, 0)
                data = text.encode()
                buffer = ctypes.create_string_buffer(data)  # NUL-terminated
                status = self.lib.espeak_Synth(buffer, len(data) + 1, 0, POS_CHARACTER, 0, flags, None, None)
            finally:
                self.current = None
        if speech.error is not None:
            raise speech.error
        if status != EE_OK and not speech.pieces.cancelled:
            raise RuntimeError(f"espeak_Synth returned {status}")


class _Speech:
    """One call's synthesis, in espeak-ng's thread: its text a sentence at a time, each buffer's audio resampled to
    24 kHz and its word events placed on the text's words (one call-wide count of samples: a word's time is from the
    call's start), handed to the caller as `Speech`."""

    def __init__(self, pieces: Pieces[Speech], text: str, voice: str, wpm: int) -> None:
        self.pieces, self.text, self.voice, self.wpm = pieces, text, voice, wpm
        self.locator = WordLocator(text)
        self.error: BaseException | None = None  # raised in the callback
        self.rate = 0
        self.resampler: Resampler | None = None
        self.next_word = 0  # the first word not yet placed
        self.last_ms = 0.0  # the time of the last word placed
        self.samples = 0  # the call's samples so far, at the library's rate
        self.start, self.base = 0, 0  # the sentence being spoken: its first character, the samples before it

    def steps(self) -> Iterator[None]:
        lib = library()
        self.rate, self.resampler = lib.rate, Resampler(lib.rate)
        spoken = self.text.replace("\0", " ")  # NUL would end espeak-ng's text early; a space keeps the positions
        spans = sentence_spans(spoken)
        for i, (start, end) in enumerate(spans):
            pause = i + 1 < len(spans) and ends_a_clause(spoken[start:end])
            self.start, self.base = start, self.samples
            lib.synth(self, spoken[start:end], self.voice, self.wpm, CHARS_UTF8 | (END_PAUSE if pause else 0))
            yield
        # What the filter held back, and the words espeak-ng gave no event of after the last one: at its time.
        rest = [(*self.locator.spans[i], self.last_ms) for i in range(self.next_word, len(self.locator.spans))]
        self.pieces.put((self.resampler.flush(), rest))

    def take(self, samples: np.ndarray, events: list[tuple[int, int]]) -> None:
        """(The callback.) A buffer's samples and word events (a position in the sentence, 0-based; a sample)."""
        assert self.resampler is not None
        words = []
        for position, sample in events:
            at = self.locator.word_at(self.start + position)
            if at is None or at < self.next_word:  # a mark or a space spoken, or a word's second event
                continue
            self.last_ms = max(self.last_ms, (self.base + sample) / self.rate * 1000.0)
            # A word espeak-ng gave no event of (none seen yet) is said just before the next one.
            words += [(*self.locator.spans[i], self.last_ms) for i in range(self.next_word, at + 1)]
            self.next_word = at + 1
        self.samples += len(samples)
        pcm = self.resampler.push(samples) if len(samples) else b""
        if pcm or words:
            self.pieces.put((pcm, words))


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
        loop = asyncio.get_running_loop()
        self.lib = await loop.run_in_executor(_THREAD, library)
        missing = [v for v in voices if not await loop.run_in_executor(_THREAD, self._has_voice, v)]
        if missing:
            raise ValueError(f"espeak-ng has no voice {', '.join(map(repr, missing))} (tts.voices)")
        logger.info("espeak-ng ready: rate=%d voices=%s", self.lib.rate, voices)

    def _has_voice(self, voice: str) -> bool:
        assert self.lib is not None
        with self.lib.lock:
            return self.lib.set_voice(voice)

    async def synthesize(self, text: str, voice: str, speed: float) -> AsyncIterator[SpeechChunk]:
        pieces: Pieces[Speech] = Pieces()
        in_turns(_THREAD, pieces, _Speech(pieces, text, voice, words_per_minute(self.config, speed)).steps())
        try:
            async for chunk in speech_chunks(pieces):
                yield chunk
        except VoiceNotFound:
            yield backend_failed(f"espeak-ng has no voice {voice!r}", code="voice_not_found")
        finally:
            pieces.cancel()  # the caller gone early: espeak-ng stops at its next buffer

    async def close(self) -> None:
        """(espeak-ng stays loaded with the process: it cannot be started twice.)"""
