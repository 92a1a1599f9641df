"""The realtime socket's spoken answers (router/realtime/output.py, router/realtime/audio_out.py), with a fake owner
(its answers replayed whole) and a fake TTS role: the session's audio settings, GA and beta, and their refusals; an
audio response's events, its transcript and its audio in each format; sentences synthesized ahead of the one being
sent; barge-in; truncation by `audio_end_ms`; TTS failures that stop the audio but not the answer (counted, and no
audio after their `error` event), the audio output's own failures likewise; sentences past the TTS role's input limit
spoken in parts; and, on `AudioOut` alone, a client socket that fails: nothing raised, nothing left running."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, WebSocketDisconnect
from fastapi.testclient import TestClient

from core.config import AppConfig, SpeechConfig, TtsConfig
from core.sentences import SentenceSplitter
from prefill.client import PrefillClient
from router.keys.auth import APIKeys
from router.realtime import audio_out, synthesis
from router.realtime import socket as realtime
from router.realtime.audio_settings import OutputAudio
from tests.unit.router import test_realtime
from tests.unit.router.test_realtime import FakePrefill, until
from tts.client import RATE, SpeechChunk

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello there, how are you doing today? The weather in Paris is sunny and warm. Bring a hat if you go out."
SENTENCES = [
    "Hello there, how are you doing today? ",
    "The weather in Paris is sunny and warm. ",
    "Bring a hat if you go out.",
]
WORD_MS = 100  # the fake speaks each word in 100 ms
USER_ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}


class FakeTts:
    """The TTS role: each word of the text is 100 ms of a tone, one chunk a word, `delay_s` before each chunk.
    `error_at` / `raise_at` (call, word): that chunk is an error chunk, or raises (its replica died); `hang_at`: that
    call sends nothing. Each call records its text, voice, speed, when it started and its chunks were made, and how
    it ended ("finished", "closed" early, or None while it runs)."""

    def __init__(
        self,
        delay_s: float = 0.0,
        error_at: tuple[int, int] | None = None,
        raise_at: tuple[int, int] | None = None,
        hang_at: int | None = None,
    ) -> None:
        self.delay_s, self.error_at, self.raise_at, self.hang_at = delay_s, error_at, raise_at, hang_at
        self.calls: list[dict[str, Any]] = []

    def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncIterator[SpeechChunk]:
        call: dict[str, Any] = {"text": text, "voice": voice, "speed": speed, "started": time.monotonic()}
        call.update(chunks=[], ended=None)
        self.calls.append(call)
        index = len(self.calls) - 1

        async def stream() -> AsyncIterator[SpeechChunk]:
            try:
                if index == self.hang_at:
                    await asyncio.sleep(3600)
                for k, word in enumerate(re.finditer(r"\S+", text)):
                    await asyncio.sleep(self.delay_s)
                    if (index, k) == self.raise_at:
                        raise RuntimeError("ActorDiedError: the replica died")
                    if (index, k) == self.error_at:
                        yield {"error": {"message": "the engine failed", "type": "server_error", "code": "tts_error"}}
                        return
                    call["chunks"].append(time.monotonic())
                    words = [{"start": word.start(), "end": word.end(), "audio_ms": float(k * WORD_MS)}]
                    yield {"audio": tone(WORD_MS), "words": words, "replica": "tts-1"}  # type: ignore[typeddict-item]
                call["ended"] = "finished"
            finally:
                call["ended"] = call["ended"] or "closed"

        return stream()


def tone(ms: int) -> bytes:
    t = np.arange(RATE * ms // 1000) / RATE
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()


@contextlib.contextmanager
def connect(
    prefill: FakePrefill,
    tts: FakeTts | None,
    beta: bool = False,
    speech: Any = None,
    tts_config: TtsConfig | None = None,
) -> Iterator[Any]:
    app = FastAPI()
    app.include_router(realtime.api)
    speech_config = SpeechConfig(model="local:tiny-whisper") if speech is not None else AppConfig().speech
    config = SimpleNamespace(
        model_name="local:tiny-llama", limits=AppConfig().limits, speech=speech_config, tts=tts_config or TtsConfig()
    )
    app.state.ingress = SimpleNamespace(
        api_keys=APIKeys([]), config=config, prefill=PrefillClient(prefill), speech=speech, tts=tts
    )
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    with TestClient(app).websocket_connect("/v1/realtime", headers=headers) as ws:
        assert ws.receive_json()["type"] == "session.created"
        yield ws


@pytest.fixture
def prefill(monkeypatch: pytest.MonkeyPatch) -> FakePrefill:
    """The owner, whose every answer is TEXT."""
    monkeypatch.setitem(test_realtime.ANSWER, "text", TEXT)
    return FakePrefill()


def update(ws: Any, session: dict[str, Any]) -> dict[str, Any]:
    """`session.update`: its reply (`session.updated`, or an `error`)."""
    ws.send_json({"type": "session.update", "session": session})
    return ws.receive_json()


def respond(ws: Any, response: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A user item and `response.create`: the events up to `response.done`."""
    ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
    until(ws, "conversation.item.created")
    ws.send_json({"type": "response.create", **({"response": response} if response is not None else {})})
    return until(ws, "response.done")[1]


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def audio_of(events: list[dict[str, Any]], kind: str = "response.output_audio.delta") -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in of(events, kind))


