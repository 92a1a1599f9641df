"""Realtime `response.create` releases a held preemptive answer (router/realtime/socket.py, router/realtime/response.py,
router/sessions/provisional.py `release_input`): its first delta goes out before the owner has the call, when the
owner's reply to the connection's last call named the input that answer was made from; the owner's reply confirms it.
A real connection, `AnswerReader`, `Held` and `Feeds`; the owner, the decode handle and the socket are scripted."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from core.config import AppConfig
from router.realtime.events import ResponseCreate
from router.realtime.response import InputSeen
from router.realtime.socket import RealtimeConnection
from router.sessions.owner import session_buffer
from tests.unit.router.test_released_answers import ADOPT, LIVE, REQUEST, SESSION, STREAM, Ingress, Owner
from tests.unit.router.test_router_answers import CHAT_ITEMS, reported

pytestmark = pytest.mark.timeout(30)
TAG = "0123456789abcdef"  # the input the live preemptive answer was made from (prefill/preemptive.py `input_tag`)
FINAL = {"turn": 0, "endpoint": "chat", "include_usage": False, "timing": {}, "adopt": ADOPT, "request": REQUEST}


class RealtimeOwner(Owner):
    """The owner of a realtime session: its replies to input calls name the input (`tag`); `session_respond`
    waits until the test lets it answer (`responds`), and only then does the claim get its answer."""

    def __init__(self, tag: str) -> None:
        super().__init__(FINAL)
        self.tag = tag
        self.responds = asyncio.Event()
        self.refuse: dict[str, Any] | None = None
        self.commits: asyncio.Event | None = None  # (set: a commit waits for it)
        self.refuse_commit: dict[str, Any] | BaseException | None = None
        self.calls: list[str] = []
        self.session_buffer = SimpleNamespace(remote=self._buffer)
        self.session_respond = SimpleNamespace(remote=self._respond)
        self.session_delete = SimpleNamespace(remote=self._buffer)

    async def _buffer(self, **kwargs: Any) -> dict[str, Any]:
        if kwargs.get("op") == "commit" and self.commits is not None:
            self.calls.append("commit")
            await self.commits.wait()
            if isinstance(self.refuse_commit, BaseException):
                raise self.refuse_commit
            if self.refuse_commit is not None:
                return {"error": self.refuse_commit}
        return {"session_id": SESSION, "preemptive": {"input": self.tag}}

    async def _claim(self, **kwargs: Any) -> dict[str, Any]:
        self.claims.append(kwargs)
        if kwargs.get("holding") == "":
            return {"pending": True, "provisional": {**LIVE, "input": TAG}}
        await self.has_end.wait()
        return self.final

    async def _respond(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append("respond")
        await self.responds.wait()
        if self.refuse is not None:
            return {"error": self.refuse}
        self.has_end.set()  # (the answer exists: the claim names it)
        return {"session_id": SESSION, "answer": {"turn": 0, "status": "ready"}}


class Socket:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))

    def types(self) -> list[str]:
        return [e["type"] for e in self.sent]


async def connection_holding(tag: str) -> tuple[RealtimeConnection, Socket, Ingress]:
    """A connection whose last call's reply named `tag`, reading turn 0 early: it holds the preemptive answer made
    from TAG, whose whole text is here already."""
    owner = RealtimeOwner(tag)
    ingress = Ingress(owner)
    ingress.config = SimpleNamespace(model_name="m", limits=AppConfig().limits, speech=AppConfig().speech)  # type: ignore[attr-defined]
    socket = Socket()
    connection = RealtimeConnection(socket, ingress, "m", beta=False)  # type: ignore[arg-type]
    connection.session_id = SESSION
    connection.settings.values["preemptive"] = {"after_idle_ms": 150}
    await connection.call(session_buffer, op="commit")
    connection.conversation.read_early(0)
    for _ in range(100):
        if SESSION in ingress.feeds.held:
            break
        await asyncio.sleep(0.001)
    await ingress.decode.batches.put(({STREAM: "".join(CHAT_ITEMS)}, {STREAM: None}, {}))
    await asyncio.sleep(0.01)
    return connection, socket, ingress


async def end(connection: RealtimeConnection, ingress: Ingress) -> None:
    """The response ends; nothing of the connection is left running (the next turn's early read included)."""
    assert connection.conversation.response is not None
    connection.closing = True
    await asyncio.wait_for(connection.conversation.response.task, 5)
    await asyncio.sleep(0)
    if connection.conversation.early is not None:
        connection.conversation.early.close()
    await ingress.decode.batches.put(StopAsyncIteration())
    await reported()


async def test_response_create_streams_the_held_answer_before_the_owner_replies() -> None:
    connection, socket, ingress = await connection_holding(TAG)
    creating = asyncio.ensure_future(connection.conversation.response_create(ResponseCreate(type="response.create")))
    for _ in range(100):
        if "response.output_text.delta" in socket.types():
            break
        await asyncio.sleep(0.005)
    assert "response.output_text.delta" in socket.types() and not creating.done()  # (`session_respond` waits)
    assert "response.done" not in socket.types()  # the end waits for the owner to confirm it and hear the outcome

    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    await end(connection, ingress)
    done = socket.sent[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed", done
    assert "".join(e["delta"] for e in socket.sent if e["type"] == "response.output_text.delta") == "Hello, world"
    assert [(r["turn"], r["outcome"]["status"], r["outcome"]["text"]) for r in ingress.owner.reports] == [
        (0, "completed", "Hello, world")  # the conversation has it
    ]


async def test_a_held_answer_of_other_input_waits_for_the_owner() -> None:
    connection, socket, ingress = await connection_holding("fedcba9876543210")
    creating = asyncio.ensure_future(connection.conversation.response_create(ResponseCreate(type="response.create")))
    await asyncio.sleep(0.05)
    assert "response.created" not in socket.types()  # not released: the ordinary path, after the owner's reply
    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    await end(connection, ingress)
    assert socket.sent[-1]["response"]["status"] == "completed"
    assert "".join(e["delta"] for e in socket.sent if e["type"] == "response.output_text.delta") == "Hello, world"


async def test_a_refused_response_create_withdraws_the_released_answer() -> None:
    connection, socket, ingress = await connection_holding(TAG)
    ingress.owner.refuse = {"message": "session gone", "type": "NotFoundError", "code": 404}
    creating = asyncio.ensure_future(connection.conversation.response_create(ResponseCreate(type="response.create")))
    await asyncio.sleep(0.02)
    ingress.owner.responds.set()
    await asyncio.wait_for(creating, 5)
    await end(connection, ingress)
    assert "error" in socket.types()  # the refusal, as any owner error
    done = socket.sent[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "failed", done
    assert "withdrawn" in done["response"]["status_details"]["error"]["message"]
    assert not ingress.owner.reports  # nothing of it is the owner's


async def spoken_turn_end(connection: RealtimeConnection, socket: Socket) -> asyncio.Future[None]:
    """A spoken turn ends with server VAD's `create_response` (router/realtime/spoken_turn.py `end_turn`)."""
    connection.conversation.buffer = "What is the weather in Paris?"

    async def announced() -> None:
        await connection.send("conversation.item.input_audio_transcription.completed", item_id="item_1")

    part = {"type": "input_audio", "transcript": connection.conversation.buffer}
    return asyncio.ensure_future(connection.conversation.commit_and_respond("item_1", [part], announced))


async def test_a_spoken_turns_end_streams_the_held_answer_before_the_owner_commits() -> None:
    """The commit's round trip to the owner is not on the answer's path: the user's item, then the held answer,
    go out while the owner's commit is still in flight; the commit and then the claim follow."""
    connection, socket, ingress = await connection_holding(TAG)
    owner = ingress.owner
    owner.commits = asyncio.Event()
    ending = await spoken_turn_end(connection, socket)
    for _ in range(100):
        if "response.output_text.delta" in socket.types():
            break
        await asyncio.sleep(0.005)
    assert "response.output_text.delta" in socket.types() and owner.calls == ["commit"]  # (still in flight)
    kinds = socket.types()
    created = kinds.index("conversation.item.created")
    assert created < kinds.index("conversation.item.input_audio_transcription.completed")
    assert kinds.index("conversation.item.input_audio_transcription.completed") < kinds.index("response.created")
    owner.commits.set()
    owner.responds.set()
    await asyncio.wait_for(ending, 5)
    await end(connection, ingress)
    assert owner.calls == ["commit", "respond"] and connection.conversation.buffer == ""
    assert socket.sent[-1]["response"]["status"] == "completed"
    assert "".join(e["delta"] for e in socket.sent if e["type"] == "response.output_text.delta") == "Hello, world"
    assert [r["outcome"]["status"] for r in owner.reports] == ["completed"]


async def test_a_refused_commit_withdraws_the_answer_it_released() -> None:
    connection, socket, ingress = await connection_holding(TAG)
    owner = ingress.owner
    owner.commits = asyncio.Event()
    owner.refuse_commit = {"message": "session gone", "type": "NotFoundError", "code": 404}
    ending = await spoken_turn_end(connection, socket)
    await asyncio.sleep(0.02)
    owner.commits.set()
    await asyncio.wait_for(ending, 5)
    early = connection.conversation.early
    assert early is not None and early.turn == 0  # (the turn is read early again)
    await end(connection, ingress)
    assert owner.calls == ["commit"]  # (no claim)
    assert connection.conversation.buffer == "What is the weather in Paris?"  # as the owner still has it
    done = socket.sent[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "failed", done
    assert not owner.reports


async def test_input_seen_names_the_input_only_after_calls_that_did_not_overlap() -> None:
    seen = InputSeen()
    gates = [asyncio.Event(), asyncio.Event()]

    async def reply(i: int) -> dict[str, Any]:
        await gates[i].wait()
        return {"preemptive": {"input": f"t{i}"}}

    gates[0].set()
    await seen.call(reply(0))
    assert seen.tag == "t0"
    gates[0].clear()
    first, second = asyncio.ensure_future(seen.call(reply(0))), asyncio.ensure_future(seen.call(reply(1)))
    await asyncio.sleep(0)
    assert seen.tag is None  # (in flight)
    gates[1].set()
    await second
    gates[0].set()
    await first
    assert seen.tag is None  # they overlapped: either reply may be the older one
    await seen.call(reply(1))
    assert seen.tag == "t1"
    await seen.call(asyncio.sleep(0, {"error": {"message": "no"}}))
    assert seen.tag is None


async def test_a_commit_that_fails_withdraws_the_answer_it_released() -> None:
    """The owner's commit raises (its replica is gone for good): the released answer is withdrawn, not left
    streaming unclaimed, and the input stays the connection's."""
    connection, socket, ingress = await connection_holding(TAG)
    owner = ingress.owner
    owner.commits = asyncio.Event()
    owner.refuse_commit = RuntimeError("ActorDiedError")
    ending = await spoken_turn_end(connection, socket)
    await asyncio.sleep(0.02)
    owner.commits.set()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(ending, 5)
    await end(connection, ingress)
    assert connection.conversation.buffer == "What is the weather in Paris?"
    done = socket.sent[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "failed", done
    assert not owner.reports
