"""The realtime socket's audio path in the router, with a fake owner and a fake speech replica: the VAD's events,
the transcript revising the session's input through the update mode, the commit and the answer, barge-in, the
audio settings of session.update, and refusals."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.config import AppConfig, SpeechConfig, TtsConfig
from local_models.whisper import load_sample
from prefill.client import PrefillClient
from router.keys.auth import APIKeys
from router.realtime import socket as realtime
from router.realtime.spoken_turn import settled
from tests.unit.router.test_realtime import FakePrefill, until

pytestmark = pytest.mark.timeout(60)


class FakeSpeech:
    """A speech replica: the audio's length decides the transcript, as a recognizer revising its hypothesis:
    under 1 s "what is", then "what is the weather", and the whole clip "What is the weather in Paris?"."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.fail = fail
        self.transcribe = self._transcribe
        self.info = self._info

    async def _info(self) -> dict[str, Any]:
        return {"window_s": 5.0}

    async def _transcribe(self, pcm: bytes, **kwargs: Any) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        seconds = len(pcm) / 2 / 16000
        self.calls.append(len(pcm) // 2)
        if self.fail:
            return {"error": {"message": "the model failed", "code": 500}}
        text = (
            "what is" if seconds < 1.0 else "what is the weather" if seconds < 1.5 else "What is the weather in Paris?"
        )
        return {"text": text, "usage": {"prompt_tokens": 4, "completion_tokens": 3}}


def pcm24k(slug: str = "weather_paris", after_s: float = 1.0) -> bytes:
    return as_pcm24k([np.zeros(4800), load_sample(slug), np.zeros(int(after_s * 16000))])


def as_pcm24k(parts: list[np.ndarray]) -> bytes:
    """16 kHz audio, joined, as a client sends it: PCM16 at 24 kHz."""
    import soxr

    audio = np.concatenate(parts).astype(np.float32)
    return (np.clip(soxr.resample(audio, 16000, 24000), -1, 1) * 32767).astype("<i2").tobytes()


@contextlib.contextmanager
def connect(prefill: FakePrefill, speech: FakeSpeech | None, tts: Any = None, **speech_config: Any) -> Iterator[Any]:
    app = FastAPI()
    app.include_router(realtime.api)
    speech_settings = SpeechConfig(model="local:tiny-whisper", **speech_config)
    config = SimpleNamespace(
        model_name="local:tiny-llama", limits=AppConfig().limits, speech=speech_settings, tts=TtsConfig()
    )
    app.state.ingress = SimpleNamespace(
        api_keys=APIKeys([]), config=config, prefill=PrefillClient(prefill), speech=speech, tts=tts
    )
    with TestClient(app).websocket_connect("/v1/realtime") as ws:
        assert ws.receive_json()["type"] == "session.created"
        yield ws


def send_audio(ws: Any, pcm: bytes) -> None:
    for i in range(0, len(pcm), 4800):  # 100 ms appends
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + 4800]).decode()})


def test_a_spoken_turn_revises_the_input_commits_it_and_answers() -> None:
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        send_audio(ws, pcm24k())
        started, _ = until(ws, "input_audio_buffer.speech_started")
        stopped, seen = until(ws, "input_audio_buffer.speech_stopped")
        committed, more = until(ws, "input_audio_buffer.committed")
        created, _ = until(ws, "conversation.item.created")
        completed, _ = until(ws, "conversation.item.input_audio_transcription.completed")
        done, _ = until(ws, "response.done")
    assert started["item_id"] == stopped["item_id"] == committed["item_id"] == completed["item_id"]
    assert completed["transcript"] == "What is the weather in Paris?"
    assert created["item"]["content"] == [{"type": "input_audio", "transcript": "What is the weather in Paris?"}]
    assert completed["usage"]["type"] == "duration" and 2.0 < completed["usage"]["seconds"] < 3.0
    deltas = "".join(e["delta"] for e in seen + more if e["type"].endswith("transcription.delta"))
    # Deltas are what two successive transcripts agree on ("what is"); the final transcript changed it ("What"),
    # so no delta followed: `completed` carries the transcript.
    assert deltas == "what is"
    # The input was revised as the transcript changed: appended, then replaced from the first changed character.
    # (The client sends each keyword: an append's and a commit's `offset` and a commit's `text` are the defaults.)
    ops = [(c["op"], c["offset"], c["text"]) for c in prefill.called("session_buffer")]
    assert ops[0][:2] == ("append", 0) and "what is".startswith(ops[0][2])
    assert applied(prefill) == "What is the weather in Paris?"
    # server_vad's create_response: one call to the owner commits the input and starts the answer
    assert "commit" not in [op for op, _, _ in ops] and len(prefill.called("session_respond")) == 1
    assert [name for name, _ in prefill.calls].index("session_respond") > max(
        i for i, (name, _) in enumerate(prefill.calls) if name == "session_buffer"
    )
    assert done["response"]["status"] == "completed"