# --- settings ----------------------------------------------------------------------------------------------------
def test_ga_audio_output_settings_are_shown_and_bad_ones_refused_by_name(prefill: FakePrefill) -> None:
    with connect(prefill, FakeTts()) as ws:
        session = update(ws, {})["session"]
        assert session["output_modalities"] == ["text"]  # (text until the client asks for audio)
        assert session["audio"]["output"] == {
            "format": {"type": "audio/pcm", "rate": 24000},
            "voice": "alloy",
            "speed": 1.0,
        }
        output = {"format": {"type": "audio/pcmu"}, "voice": "echo", "speed": 1.25}
        session = update(ws, {"output_modalities": ["audio"], "audio": {"output": output}})["session"]
        assert session["output_modalities"] == ["audio"] and session["audio"]["output"] == output
        for bad, code, param in [
            ({"audio": {"output": {"voice": "nobody"}}}, "invalid_value", "session.audio.output.voice"),
            ({"audio": {"output": {"voice": {"id": "voice_1"}}}}, "invalid_value", "session.audio.output.voice"),
            ({"audio": {"output": {"format": {"type": "audio/mp3"}}}}, "invalid_audio", "session.audio.output.format"),
            ({"audio": {"output": {"speed": 2.0}}}, "invalid_event", "session.audio.output.speed"),
            ({"audio": {"output": {"speed": 0.2}}}, "invalid_event", "session.audio.output.speed"),
            ({"output_modalities": ["text", "audio"]}, "invalid_value", "session.output_modalities"),
            ({"output_modalities": ["video"]}, "unsupported_modality", "session.output_modalities"),
            (
                {"output_modalities": ["text"], "audio": {"output": {"voice": "x"}}},
                "invalid_value",
                "session.audio.output.voice",
            ),
        ]:
            error = update(ws, bad)
            assert error["type"] == "error", (bad, error)
            assert (error["error"]["code"], error["error"]["param"]) == (code, param), (bad, error)
        session = update(ws, {})["session"]  # the session as it was
        assert session["output_modalities"] == ["audio"] and session["audio"]["output"] == output


def test_beta_audio_output_settings(prefill: FakePrefill) -> None:
    with connect(prefill, FakeTts(), beta=True) as ws:
        session = update(ws, {})["session"]
        assert (session["modalities"], session["output_audio_format"], session["voice"]) == (["text"], "pcm16", "alloy")
        wanted = {"modalities": ["text", "audio"], "output_audio_format": "g711_alaw", "voice": "sage", "speed": 0.5}
        session = update(ws, wanted)["session"]
        assert {k: session[k] for k in wanted} == wanted
        for bad, param in [
            ({"voice": "nobody"}, "session.voice"),
            ({"output_audio_format": "mp3"}, "session.output_audio_format"),
            ({"speed": 1.6}, "session.speed"),
        ]:
            error = update(ws, bad)
            assert error["type"] == "error" and error["error"]["param"] == param, (bad, error)


def test_a_ga_session_ignores_the_beta_fields(prefill: FakePrefill) -> None:
    """A GA session has no top-level `voice` (ignored as before, as OpenAI's clients may send it)."""
    with connect(prefill, FakeTts()) as ws:
        session = update(ws, {"voice": "nobody", "output_audio_format": "mp3"})["session"]
        assert "voice" not in session and session["audio"]["output"]["voice"] == "alloy"


def test_audio_output_without_a_tts_role_is_refused_and_the_session_goes_on(prefill: FakePrefill) -> None:
    with connect(prefill, None) as ws:
        error = update(ws, {"output_modalities": ["audio"]})
        assert error["error"]["code"] == "audio_output_not_supported"
        assert error["error"]["param"] == "session.output_modalities" and "tts.backend" in error["error"]["message"]
        ws.send_json({"type": "response.create", "response": {"output_modalities": ["audio"]}})
        error = ws.receive_json()
        assert error["error"]["code"] == "audio_output_not_supported"
        assert error["error"]["param"] == "response.output_modalities"
        assert not prefill.called("session_respond")
        events = respond(ws)  # (text, as the session has it)
        assert of(events, "response.output_text.delta") and not of(events, "response.output_audio.delta")


