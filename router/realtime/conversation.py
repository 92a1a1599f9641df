"""A realtime connection's conversation (router/realtime/socket.py `RealtimeConnection` holds one): items created by
the client, the text input buffer (`input_text_buffer.*`, this server's streaming-input events, each forwarded to the
owner prefill replica as it arrives), and the responses: `response.create` (which may release a preemptive answer
read early, router/realtime/response.py) and `response.cancel`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from router.realtime.audio_out import AudioOut
from router.realtime.audio_settings import OutputAudio
from router.realtime.connection import Calls, ClientErrors
from router.realtime.events import (
    BufferAppend,
    BufferClear,
    BufferReplace,
    ClientEvent,
    ConversationItemCreate,
    InvalidEvent,
    ResponseCancel,
    ResponseCreate,
    Sampling,
    new_id,
)
from router.realtime.response import EarlyRead, InputSeen, ResponseStream
from router.sessions.owner import current_tenant, session_buffer, session_message, session_respond

RESPONDING = ("a response is already in progress", "conversation_already_has_active_response")


class TypedText(Protocol):
    """What the conversation needs of the spoken turn (router/realtime/spoken_turn.py): typed text goes before the
    transcript of a turn in progress."""

    @property
    def speaking(self) -> bool: ...

    def typed_text(self) -> str: ...

    async def typed(self, offset: int, text: str) -> bool: ...


class ConversationAudio(Protocol):
    """What the conversation needs of the audio input (router/realtime/audio.py)."""

    @property
    def spoken(self) -> TypedText: ...

    async def end_spoken_turn(self) -> None: ...


class ConversationSettings(Protocol):
    """What the conversation needs of the session settings (router/realtime/settings.py)."""

    values: dict[str, Any]
    voiced: str | None  # the voice the session first spoke in

    def sampling(self, settings: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]: ...

    def check_tools(self, settings: dict[str, Any], where: str) -> None: ...

    def speech(self, response: Sampling | None = None) -> OutputAudio | None: ...


class ConversationConnection(Calls, ClientErrors, Protocol):
    """What the conversation needs of its connection (router/realtime/socket.py); its responses and early reads
    get it too (router/realtime/response.py `Connection`)."""

    ingress: Any
    session_id: str | None
    beta: bool
    closing: bool  # (no early read starts then)
    close_after_answer: bool
    input_seen: InputSeen  # the input the owner's reply to the last call named (a held answer made from it leaves)

    @property
    def settings(self) -> ConversationSettings: ...

    @property
    def audio(self) -> ConversationAudio: ...

    async def checked(
        self, call: Awaitable[dict[str, Any]], fields: dict[str, str] | None = None
    ) -> dict[str, Any] | None: ...


class Conversation:
    """One connection's conversation items, text input buffer and responses."""

    def __init__(self, connection: ConversationConnection) -> None:
        self.connection = connection
        self.buffer = ""  # the input text buffer: typed text, then the transcript of a spoken turn in progress
        self.lock = asyncio.Lock()  # the input text's: transcripts and client events change it in turn
        self.items: set[str] = set()  # the conversation's item ids (conversation.item.truncate names one)
        self.answer_item: str | None = None  # the last response's message item (a truncate may cut its text)
        self.answer_audio: AudioOut | None = None  # its audio, if it was spoken (a truncate cuts it by audio_end_ms)
        self.last_item_id: str | None = None
        self.response: ResponseStream | None = None  # the latest response (router/realtime/response.py)
        self.early: EarlyRead | None = None  # the next turn's answer, read early (preemptive answers)

    @property
    def responding(self) -> bool:
        return self.response is not None and not self.response.done

    def read_early(self, turn: int) -> None:
        """With preemptive answers, the answer of `turn` is read from now on, before `response.create` asks for
        it (router/realtime/response.py `EarlyRead`)."""
        if (
            self.connection.closing
            or (self.connection.close_after_answer and turn > 0)
            or self.connection.settings.values.get("preemptive") is None
        ):
            return
        if self.early is not None:
            if self.early.turn == turn and self.early.usable():
                return
            self.early.close()
        self.early = EarlyRead(self.connection, turn)

    def take_early(self, turn: int) -> EarlyRead | None:
        early, self.early = self.early, None
        if early is not None and (early.turn != turn or not early.usable()):
            early.close()
            return None
        return early

    async def item_create(self, event: ConversationItemCreate) -> None:
        item = event.item
        item.check()
        await self.connection.audio.end_spoken_turn()
        if self.buffer:  # text typed before the item is the user's turn before it (as the owner commits it too)
            await self.buffer_commit()
        item_id = item.id or new_id("item")
        base = {"id": item_id, "object": "realtime.item", "type": item.type, "status": "completed"}
        if item.type == "function_call_output":  # a call's result: a `tool` message answering it
            made = await self.connection.checked(
                session_message(
                    self.connection.ingress,
                    self.connection.session_id,
                    role="tool",
                    content=item.output,
                    tool_call_id=item.call_id,
                ),
                fields={"tool_call_id": "item.call_id"},
            )
            if made is None:
                return
            shown = {**base, "call_id": item.call_id, "output": item.output}
        elif item.type == "function_call":  # a call in the conversation's history
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if await self.connection.call(session_message, role="assistant", content="", tool_calls=[call]) is None:
                return
            shown = {**base, "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
        else:
            if await self.connection.call(session_message, role=item.role, content=item.text) is None:
                return
            shown = {**base, "role": item.role, "content": item.parts}
        await self.announce(shown)

    async def announce_item(self, item_id: str, role: str, parts: list[dict[str, Any]]) -> None:
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": "completed"}
        await self.announce({**item, "content": parts})

    async def announce(self, item: dict[str, Any]) -> None:
        """An item the conversation took: `conversation.item.created` (beta), `.added` and `.done` (GA)."""
        previous, self.last_item_id = self.last_item_id, item["id"]
        self.items.add(item["id"])
        await self.connection.send("conversation.item.created", previous_item_id=previous, item=item)
        if not self.connection.beta:
            await self.connection.send("conversation.item.added", previous_item_id=previous, item=item)
            await self.connection.send("conversation.item.done", previous_item_id=previous, item=item)

    # Typed text: while a spoken turn is in progress its transcript stays at the end of the input, after the typed
    # text (router/realtime/spoken_turn.py `typed`); every change takes the input's lock, as transcripts do.
    async def buffer_append(self, event: BufferAppend) -> None:
        spoken = self.connection.audio.spoken
        async with self.lock:
            await spoken.typed(len(spoken.typed_text()), event.delta)

    async def buffer_replace(self, event: BufferReplace) -> None:
        """Update mode: the buffer's text from character `offset` (default 0) on becomes `text`."""
        spoken = self.connection.audio.spoken
        async with self.lock:
            typed = spoken.typed_text()
            if event.offset > len(typed):
                message = f"`offset` must be from 0 to the typed text's length ({len(typed)})"
                raise InvalidEvent(message, param="offset")
            await spoken.typed(event.offset, event.text)

    async def buffer_commit(self, event: ClientEvent | None = None) -> None:
        await self.connection.audio.end_spoken_turn()  # (a commit ends the spoken turn in progress: its audio so far)
        if not self.buffer:
            await self.connection.error("the input text buffer is empty", "input_text_buffer_empty")
            return
        parts = [{"type": "input_text", "text": self.buffer}]
        await self.commit_input(new_id("item"), parts, "input_text_buffer.committed")

    async def commit_input(self, item_id: str, parts: list[dict[str, Any]], committed: str | None = None) -> bool:
        """The input text becomes the user's turn: a text or an audio item (`parts` as the item shows it), after
        the `committed` event if given."""
        async with self.lock:  # (not while a transcript revises it)
            if not await self.connection.call(session_buffer, op="commit"):
                return False
            self.buffer = ""
        if committed is not None:
            await self.connection.send(committed, previous_item_id=self.last_item_id, item_id=item_id)
        await self.announce_item(item_id, "user", parts)
        return True

    async def buffer_clear(self, event: BufferClear) -> None:
        spoken = self.connection.audio.spoken
        async with self.lock:
            if spoken.speaking:  # the typed text goes; the spoken turn's transcript stays
                cleared = await spoken.typed(0, "")
            elif cleared := bool(await self.connection.call(session_buffer, op="clear")):
                self.buffer = ""
        if cleared:
            await self.connection.send("input_text_buffer.cleared")

    async def commit_and_respond(
        self, item_id: str, parts: list[dict[str, Any]], announced: Callable[[], Awaitable[None]]
    ) -> None:
        """A spoken turn's end (server VAD's `create_response`): the input becomes the user's item, then the answer.
        A held preemptive answer made from this very input (the owner's last reply named it) streams at once after
        the item's events (and `announced`'s): the owner's commit and the answer's claim follow it, and a refusal of
        either ends that response with an error. Otherwise one call, `session_respond`, both commits the input and
        starts the answer (the owner commits what it holds before it answers); a refused answer still commits the
        input, as `response.create` after a commit would leave it. A response that cannot start (one in progress,
        the key's budget spent, bad settings) takes the ordinary way: commit, then `response.create` says why."""
        async with self.lock:  # (no typed text in between)
            early, released, overrides = self.early, None, None
            if self._refusal(Sampling()) is None:
                with contextlib.suppress(InvalidEvent):  # (then the ordinary way says why, after the commit)
                    overrides = self._overrides(Sampling())
            if early is not None and overrides is not None and early.release(self.connection.input_seen.tag):
                released, self.early = early, None
            if overrides is not None:
                buffer, self.buffer = self.buffer, ""
                started: dict[str, Any] | None = None
                speech = self.connection.settings.speech()
                try:
                    await self.announce_item(item_id, "user", parts)
                    await announced()
                    if released is not None:
                        self.response = ResponseStream(self.connection, self, released.turn, released, speech)
                        started = await self.connection.call(session_buffer, op="commit")
                    else:
                        started = await self.connection.call(session_respond, overrides=overrides)
                        if started is None and await self.connection.call(session_buffer, op="commit"):
                            buffer = ""  # (refused: the input is the user's item all the same)
                finally:
                    if not started:  # (refused, or the call failed: the owner still has the input)
                        self.buffer = buffer
                        if released is not None:
                            error = {"message": "the input was not committed", "type": "invalid_request_error"}
                            released.revoke({**error, "code": 409})
        if overrides is None:
            committed = await self.commit_input(item_id, parts)
            await announced()
            if committed:
                await self.response_create(ResponseCreate(type="response.create"))
            return
        if released is not None:
            if started:
                await self._claim(overrides, released)
            else:
                self.read_early(released.turn)  # (the turn is still to be answered: read it early again)
        elif started:
            self._stream(started["answer"]["turn"], speech)

    def _refusal(self, response: Sampling) -> tuple[str, str] | None:
        """Why a response cannot start now (message, code), or None."""
        if self.responding:
            return RESPONDING
        budgets = getattr(self.connection.ingress, "budgets", None)
        if budgets is not None and (wait := budgets.retry_after(current_tenant.get())) is not None:
            return f"this API key has used its tokens per minute; retry in {wait} s", "rate_limit_exceeded"
        return None

    def _overrides(self, response: Sampling) -> dict[str, Any]:
        session = self.connection.settings
        settings = {**session.values, **response.given()}
        session.check_tools(settings, "response")
        overrides = session.sampling(settings, session.values)
        if settings["instructions"] != session.values["instructions"]:
            overrides["instructions"] = settings["instructions"]
        return overrides

    async def response_create(self, event: ResponseCreate) -> None:
        response = event.response or Sampling()
        if self.responding:
            await self.connection.error(*RESPONDING)
            return
        if response.preemptive is not None:
            await self.connection.error(
                "preemptive answers are a session setting (session.update)", "invalid_value", "response.preemptive"
            )
            return
        speech = self.connection.settings.speech(response)  # (checked before anything is done)
        if (refused := self._refusal(response)) is not None:
            await self.connection.error(*refused)
            return
        await self.connection.audio.end_spoken_turn()
        if self.buffer:  # text typed but not committed is part of the user's turn
            await self.buffer_commit()
        overrides = self._overrides(response)
        # Nothing of its own, and the held preemptive answer made from the input the owner last named: it streams
        # now, before the owner has this call, whose reply (its claim's) confirms it (router/sessions/provisional.py).
        early = self.early if not response.given() else None
        released = early if early is not None and early.release(self.connection.input_seen.tag) else None
        if released is not None:
            self.early, self.response = None, ResponseStream(self.connection, self, released.turn, released, speech)
        await self._claim(overrides, released, speech)

    async def _claim(
        self, overrides: dict[str, Any], released: EarlyRead | None, speech: OutputAudio | None = None
    ) -> None:
        """The owner's answer to the response (`session_respond`); `released`: the held answer already streaming."""
        started = None
        try:
            started = await self.connection.call(session_respond, overrides=overrides)
        finally:
            if released is not None and started is None:  # refused: the response ends with an error, not with it
                released.revoke({"message": "the response was refused", "type": "invalid_request_error", "code": 409})
        if started is None:
            return
        turn = started["answer"]["turn"]
        if released is None:
            self._stream(turn, speech)
        else:
            self.response.task.add_done_callback(lambda _: self.read_early(turn + 1))

    def _stream(self, turn: int, speech: OutputAudio | None) -> None:
        """The answer of `turn`, which the owner started, streamed as a response."""
        self.response = ResponseStream(self.connection, self, turn, self.take_early(turn), speech)
        self.response.task.add_done_callback(lambda _: self.read_early(turn + 1))

    async def response_cancel(self, event: ResponseCancel) -> None:
        if not self.responding:
            await self.connection.error("no response is in progress", "response_cancel_not_active")
            return
        assert self.response is not None
        await self.response.cancel()