def test_a_refused_answer_at_the_end_of_a_spoken_turn_still_commits_its_input() -> None:
    """The owner refuses the answer the VAD's end of turn asks for: an `error` event says why, the input is
    committed all the same (the user's item is the conversation's), and the session goes on to answer the next."""
    prefill, speech = FakePrefill(), FakeSpeech()
    refusal = {"message": "a response is already in progress", "type": "invalid_request_error", "code": 409}
    prefill.fail["session_respond"] = {"error": refusal}
    with connect(prefill, speech) as ws:
        send_audio(ws, pcm24k())
        error, seen = until(ws, "error")
        assert error["error"]["message"] == refusal["message"]
        assert "conversation.item.input_audio_transcription.completed" in [e["type"] for e in seen]
        ops = [c["op"] for c in prefill.called("session_buffer")]
        for _ in range(100):  # (the commit follows the refusal)
            if ops[-1] == "commit":
                break
            time.sleep(0.01)
            ops = [c["op"] for c in prefill.called("session_buffer")]
        assert ops[-1] == "commit"
        ws.send_json({"type": "response.create"})
        done, _ = until(ws, "response.done")
    assert done["response"]["status"] == "completed"
    assert len(prefill.called("session_respond")) == 2


def test_agreed_words_enter_the_input_as_spoken_and_the_pause_starts_the_preemptive_answer() -> None:
    """As the user speaks, only words two transcripts agree on, and not the newest one's last two, enter the
    input; the pause's transcript goes in whole, and the preemptive answer (on by default for voice,
    `speech.preemptive`) is asked for then, once, not at the gaps between transcripts."""
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        send_audio(ws, pcm24k(after_s=0.45))  # the clip and a pause (the rest of the window comes later)
        for _ in range(500):
            if prefill.called("session_preempt"):
                break
            time.sleep(0.01)  # (the app runs in the test client's own thread)
        send_audio(ws, bytes(48000))  # 1 s of silence: the VAD ends the turn
        until(ws, "response.done")
    names = [name for name, _ in prefill.calls]
    update = prefill.called("session_update")[0]
    assert update["preemptive"] == {"after_idle_ms": None, "max_tokens": 4}  # pauses only, held at 4 tokens
    assert names.count("session_preempt") == 1
    pause = names.index("session_preempt")
    before = [kw for name, kw in prefill.calls[:pause] if name == "session_buffer"]
    # Each state of the input while speaking is settled words of one of the recognizer's transcripts:
    # "what" (of "what is"), then "What is the weather" (of the whole sentence, its last two words held back).
    states = [applied(prefill, upto) for upto in range(1, len(before))]
    assert states and all(state in ("what", "What is the weather") for state in states), states
    assert applied(prefill, len(before)) == "What is the weather in Paris?"  # the pause's transcript, whole
    assert len(speech.calls) >= 3  # (partials were made: the gaps between them started no answer)
    after = [kw["op"] for name, kw in prefill.calls[pause:] if name == "session_buffer"]
    assert after == []  # the end of the turn reused the pause's transcript: nothing new to prefill, no commit
    assert [name for name, _ in prefill.calls[pause:]].count("session_respond") == 1  # (it commits, and answers)


def applied(prefill: FakePrefill, upto: int | None = None) -> str:
    """The session's input text after its first `upto` buffer calls (appends and replaces from an offset)."""
    text = ""
    for call in prefill.called("session_buffer")[:upto]:
        if call["op"] == "append":
            text += call["text"]
        elif call["op"] == "replace":
            text = text[: call["offset"]] + call["text"]
    return text


def test_settled_words_are_agreed_and_behind_the_newest_transcripts_last_words() -> None:
    assert settled("what is the weather", "what is the weather in") == "what is the"
    assert settled("what is the weather", "what is the weather") == "what is"
    assert settled("what", "what is") == ""
    assert settled("", "anything at all") == ""


def test_preemptive_null_turns_a_spoken_sessions_default_off() -> None:
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        ws.send_json({"type": "session.update", "session": {"preemptive": None}})
        until(ws, "session.updated")
        send_audio(ws, pcm24k())
        until(ws, "response.done")
    assert [c.get("preemptive") for c in prefill.called("session_update")] == [False]  # off on the owner
    assert not prefill.called("session_preempt")