# --- an audio response -------------------------------------------------------------------------------------------
def test_an_audio_response_speaks_each_sentence_after_its_transcript(prefill: FakePrefill) -> None:
    tts = FakeTts()
    with connect(prefill, tts) as ws:
        update(ws, {"output_modalities": ["audio"], "audio": {"output": {"voice": "coral", "speed": 1.5}}})
        events = respond(ws)
    kinds = [e["type"] for e in events]
    assert not [k for k in kinds if k.startswith("response.output_text")]  # audio and its transcript only
    created = of(events, "response.created")[0]["response"]
    assert created["output_modalities"] == ["audio"] and created["audio"]["output"]["voice"] == "coral"
    part = of(events, "response.content_part.added")[0]["part"]
    assert part == {"type": "audio", "transcript": ""}
    # Per sentence: its transcript, then its audio; each delta 100-200 ms.
    deltas = [e for e in events if e["type"].startswith("response.output_audio")]
    order = [(e["type"].rsplit(".", 1)[0], e.get("delta", "")) for e in deltas if e["type"].endswith(".delta")]
    transcripts = [d for kind, d in order if kind == "response.output_audio_transcript"]
    assert transcripts == SENTENCES and "".join(transcripts) == TEXT  # (as a text-only session's deltas join)
    assert order[0][0] == "response.output_audio_transcript" and order[1][0] == "response.output_audio"
    for sentence in SENTENCES:  # each sentence's audio follows its transcript
        at = order.index(("response.output_audio_transcript", sentence))
        sizes = []
        for kind, delta in order[at + 1 :]:
            if kind != "response.output_audio":
                break
            sizes.append(len(base64.b64decode(delta)))
        assert sum(sizes) == len(sentence.split()) * WORD_MS * 48  # 24 kHz PCM16: 48 bytes a ms
        assert all(4800 <= size <= 9600 for size in sizes[:-1]) and 0 < sizes[-1] <= 9600
    first = {e["type"]: e for e in events}
    where = {k: first["response.output_audio.delta"][k] for k in ("response_id", "item_id", "output_index")}
    assert where["output_index"] == 0 and first["response.output_audio.delta"]["content_index"] == 0
    for kind in ("response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done"):
        assert {k: first[kind][k] for k in where} == where, kind
    assert "delta" not in first["response.output_audio.done"]
    assert first["response.output_audio_transcript.done"]["transcript"] == TEXT
    assert first["response.content_part.done"]["part"] == {"type": "audio", "transcript": TEXT}
    ends = ["response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done"]
    assert [k for k in kinds if k in ends] == ends and kinds.index(ends[0]) > max(
        i for i, k in enumerate(kinds) if k.endswith("audio.delta")
    )
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": TEXT}]
    assert done["usage"]["output_tokens"] == 2  # (the text's usage)
    assert [(c["text"], c["voice"], c["speed"]) for c in tts.calls] == [(s.strip(), "coral", 1.5) for s in SENTENCES]


def test_beta_speaks_g711_at_8_khz(prefill: FakePrefill) -> None:
    with connect(prefill, FakeTts(), beta=True) as ws:
        update(ws, {"modalities": ["text", "audio"], "output_audio_format": "g711_ulaw"})
        events = respond(ws)
    assert not of(events, "response.text.delta") and not of(events, "response.output_audio.delta")
    audio = audio_of(events, "response.audio.delta")
    words = len(TEXT.split())
    assert abs(len(audio) - words * WORD_MS * 8) <= 3 * 8  # one byte a sample at 8 kHz (the resampler's edges)
    assert "".join(e["delta"] for e in of(events, "response.audio_transcript.delta")) == TEXT
    assert of(events, "response.audio.done") and of(events, "response.audio_transcript.done")[0]["transcript"] == TEXT
    assert of(events, "response.created")[0]["response"]["modalities"] == ["text", "audio"]
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "audio", "transcript": TEXT}]


def test_response_create_may_speak_in_a_text_session_and_set_its_own_voice(prefill: FakePrefill) -> None:
    tts = FakeTts()
    with connect(prefill, tts) as ws:
        events = respond(ws, {"output_modalities": ["audio"], "audio": {"output": {"voice": "ash"}}})
        assert audio_of(events) and {c["voice"] for c in tts.calls} == {"ash"}
        events = respond(ws)  # the session's own: text
        assert of(events, "response.output_text.delta") and not of(events, "response.output_audio.delta")
        ws.send_json({"type": "response.create", "response": {"audio": {"output": {"voice": "nobody"}}}})
        error = ws.receive_json()["error"]
        assert error["param"] == "response.audio.output.voice"


def test_a_beta_response_create_sets_its_own_modalities_voice_and_format(prefill: FakePrefill) -> None:
    tts = FakeTts()
    with connect(prefill, tts, beta=True) as ws:
        response = {"modalities": ["text", "audio"], "voice": "ballad", "output_audio_format": "g711_alaw"}
        events = respond(ws, response)
        assert abs(len(audio_of(events, "response.audio.delta")) - len(TEXT.split()) * WORD_MS * 8) <= 24
        assert {c["voice"] for c in tts.calls} == {"ballad"}
        created = of(events, "response.created")[0]["response"]
        assert (created["voice"], created["output_audio_format"]) == ("ballad", "g711_alaw")
        assert update(ws, {})["session"]["modalities"] == ["text"]  # (the session's own are unchanged)


