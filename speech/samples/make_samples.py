"""Regenerate the spoken sample clips (`<slug>.wav`) and `sentences.json` in this folder.

The clips are what `local:tiny-whisper` (local_models/whisper.py) is fitted to transcribe, and what tests and demos
send as a user's voice. They are committed, so nothing else needs espeak-ng: run this only to change the set.
Needs `espeak-ng` and `sox` (Debian: `apt-get install -y espeak-ng sox`); made with espeak-ng 1.51 and sox 14.4.2.
Other versions may synthesize slightly different audio: rebuild the model afterwards (`--force`).

    python speech/samples/make_samples.py
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import wave
from pathlib import Path

HERE = Path(__file__).resolve().parent
# slug -> the exact text spoken, and the transcript the model must give (cased, with punctuation). The first four are
# questions the tool-calling LLM (local_models/tools_fit.py) answers, so a spoken question can end in a tool call.
SENTENCES = {
    "weather_paris": "What is the weather in Paris?",
    "time_tokyo": "What time is it in Tokyo?",
    "compare_weather": "Compare the weather in Paris and Rome.",
    "say_hello": "Say hello.",
    "joke": "Tell me a joke.",
    "moon": "How far away is the moon?",
    "lights": "Turn on the kitchen lights.",
    "two_plus_two": "What is two plus two?",
    "timer": "Set a timer for ten minutes.",
    "music": "Play some relaxing music.",
    "thanks": "Thank you very much.",
    "capital_spain": "What is the capital of Spain?",
    "alarm": "Wake me up at seven tomorrow.",
    "news": "What is in the news today?",
    "bread": "How do I bake bread?",
    "goodbye": "Goodbye, see you later.",
}
VOICE = "en-us"
SPEED = 125  # words per minute
# Short sentences are spoken slower (and with wider word gaps, in 10 ms units) so every clip lasts 1.5-3.5 s.
SLOWER = {"say_hello": (80, 8), "joke": (90, 0)}
RATE = 16_000
# Trim start and end down to the first/last 5 ms above -55 dB: espeak-ng pads its output with silence.
TRIM = ["silence", "1", "0.005", "-55d", "reverse", "silence", "1", "0.005", "-55d", "reverse"]
MIN_S, MAX_S = 1.5, 3.5


def synthesize(slug: str, text: str) -> float:
    """Write `<slug>.wav` (16 kHz mono 16-bit, silence trimmed); its duration in seconds."""
    speed, gap = SLOWER.get(slug, (SPEED, 0))
    out = HERE / f"{slug}.wav"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"  # espeak-ng writes 22,050 Hz
        subprocess.run(["espeak-ng", "-v", VOICE, "-s", str(speed), "-g", str(gap), "-w", str(raw), text], check=True)
        # -R: repeatable; -D: no dither (random noise) when requantizing to 16 bits.
        subprocess.run(
            ["sox", "-R", "-D", str(raw), "-r", str(RATE), "-b", "16", "-c", "1", str(out), *TRIM], check=True
        )
    with wave.open(str(out)) as w:
        return w.getnframes() / w.getframerate()


def main() -> None:
    total = 0
    for slug, text in SENTENCES.items():
        seconds = synthesize(slug, text)
        if not MIN_S <= seconds <= MAX_S:
            raise SystemExit(f"{slug}: {seconds:.2f} s is outside {MIN_S}-{MAX_S} s; adjust SLOWER")
        total += (HERE / f"{slug}.wav").stat().st_size
        print(f"{slug:16} {seconds:.2f} s  {text}")
    (HERE / "sentences.json").write_text(json.dumps(SENTENCES, indent=2) + "\n")
    print(f"{len(SENTENCES)} clips, {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
