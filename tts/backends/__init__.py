"""The TTS backends: what speaks a text (`Backend`), one per `tts.backend` of the config.

- `espeak.py`: espeak-ng, embedded through its C library (the default: formant synthesis, ~1/500 of real time);
- `piper.py`: Piper's neural voices (ONNX, ~0.06 CPU seconds per audio second);
- `openai_http.py`: an OpenAI-compatible `/v1/audio/speech` server (vLLM-Omni on a GPU, say).

Each yields `SpeechChunk`s without `replica` (tts/engine.py adds it): PCM16 mono at 24 kHz and the words that start
in it, every item holding all the audio made by the time it is asked for; or one error item, then nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from core.config import TtsConfig
from tts.client import SpeechChunk


class Backend(Protocol):
    name: str

    async def start(self, voices: list[str]) -> None:
        """Ready to speak in each of `voices` (the backend's own names); ValueError for one it does not have."""

    def synthesize(self, text: str, voice: str, speed: float) -> AsyncIterator[SpeechChunk]:
        """`text` spoken by `voice` at `speed` (1.0: the voice's own pace), as it is made."""
        ...

    async def close(self) -> None: ...


def make_backend(config: TtsConfig) -> Backend:
    """The backend `config.backend` names (imported here only: Piper is an optional install)."""
    if config.backend == "espeak":
        from tts.backends.espeak import EspeakBackend

        return EspeakBackend(config)
    if config.backend == "piper":
        from tts.backends.piper import PiperBackend

        return PiperBackend(config)
    if config.backend == "openai":
        from tts.backends.openai_http import OpenAIBackend

        return OpenAIBackend(config)
    raise ValueError(f"no TTS backend {config.backend!r}")