def test_the_voice_cannot_change_once_the_session_has_spoken(prefill: FakePrefill) -> None:
    with connect(prefill, FakeTts()) as ws:
        assert update(ws, {"audio": {"output": {"voice": "verse"}}})["type"] == "session.updated"  # (not yet spoken)
        update(ws, {"output_modalities": ["audio"]})
        respond(ws)
        error = update(ws, {"audio": {"output": {"voice": "echo"}}})
        assert (
            error["error"]["code"] == "cannot_update_voice" and error["error"]["param"] == "session.audio.output.voice"
        )
        assert update(ws, {"audio": {"output": {"voice": "verse", "speed": 0.8}}})["type"] == "session.updated"
        ws.send_json({"type": "response.create", "response": {"audio": {"output": {"voice": "echo"}}}})
        assert ws.receive_json()["error"]["code"] == "cannot_update_voice"


def test_a_reattached_connection_speaks_and_hears_as_the_one_it_replaces(prefill: FakePrefill) -> None:
    """A router restart's re-attach (`?session_id=`): the audio input format and turn detection, the output
    modalities, format and voice the client set on the connection it lost are the new one's (kept on the owner,
    `view`), and the voice it spoke in stays fixed. Before, the new connection took PCM16 at 24 kHz and answered in
    text: a G.711 client's audio would have been read as PCM."""
    settings = {
        "output_modalities": ["audio"],
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcma"}, "voice": "ash"},
        },
    }
    with connect(prefill, FakeTts()) as ws:
        update(ws, {"instructions": "Be brief.", "tool_choice": "none", "audio": {"output": {"speed": 1.25}}})
        before = update(ws, settings)["session"]
        assert audio_of(respond(ws))  # (it spoke: its voice is fixed)
        for _ in range(100):  # (the owner learns the voice in the background)
            if prefill.called("session_update")[-1]["view"]["voiced"] == "ash":
                break
            time.sleep(0.01)
    view: dict[str, Any] = {}
    for call in prefill.called("session_update"):  # (the owner merges each call's keys)
        view.update(call.get("view") or {})
    assert view["voiced"] == "ash" and set(view) == {"given", "voiced"}
    assert not {"instructions", "tool_choice"} & set(view["given"])  # (the owner's own: restored from it)
    assert view["given"]["audio"]["output"] == {"format": {"type": "audio/pcma"}, "voice": "ash", "speed": 1.25}

    app = FastAPI()
    app.include_router(realtime.api)
    config = SimpleNamespace(
        model_name="local:tiny-llama", limits=AppConfig().limits, speech=AppConfig().speech, tts=TtsConfig()
    )
    app.state.ingress = SimpleNamespace(
        api_keys=APIKeys([]), config=config, prefill=PrefillClient(prefill), speech=None, tts=FakeTts()
    )
    prefill.fail["session_info"] = {"session_id": "sess-1", "state": "open", "view": view}
    with TestClient(app).websocket_connect("/v1/realtime?session_id=sess-1") as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created"
        after = created["session"]
        assert after["output_modalities"] == ["audio"]
        assert after["audio"]["output"] == before["audio"]["output"]
        assert after["audio"]["input"]["format"] == before["audio"]["input"]["format"] == {"type": "audio/pcmu"}
        assert after["audio"]["input"]["turn_detection"] is None
        error = update(ws, {"audio": {"output": {"voice": "echo"}}})
        assert error["error"]["code"] == "cannot_update_voice"
        events = respond(ws)
        assert of(events, "response.output_audio.delta")  # (it answers in speech, as before)


def test_the_settings_kept_for_a_reattach_merge_field_by_field() -> None:
    from router.realtime.settings import merged

    first = {
        "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": {"type": "server_vad"}}},
    }
    then = {"audio": {"input": {"turn_detection": None}, "output": {"voice": "ash"}}, "output_modalities": ["text"]}
    assert merged(first, then) == {
        "output_modalities": ["text"],
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},  # (a null is a setting too)
            "output": {"voice": "ash"},
        },
    }