def test_a_session_that_speaks_holds_its_default_preemptive_answer_until_its_first_piece() -> None:
    """`speech.preemptive` holds a text session's answer at 4 tokens; one that answers in speech holds it at
    `tts.preemptive_tokens`, so that its first piece is synthesized in the pause. The default follows the session's
    output as it changes; a client's own `preemptive` is never changed."""
    from tests.unit.router.test_realtime_speech import FakeTts

    spoken = {"after_idle_ms": None, "max_tokens": TtsConfig().preemptive_tokens}
    text = {"after_idle_ms": None, "max_tokens": 4}
    prefill = FakePrefill()
    with connect(prefill, FakeSpeech(), tts=FakeTts()) as ws:
        ws.send_json({"type": "session.update", "session": {"output_modalities": ["audio"]}})
        until(ws, "session.updated")
        send_audio(ws, bytes(4800))  # (the first audio: the voice defaults)
        ws.send_json({"type": "session.update", "session": {"output_modalities": ["text"]}})
        assert until(ws, "session.updated")[0]["session"]["preemptive"] == text
        ws.send_json({"type": "session.update", "session": {"output_modalities": ["audio"]}})
        assert until(ws, "session.updated")[0]["session"]["preemptive"] == spoken
        ws.send_json({"type": "session.update", "session": {"instructions": "Be brief."}})  # (nothing to change)
        until(ws, "session.updated")
    assert [c.get("preemptive") for c in prefill.called("session_update")] == [None, spoken, text, spoken, None]

    prefill = FakePrefill()
    mine = {"after_idle_ms": 300, "max_tokens": 2}
    with connect(prefill, FakeSpeech(), tts=FakeTts()) as ws:
        ws.send_json({"type": "session.update", "session": {"preemptive": mine}})
        until(ws, "session.updated")
        send_audio(ws, bytes(4800))
        ws.send_json({"type": "session.update", "session": {"output_modalities": ["audio"]}})
        assert until(ws, "session.updated")[0]["session"]["preemptive"] == mine
    assert [c.get("preemptive") for c in prefill.called("session_update")] == [mine, None]


def test_manual_commits_without_vad_and_the_audio_settings_as_shown() -> None:
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        audio = {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None}}
        ws.send_json({"type": "session.update", "session": {"audio": audio}})
        updated, _ = until(ws, "session.updated")
        assert updated["session"]["audio"]["input"]["turn_detection"] is None
        send_audio(ws, pcm24k(after_s=0.2))
        ws.send_json({"type": "input_audio_buffer.commit"})
        completed, seen = until(ws, "conversation.item.input_audio_transcription.completed")
        assert "input_audio_buffer.speech_started" not in [e["type"] for e in seen]
        assert completed["transcript"] == "What is the weather in Paris?"
        assert not prefill.called("session_respond")  # the client asks for the answer
        ws.send_json({"type": "input_audio_buffer.commit"})
        assert ws.receive_json()["error"]["code"] == "input_audio_buffer_commit_empty"


def test_speech_cancels_the_response_in_progress() -> None:
    prefill, speech = FakePrefill(), FakeSpeech()
    prefill.claim_delay = 30.0  # the answer streams until something stops it
    with connect(prefill, speech) as ws:
        ws.send_json(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            }
        )
        ws.send_json({"type": "response.create"})
        until(ws, "response.created")
        send_audio(ws, pcm24k(after_s=0.1))
        _, seen = until(ws, "response.done")
    kinds = [e["type"] for e in seen]
    assert "input_audio_buffer.speech_started" in kinds
    done = next(e for e in seen if e["type"] == "response.done")
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"


def test_a_failed_transcription_is_reported_and_its_text_leaves_the_input() -> None:
    prefill, speech = FakePrefill(), FakeSpeech(fail=True)
    with connect(prefill, speech) as ws:
        send_audio(ws, pcm24k())
        failed, _ = until(ws, "conversation.item.input_audio_transcription.failed")
        assert failed["error"]["code"] == "transcription_failed"
        ws.send_json({"type": "input_text_buffer.append", "delta": "typed"})
        ws.send_json({"type": "input_text_buffer.commit"})
        until(ws, "input_text_buffer.committed")  # the session goes on
    assert not prefill.called("session_respond")


