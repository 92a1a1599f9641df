"""A held preemptive answer's first sentence is synthesized before its turn is confirmed (router/realtime/
early_speech.py, hooked into router/sessions/provisional.py `Held`): sent only once the answer is the response's,
with no second call to the TTS role; cancelled when the held answer is discarded; retired once the response took it
or needs it not (the rest of the held text synthesizes nothing). A real connection, `AnswerReader`, `Held` and
`Feeds`; the owner, the decode handle, the TTS role and the socket are scripted (tests/unit/router/
test_realtime_release.py): a socket that fails mid-response leaves no synthesis or task running."""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import pytest
from fastapi import WebSocketDisconnect

from core.config import AppConfig, TtsConfig
from router.realtime.audio_settings import OutputAudio
from router.realtime.early_speech import EarlySpeech
from router.realtime.events import ResponseCreate
from router.realtime.output import Output
from router.realtime.socket import RealtimeConnection
from router.sessions.owner import session_buffer
from tests.unit.router.test_realtime_release import TAG, RealtimeOwner, Socket, end
from tests.unit.router.test_realtime_speech import WORD_MS, FakeTts, settled
from tests.unit.router.test_released_answers import SESSION, STREAM, Ingress
from tests.unit.router.test_router_answers import CHAT_ITEMS, reported

pytestmark = pytest.mark.timeout(30)
TTS_CONFIG = TtsConfig(min_sentence_chars=5, first_clause_chars=5)


async def speaking_connection_holding(
    tts: FakeTts, voice: str = "alloy", socket: Socket | None = None
) -> tuple[RealtimeConnection, Socket, Ingress]:
    """A connection that speaks ("Hello, world": its first piece "Hello, " at a clause of 5 characters), reading
    turn 0 early and holding the preemptive answer made from TAG, whose whole text is here already."""
    owner = RealtimeOwner(TAG)
    ingress = Ingress(owner)
    config = SimpleNamespace(model_name="m", limits=AppConfig().limits, speech=AppConfig().speech, tts=TTS_CONFIG)
    ingress.config, ingress.tts = config, tts  # type: ignore[attr-defined]
    socket = socket or Socket()
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


# --- the early speech alone, as the held answer's tap and the response use it ----------------------------------------
def early_speech(tts: FakeTts) -> EarlySpeech:
    connection = SimpleNamespace(ingress=SimpleNamespace(tts=tts, config=SimpleNamespace(tts=TTS_CONFIG)))
    return EarlySpeech(connection, lambda: OutputAudio())  # type: ignore[arg-type]


async def test_a_response_that_took_it_before_its_first_sentence_was_complete_gets_no_late_synthesis() -> None:
    """Released while its first sentence was still arriving: the tap goes on feeding the released answer's text
    (until the owner confirms it), and nothing of it is synthesized for nobody."""
    tts = FakeTts()
    speech = early_speech(tts)
    speech.watch("attempt-1", "Hello")
    assert speech.take(("Hello,", "alloy", 1.0)) is None  # (the response synthesizes it itself)
    speech.watch("attempt-1", ", world. And then some more, and more")
    await asyncio.sleep(0.01)
    assert tts.calls == []


async def test_a_text_response_retires_it_for_the_rest_of_its_answer() -> None:
    tts = FakeTts(delay_s=0.5)
    speech = early_speech(tts)
    speech.watch("attempt-1", "Hello, world and")
    await asyncio.sleep(0.01)
    assert [call["text"] for call in tts.calls] == ["Hello,"]
    conversation = SimpleNamespace(items=set(), answer_item=None, answer_audio=None, last_item_id=None)
    Output(SimpleNamespace(), conversation, "resp_1", speech=None, ready=speech)  # type: ignore[arg-type]
    speech.watch("attempt-1", " more text. Then some more, and")  # (the released answer, still held)
    await settled(tts)
    assert [(call["text"], call["ended"]) for call in tts.calls] == [("Hello,", "closed")]


async def test_a_discarded_answer_leaves_it_ready_for_the_next_one() -> None:
    tts = FakeTts()
    speech = early_speech(tts)
    for attempt, text in [("attempt-1", "Hello, world"), ("attempt-1", None), ("attempt-2", "Goodbye, now")]:
        speech.watch(attempt, text)  # (None: discarded)
        await asyncio.sleep(0.01)
    speech.watch("attempt-3", "Well, then")  # (another one replaced it)
    await asyncio.sleep(0.01)
    assert [(call["text"], call["ended"]) for call in tts.calls] == [
        ("Hello,", "finished"),
        ("Goodbye,", "finished"),
        ("Well,", "finished"),
    ]
    synthesis = speech.take(("Well,", "alloy", 1.0))
    assert synthesis is not None and synthesis.key == ("Well,", "alloy", 1.0)
    await synthesis.task


class BrokenSocket(Socket):
    """The client's socket, closed from the event `broken` on: that send and every one after raise."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken, self.closed = broken, False

    async def send_text(self, text: str) -> None:
        if self.closed or f'"type": "{self.broken}"' in text:
            self.closed = True
            raise WebSocketDisconnect(1006)
        await super().send_text(text)


@pytest.mark.parametrize(
    "broken",
    [
        "response.content_part.added",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
    ],
)
async def test_a_socket_that_fails_mid_response_leaves_no_synthesis_or_task_running(broken: str) -> None:
    tts = FakeTts(hang_at=1)  # (the second sentence's synthesis still running when the socket fails)
    connection, _, ingress = await speaking_connection_holding(tts, socket=BrokenSocket(broken))
    creating = asyncio.ensure_future(connection.conversation.response_create(ResponseCreate(type="response.create")))
    await asyncio.sleep(0.05)
    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    response = connection.conversation.response
    assert response is not None
    await asyncio.wait({response.task}, timeout=5)
    assert response.task.done()
    await settled(tts)  # ("world"'s synthesis closed, or never begun)
    assert tts.calls[0]["text"] == "Hello,"
    connection.closing = True
    await asyncio.sleep(0)
    if connection.conversation.early is not None:
        connection.conversation.early.close()
    await ingress.decode.batches.put(StopAsyncIteration())
    await reported()