def test_the_voice_kept_for_a_reattach_is_no_error_when_the_session_has_ended(prefill: FakePrefill) -> None:
    """The owner learns the voice in the background once audio goes out; a one-turn session (`close_after_answer`)
    may be closed by then: the client sees no `error` for it (a bench saw one in a turn of four)."""
    with connect(prefill, FakeTts()) as ws:
        update(ws, {"output_modalities": ["audio"]})
        closed = {"message": "session sess-1 is closed (its answer ended)", "type": "invalid_request_error"}
        prefill.fail["session_update"] = {"error": {**closed, "code": 409}}
        events = respond(ws)
        assert audio_of(events) and not of(events, "error")
        for _ in range(100):
            if "session_update" not in prefill.fail:  # (the refused call was made)
                break
            time.sleep(0.01)
        assert "session_update" not in prefill.fail
        ws.send_json({"type": "session.update", "session": {"instructions": "Be brief."}})
        _, seen = until(ws, "session.updated")  # (everything sent since the response: no error among it)
        assert not of(seen, "error")


def test_the_next_sentence_is_synthesized_while_the_first_is_sent(prefill: FakePrefill) -> None:
    tts = FakeTts(delay_s=0.02)
    with connect(prefill, tts) as ws:
        update(ws, {"output_modalities": ["audio"]})
        events = respond(ws)
    assert "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta")) == TEXT
    first, second, third = tts.calls
    assert second["started"] < first["chunks"][-1]  # before the first sentence's last audio was even made
    assert third["started"] < first["chunks"][-1]  # (two sentences ahead)
    assert all(call["ended"] == "finished" for call in tts.calls)


def test_the_lookahead_is_bounded(prefill: FakePrefill, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audio_out, "LOOKAHEAD", 1)
    tts = FakeTts(delay_s=0.02)
    with connect(prefill, tts) as ws:
        update(ws, {"output_modalities": ["audio"]})
        respond(ws)
    first, second, third = tts.calls
    assert second["started"] < first["chunks"][-1] < third["started"]  # one sentence ahead, no more


# --- barge-in and truncation -------------------------------------------------------------------------------------
def heard(events: list[dict[str, Any]]) -> str:
    """The transcript a client heard: from the events, each sentence's audio (after its transcript delta) against the
    fake's word timings: whole sentences whose audio all came, then the words whose audio had started."""
    out, sentence, sent = "", None, 0
    spoken: list[tuple[str, int]] = []
    for e in events:
        if e["type"] == "response.output_audio_transcript.delta":
            if sentence is not None:
                spoken.append((sentence, sent))
            sentence, sent = e["delta"], 0
        elif e["type"] == "response.output_audio.delta":
            sent += len(base64.b64decode(e["delta"]))
    if sentence is not None:
        spoken.append((sentence, sent))
    for text, size in spoken:
        ms = size / 48
        words = list(re.finditer(r"\S+", text))
        if ms >= len(words) * WORD_MS:
            out += text
            continue
        started = [w for k, w in enumerate(words) if k * WORD_MS < ms]
        return out + (text[: started[-1].end()] if started else "")
    return out


def test_speech_over_the_answer_stops_its_audio_and_cuts_it_to_what_was_heard(prefill: FakePrefill) -> None:
    from tests.unit.router.voice.test_realtime_audio import FakeSpeech, pcm24k, send_audio

    tts = FakeTts(delay_s=0.15)  # ~1 s a sentence: the speech comes while the first is still being spoken
    with connect(prefill, tts, speech=FakeSpeech()) as ws:
        detection = {"type": "server_vad", "create_response": False}
        update(ws, {"output_modalities": ["audio"], "audio": {"input": {"turn_detection": detection}}})
        ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
        ws.send_json({"type": "response.create"})
        _, seen = until(ws, "response.output_audio.delta")
        send_audio(ws, pcm24k(after_s=0.1))
        _, more = until(ws, "response.done")
    events = seen + more
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
    done = events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    transcript = of(events, "response.output_audio_transcript.done")[0]["transcript"]
    sent = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    assert transcript == heard(events) and transcript and sent.startswith(transcript) and len(transcript) < len(TEXT)
    assert kinds.index("response.output_audio.done") > max(
        i for i, k in enumerate(kinds) if k == "response.output_audio.delta"
    )
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": transcript}]
    # The syntheses were stopped (their TTS streams closed) and the conversation keeps what was heard.
    assert any(call["ended"] == "closed" for call in tts.calls) and all(call["ended"] for call in tts.calls)
    assert prefill.called("session_truncate")[-1]["chars"] == len(transcript)


def test_response_cancel_mid_audio(prefill: FakePrefill) -> None:
    tts = FakeTts(delay_s=0.1)
    with connect(prefill, tts, beta=True) as ws:
        update(ws, {"modalities": ["text", "audio"]})
        ws.send_json({"type": "conversation.item.create", "item": USER_ITEM})
        ws.send_json({"type": "response.create"})
        _, seen = until(ws, "response.audio.delta")
        ws.send_json({"type": "response.cancel"})
        _, more = until(ws, "response.done")
    events = seen + more
    done = events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    transcript = of(events, "response.audio_transcript.done")[0]["transcript"]
    assert of(events, "response.audio.done") and TEXT.startswith(transcript) and len(transcript) < len(TEXT)
    assert done["output"][0]["content"] == [{"type": "audio", "transcript": transcript}]
    assert all(call["ended"] for call in tts.calls)