def test_audio_without_a_speech_role_and_bad_settings_are_refused_by_name() -> None:
    prefill = FakePrefill()
    with connect(prefill, None) as ws:
        ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0\0").decode()})
        assert ws.receive_json()["error"]["code"] == "audio_not_supported"
    with connect(prefill, FakeSpeech()) as ws:
        for session, param in (
            ({"turn_detection": {"type": "server_vad", "threshold": 2}}, "session.turn_detection.threshold"),
            (
                {"audio": {"input": {"turn_detection": {"type": "magic_vad"}}}},
                "session.audio.input.turn_detection.type",
            ),
            ({"input_audio_format": "mp3"}, "session.input_audio_format"),
            ({"type": "conversation"}, "session.type"),
        ):
            ws.send_json({"type": "session.update", "session": session})
            error = ws.receive_json()
            assert error["type"] == "error" and error["error"]["param"] == param, (session, error)
        ws.send_json(
            {"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}
        )
        updated = ws.receive_json()
        assert updated["session"]["audio"]["input"]["turn_detection"]["eagerness"] == "high"


def test_idle_timeout_triggers_once_per_idle_stretch_and_answers() -> None:
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        detection = {"type": "server_vad", "idle_timeout_ms": 1000}
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": detection}}}})
        until(ws, "session.updated")
        silence = b"\0\0" * 24000 * 3  # 3 s of silence at 24 kHz: one trigger a second of it
        send_audio(ws, silence)
        timeout, _ = until(ws, "input_audio_buffer.timeout_triggered")
        assert timeout["audio_end_ms"] - timeout["audio_start_ms"] == 1000
        # As OpenAI's: the silent audio is committed as an input_audio item, then answered.
        committed, _ = until(ws, "input_audio_buffer.committed")
        created, _ = until(ws, "conversation.item.created")
        until(ws, "response.done")
    assert committed["item_id"] == timeout["item_id"] == created["item"]["id"]
    assert created["item"]["content"] == [{"type": "input_audio", "transcript": ""}]
    assert prefill.called("session_respond")


def test_truncate_names_a_known_item() -> None:
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        ws.send_json({"type": "conversation.item.truncate", "item_id": "item_x", "audio_end_ms": 10})
        assert ws.receive_json()["error"]["code"] == "item_not_found"
        item = {"id": "item_a", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ws.send_json({"type": "conversation.item.create", "item": item})
        until(ws, "conversation.item.created")
        ws.send_json({"type": "conversation.item.truncate", "item_id": "item_a", "audio_end_ms": 10})
        truncated, _ = until(ws, "conversation.item.truncated")
        assert truncated["item_id"] == "item_a" and truncated["audio_end_ms"] == 10
        assert not prefill.called("session_truncate")  # (no text_end: nothing to cut in a text answer)
        ws.send_json({"type": "conversation.item.truncate", "item_id": "item_a", "audio_end_ms": 10, "text_end": 2})
        assert ws.receive_json()["error"]["param"] == "item_id"  # a user item is not an answer
        ws.send_json({"type": "response.create"})
        done, seen = until(ws, "response.done")
        answer = next(e["item"]["id"] for e in seen if e["type"] == "response.output_item.added")
        ws.send_json({"type": "conversation.item.truncate", "item_id": answer, "audio_end_ms": 900, "text_end": 5})
        until(ws, "conversation.item.truncated")
    assert prefill.called("session_truncate")[-1]["chars"] == 5


def owner_text_at_commits(prefill: FakePrefill) -> list[str]:
    """The owner's input text at each commit, from the `session_buffer` calls it took, in order."""
    text, committed = "", []
    for call in prefill.called("session_buffer"):
        if call["op"] == "append":
            text += call["text"]
        elif call["op"] == "replace":
            text = text[: call["offset"]] + call["text"]
        elif call["op"] == "clear":
            text = ""
        elif call["op"] == "commit":
            committed.append(text)
            text = ""
    return committed


def test_text_typed_during_a_spoken_turn_stays_before_its_transcript_on_both_sides() -> None:
    """Typed text and a transcript revised at once: the owner's copy and the router's agree, nothing typed is
    lost, and a commit during the turn ends it with its audio so far."""
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        detection = {"type": "server_vad", "create_response": False}
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": detection}}}})
        until(ws, "session.updated")
        pcm = pcm24k(after_s=0.0)
        half = len(pcm) // 2 // 4800 * 4800
        send_audio(ws, pcm[:half])
        until(ws, "input_audio_buffer.speech_started")
        ws.send_json({"type": "input_text_buffer.append", "delta": "Note:"})
        send_audio(ws, pcm[half:])
        ws.send_json({"type": "input_text_buffer.append", "delta": " urgent"})
        ws.send_json({"type": "input_text_buffer.commit"})  # (ends the spoken turn with its audio so far)
        completed, _ = until(ws, "conversation.item.input_audio_transcription.completed")
    committed = owner_text_at_commits(prefill)
    assert committed[0] == "Note: urgent " + completed["transcript"], committed


def test_the_vad_hears_the_end_of_speech_without_the_resamplers_delay() -> None:
    """24 kHz audio reaches the VAD through a resampler that holds back a sample (the one for transcription
    holds back ~6 ms): audio up to 1 ms past the silence window's end is enough for `speech_stopped`."""
    import soxr

    from router.voice.vad import SpeechDetector, VadSettings

    pcm = pcm24k(after_s=1.0)
    x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    stream = soxr.ResampleStream(24000, 16000, 1, dtype="float32", quality="QQ")
    detector, stop = SpeechDetector(VadSettings()), None  # (where the server's VAD ends the turn)
    for i in range(0, len(x), 480):
        stop = next(
            (e.sample for e in detector.feed(stream.resample_chunk(x[i : i + 480])) if e.kind == "stopped"), None
        )
        if stop is not None:
            break
    assert stop is not None
    with connect(FakePrefill(), FakeSpeech()) as ws:
        send_audio(ws, pcm[: (stop + 16) * 3 // 2 * 2])
        ws.send_json({"type": "session.update", "session": {}})  # (answered after every append before it)
        _, seen = until(ws, "session.updated")
    assert "input_audio_buffer.speech_stopped" in [e["type"] for e in seen]


def spoken_twice(gap_s: float) -> bytes:
    """ "Tell me a joke.", a pause of `gap_s` inside the turn, "Thank you very much.", then the window's silence."""
    gap = np.zeros(int(gap_s * 16000))
    return as_pcm24k([np.zeros(4800), load_sample("joke"), gap, load_sample("thanks"), np.zeros(16000)])


@pytest.mark.parametrize(("pause_lead_ms", "answers"), [(None, 2), (120, 1)])
def test_a_pause_counts_late_in_the_window_so_a_shorter_one_costs_nothing(
    pause_lead_ms: int | None, answers: int
) -> None:
    """A pause of 250 ms inside the turn: at 96 ms of silence (`pause_lead_ms` None) it is transcribed and starts an
    answer, given up when speech resumes; 120 ms before a 500 ms window ends (380 ms into the silence) it is
    neither, and the turn's end is both, before the VAD ends the turn."""
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech, pause_lead_ms=pause_lead_ms, partial_every_ms=None) as ws:
        pcm = spoken_twice(0.25)
        for i in range(0, len(pcm), 4800):  # at 2x the audio's pace (the fake recognizer keeps up: 1 ms a call)
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + 4800]).decode()})
            time.sleep(0.05)
        until(ws, "response.done")
    names = [name for name, _ in prefill.calls]
    assert names.count("session_preempt") == answers
    # (transcribed at pauses only, as configs/config.yaml has it: late in the window, once)
    assert len(speech.calls) == 1 if pause_lead_ms is not None else len(speech.calls) >= 2
    # (the turn's end: one call commits the input and answers it)
    assert max(i for i, name in enumerate(names) if name == "session_preempt") < names.index("session_respond")


def test_the_vad_and_the_turns_audio_keep_one_clock_when_turn_detection_is_switched_on() -> None:
    """Audio taken with `turn_detection: null`, cleared, then server VAD: the turn the VAD finds is the clip's
    audio (its onset where the clip starts, less the padding), not audio from before it on another clock."""
    prefill, speech = FakePrefill(), FakeSpeech()
    with connect(prefill, speech) as ws:
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        until(ws, "session.updated")
        send_audio(ws, bytes(4 * 48000))  # 4 s, no detection
        ws.send_json({"type": "input_audio_buffer.clear"})
        until(ws, "input_audio_buffer.cleared")
        ws.send_json({"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}})
        until(ws, "session.updated")
        send_audio(ws, bytes(2 * 48000) + pcm24k())  # 2 s of silence, then the clip (after 0.3 s of silence)
        started, _ = until(ws, "input_audio_buffer.speech_started")
        until(ws, "response.done")
    onset_ms = 4000 + 2000 + 300 - 300  # (the padding: 300 ms)
    assert abs(started["audio_start_ms"] - onset_ms) <= 100, started
    assert speech.calls and max(speech.calls) <= 16000 * 4  # the turn's audio: the clip and its padding, no more
