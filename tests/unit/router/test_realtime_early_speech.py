"""A held preemptive answer's first sentence is synthesized before its turn is confirmed (router/realtime/
early_speech.py, hooked into router/sessions/provisional.py `Held`): sent only once the answer is the response's,
with no second call to the TTS role; cancelled when the held answer is discarded. A real connection, `AnswerReader`,
`Held` and `Feeds`; the owner, the decode handle, the TTS role and the socket are scripted
(tests/unit/router/test_realtime_release.py)."""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import pytest

from core.config import AppConfig, TtsConfig
from router.realtime.events import ResponseCreate
from router.realtime.socket import RealtimeConnection
from router.sessions.owner import session_buffer
from tests.unit.router.test_realtime_release import TAG, RealtimeOwner, Socket, end
from tests.unit.router.test_realtime_speech import WORD_MS, FakeTts
from tests.unit.router.test_released_answers import SESSION, STREAM, Ingress
from tests.unit.router.test_router_answers import CHAT_ITEMS

pytestmark = pytest.mark.timeout(30)


async def speaking_connection_holding(tts: FakeTts, voice: str = "alloy") -> tuple[RealtimeConnection, Socket, Ingress]:
    """A connection that speaks ("Hello, world": its first piece "Hello, " at a clause of 5 characters), reading
    turn 0 early and holding the preemptive answer made from TAG, whose whole text is here already."""
    owner = RealtimeOwner(TAG)
    ingress = Ingress(owner)
    tts_config = TtsConfig(min_sentence_chars=5, first_clause_chars=5)
    config = SimpleNamespace(model_name="m", limits=AppConfig().limits, speech=AppConfig().speech, tts=tts_config)
    ingress.config, ingress.tts = config, tts  # type: ignore[attr-defined]
    socket = Socket()
    connection = RealtimeConnection(socket, ingress, "m", beta=False)  # type: ignore[arg-type]
    connection.session_id = SESSION
    connection.settings.values.update(preemptive={"after_idle_ms": 150}, output_modalities=["audio"])
    connection.settings.output = connection.settings.output.__class__(voice=voice)
    await connection.call(session_buffer, op="commit")
    connection.conversation.read_early(0)
    for _ in range(100):
        if SESSION in ingress.feeds.held:
            break
        await asyncio.sleep(0.001)
    await ingress.decode.batches.put(({STREAM: "".join(CHAT_ITEMS)}, {STREAM: None}, {}))
    await asyncio.sleep(0.01)
    return connection, socket, ingress


async def test_the_first_sentence_is_synthesized_while_held_and_sent_once_released() -> None:
    tts = FakeTts()
    connection, socket, ingress = await speaking_connection_holding(tts)
    assert [call["text"] for call in tts.calls] == ["Hello,"]  # before any response.create
    assert not [e for e in socket.sent if e["type"].startswith("response.")]  # nothing sent
    creating = asyncio.ensure_future(connection.conversation.response_create(ResponseCreate(type="response.create")))
    await asyncio.sleep(0.05)
    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    await end(connection, ingress)
    assert [call["text"] for call in tts.calls] == [
        "Hello,",
        "world",
    ]  # the first one's audio was used, not asked again
    transcript = [e["delta"] for e in socket.sent if e["type"] == "response.output_audio_transcript.delta"]
    assert transcript == ["Hello, ", "world"]
    audio = b"".join(base64.b64decode(e["delta"]) for e in socket.sent if e["type"] == "response.output_audio.delta")
    assert len(audio) == 2 * WORD_MS * 48
    assert socket.sent[-1]["type"] == "response.done" and socket.sent[-1]["response"]["status"] == "completed"


async def test_a_synthesis_in_another_voice_is_not_used() -> None:
    tts = FakeTts()
    connection, socket, ingress = await speaking_connection_holding(tts)
    response = {"audio": {"output": {"voice": "echo"}}}  # (released all the same: its text is the same)
    creating = asyncio.ensure_future(
        connection.conversation.response_create(
            ResponseCreate.model_validate({"type": "response.create", "response": response})
        )
    )
    await asyncio.sleep(0.05)
    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    await end(connection, ingress)
    assert [(c["text"], c["voice"]) for c in tts.calls] == [("Hello,", "alloy"), ("Hello,", "echo"), ("world", "echo")]
    assert tts.calls[0]["ended"]  # (closed, or done: never sent)
    transcript = "".join(e["delta"] for e in socket.sent if e["type"] == "response.output_audio_transcript.delta")
    assert transcript == "Hello, world"


async def test_a_discarded_held_answer_cancels_its_synthesis() -> None:
    tts = FakeTts(delay_s=0.5)  # still speaking when the answer is discarded
    connection, socket, ingress = await speaking_connection_holding(tts)
    assert [call["text"] for call in tts.calls] == ["Hello,"] and tts.calls[0]["ended"] is None
    early = connection.conversation.early
    assert early is not None and early.speech is not None
    held = ingress.feeds.held[SESSION]
    held.drop()  # (the user went on: the owner gave this preemptive answer up)
    await asyncio.sleep(0.05)
    assert tts.calls[0]["ended"] == "closed" and early.speech.synthesis is None
    assert not [e for e in socket.sent if e["type"].startswith("response.")]
    early.close()
    await ingress.decode.batches.put(StopAsyncIteration())


async def test_a_text_session_synthesizes_nothing_early() -> None:
    tts = FakeTts()
    connection, _, ingress = await speaking_connection_holding(tts)
    early = connection.conversation.early
    assert early is not None and early.speech is not None
    # Another held answer, of a session that answers in text now: its text is watched, and nothing synthesized.
    connection.settings.values["output_modalities"] = ["text"]
    early.speech.watch("attempt-2", "Hello, world")
    assert [call["text"] for call in tts.calls] == ["Hello,"] and early.speech.synthesis is None
    early.close()
    await ingress.decode.batches.put(StopAsyncIteration())


async def test_a_text_response_drops_the_early_synthesis() -> None:
    tts = FakeTts(delay_s=0.5)  # still speaking when the response starts
    connection, socket, ingress = await speaking_connection_holding(tts)
    event = ResponseCreate.model_validate({"type": "response.create", "response": {"output_modalities": ["text"]}})
    creating = asyncio.ensure_future(connection.conversation.response_create(event))
    await asyncio.sleep(0.05)
    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    await end(connection, ingress)
    assert [call["text"] for call in tts.calls] == ["Hello,"] and tts.calls[0]["ended"] == "closed"
    assert "".join(e["delta"] for e in socket.sent if e["type"] == "response.output_text.delta") == "Hello, world"
    assert not [e for e in socket.sent if e["type"].startswith("response.output_audio")]