def test_truncate_cuts_a_spoken_answer_at_the_word_heard(prefill: FakePrefill) -> None:
    with connect(prefill, FakeTts()) as ws:
        update(ws, {"output_modalities": ["audio"]})
        events = respond(ws)
        item = events[-1]["response"]["output"][0]["id"]
        total_ms = len(audio_of(events)) / 48
        for audio_end_ms, chars in [
            (250, len("Hello there, how")),  # three words had started
            (700, len(SENTENCES[0])),  # the whole first sentence (700 ms, all its audio)
            (950, len(SENTENCES[0]) + len("The weather in")),
            (int(total_ms), len(TEXT)),
        ]:
            truncate = {"type": "conversation.item.truncate", "item_id": item, "content_index": 0}
            ws.send_json({**truncate, "audio_end_ms": audio_end_ms})
            truncated, _ = until(ws, "conversation.item.truncated")
            assert (truncated["item_id"], truncated["content_index"], truncated["audio_end_ms"]) == (
                item,
                0,
                audio_end_ms,
            )
            assert prefill.called("session_truncate")[-1]["chars"] == chars, audio_end_ms
        calls = len(prefill.called("session_truncate"))
        ws.send_json({**truncate, "audio_end_ms": int(total_ms) + 500, "event_id": "evt_t"})
        error = ws.receive_json()["error"]
        assert (error["code"], error["param"], error["event_id"]) == ("invalid_value", "audio_end_ms", "evt_t")
        ws.send_json({**truncate, "content_index": 1, "audio_end_ms": 10})
        assert ws.receive_json()["error"]["param"] == "content_index"
        assert len(prefill.called("session_truncate")) == calls  # (refused: nothing cut)
        ws.send_json({**truncate, "audio_end_ms": 10, "text_end": 4})  # (the text extension still cuts by text)
        until(ws, "conversation.item.truncated")
        assert prefill.called("session_truncate")[-1]["chars"] == 4


