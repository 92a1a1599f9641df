"""Spoken turns: end of speech → first answer token, this system's voice path against the cascade on the same stack.

Each turn is one of the embedded speech model's clips (speech/samples/), sent as a microphone would: 24 kHz PCM16
in 20 ms frames paced at the audio's own rate, with silence before and after. "End of speech" is the moment the
clip's last sample was spoken (the frame holding it is sent at most 20 ms later). Systems, in the same run on the
same app (the default config's, as `make run` serves it), alternating turn by turn:

- `voice`: the realtime socket with `server_vad` (`--silence-ms`) and `create_response`: the turn is transcribed
  and prefilled while it is spoken, and answered when the VAD confirms its end;
- `voice+preemptive`: the same with preemptive answers (`after_idle_ms` `--after-idle-ms`, `stream`: the
  `rtpd.response.provisional.done` events say whether the answer made in the silence was delivered);
- `cascade`: what a user would otherwise build on this stack: the client finds the end of speech with the same
  VAD (Silero, the same threshold and silence window, router/voice/vad.py), then `POST /v1/audio/transcriptions`
  of the whole utterance, then one streamed `/v1/chat/completions` of its transcript;
- and each of them answering in speech (`+audio`, unless `--no-speak`): the realtime socket with
  `output_modalities: ["audio"]` (the answer's sentences spoken by the TTS role as decode makes them), and the
  cascade sending its answer's first sentence to `/v1/audio/speech` the moment it is complete; their figure is end
  of speech → first audio byte.

Reported: end of speech → first token P50/P95/P99; how long the transcript lags the end of speech (the
`completed` event, or the cascade's transcription reply); the share of turns answered preemptively; whether each
voice answer is the cascade's answer for the same transcript (greedy: the same text); and the work per turn (audio
seconds transcribed, LLM prompt tokens computed on prefill and decode, tokens decoded), each system on the same
sentences. At `--voices 1` and at
many voices at once.

    .venv/bin/python bench/voice.py [--quick] [--voices 1 4] [--turns 16] [--pause-lead-ms N|none]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import cpu
import httpx
import numpy as np
import record as record_io
import systems
import websockets
import yaml
from clients import pct_ms
from tqdm import tqdm

from core.config import PreemptiveOptions, SpeechConfig, TtsConfig
from core.pcm import wav_bytes
from core.sentences import SentenceSplitter
from local_models.whisper import SENTENCES, load_sample
from router.voice.vad import SpeechDetector, VadSettings

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FRAME_S = 0.02
TEXT_SYSTEMS = ("voice", "voice+preemptive", "cascade")
AUDIO_SYSTEMS = ("voice+audio", "voice+preemptive+audio", "cascade+audio")  # (answered in speech: first audio byte)
SPEECH_BODY = {"model": "tts-1", "voice": "alloy", "response_format": "pcm"}
WORK = (
    ("llm_prompt_tokens_per_turn", "prompt tokens"),
    ("llm_generated_tokens_per_turn", "tokens decoded"),
    ("audio_s_transcribed_per_turn", "audio transcribed"),
    ("transcriptions_per_turn", "transcriptions"),
    ("engine_cpu_s_per_turn", "engines' CPU"),
    ("tts_audio_s_per_turn", "audio synthesized"),
    ("tts_busy_s_per_turn", "TTS busy"),
)


def turn_audio(slug: str, lead_s: float, tail_s: float) -> tuple[np.ndarray, float]:
    """The clip at 16 kHz with silence around it, and where (seconds) its speech ends."""
    clip = load_sample(slug)
    audio = np.concatenate([np.zeros(int(lead_s * 16000)), clip, np.zeros(int(tail_s * 16000))]).astype(np.float32)
    return audio, lead_s + len(clip) / 16000


def pcm24k(audio: np.ndarray) -> bytes:
    import soxr

    return (np.clip(soxr.resample(audio, 16000, 24000), -1, 1) * 32767).astype("<i2").tobytes()


async def paced(frames: list[Any], send: Any, start: float) -> None:
    """Send `frames` (one per FRAME_S of audio, the first spoken from `start` on) as a microphone makes them."""
    for i, frame in enumerate(frames):
        delay = start + (i + 1) * FRAME_S - time.perf_counter()  # a frame leaves once it has been spoken
        if delay > 0:
            await asyncio.sleep(delay)
        await send(frame)


async def voice_turn(
    args: argparse.Namespace, base: str, slug: str, preemptive: bool, audio_out: bool = False
) -> dict[str, Any]:
    audio, speech_end = turn_audio(slug, args.lead_s, args.tail_s)
    pcm = pcm24k(audio)
    step = int(24000 * FRAME_S) * 2
    frames = [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)]
    # One turn per connection, as the cascade's turn is one request: the session ends with its answer, and its
    # conversation is not prefilled again for a next turn (docs/api.md).
    url = base.replace("http://", "ws://") + "/v1/realtime?close_after_answer=true"
    detection = {"type": "server_vad", "silence_duration_ms": args.silence_ms, "create_response": True}
    session: dict[str, Any] = {
        "output_modalities": ["text"],
        "temperature": 0,
        "max_output_tokens": args.max_tokens,
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": detection}},
    }
    # Off for `voice` (a spoken session's default is on: `speech.preemptive`); `voice+preemptive` as the default
    # (the VAD's pause starts it), with its text streamed to see whether it was delivered.
    # (held as the server holds a spoken session's default: further when it answers in speech, tts.preemptive_tokens)
    held = args.spoken_preemptive_tokens if audio_out else args.preemptive_tokens
    preemptive_options = {"after_idle_ms": args.after_idle_ms, "max_tokens": held, "stream": True}
    session["preemptive"] = preemptive_options if preemptive else None
    if audio_out:  # the answer spoken: its transcript and audio, the first audio byte its first sound
        session["output_modalities"] = ["audio"]
        session["audio"]["output"] = {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}
    system = "voice+preemptive" if preemptive else "voice"
    out: dict[str, Any] = {"slug": slug, "system": system + ("+audio" if audio_out else "")}
    first_event = "response.output_audio.delta" if audio_out else "response.output_text.delta"
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        times: dict[str, float] = {}
        text: list[str] = []
        made: dict[Any, float] = {}  # a preemptive answer's first token (by attempt)

        async def read() -> None:
            async for raw in ws:
                event = json.loads(raw)
                kind, now = event["type"], time.perf_counter()
                times.setdefault(kind, now)
                if kind == "conversation.item.input_audio_transcription.completed":
                    out["transcript"] = event["transcript"]
                elif kind in ("response.output_text.delta", "response.output_audio_transcript.delta"):
                    text.append(event["delta"])
                elif kind == "response.output_audio.delta":
                    out["audio_bytes"] = out.get("audio_bytes", 0) + len(base64.b64decode(event["delta"]))
                elif kind == "rtpd.response.provisional.delta":
                    made.setdefault(event.get("attempt"), now)
                elif kind == "rtpd.response.provisional.done":
                    out["preemptive"] = event.get("status")
                    if event.get("status") == "confirmed" and event.get("attempt") in made:
                        times["answer made"] = made[event["attempt"]]
                elif kind == "error":
                    out["error"] = event["error"]
                elif kind == "response.done":
                    out["status"] = event["response"]["status"]
                    out["prompt_tokens"] = (event["response"].get("usage") or {}).get("input_tokens")
                    return

        reader = asyncio.create_task(read())

        async def append(frame: str) -> None:
            if not reader.done():  # (the microphone goes on; the one-turn connection closes after its answer)
                with contextlib.suppress(websockets.ConnectionClosedOK):
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))

        start = time.perf_counter()
        await paced(frames, append, start)
        try:
            await asyncio.wait_for(reader, 60)
        except TimeoutError:
            out["error"] = "no response.done within 60 s"
    eos = start + speech_end
    out["answer"] = "".join(text)
    # Each event's first arrival, ms after the end of speech (where a slow turn spent its time).
    out["events_ms"] = {kind: round((at - eos) * 1000, 1) for kind, at in sorted(times.items(), key=lambda kv: kv[1])}
    if first_event in times:
        out["eos_to_first_s"] = times[first_event] - eos
    if "conversation.item.input_audio_transcription.completed" in times:
        out["transcript_lag_s"] = times["conversation.item.input_audio_transcription.completed"] - eos
    if "input_audio_buffer.speech_stopped" in times:
        out["eos_to_stopped_s"] = times["input_audio_buffer.speech_stopped"] - eos
        if "answer made" in times:  # (how long before the VAD's stop the delivered preemptive answer was ready)
            out["made_before_stop_s"] = times["input_audio_buffer.speech_stopped"] - times["answer made"]
    return out


async def first_audio(base: str, client: httpx.AsyncClient, text: str) -> tuple[float, int]:
    """`/v1/audio/speech` of `text`, streamed: when its first audio byte came, and its length in bytes."""
    first, size = 0.0, 0
    body = {**SPEECH_BODY, "input": text}
    async with client.stream("POST", f"{base}/v1/audio/speech", json=body, timeout=60) as response:
        async for data in response.aiter_bytes():
            first = first or time.perf_counter()
            size += len(data)
    return first, size


async def cascade_turn(
    args: argparse.Namespace, base: str, slug: str, client: httpx.AsyncClient, audio_out: bool = False
) -> dict[str, Any]:
    """Client-side VAD on the same frames, then transcription of the utterance, then one chat completion; with
    `audio_out`, its first sentence (cut as the server cuts the answers it speaks, core/sentences.py) sent
    to `/v1/audio/speech` the moment it is complete, as LiveKit and Pipecat do."""
    audio, speech_end = turn_audio(slug, args.lead_s, args.tail_s)
    step = int(16000 * FRAME_S)
    frames = [audio[i : i + step] for i in range(0, len(audio), step)]
    vad = SpeechDetector(VadSettings(silence_duration_ms=args.silence_ms))
    onset: list[int] = []
    stopped = asyncio.Event()
    end_sample: list[int] = []
    stopped_at: list[float] = []

    async def send(frame: np.ndarray) -> None:
        for event in vad.feed(frame):
            if event.kind == "started" and not onset:
                onset.append(event.sample)
            elif event.kind == "stopped" and not stopped.is_set():
                end_sample.append(event.sample)
                stopped_at.append(time.perf_counter())
                stopped.set()

    out: dict[str, Any] = {"slug": slug, "system": "cascade+audio" if audio_out else "cascade"}
    splitter = SentenceSplitter.of(TtsConfig())
    speaking: asyncio.Task[tuple[float, int]] | None = None
    start = time.perf_counter()
    eos = start + speech_end
    # The microphone goes on while the client transcribes and asks: it acts on its VAD's stop at once.
    microphone = asyncio.create_task(paced(frames, send, start))
    try:
        waiting = asyncio.create_task(stopped.wait())
        await asyncio.wait({microphone, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if not stopped.is_set():
            return {**out, "error": "the VAD did not end the turn"}
        out["eos_to_stopped_s"] = stopped_at[0] - eos
        utterance = audio[onset[0] : end_sample[0]]
        wav = wav_bytes((np.clip(utterance, -1, 1) * 32767).astype("<i2").tobytes(), 16000)
        files = {"file": ("turn.wav", wav, "audio/wav")}
        heard = await client.post(f"{base}/v1/audio/transcriptions", files=files, timeout=60)
        out["transcript_lag_s"] = time.perf_counter() - eos
        transcript = heard.json().get("text", "").strip()
        out["transcript"] = transcript
        body = {
            "messages": [{"role": "user", "content": transcript}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        text: list[str] = []
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") if "choices" in line else None
                if delta:
                    if not audio_out:
                        out.setdefault("eos_to_first_s", time.perf_counter() - eos)
                    elif speaking is None and (pieces := splitter.feed(delta)):
                        speaking = asyncio.create_task(first_audio(base, client, pieces[0]))
                    text.append(delta)
        out["answer"] = "".join(text)
        if audio_out:
            if speaking is None and (rest := splitter.flush()).strip():
                speaking = asyncio.create_task(first_audio(base, client, rest))
            if speaking is not None:
                at, out["audio_bytes"] = await speaking
                out["eos_to_first_s"] = at - eos
        out["status"] = "completed"
        await microphone  # (the turn's audio ends)
        return out
    finally:
        microphone.cancel()  # (a failure above: the microphone stops too)


def work(handles: dict[str, Any], processes: dict[str, list[Any]]) -> dict[str, float]:
    """Running totals of the engines' work: prompt tokens computed on prefill and decode, tokens decoded (a
    prefill's sampled token is not counted: its logits come with the prompt's, no pass of its own), audio seconds
    transcribed; and CPU seconds of every engine process (speech, prefill and decode: the LLM's work and the
    recognizer's in one unit) and of the router replicas (where the voice systems' VAD runs; the cascade's runs in
    this client)."""
    prefill = handles["prefill"].stats.remote().result(timeout_s=60)
    decode = handles["decode"].stats.remote().result(timeout_s=60)
    speech = handles["speech"].stats.remote().result(timeout_s=60)
    tts = handles["tts"].stats.remote().result(timeout_s=60) if "tts" in handles else {}
    return {
        # (less the token a held preemptive answer is fed again when it goes on: the decode step on it, decode/hold.py)
        "llm_prompt_tokens": prefill["prompt_tokens_computed_total"]
        + decode["prompt_tokens_computed_total"]
        - decode.get("held_tokens_fed_again", 0),
        "llm_generated_tokens": decode["generation_tokens"],
        "audio_s_transcribed": speech["audio_seconds"],
        "transcriptions": speech["transcriptions"],
        "tts_audio_s": tts.get("audio_seconds", 0.0),
        "tts_busy_s": tts.get("busy_s", 0.0),
        "engine_cpu_s": cpu.cpu_s(processes["engines"]),
        "router_cpu_s": cpu.cpu_s(processes["router"]),
    }


async def level(
    args: argparse.Namespace, base: str, voices: int, handles: dict[str, Any], processes: dict[str, list[Any]]
) -> dict[str, Any]:
    rng = random.Random(voices)
    slugs = list(SENTENCES)
    rng.shuffle(slugs)  # (each round's sentences are every system's: their work compares the same turns)
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    spent: dict[str, dict[str, float]] = {s: {} for s in args.systems}
    rounds: list[dict[str, Any]] = []  # each round's work by system (one voice: one turn's)
    bar = tqdm(total=args.turns * len(args.systems) * voices, desc=f"{voices} voice(s)", unit="turn")
    async with httpx.AsyncClient() as client:
        for round_ in range(args.turns):
            order = list(args.systems)
            rng.shuffle(order)
            turn_slugs = [slugs[(round_ * voices + v) % len(slugs)] for v in range(voices)]
            rounds.append({"sentences": turn_slugs})
            for system in order:
                before = await asyncio.to_thread(work, handles, processes)
                speaks = system.endswith("+audio")
                if system.startswith("cascade"):
                    runs = [cascade_turn(args, base, s, client, speaks) for s in turn_slugs]
                else:
                    runs = [voice_turn(args, base, s, "preemptive" in system, speaks) for s in turn_slugs]
                done = await asyncio.gather(*runs)
                after = await asyncio.to_thread(work, handles, processes)
                rounds[-1][system] = delta = {key: after[key] - before[key] for key in after}
                for key, value in delta.items():
                    spent[system][key] = spent[system].get(key, 0.0) + value
                results[system] += done
                bar.update(voices)
                await asyncio.sleep(0.5)  # (the engines settle between systems)
    bar.close()
    return {"voices": voices, "summary": summarise(results, spent, args), "turns": results, "work_by_round": rounds}


def summarise(results: dict[str, list[dict[str, Any]]], spent: dict[str, dict[str, float]], args: Any) -> dict:
    summary: dict[str, Any] = {}
    cascade_answer = {(r["transcript"]): r["answer"] for r in results.get("cascade", []) if r.get("transcript")}
    for system, turns in results.items():
        ok = [r for r in turns if "eos_to_first_s" in r and "error" not in r]
        first = [r["eos_to_first_s"] for r in ok]
        lag = [r["transcript_lag_s"] for r in ok if "transcript_lag_s" in r]
        vad = [r["eos_to_stopped_s"] for r in ok if "eos_to_stopped_s" in r]
        after_vad = [r["eos_to_first_s"] - r["eos_to_stopped_s"] for r in ok if "eos_to_stopped_s" in r]
        made = [r["made_before_stop_s"] for r in ok if "made_before_stop_s" in r]
        n = max(len(turns), 1)
        same = [r for r in ok if r.get("transcript") in cascade_answer]
        row = {
            "turns": len(turns),
            "answered": len(ok),
            **{f"p{q}_ms": pct_ms(first, q) for q in (50, 95, 99)},
            "over_silence_p50_ms": (pct_ms(first, 50) or 0) - args.silence_ms if first else None,
            "transcript_lag_p50_ms": pct_ms(lag, 50),
            # The two parts of end of speech → first token: the VAD's decision (the same VAD for every system),
            # then this system's own time from it to the first token.
            "vad_stop_p50_ms": pct_ms(vad, 50),
            "stop_to_first_p50_ms": pct_ms(after_vad, 50),
            "stop_to_first_p95_ms": pct_ms(after_vad, 95),
            # A delivered preemptive answer's first token: how long before the VAD's stop it was made (P50, P5).
            "made_before_stop_p50_ms": pct_ms(made, 50),
            "made_before_stop_p5_ms": pct_ms(made, 5),
            "transcripts_exact": sum(r.get("transcript") == SENTENCES[r["slug"]] for r in turns) / n,
            "preemptive_delivered": sum(r.get("preemptive") == "confirmed" for r in turns) / n,
            "same_answer_as_cascade": (
                sum(r["answer"] == cascade_answer[r["transcript"]] for r in same) / len(same) if same else None
            ),
            **{f"{k}_per_turn": v / n for k, v in spent[system].items()},
        }
        if system.endswith("+audio"):
            row["audio_out_s_per_turn"] = sum(r.get("audio_bytes", 0) for r in turns) / 2 / 24000 / n
        summary[system] = row
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def report(record: dict[str, Any], args: argparse.Namespace, stamp: str) -> str:
    lines = [
        "# Spoken turns: end of speech → first answer token",
        "",
        f"`python bench/voice.py --voices {' '.join(map(str, args.voices))} --turns {args.turns}"
        + (f" --partial-every-ms {args.partial_every_ms or 'none'} --name {args.name}" if args.name != "voice" else "")
        + f"` ({stamp}); the default config (`local:tiny-llama`, `local:tiny-whisper`), partial transcripts "
        + (f"every {args.partial_every_ms} ms of audio" if args.partial_every_ms else "at pauses only")
        + "; server_vad silence "
        f"{args.silence_ms} ms (the cascade's client VAD the same); answers of {args.max_tokens} tokens; "
        f"preemptive after_idle_ms {args.after_idle_ms} (null: the VAD's pause starts it), max_tokens "
        f"{args.preemptive_tokens}, {args.spoken_preemptive_tokens} when it answers in speech (held there until the "
        "turn is confirmed); speech.pause_lead_ms "
        f"{args.pause_lead_ms} (a pause counts that long before the window ends; null: at 96 ms of silence); each "
        "round's sentences the same for every system, the 16 in "
        "turn; work per turn: prompt tokens computed on prefill and decode, tokens decoded, CPU of every engine "
        "process (speech, prefill, decode: the recognizer's work and the LLM's in one unit) and of the router "
        "(the voice systems' VAD runs there, the cascade's in the bench client); audio paced in "
        f'{FRAME_S * 1000:.0f} ms frames. "VAD stop": end of speech → the VAD\'s end of turn (`speech_stopped`; '
        'the cascade\'s own VAD, the same model and settings); "stop → first": from there to the first token.',
        "",
        "| voices | system | P50 / P95 / P99 ms | P50 over silence | VAD stop P50 | stop → first P50 / P95 "
        "| transcript lag P50 | exact transcripts | preemptive delivered (made before stop P50 / P5) "
        "| same answer as cascade | audio s / turn "
        "| transcriptions / turn | LLM prompt tok / turn | decoded / turn | engines' CPU ms / turn "
        "| router CPU ms / turn |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in record["runs"]:
        for system, row in run["summary"].items():
            same = "-" if row["same_answer_as_cascade"] is None else f"{row['same_answer_as_cascade']:.0%}"
            # (a turn that failed, an `error` event included, is not timed: said beside the system)
            failed = "" if row["answered"] == row["turns"] else f" ({row['turns'] - row['answered']} failed)"
            lines.append(
                f"| {run['voices']} | {system}{failed} "
                f"| {_ms(row['p50_ms'])} / {_ms(row['p95_ms'])} / {_ms(row['p99_ms'])} "
                f"| {_ms(row['over_silence_p50_ms'])} | {_ms(row['vad_stop_p50_ms'])} "
                f"| {_ms(row['stop_to_first_p50_ms'])} / {_ms(row['stop_to_first_p95_ms'])} "
                f"| {_ms(row['transcript_lag_p50_ms'])} "
                f"| {row['transcripts_exact']:.0%} | {row['preemptive_delivered']:.0%}"
                + (
                    f" ({_ms(row.get('made_before_stop_p50_ms'))} / {_ms(row.get('made_before_stop_p5_ms'))} ms)"
                    if row.get("made_before_stop_p50_ms") is not None
                    else ""
                )
                + f" | {same} "
                f"| {row.get('audio_s_transcribed_per_turn', 0):.1f} | {row.get('transcriptions_per_turn', 0):.1f} "
                f"| {row.get('llm_prompt_tokens_per_turn', 0):.1f} "
                f"| {row.get('llm_generated_tokens_per_turn', 0):.1f} "
                f"| {1000 * row.get('engine_cpu_s_per_turn', 0):.0f} "
                f"| {1000 * row.get('router_cpu_s_per_turn', 0):.0f} |"
            )
    lines += ["", "Work per turn against the cascade's (the same sentences):", ""]
    for run in record["runs"]:
        base = run["summary"].get("cascade", {})
        for system, row in run["summary"].items():
            if system == "cascade" or not base:
                continue
            ratios = [f"{label} {row.get(key, 0) / base[key]:.2f}x" for key, label in WORK if base.get(key)]
            llm = [k for k in ("llm_prompt_tokens_per_turn", "llm_generated_tokens_per_turn") if base.get(k)]
            if llm:  # (the LLM's work: every token it computed, prompt and decoded)
                ratios.insert(2, f"LLM tokens {sum(row.get(k, 0) for k in llm) / sum(base[k] for k in llm):.2f}x")
            lines.append(f"- {run['voices']} voice(s), {system}: " + ", ".join(ratios))
    lines += spoken_answers(record)
    decode_step = record.get("decode_step_ms")
    if decode_step:
        lines += ["", f"Decode step (median inter-token time of a plain streamed chat here): {decode_step:.1f} ms."]
    return "\n".join(lines) + "\n"


def spoken_answers(record: dict[str, Any]) -> list[str]:
    """Issue 43's figures: a spoken answer's first audio byte against the same system's first text token (the
    same run, the same sentences), and against the cascade that speaks through `/v1/audio/speech`."""
    lines = []
    for run in record["runs"]:
        summary = run["summary"]
        if "voice+audio" not in summary:
            continue
        if not lines:
            lines += [
                "",
                "Spoken answers (end of speech → first audio byte):",
                "",
                "| voices | system | first audio P50 / P95 / P99 ms | its text system's first token P50 "
                "| audio − text P50 | cascade+audio P50 / P95 / P99 | ahead of it at every percentile "
                "| audio out s / turn | synthesized s / turn | TTS busy ms / turn |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
        cascade = summary.get("cascade+audio", {})
        for system in ("voice+audio", "voice+preemptive+audio"):
            row, text = summary.get(system), summary.get(system.removesuffix("+audio"), {})
            if row is None or row["p50_ms"] is None:
                continue
            gap = row["p50_ms"] - text["p50_ms"] if text.get("p50_ms") is not None else None
            quantiles = ("p50_ms", "p95_ms", "p99_ms")
            ahead = all(row[q] is not None and cascade.get(q) is not None and row[q] < cascade[q] for q in quantiles)
            lines.append(
                f"| {run['voices']} | {system} | {' / '.join(_ms(row[q]) for q in quantiles)} "
                f"| {_ms(text.get('p50_ms'))} | {_ms(gap)} "
                f"| {' / '.join(_ms(cascade.get(q)) for q in quantiles)} | {'yes' if ahead else 'no'} "
                f"| {row.get('audio_out_s_per_turn', 0):.2f} | {row.get('tts_audio_s_per_turn', 0):.2f} "
                f"| {1000 * row.get('tts_busy_s_per_turn', 0):.1f} |"
            )
    return lines


async def decode_step_ms(base: str) -> float:
    """The median gap between a streamed chat's tokens: one decode step on this machine, now."""
    gaps: list[float] = []
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "stream": True}
            last = None
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
    return statistics.median(gaps) * 1000 if gaps else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 turns, 1 and 2 voices")
    parser.add_argument("--voices", type=int, nargs="+", default=[1, 4], help="voices at once")
    parser.add_argument("--turns", type=int, default=16, help="rounds: turns per voice and system")
    parser.add_argument("--silence-ms", type=int, default=500, help="server_vad's silence window (OpenAI's default)")
    parser.add_argument(
        "--after-idle-ms", type=int, default=None, help="voice+preemptive: after_idle_ms (default: none, pauses only)"
    )
    parser.add_argument(
        "--pause-lead-ms",
        default=None,
        help="speech.pause_lead_ms for the run ('none': pauses at 96 ms of silence; default: the config's)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="the answer's")
    parser.add_argument(
        "--no-speak", action="store_true", help="text answers only (no +audio systems: the answer spoken, tts/)"
    )
    parser.add_argument(
        "--preemptive-tokens",
        type=int,
        default=PreemptiveOptions.model_validate(SpeechConfig().preemptive or {}).max_tokens,
        help="voice+preemptive: the answer made at a pause stops (held) there until the turn is confirmed "
        "(default: speech.preemptive's)",
    )
    parser.add_argument(
        "--spoken-preemptive-tokens",
        type=int,
        default=None,
        help="voice+preemptive+audio: where its answer is held (default: as the server holds a spoken session's, "
        "tts.preemptive_tokens)",
    )
    parser.add_argument("--lead-s", type=float, default=0.4, help="silence before the speech")
    parser.add_argument("--tail-s", type=float, default=1.0, help="silence after it (more than the window)")
    parser.add_argument(
        "--partial-every-ms",
        default=None,
        help="speech.partial_every_ms for the run ('none': transcribed at pauses only; default: the config's)",
    )
    parser.add_argument(
        "--systems", nargs="+", default=None, help=f"only these ({', '.join(TEXT_SYSTEMS + AUDIO_SYSTEMS)})"
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "config.yaml"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="voice", help="the result files' name (<name>.json, <name>.md)")
    args = parser.parse_args()
    if args.quick:
        args.voices, args.turns = [1, 2], 2
    every = TEXT_SYSTEMS + (() if args.no_speak else AUDIO_SYSTEMS)
    unknown = set(args.systems or ()) - set(every)
    assert not unknown, f"no such system(s): {', '.join(sorted(unknown))}"
    args.systems = tuple(s for s in every if s in (args.systems or every))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    assert app_args.get("speech", {}).get("model"), "the config has no speech role"
    if args.partial_every_ms is not None:
        every = None if args.partial_every_ms.lower() == "none" else int(args.partial_every_ms)
        app_args["speech"]["partial_every_ms"] = every
    args.partial_every_ms = app_args["speech"].get("partial_every_ms", "default (300)")
    if args.pause_lead_ms is not None:
        lead = None if args.pause_lead_ms.lower() == "none" else int(args.pause_lead_ms)
        app_args["speech"]["pause_lead_ms"] = lead
    args.pause_lead_ms = SpeechConfig.model_validate(app_args["speech"]).pause_lead_ms
    if args.spoken_preemptive_tokens is None:  # (as the config's server holds a spoken session's)
        spoken = TtsConfig.model_validate(app_args.get("tts") or {}).preemptive_tokens
        args.spoken_preemptive_tokens = max(args.preemptive_tokens, spoken or 0)
    with systems.app(app_args) as app:
        from ray import serve

        roles = ("prefill", "decode", "speech") + (() if args.no_speak else ("tts",))
        handles = {role: serve.get_deployment_handle(role, app_name=systems.APP_NAME) for role in roles}
        processes = cpu.find_roles({"engines": systems.ENGINES, "router": app.roles["router"]}, app.root)
        step = asyncio.run(decode_step_ms(app.base))
        runs = [asyncio.run(level(args, app.base, voices, handles, processes)) for voices in args.voices]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    record = {"args": record_io.portable(vars(args)), "runs": runs, "stamp": stamp}
    record["decode_step_ms"] = step
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2))
    text = report(record, args, stamp)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