# --- failures ----------------------------------------------------------------------------------------------------
def spoken_with_an_error(prefill: FakePrefill, tts: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A response spoken through `tts` that fails on the way: its events and its one `error` (a server error); the
    session goes on."""
    with connect(prefill, tts) as ws:
        update(ws, {"output_modalities": ["audio"]})
        events = respond(ws)
        assert update(ws, {})["type"] == "session.updated"  # the session goes on
    errors = of(events, "error")
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error", errors
    return events, errors


@pytest.mark.parametrize(
    "tts",
    [
        pytest.param(lambda: FakeTts(error_at=(1, 2)), id="error-chunk"),
        pytest.param(lambda: FakeTts(raise_at=(1, 2)), id="replica-died"),
        pytest.param(lambda: FakeTts(hang_at=1), id="stuck"),
    ],
)
def test_a_tts_failure_stops_the_audio_and_the_text_answer_goes_on(
    prefill: FakePrefill, tts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synthesis, "CHUNK_TIMEOUT_S", 0.3)
    fake = tts()
    events, errors = spoken_with_an_error(prefill, fake)
    assert "TTS" in errors[0]["error"]["message"] and errors[0]["error"]["code"] == "tts_failed"
    transcript = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    assert transcript == TEXT == of(events, "response.output_audio_transcript.done")[0]["transcript"]
    assert events[-1]["response"]["status"] == "completed"
    # The first sentence was spoken whole; the second's audio stopped where it failed; none after it.
    kinds = [e["type"] for e in events]
    after = kinds.index("error")
    assert "response.output_audio.delta" not in kinds[after:]
    spoken = len(SENTENCES[0].split()) * WORD_MS * 48 + (0 if fake.hang_at is not None else 2 * WORD_MS * 48)
    assert len(audio_of(events)) == spoken
    assert all(call["ended"] for call in fake.calls)  # (the third's synthesis closed too)
    assert of(events, "response.output_audio.done")


def test_the_first_audio_and_the_audio_sent_are_measured(prefill: FakePrefill, monkeypatch: pytest.MonkeyPatch) -> None:
    from router.realtime import output

    seen: list[tuple[str, str, float, dict[str, str]]] = []
    monkeypatch.setattr(
        output.metrics, "inc", lambda name, value=1.0, description="", **tags: seen.append(("inc", name, value, tags))
    )
    monkeypatch.setattr(
        output.metrics,
        "observe",
        lambda name, value, description="", **tags: seen.append(("observe", name, value, tags)),
    )
    with connect(prefill, FakeTts()) as ws:
        update(ws, {"output_modalities": ["audio"]})
        respond(ws)
    seconds = sum(v for kind, name, v, _ in seen if name == output.metrics.AUDIO_OUT_SECONDS)
    assert seconds == pytest.approx(len(TEXT.split()) * WORD_MS / 1000)
    first = [(v, tags) for kind, name, v, tags in seen if name == output.metrics.FIRST_AUDIO_SECONDS]
    assert len(first) == 1 and 0 < first[0][0] < 5 and first[0][1] == {"surface": "realtime"}


def test_the_splitter_cuts_the_answer_as_the_tts_calls_show() -> None:
    splitter = SentenceSplitter()
    assert splitter.feed(TEXT) + [splitter.flush()] == SENTENCES


def test_a_tts_failure_ends_the_audio_at_its_error_event_in_g711(prefill: FakePrefill) -> None:
    """G.711 at 8 kHz: the resampler holds a few ms at any time; none of it goes out after the `error` event."""
    fake = FakeTts(error_at=(1, 2))
    with connect(prefill, fake, beta=True) as ws:
        update(ws, {"modalities": ["text", "audio"], "output_audio_format": "g711_ulaw"})
        events = respond(ws)
    kinds = [e["type"] for e in events]
    assert kinds.count("error") == 1
    assert "response.audio.delta" not in kinds[kinds.index("error") :]
    spoken = (len(SENTENCES[0].split()) + 2) * WORD_MS * 8  # one byte a sample at 8 kHz
    assert abs(len(audio_of(events, "response.audio.delta")) - spoken) <= 2 * 3 * 8  # (the resampler's edges)
    assert of(events, "response.audio_transcript.done")[0]["transcript"] == TEXT


def test_a_tts_failure_is_counted_by_its_code(prefill: FakePrefill, monkeypatch: pytest.MonkeyPatch) -> None:
    from core import metrics

    seen: list[tuple[str, float, str, dict[str, str]]] = []
    monkeypatch.setattr(
        metrics, "inc", lambda name, value=1.0, description="", **tags: seen.append((name, value, description, tags))
    )
    with connect(prefill, FakeTts(error_at=(1, 2))) as ws:
        update(ws, {"output_modalities": ["audio"]})
        respond(ws)
    assert [(v, d, t) for name, v, d, t in seen if name == metrics.TTS_ERRORS] == [
        (1, metrics.TTS_FAILED, {"code": "tts_error", "surface": "realtime"})
    ]
    assert {d for name, _, d, _ in seen if name == metrics.AUDIO_OUT_SECONDS} == {metrics.AUDIO_OUT}


class BrokenEncoder:
    """An encoder that fails on its `fail_at`-th call (a bug in the router's own audio path, not the TTS role's)."""

    calls = 0
    fail_at = 2

    def __init__(self, fmt: Any, rate: int) -> None:
        pass

    def __call__(self, pcm: bytes) -> bytes:
        BrokenEncoder.calls += 1
        if BrokenEncoder.calls == BrokenEncoder.fail_at:
            raise ValueError("buffer size must be a multiple of element size")
        return bytes(pcm)

    def flush(self) -> bytes:
        return b""


def test_an_audio_output_bug_is_an_error_event_and_the_transcript_goes_on(
    prefill: FakePrefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audio_out, "Encoder", BrokenEncoder)
    monkeypatch.setattr(BrokenEncoder, "calls", 0)
    tts = FakeTts()
    events, errors = spoken_with_an_error(prefill, tts)
    kinds = [e["type"] for e in events]
    assert "response.output_audio.delta" not in kinds[kinds.index("error") :]
    transcript = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    assert transcript == TEXT == of(events, "response.output_audio_transcript.done")[0]["transcript"]
    assert events[-1]["response"]["status"] == "completed"
    assert all(call["ended"] for call in tts.calls)


def test_a_sentence_longer_than_the_tts_input_limit_is_spoken_in_parts(prefill: FakePrefill) -> None:
    """The TTS role refuses text past `tts.max_input_chars`: a longer piece goes to it in parts, at spaces."""
    tts = FakeTts()
    with connect(prefill, tts, tts_config=TtsConfig(max_input_chars=16)) as ws:
        update(ws, {"output_modalities": ["audio"]})
        events = respond(ws)
    assert tts.calls and all(len(call["text"]) <= 16 for call in tts.calls), [c["text"] for c in tts.calls]
    assert " ".join(call["text"] for call in tts.calls).split() == TEXT.split()
    transcript = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    assert transcript == TEXT and len(audio_of(events)) == len(TEXT.split()) * WORD_MS * 48
    assert not of(events, "error") and events[-1]["response"]["status"] == "completed"


# --- the spoken message alone (router/realtime/audio_out.py `AudioOut`) -------------------------------------------
class Connection:
    """What `AudioOut` needs of its connection: the events it sent; from the event `broken` on, every send raises as
    a closed socket's does."""

    beta = False

    def __init__(self, tts: FakeTts, broken: str | None = None) -> None:
        self.ingress = SimpleNamespace(tts=tts, config=SimpleNamespace(tts=TtsConfig()))
        self.settings = SimpleNamespace(voiced=None)
        self.broken, self.closed = broken, False
        self.events: list[dict[str, Any]] = []

    async def send(self, type_: str, **fields: Any) -> None:
        if self.closed or type_ == self.broken:
            self.closed = True
            raise WebSocketDisconnect(1006)
        self.events.append({"type": type_, **fields})


WHERE = {"response_id": "resp_1", "item_id": "item_1", "output_index": 0}


def running() -> list[str]:
    """The audio output's tasks still running."""
    names = ("AudioOut._send_all", "Synthesis._read")
    tasks = [getattr(t.get_coro(), "__qualname__", "") for t in asyncio.all_tasks() if not t.done()]
    return [name for name in tasks if name in names]


async def settled(tts: FakeTts) -> None:
    """Every synthesis ended (its TTS stream read or closed), and no task of the audio output left."""
    for _ in range(100):
        if all(call["ended"] for call in tts.calls) and not running():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"left running: {running()}, {[(c['text'], c['ended']) for c in tts.calls]}")


async def test_an_interruption_after_the_socket_failed_mid_audio_raises_nothing() -> None:
    """The sender died of the client's socket: barge-in (router/realtime/audio.py's VAD handler) and response.cancel
    still stop the message quietly."""
    tts = FakeTts(delay_s=0.05)
    connection = Connection(tts, broken="response.output_audio.delta")
    out = audio_out.AudioOut(connection, WHERE, OutputAudio(), lambda seconds: None)
    out.add(TEXT)
    for _ in range(100):
        if connection.closed:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    await out.interrupt()
    assert out.cut == 0  # (none of its audio went out)
    await settled(tts)


async def test_a_socket_that_fails_ends_the_audio_and_every_synthesis() -> None:
    tts = FakeTts(delay_s=0.3)  # (each sentence's synthesis takes 2 s: closed, not read to its end)
    connection = Connection(tts, broken="response.output_audio_transcript.delta")
    out = audio_out.AudioOut(connection, WHERE, OutputAudio(), lambda seconds: None)
    out.add(TEXT)
    assert await asyncio.wait_for(out.finish(), 5) == TEXT
    await settled(tts)


async def test_response_cancel_stops_the_reading_even_if_the_audio_fails_to_stop() -> None:
    from router.realtime.response import ResponseStream

    async def fails() -> None:
        raise WebSocketDisconnect(1006)

    stream = ResponseStream.__new__(ResponseStream)
    stream.connection = SimpleNamespace(session_id="sess_1")  # type: ignore[assignment]
    cancelled: list[str] = []
    stream.output = SimpleNamespace(interrupt=fails)  # type: ignore[assignment]
    stream.reader = SimpleNamespace(cancel=lambda: cancelled.append("reader"))  # type: ignore[assignment]
    stream.reading = asyncio.ensure_future(asyncio.sleep(3600))  # type: ignore[assignment]
    stream.task = asyncio.ensure_future(asyncio.sleep(0))
    await stream.cancel("turn_detected")
    await asyncio.sleep(0)
    assert cancelled == ["reader"] and stream.reading.cancelled()
    assert stream.cancel_requested and stream.cancel_reason == "turn_detected"


class WholeTts(FakeTts):
    """A TTS role that sends each sentence's audio as one item (espeak-ng's way: 100s of KB), split at odd bytes."""

    def synthesize(self, text: str, *, voice: str, speed: float = 1.0) -> AsyncIterator[SpeechChunk]:
        self.calls.append({"text": text, "ended": None})
        call = self.calls[-1]

        async def stream() -> AsyncIterator[SpeechChunk]:
            audio = tone(len(text.split()) * WORD_MS)
            for part in (audio[:4801], audio[4801:4802], audio[4802:]):
                yield {"audio": part, "words": []}  # type: ignore[typeddict-item]
            call["ended"] = "finished"

        return stream()


@pytest.mark.parametrize("beta_format", ["pcm16", "g711_ulaw"])
def test_a_sentence_sent_as_one_item_goes_out_in_deltas_of_whole_samples(
    prefill: FakePrefill, beta_format: str
) -> None:
    tts = WholeTts()
    with connect(prefill, tts, beta=True) as ws:
        update(ws, {"modalities": ["text", "audio"], "output_audio_format": beta_format})
        events = respond(ws)
    assert not of(events, "error")
    sizes = [len(base64.b64decode(e["delta"])) for e in of(events, "response.audio.delta")]
    words = len(TEXT.split())
    if beta_format == "pcm16":
        assert sum(sizes) == words * WORD_MS * 48 and all(size % 2 == 0 and size <= 9600 for size in sizes)
    else:
        assert abs(sum(sizes) - words * WORD_MS * 8) <= 3 * 3 * 8 and all(size <= 3200 for size in sizes)
